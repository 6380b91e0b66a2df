// HF tokenizers loaded from tokenizer.json (or a tiktoken ranks file), encoding and decoding id for
// id as Hugging Face `tokenizers` 0.23 does: byte-level BPE (Qwen2/Qwen3, GPT-2, Llama-3, DeepSeek-V3,
// GLM-4.5, Nemotron 3, gpt-oss o200k) and SentencePiece-style BPE (Mistral/Mixtral: byte_fallback,
// Metaspace or Prepend+Replace normalizers).
//
// Encoding follows HF's pipeline:
//   1. added tokens with normalized=false are matched in the raw text (leftmost, longest first) and
//      never split further; lstrip/rstrip take the whitespace next to them; a single_word token
//      touching a word character (\w) is no match;
//   2. each remaining segment is normalised (NFC, Replace, Prepend, Strip; Sequence), then added
//      tokens with normalized=true are matched in it (their contents normalised the same way);
//   3. pre-tokenizers cut each segment into words: Split (regex or string; Removed, Isolated,
//      MergedWithPrevious, MergedWithNext, Contiguous; invert), ByteLevel (GPT-2 regex or not,
//      add_prefix_space; bytes mapped to chars), Metaspace (replacement, prepend_scheme
//      always/first/never, split), Digits (individual_digits), Punctuation, Sequence;
//   4. BPE merges each word by merge rank (lowest first, leftmost on ties), with a word cache;
//      ignore_merges takes a word that is a token whole; a character not in the vocabulary becomes
//      its bytes' <0xNN> tokens (byte_fallback), else unk (fuse_unk), else nothing;
//   5. with add_special_tokens, the post-processor (TemplateProcessing's single template) adds its
//      special tokens (Mistral's and DeepSeek's BOS); ByteLevel post-processors change offsets only.
// Decoding maps ids to tokens (added tokens first), drops special ones on request, and runs the
// decoders in order (ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace; Sequence), joining
// what they leave with nothing (no decoder: tokens joined with spaces, as HF).
//
// Anything in tokenizer.json that changes results and is not implemented (other models,
// normalizers such as NFKC or Lowercase, pre-tokenizers, decoders, post-processors, BPE dropout or
// subword prefixes, truncation/padding) is refused at load with an mf::Error naming the file, the
// JSON path and the value, and what is supported. Input text must be valid UTF-8 (else mf::Error
// with the byte offset). A Tokenizer is cheap to copy (shared state) and safe to use from several
// threads.
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
    // present (for eos/pad/bos). `dir` may also name the tokenizer.json file itself. A directory
    // without tokenizer.json but with tiktoken.model (Kimi-K2) is loaded with from_tiktoken: the
    // family, known by the module tokenizer_config.json's auto_map.AutoTokenizer names, gives the
    // split regex; its added_tokens_decoder and reserved ids give the special tokens.
    static Tokenizer load(const std::filesystem::path& dir);
    // True when `dir` holds a tokenizer load() reads (tokenizer.json, or else tiktoken.model).
    static bool found_in(const std::filesystem::path& dir);
    // Builds a tokenizer from tokenizer.json text; `source` names it in errors. `config` is the
    // parsed tokenizer_config.json (or null) and `special_tokens_map` special_tokens_map.json (or null).
    static Tokenizer from_json(std::string_view tokenizer_json, const std::string& source, json::Value config = {},
                               json::Value special_tokens_map = {});

    // A tiktoken ranks file's text (lines "<base64 token> <rank>", ranks 0..N-1 with all 256 single
    // bytes): BPE as tiktoken runs it (a piece that is a token is taken whole, else the adjacent pair
    // whose concatenation has the lowest rank merges first), pieces split by `pattern` (Isolated),
    // then byte-level mapped; `added_tokens` in tokenizer.json's added_tokens form.
    static Tokenizer from_tiktoken(std::string_view ranks, const std::string& source, const std::string& pattern,
                                   json::Value added_tokens, json::Value config = {},
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
