// Chat formatting for supervised fine-tuning: a conversation (`messages` of system/user/assistant
// turns, tool calls and tool responses) becomes token ids and labels exactly as Hugging Face's
// `apply_chat_template(messages, tokenize=True)` renders it with the model's template, plus a loss
// mask. Two renderers, chosen by data.chat_format:
//
//   ChatML fast path   the formats below, written out here; a template is recognised, not run.
//   the model's own    (chat_format auto on a template that is not one of them, or jinja) the
//   template           template run by the Jinja interpreter (text/jinja.h) with HF's context:
//                      messages, tools, documents, add_generation_prompt, the special tokens and
//                      data.chat_template_kwargs. Both render a ChatML template identically.
//
// ChatML formats:
//   chatml          <|im_start|>{role}\n{content}<|im_end|>\n per message, nothing else
//                   (Qwen3-*-Instruct-2507 and generic ChatML templates)
//   chatml_qwen2    chatml, plus "You are a helpful assistant." as a system message when the
//                   conversation does not open with one (Qwen2 / Qwen2-MoE instruct templates)
//   chatml_qwen2_5  the same with "You are Qwen, created by Alibaba Cloud. You are a helpful
//                   assistant." (Qwen2.5)
//   chatml_qwen3    no default system message; an assistant turn after the last user query gets
//                   a <think>\n{reasoning}\n</think>\n\n block (empty when the turn is the last one
//                   and has no reasoning); reasoning is the `reasoning_content` field or the part
//                   of the content before </think>, which earlier turns lose (Qwen3, Qwen3-MoE)
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

enum class ChatFormat { chatml, chatml_qwen2, chatml_qwen2_5, chatml_qwen3 };
enum class LossOn { assistant, all };

struct ChatMessage {
    std::string role;  // system | user | assistant
    std::string content;
    std::optional<std::string> reasoning_content;  // read by chatml_qwen3 only (as HF's templates do)
};

// "chatml", "chatml_qwen2", "chatml_qwen2_5", "chatml_qwen3"; anything else is an mf::Error that
// lists the names ("auto" is resolved by resolve_chat_format, not here).
ChatFormat parse_chat_format(std::string_view name);
const char* chat_format_name(ChatFormat format);
LossOn parse_loss_on(std::string_view name);  // "assistant" | "all"
const char* loss_on_name(LossOn loss_on);

// Recognises a Jinja chat template as one of the formats above. The template is normalised
// (whitespace that Jinja would not emit and the dashes of tags dropped, quotes and ['key']
// subscripts unified), then it must render messages as ChatML, may name a default system message
// only if it is one we know, and may handle <think> only exactly as Qwen3 does. Anything else
// (another chat format, bos/eos tokens, trimmed content, text outside tags, ...) is an mf::Error
// naming `source` and the reason, suggesting data.chat_format.
ChatFormat detect_chat_format(std::string_view chat_template, const std::string& source);

// The template a tokenizer ships: `tokenizer_dir`/chat_template.jinja when that file exists (what
// transformers v5 writes), else tokenizer_config.json's "chat_template" (a string, or a list of
// {name, template} from which "default" is taken). nullopt when there is none.
std::optional<std::string> find_chat_template(const Tokenizer& tokenizer, const std::filesystem::path& tokenizer_dir);

// `setting` is a format name or "auto" (detect from the tokenizer's template; none is an error).
// A format named while the tokenizer ships a template that renders conversations differently
// (checked on probe conversations through the interpreter) is an mf::Error: training would learn
// a format the model was not made for, and the checkpoint would carry the model's own template.
ChatFormat resolve_chat_format(std::string_view setting, const Tokenizer& tokenizer,
                               const std::filesystem::path& tokenizer_dir);

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
std::vector<RenderedMessage> render_chat(const std::vector<ChatMessage>& messages, ChatFormat format, LossOn loss_on,
                                         size_t first_learnable = 0);
std::string render_chat_text(const std::vector<ChatMessage>& messages, ChatFormat format);

struct TokenizedChat {
    std::vector<int32_t> input_ids;
    std::vector<int32_t> labels;  // input_ids where learned, -100 elsewhere
};

// Renders and tokenises; see the file comment for the mask. mf::Error if the per-message
// encodings do not add up to the whole text's encoding (a tokenizer whose special tokens strip
// neighbouring whitespace, say).
TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const std::vector<ChatMessage>& messages, ChatFormat format,
                            LossOn loss_on, size_t first_learnable = 0);

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

// What data.chat_format resolves to: a ChatML fast-path format or the model's template.
//   auto     the fast path when the tokenizer's template is one of the ChatML formats (it renders
//            the same, faster), else the model's template through the interpreter
//   jinja    always the interpreter
//   chatml*  that fast-path format, checked against the tokenizer's template as in resolve_chat_format
// The model's template is kept beside a fast-path format when the tokenizer has one: it renders
// what the fast path does not (tool calls, tool messages, tools, content parts).
struct ChatRenderer {
    std::optional<ChatFormat> format;            // set: the fast path for system/user/assistant text
    std::optional<ChatTemplate> model_template;  // the model's template, when the tokenizer has one
    std::string describe() const;                // "chatml_qwen2" or "the model's chat template (jinja)"
};
ChatRenderer resolve_chat_renderer(std::string_view setting, const Tokenizer& tokenizer,
                                   const std::filesystem::path& tokenizer_dir, const json::Value& kwargs = {});
TokenizedChat tokenize_chat(const Tokenizer& tokenizer, const ChatRenderer& renderer,
                            const std::vector<ChatMessage>& messages, LossOn loss_on, size_t first_learnable = 0);

}  // namespace mf::text
