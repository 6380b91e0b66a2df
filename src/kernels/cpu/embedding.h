// Token embedding lookup. Ids are validated by the caller (0 <= id < V).
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[N, C] = wte[ids[n], :]
void embedding_forward(float* out, const int32_t* ids, const float* wte, int64_t N, int64_t C);
// dwte[ids[n], :] += dout[n, :], rows visited in order n = 0..N-1 (deterministic).
void embedding_backward(float* dwte, const float* dout, const int32_t* ids, int64_t N, int64_t C);

}  // namespace mf::cpu
