// Chat formatting for supervised fine-tuning: a conversation (`messages` of system/user/assistant
// turns, tool calls and tool responses) becomes token ids and labels exactly as Hugging Face's
// `apply_chat_template(messages, tokenize=True)` renders it with the model's template, plus a loss
// mask. Two renderers, chosen by data.chat_format:
//
//   ChatML fast path   the formats below, written out here, for templates that render like one of
//                      them (decided by rendering probe conversations, below).
//   the model's own    (chat_format auto on a template that is not one of them, or jinja) the
//   template           template run by the Jinja interpreter (text/jinja.h) with HF's context:
//                      messages, tools, documents, add_generation_prompt, the special tokens and
//                      data.chat_template_kwargs. Both render a ChatML template identically.
//
// ChatML formats (each writes <|im_start|>{role}\n{content}<|im_end|>\n per message, and
// <|im_start|>assistant\n as the generation prompt):
//   chatml          nothing else
//   chatml_system   plus a default system message when the conversation does not open with one;
//                   its text is the model's, read off the template's rendering of a conversation
//                   without a system message
//   chatml_think    no default system message; an assistant turn after the last user query gets
//                   a <think>\n{reasoning}\n</think>\n\n block (empty when the turn is the last one
//                   and has no reasoning); reasoning is the `reasoning_content` field or the part
//                   of the content before </think>, which earlier turns lose. A user message that
//                   is a whole <tool_response>...</tool_response> is not a query. (The hybrid-thinking
//                   layout of the Qwen3 family.)
//
// Recognition is by behaviour, never by the template's text: the template renders a fixed set of
// probe conversations through the interpreter (with and without a system message, several turns, a
// system message later on, an assistant turn first, reasoning in the content and in
// reasoning_content, answers after a tool-response-looking user turn, with and without the
// generation prompt; no tools), and a format is the template's only if it writes every probe
// byte for byte as the template renders it.
//
// Loss mask (data.loss_on: assistant, the default): in each assistant turn the tokens after the
// "<|im_start|>assistant\n" header are learned: the think block, the content, <|im_end|> and the
// "\n" after it. This is what TRL's generation-tagged training templates mark for
// assistant_only_loss: the header is a prompt cue the model never generates, <|im_end|> is how it
// learns to stop, and the "\n" is always generated with it. Everything else (system and user
// turns, default system message) is -100. With loss_on: all every token is learned.
//
// Exactness: the ids are those of tokenizer.encode(rendered text, add_special_tokens=false). Each
// message is encoded on its own (special tokens such as <|im_start|> split HF's encoding, so the
// concatenation is the whole text's encoding; tokenize_chat checks this and fails if a tokenizer
// breaks it). The header/content boundary is found as the longest common prefix of the encodings
// of the header and of the whole message, so a token that straddles the boundary (content opening
// with "\n", say) counts as learned, as HF's char_to_token-based assistant mask does.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/json.h"
#include "text/jinja.h"
#include "text/tokenizer.h"

namespace mf::text {

// A ChatML fast-path format (see the file comment).
struct ChatFormat {
    enum class Kind { chatml, chatml_system, chatml_think };
    Kind kind = Kind::chatml;
    std::string default_system;  // chatml_system: the model's default system message
    bool operator==(const ChatFormat&) const = default;
};
enum class LossOn { assistant, all };

struct ChatMessage {
    std::string role;  // system | user | assistant
    std::string content;
    std::optional<std::string> reasoning_content;  // read by chatml_think only (as the templates it renders do)
};

// "chatml", "chatml_system", "chatml_think"; anything else is an mf::Error that lists the names
// ("auto" and "jinja" are resolved by resolve_chat_renderer, not here).
ChatFormat::Kind parse_chat_format(std::string_view name);
const char* chat_format_name(ChatFormat::Kind kind);
LossOn parse_loss_on(std::string_view name);  // "assistant" | "all"
const char* loss_on_name(LossOn loss_on);

// The template a tokenizer ships: `tokenizer_dir`/chat_template.jinja when that file exists (what
// transformers v5 writes), else tokenizer_config.json's "chat_template" (a string, or a list of
// {name, template} from which "default" is taken). nullopt when there is none.
std::optional<std::string> find_chat_template(const Tokenizer& tokenizer, const std::filesystem::path& tokenizer_dir);

// One piece of rendered text; `learned` marks the pieces whose tokens count in the loss.
struct ChatSegment {
    std::string text;
    bool learned = false;
};

// The rendered conversation: one entry per rendered message (the default system message too),
// header first, then the rest of the message. Joined, the texts are apply_chat_template's
// tokenize=False output. Messages before `first_learnable` are never learned (the prompt half of
// a prompt/completion record). Roles other than system/user/assistant, empty `messages` and tool
// calls are refused by the caller (sft_dataset); here an unknown role is an mf::Error.
struct RenderedMessage {
    std::string header;  // "<|im_start|>{role}\n"
    std::string body;    // [think block] content "<|im_end|>\n"
    bool learned = false;
};
std::vector<RenderedMessage> render_chat(const std::vector<ChatMessage>& messages, const ChatFormat& format,
                                         LossOn loss_on, size_t first_learnable = 0);
// The joined text; with `add_generation_prompt` followed by "<|im_start|>assistant\n".
std::string render_chat_text(const std::vector<ChatMessage>& messages, const ChatFormat& format,
                             bool add_generation_prompt = false);

struct TokenizedChat {
    std::vector<int32_t> input_ids;
    std::vector<int32_t> labels;  // input_ids where learned, -100 elsewhere
};

// Renders and tokenises; see the file comment for the mask. mf::Error if the per-message
// encodings do not add up to the whole text's encoding (a tokenizer whose special tokens strip
// neighbouring whitespace, say).
TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages,
                            const ChatFormat& format, LossOn loss_on, size_t first_learnable = 0);

// --- the model's own template, through the interpreter ------------------------------------------------

// A model's chat template(s) with the variables HF renders them with. Cheap to copy (shared).
class ChatTemplate {
 public:
    // The tokenizer's template (find_chat_template's sources; a list of named templates gives
    // "default" and, when present, "tool_use", which HF picks for conversations with tools), its
    // special tokens (bos_token, eos_token, unk_token, sep_token, pad_token, cls_token, mask_token:
    // strings or AddedToken objects {"content": ...} in tokenizer_config.json) and `kwargs`
    // (data.chat_template_kwargs: a JSON object of extra variables, e.g. {"enable_thinking": false},
    // which win over the special tokens as in HF). mf::Error when there is no template, when it
    // does not parse, or when `kwargs` is not an object.
    static ChatTemplate load(const Tokenizer& tokenizer, const std::filesystem::path& tokenizer_dir,
                             const json::Value& kwargs = {});
    // One template's text and its variables (a JSON object or null); `name` prefixes errors.
    static ChatTemplate from_source(std::string_view source, const json::Value& variables = {},
                                    std::string name = "chat_template");

    // The rendering of `conversation`: {"messages": [...], "tools"?: [...], "documents"?: [...],
    // "add_generation_prompt"?: bool, other keys: extra variables}. Absent tools and documents are
    // None, as apply_chat_template passes them. mf::Error (template:line:col: ...) when the
    // template fails on it.
    jinja::Rendered render(const json::Value& conversation) const;
    std::string render_text(const json::Value& conversation) const { return render(conversation).text; }

    // The byte spans [begin, end) of the text that is learned with data.loss_on: assistant: the
    // {% generation %} blocks where the template has them (HF's return_assistant_tokens_mask);
    // otherwise, for each assistant message i, the text between the rendering of messages[:i] with
    // the generation prompt and that of messages[:i+1] (TRL's prefix rule), both of which must be
    // prefixes of the whole rendering, else mf::Error naming the message (the template's
    // assistant spans cannot be found: give it {% generation %} blocks). Messages before
    // `first_learnable` (a prompt) are never learned: nothing inside the rendering of
    // messages[:first_learnable]. add_generation_prompt is false here.
    struct Spans {
        std::string text;
        std::vector<std::pair<size_t, size_t>> learned;
    };
    Spans learned_spans(const json::Value& conversation, size_t first_learnable = 0) const;

    bool has_generation_blocks() const;
    const std::string& name() const;

 private:
    const jinja::Template& pick(const json::Value& conversation) const;
    json::Value context(const json::Value& conversation, const json::Value& messages, bool add_generation_prompt) const;

    std::shared_ptr<const jinja::Template> default_, tool_use_;
    json::Value variables_;
};

// Tokenises a conversation rendered by `chat_template`: ids as tokenizer.encode(text) (no special
// tokens added), labels from learned_spans mapped to tokens as HF's assistant mask does (from the
// token holding a span's first byte to the one holding its last; a token straddling a span's edge
// is learned).
TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatTemplate& chat_template,
                            const json::Value& conversation, LossOn loss_on, size_t first_learnable = 0);

// HF's assistant mask of byte spans over `text`'s encoding `ids`: 1 from the token holding a span's
// first byte to the one holding its last byte, 0 elsewhere; empty spans mark nothing.
std::vector<int32_t> spans_to_token_mask(const Tokenizer& tokenizer, const std::string& text,
                                         const std::vector<int32_t>& ids,
                                         const std::vector<std::pair<size_t, size_t>>& spans);

// The conversation object for `messages` (what sft_dataset reads is turned into this).
json::Value conversation_json(const std::vector<ChatMessage>& messages);

// --- recognition by probing ------------------------------------------------------------------------

// The fast-path format of kind `kind` that renders the probe conversations (see the file comment)
// exactly as `chat_template` does, its default system message (chatml_system) read off the
// template's rendering of a probe without one; nullopt when it renders any probe differently or
// the template fails on one, with `why` (when given) set to the first such probe and a short
// excerpt of both renderings from where they part.
std::optional<ChatFormat> match_chat_format(const ChatTemplate& chat_template, ChatFormat::Kind kind,
                                            std::string* why = nullptr);
// The fast-path format that renders every probe as `chat_template` does (at most one can), or nullopt.
std::optional<ChatFormat> detect_chat_format(const ChatTemplate& chat_template);

// What data.chat_format resolves to: a ChatML fast-path format or the model's template.
//   auto     the fast path when the tokenizer's template renders like one of the ChatML formats (it
//            renders the same, faster), else the model's template through the interpreter; the
//            probes render with data.chat_template_kwargs. No template is an error.
//   jinja    always the interpreter
//   chatml*  that fast-path format; when the tokenizer has a template, one that renders a probe
//            differently is an mf::Error naming the template's file, the format and the probe
//            (training would learn a format the model was not made for, and the checkpoint would
//            carry the model's own template). chatml_system needs the template: its default
//            system message is the template's.
// The model's template is kept beside a fast-path format when the tokenizer has one: it renders
// what the fast path does not (tool calls, tool messages, tools, content parts).
struct ChatRenderer {
    std::optional<ChatFormat> format;            // set: the fast path for system/user/assistant text
    std::optional<ChatTemplate> model_template;  // the model's template, when the tokenizer has one
    std::string describe() const;                // "chatml_system" or "the model's chat template (jinja)"
};
ChatRenderer resolve_chat_renderer(std::string_view setting, const Tokenizer& tokenizer,
                                   const std::filesystem::path& tokenizer_dir, const json::Value& kwargs = {});
TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatRenderer& renderer,
                            const std::vector<ChatMessage>& messages, LossOn loss_on, size_t first_learnable = 0);

}  // namespace mf::text
