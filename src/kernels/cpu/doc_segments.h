// Packed documents for the recurrent (Mamba-2) kernels. Tokens are token-major, N = B·T: B rows of T
// tokens. A *segment* is a maximal run of consecutive tokens of one row with one document id; the conv
// window and the scan state reset at every segment start, so nothing crosses a row or a document.
// NOTE: segments are runs, not sets: ids 3, 3, 5, 3 make three segments (attention, which masks by
// id equality, would let the last token see the first two). Packed rows never reuse an id.
#pragma once

#include <cstdint>

namespace mf::cpu {

// Whether token n starts a segment: the first token of its row, or its id differs from the previous
// token's. doc_ids may be null: then every row is one document.
inline bool starts_segment(const int32_t* doc_ids, int64_t n, int64_t T) {
    return n % T == 0 || (doc_ids != nullptr && doc_ids[n] != doc_ids[n - 1]);
}

}  // namespace mf::cpu
