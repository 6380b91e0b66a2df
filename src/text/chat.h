// Chat formatting for supervised fine-tuning: a conversation (`messages` of system/user/assistant
// turns) becomes token ids and labels exactly as Hugging Face's
// `apply_chat_template(messages, tokenize=True)` renders it with the model's ChatML template, plus a
// loss mask.
//
// Formats (no Jinja engine: each is written out here, and a template is recognised, not run):
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

}  // namespace mf::text
