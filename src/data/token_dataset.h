// Token datasets: JSONL, one document per line, `{"input_ids": [...], "labels": [...]}`.
// Labels are aligned with input_ids as in HF (the model shifts them), -100 marks tokens that do
// not count, and `labels` may be left out (= input_ids). A malformed line is an error naming the
// file and line, or (on_error = skip) is counted and skipped.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace mf::json {
class Value;
}

namespace mf::data {

struct Document {
    std::vector<int32_t> input_ids;
    std::vector<int32_t> labels;  // same length as input_ids
};

struct TokenDataset {
    std::vector<Document> docs;
    int64_t skipped_lines = 0;
    std::string first_skip_reason;  // the first skipped line's error, for the end-of-run report
};

// A record's token id array `field` (0 <= id < vocab_size; -100 too where allow_ignore), or an error
// naming the field, the index and the problem. Shared by the token and SFT datasets.
std::vector<int32_t> read_token_ids(const json::Value& v, const char* field, int64_t vocab_size, bool allow_ignore);

// vocab_size bounds the ids (0 <= id < vocab_size; labels also may be -100).
TokenDataset read_token_jsonl(const std::filesystem::path& file, int64_t vocab_size, bool skip_bad_lines);

}  // namespace mf::data
