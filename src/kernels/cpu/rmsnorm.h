// RMSNorm as Qwen3 computes it: out = weight ⊙ x · rsqrt(mean(x²) + eps), per row of C.
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[N, C], rstd[N] (saved for backward). out may alias inp.
void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
// dinp[N, C] += ∂L/∂inp;  dweight[C] += ∂L/∂weight.  inp is the forward input, rstd from forward.
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C);

}  // namespace mf::cpu
