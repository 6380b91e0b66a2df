// Fused per-head RMSNorm (Qwen3's q_norm / k_norm, weight [D]) + rotary position embedding (HF
// rotate_half layout) on the query and key heads, bf16 storage, fp32 math. Per head of D:
//   rstd = 1 / sqrt(mean(x²) + eps),  n = w ⊙ (x · rstd)
//   y[i] = n[i]·cos − n[i+D/2]·sin,  y[i+D/2] = n[i+D/2]·cos + n[i]·sin   (i < D/2)
//   angle = (float)position · inv_freq[i],  inv_freq[i] = 1 / θ^(2i/D) in fp32 as kernels/cpu/rope.h
// CPU reference and spec: kernels/cpu/rmsnorm.h (per head, C = D) followed by kernels/cpu/rope.h.
// Also RoPE alone (no norm), with partial rotary: of each head only the first R = rotary_dim dims
// rotate (pairs i, i + R/2, inv_freq[i] = 1 / θ^(2i/R)), dims [R, D) pass through; spec
// kernels/cpu/rope.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// q [N, Hq, D], k [N, Hkv, D] bf16 (the projections, before the norm) -> q_out, k_out (same shapes,
// written; may alias q and k: in place). q_rstd [N·Hq], k_rstd [N·Hkv] fp32 (written, for backward).
// q_weight, k_weight [D] bf16. positions [N] int32. D even, D <= 256.
// NOTE: the backward needs the pre-norm q and k; run in place only when they are kept or recomputed.
void rope_qknorm_forward(bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q, const bf16* k,
                         const bf16* q_weight, const bf16* k_weight, const int32_t* positions, int64_t N, int64_t Hq,
                         int64_t Hkv, int64_t D, float theta, float eps, cudaStream_t stream);

// The same with the rotation given by tables cos, sin [N, D] bf16 (transformers' position_embeddings,
// any rope type) instead of positions and θ: y[i] = n[i]·cos[i] − n[i+D/2]·sin[i], y[i+D/2] =
// n[i+D/2]·cos[i+D/2] + n[i]·sin[i+D/2] (fp32 math on the bf16 table values).
void rope_qknorm_table_forward(bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q, const bf16* k,
                               const bf16* q_weight, const bf16* k_weight, const bf16* cos, const bf16* sin, int64_t N,
                               int64_t Hq, int64_t Hkv, int64_t D, float eps, cudaStream_t stream);

// RoPE alone: q_out [N, Hq, D] = rope(q), k_out [N, Hkv, D] = rope(k) (bf16, written; may alias q and
// k: in place). R = rotary_dim even, R <= D, R <= 256. positions [N] int32.
void rope_forward(bf16* q_out, bf16* k_out, const bf16* q, const bf16* k, const int32_t* positions, int64_t N,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t rotary_dim, float theta, cudaStream_t stream);
// Its transpose: dq [N, Hq, D], dk [N, Hkv, D] (bf16, written; may alias dq_out, dk_out) = the
// inverse rotation of the output gradients dq_out, dk_out on the first R dims, a copy on the rest.
void rope_backward(bf16* dq, bf16* dk, const bf16* dq_out, const bf16* dk_out, const int32_t* positions, int64_t N,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t rotary_dim, float theta, cudaStream_t stream);

// Bytes of scratch rope_qknorm_backward needs (per-block weight-gradient partial sums).
size_t rope_qknorm_backward_scratch_bytes(int64_t N, int64_t D);

// From the output gradients dq_out [N, Hq, D], dk_out [N, Hkv, D] (bf16):
//   dn = the inverse rotation of dy;  g = dn ⊙ w;  x̂ = x · rstd
//   dq, dk (bf16, written; may alias dq_out, dk_out) = rstd · (g − x̂ · mean(g ⊙ x̂))
//   dq_weight, dk_weight [D] (+=, f32 or bf16 per dweight_dtype; skipped when null) = Σ_heads dn ⊙ x̂,
//   deterministic: per-block fp32 partials in scratch, added in a fixed order (block count from N only).
// q, k: the forward's inputs (pre-norm); q_rstd, k_rstd from the forward.
// scratch: rope_qknorm_backward_scratch_bytes(N, D) bytes, 16-byte aligned (may be null when both
// dweights are).
void rope_qknorm_backward(bf16* dq, bf16* dk, void* dq_weight, void* dk_weight, DType dweight_dtype, const bf16* dq_out,
                          const bf16* dk_out, const bf16* q, const bf16* k, const bf16* q_weight, const bf16* k_weight,
                          const float* q_rstd, const float* k_rstd, const int32_t* positions, int64_t N, int64_t Hq,
                          int64_t Hkv, int64_t D, float theta, void* scratch, size_t scratch_bytes,
                          cudaStream_t stream);

// rope_qknorm_backward with the rotation of the tables cos, sin [N, D] bf16 (its transpose:
// dn[i] = dy[i]·cos[i] + dy[i+D/2]·sin[i+D/2], dn[i+D/2] = dy[i+D/2]·cos[i+D/2] − dy[i]·sin[i]).
void rope_qknorm_table_backward(bf16* dq, bf16* dk, void* dq_weight, void* dk_weight, DType dweight_dtype,
                                const bf16* dq_out, const bf16* dk_out, const bf16* q, const bf16* k,
                                const bf16* q_weight, const bf16* k_weight, const float* q_rstd, const float* k_rstd,
                                const bf16* cos, const bf16* sin, int64_t N, int64_t Hq, int64_t Hkv, int64_t D,
                                void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
