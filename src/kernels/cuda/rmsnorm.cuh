// RMSNorm on the GPU (bf16 storage, fp32 math), as Qwen3 computes it:
//   rstd = 1 / sqrt(mean(x²) + eps),  out = weight ⊙ (x · rstd)
// CPU reference and spec: kernels/cpu/rmsnorm.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out [N, C] bf16 (written; may alias inp), rstd [N] fp32 (written, saved for backward),
// inp [N, C] bf16, weight [C] bf16.
void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t N, int64_t C, float eps,
                     cudaStream_t stream);

// Bytes of scratch rmsnorm_backward needs (per-block partial sums of the weight gradient).
size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C);

// With x̂ = x · rstd and g = dout ⊙ weight:
//   dinp [N, C] bf16  = (or += when accumulate_dinp) rstd · (g − x̂ · mean(g ⊙ x̂));  skipped when null.
//     dinp may alias dout when accumulate_dinp is false.
//   dweight [C] (f32 or bf16) += Σ_n dout[n] ⊙ x̂[n]; skipped when null. Deterministic: each block sums
//     its rows in fp32 (fixed row order per warp, warps combined in a fixed order) into
//     scratch [num_blocks, C], then reduce_partial_rows adds the blocks in ascending order. The block
//     count depends on N and C only.
// inp, weight: the forward's; rstd [N] from rmsnorm_forward.
// scratch: rmsnorm_backward_scratch_bytes(N, C) bytes, 16-byte aligned (may be null when dweight is).
void rmsnorm_backward(bf16* dinp, bool accumulate_dinp, void* dweight, DType dweight_dtype, const bf16* dout,
                      const bf16* inp, const bf16* weight, const float* rstd, int64_t N, int64_t C, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
