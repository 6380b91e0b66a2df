// HF byte-level BPE tokenizers (Qwen2/Qwen3, GPT-2, Llama-3 style) loaded from tokenizer.json,
// encoding and decoding id for id as Hugging Face `tokenizers` does.
//
// Encoding follows HF's pipeline:
//   1. added tokens with normalized=false are matched in the raw text (leftmost, longest first) and
//      never split further; lstrip/rstrip take the whitespace next to them;
//   2. each remaining segment is normalised (NFC or nothing), then added tokens with
//      normalized=true are matched in it;
//   3. pre-tokenizers (Split with a regex or string, any behavior, invert; ByteLevel with its GPT-2
//      regex and add_prefix_space) cut each segment into words, ByteLevel mapping bytes to chars;
//   4. BPE merges each word by merge rank (lowest first, leftmost on ties), with a word cache;
//   5. with add_special_tokens, the post-processor (TemplateProcessing) adds its special tokens.
// Decoding maps ids to tokens (added tokens first), drops special ones on request, and runs the
// decoder (ByteLevel: chars back to bytes, then bytes to text as Rust's from_utf8_lossy).
//
// Anything in tokenizer.json that changes results and is not implemented (other models,
// normalizers, pre-tokenizers, decoders, post-processors, flags such as byte_fallback or
// single_word, truncation/padding) is refused at load with an mf::Error naming the file, the JSON
// path and the value. Input text must be valid UTF-8 (else mf::Error with the byte offset).
// A Tokenizer is cheap to copy (shared state) and safe to use from several threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/json.h"

namespace mf::text {

class Tokenizer {
 public:
    // Loads DIR/tokenizer.json, plus DIR/tokenizer_config.json and DIR/special_tokens_map.json where
    // present (for eos/pad/bos). `dir` may also name the tokenizer.json file itself.
    static Tokenizer load(const std::filesystem::path& dir);
    // Builds a tokenizer from tokenizer.json text; `source` names it in errors. `config` is the
    // parsed tokenizer_config.json (or null) and `special_tokens_map` special_tokens_map.json (or null).
    static Tokenizer from_json(std::string_view tokenizer_json, const std::string& source, json::Value config = {},
                               json::Value special_tokens_map = {});

    // Token ids of `text` (valid UTF-8); with add_special_tokens, the post-processor's tokens too.
    std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = false) const;
    // Text of `ids`; an id outside [0, vocab_size()) or one with no token is an mf::Error.
    std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;

    int32_t token_to_id(std::string_view token) const;  // -1 when there is no such token
    std::string id_to_token(int32_t id) const;          // mf::Error when there is no such id
    bool is_special(int32_t id) const;                  // an added token marked special
    // 1 + the largest id of the vocabulary and the added tokens (the embedding rows a model needs).
    size_t vocab_size() const;
    // tokenizer_config.json as parsed, or null when the directory has none.
    const json::Value& config() const;

    std::optional<int32_t> eos_id, pad_id, bos_id;

    struct Impl;

 private:
    const Impl& impl() const;  // mf::Error for a default-constructed Tokenizer
    std::shared_ptr<Impl> impl_;
};

}  // namespace mf::text
