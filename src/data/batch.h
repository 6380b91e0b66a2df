// A training batch as the model consumes it: B rows of T tokens, flattened row-major to N = B·T.
//
// Targets are already shifted (targets[t] is the label of token t+1 of the same document), so
// the model never shifts; -100 marks positions that do not count in the loss (prompt tokens,
// the last token of each document, padding). Packed rows hold several documents: positions
// restart at 0 in each and doc_ids keep attention inside a document.
#pragma once

#include <cstdint>
#include <vector>

namespace mf::data {

constexpr int32_t kIgnoreIndex = -100;

struct Batch {
    int64_t B = 0, T = 0;
    std::vector<int32_t> input_ids;  // [B·T]
    std::vector<int32_t> targets;    // [B·T]
    std::vector<int32_t> positions;  // [B·T]
    std::vector<int32_t> doc_ids;    // [B·T]
    std::vector<uint8_t> is_pad;     // [B·T] 1 for padding (excluded from the aux loss and token counts)

    int64_t num_tokens() const { return B * T; }
    int64_t num_targets() const {
        int64_t n = 0;
        for (int32_t t : targets) n += t != kIgnoreIndex;
        return n;
    }
    int64_t num_real_tokens() const {
        int64_t n = 0;
        for (uint8_t p : is_pad) n += p == 0;
        return n;
    }
};

// One document per row, HF's label shift: targets[t] = labels[t + 1], the last position ignored.
// `labels` may be empty (= input_ids). Rows shorter than T are padded with pad_id (ignored).
Batch make_row_batch(const std::vector<std::vector<int32_t>>& input_ids,
                     const std::vector<std::vector<int32_t>>& labels, int64_t T, int32_t pad_id);

}  // namespace mf::data
