// Token embedding, fp32 CPU reference.
//   forward   out[n, :] = wte[ids[n], :]                 a row copy per token
//   backward  dwte[ids[n], :] += dout[n, :]              rows visited n = 0..N-1
// A token id that appears several times accumulates its rows in token order, so the result is
// deterministic (no scatter races, no atomics). Ids are validated by the caller (0 <= id < V);
// only a negative id, which can never be valid, is rejected here.
#include "kernels/cpu/embedding.h"

#include <algorithm>

#include "core/check.h"

namespace mf::cpu {

void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C >= 0, "embedding: negative shape N=", N, " C=", C);
    for (int64_t n = 0; n < N; ++n) {
        MF_CHECK(ids[n] >= 0, "embedding: negative token id ", ids[n], " at position ", n);
        std::copy_n(wte + static_cast<int64_t>(ids[n]) * C, C, out + n * C);
    }
}

void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C >= 0, "embedding: negative shape N=", N, " C=", C);
    for (int64_t n = 0; n < N; ++n) {
        MF_CHECK(ids[n] >= 0, "embedding: negative token id ", ids[n], " at position ", n);
        float* row = dwte + static_cast<int64_t>(ids[n]) * C;
        const float* g = dout + n * C;
        for (int64_t c = 0; c < C; ++c) row[c] += g[c];
    }
}

}  // namespace mf::cpu
