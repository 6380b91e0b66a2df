// Mamba-2's gated RMSNorm (HF Zamba2RMSNormGated / MambaRMSNormGated, norm_before_gate=False), per
// token and per group of group_size consecutive channels of I:
//   g = x · silu(z),  rstd = 1 / sqrt(mean_group(g²) + eps),  out = weight · (g · rstd)
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[N, I], rstd[N · I/group_size] (written; saved for the backward); x, z [N, I]; weight [I].
void gated_rmsnorm_forward(float* out, float* rstd, const float* x, const float* z, const float* weight, int64_t N,
                           int64_t I, int64_t group_size, float eps);
// dx, dz [N, I] written; dweight[I] +=. g is recomputed from x and z.
void gated_rmsnorm_backward(float* dx, float* dz, float* dweight, const float* dout, const float* x, const float* z,
                            const float* weight, const float* rstd, int64_t N, int64_t I, int64_t group_size);

}  // namespace mf::cpu
