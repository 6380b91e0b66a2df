// Mamba-2's gated RMSNorm on the GPU (bf16 storage, fp32 math; HF MambaRMSNormGated with
// norm_before_gate=False): per token and group of group_size consecutive channels of I,
//   g = x · silu(z),  rstd = 1 / sqrt(mean_group(g²) + eps),  out = weight · (g · rstd).
// CPU reference and spec: kernels/cpu/gated_rmsnorm.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

constexpr int64_t kGatedRmsnormMaxGroup = 2048;

// out [N, I] bf16 and rstd [N · I/group_size] f32 (written); x, z [N, I] bf16; weight [I] f32.
// group_size divides I and is at most kGatedRmsnormMaxGroup.
void gated_rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* z, const float* weight, int64_t N,
                           int64_t I, int64_t group_size, float eps, cudaStream_t stream);

// Bytes of scratch gated_rmsnorm_backward needs (per-block partial sums of dweight).
size_t gated_rmsnorm_backward_scratch_bytes(int64_t N, int64_t I);

// With x̂ = g · rstd and dg' = dout ⊙ weight: dg = rstd · (dg' − x̂ · mean_group(dg' ⊙ x̂)),
//   dx = dg · silu(z), dz = dg · x · silu'(z) (both [N, I] bf16, written),
//   dweight [I] (f32 or bf16) += Σ_n dout ⊙ x̂.
// Deterministic: a block walks a fixed range of tokens of one group in order, writes its partial
// dweight sums to scratch [blocks, I], and reduce_partial_rows adds them in a fixed order.
void gated_rmsnorm_backward(bf16* dx, bf16* dz, void* dweight, DType dweight_dtype, const bf16* dout, const bf16* x,
                            const bf16* z, const float* weight, const float* rstd, int64_t N, int64_t I,
                            int64_t group_size, void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
