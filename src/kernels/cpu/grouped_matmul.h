// Grouped matmul over per-expert row groups (the expert GEMMs of a dropless MoE).
// inp[M, C] rows are grouped by expert via offsets[E + 1]; weight[E, OC, C] is stacked;
// out[r, :] = inp[r, :] · weight[e]ᵀ for every row r of group e. Empty groups are fine.
#pragma once

#include <cstdint>

namespace mf::cpu {

void grouped_matmul_forward(float* out, const float* inp, const float* weight, const int32_t* offsets, int64_t E,
                            int64_t C, int64_t OC);
// dinp[M, C] += dout · weight[e];  dweight[e] += doutᵀ · inp over the rows of group e.
// Either output pointer may be null.
void grouped_matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                             const int32_t* offsets, int64_t E, int64_t C, int64_t OC);

}  // namespace mf::cpu
