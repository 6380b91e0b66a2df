// Dense matmul, the layout of torch.nn.Linear: out[N, OC] = inp[N, C] · weight[OC, C]ᵀ.
// CPU reference, fp32. Backward accumulates (+=) into both dinp and dweight, so callers zero
// activation gradients once and several consumers of one tensor can add into it.
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[N, OC] = inp[N, C] · weight[OC, C]ᵀ (written, not accumulated).
void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC);

// dinp[N, C] += dout[N, OC] · weight[OC, C];  dweight[OC, C] += dout[N, OC]ᵀ · inp[N, C].
// Either output pointer may be null to skip it.
void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int64_t N,
                     int64_t C, int64_t OC);

}  // namespace mf::cpu
