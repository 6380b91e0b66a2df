// SwiGLU on a fused gate/up row: inp[N, 2I] holds gate in columns [0, I) and up in [I, 2I);
// out[N, I] = silu(gate) ⊙ up, silu(x) = x · sigmoid(x).
#pragma once

#include <cstdint>

namespace mf::cpu {

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t I);
// dinp[N, 2I] is written (=), not accumulated.
void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t I);

}  // namespace mf::cpu
