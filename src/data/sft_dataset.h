// Supervised fine-tuning datasets: JSONL, one record a line, in one of four kinds.
//
//   messages           {"messages": [{"role": "system"|"user"|"assistant", "content": "...",
//                                     "reasoning_content"?: "..."}, ...], "tools"?: [...]}
//                      rendered with the chat format (text/chat.h); loss_on decides what is learned.
//                      Tools, tool calls, other roles (tool, ...) and content parts are passed as
//                      they are to the model's own chat template, which renders them or fails.
//   prompt_completion  {"prompt": "...", "completion": "..."}: tokens of prompt + completion (one
//                      encoding, special tokens added as HF's tokenizer(text) does) + eos; the
//                      prompt's tokens are not learned (loss_on: all learns them too). The first
//                      token that differs from the prompt's own encoding is the first learned one.
//                      Both may instead be lists of messages: rendered as one conversation whose
//                      assistant messages in the completion are learned (TRL's conversational
//                      prompt-completion).
//   text               {"text": "..."}: every token learned, eos appended
//   tokens             {"input_ids": [...], "labels"?: [...]} as data/token_dataset.h
// eos is appended unless the encoding already ends with it. Records of the text kinds may carry other
// fields (id, source, ...), which are ignored; a tokens record may not (as read_token_jsonl).
//
// format auto takes the kind of the first valid line; every other line must be of the same kind.
// A bad line (invalid JSON, wrong types, unknown role, empty messages, missing content, nothing to
// learn, ids outside the vocabulary, a line of another kind, ...) is an mf::Error "FILE:LINE: what",
// or with skip_bad_lines is counted in skipped_lines (the first one's message kept). Errors that are
// not about a line (no tokenizer, a chat template that does not parse, no eos token) always stop.
// Documents longer than the loader's seq_len are cut there, not here.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "data/token_dataset.h"
#include "text/chat.h"
#include "text/tokenizer.h"

namespace mf::data {

enum class SftFormat { auto_detect, tokens, messages, prompt_completion, text };

// "auto" | "tokens" | "messages" | "prompt_completion" | "text"; anything else is an mf::Error.
SftFormat parse_sft_format(std::string_view name);
const char* sft_format_name(SftFormat format);  // "auto" for auto_detect

struct SftOptions {
    SftFormat format = SftFormat::auto_detect;
    // A chat format name, "auto" or "jinja" (see text::resolve_chat_renderer: the ChatML fast path or
    // the model's template through the interpreter); resolved only when the dataset holds messages.
    std::string chat_format = "auto";
    json::Value chat_template_kwargs;     // data.chat_template_kwargs: an object of template variables, or null
    std::filesystem::path tokenizer_dir;  // where chat_template.jinja may lie (may be empty)
    text::LossOn loss_on = text::LossOn::assistant;
    bool skip_bad_lines = false;
    int64_t vocab_size = 0;  // the model's: every id must lie in [0, vocab_size)
};

// Reads `file`. `tokenizer` may be null for token data only (a text record then is an error that
// says a tokenizer is needed). `detected`, when given, receives the kind the file was read as, and
// `chat_format` the chat format used (only set for messages data).
TokenDataset read_sft_jsonl(const std::filesystem::path& file, const text::Tokenizer* tokenizer,
                            const SftOptions& options, SftFormat* detected = nullptr,
                            text::ChatFormat* chat_format = nullptr);

}  // namespace mf::data
