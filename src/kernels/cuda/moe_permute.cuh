// Dropless MoE token permutation on the GPU. The N·K (token, slot) pairs are grouped by expert,
// stable in pair order p = t·K + k (bitwise the CPU reference's index outputs):
//   expert_offsets[E + 1]   rows of expert e are [expert_offsets[e], expert_offsets[e + 1])
//   sorted_pair[N·K]        row r holds pair sorted_pair[r]
//   pair_row[N·K]           inverse: pair p sits at row pair_row[p]
// Activations bf16, routing weights fp32, sums in fp32 over k ascending (never atomics).
// CPU reference and spec: kernels/cpu/moe_permute.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// Bytes of scratch moe_permute_indices needs.
size_t moe_permute_indices_scratch_bytes(int64_t N, int64_t K, int64_t E);

// topk_idx [N, K] int32 -> expert_offsets [E + 1], sorted_pair [N·K], pair_row [N·K] (all written).
// A pair whose expert lies outside [0, E) is left out (the CPU reference rejects it): its pair_row
// is -1, expert_offsets[E] < N·K counts only the valid pairs, and the rows past expert_offsets[E]
// hold sorted_pair -1. E <= 4096. scratch: moe_permute_indices_scratch_bytes(N, K, E), 16-byte aligned.
void moe_permute_indices(int32_t* expert_offsets, int32_t* sorted_pair, int32_t* pair_row, const int32_t* topk_idx,
                         int64_t N, int64_t K, int64_t E, void* scratch, size_t scratch_bytes, cudaStream_t stream);

// x_perm [N·K, H] (written): row r = x[sorted_pair[r] / K] (a zero row where sorted_pair[r] is -1).
void moe_gather_forward(bf16* x_perm, const bf16* x, const int32_t* sorted_pair, int64_t N, int64_t K, int64_t H,
                        cudaStream_t stream);

// dx [N, H] = (or += when accumulate) Σ_k dx_perm[pair_row[t·K + k]], k ascending, fp32 sum.
void moe_gather_backward(bf16* dx, bool accumulate, const bf16* dx_perm, const int32_t* pair_row, int64_t N, int64_t K,
                         int64_t H, cudaStream_t stream);

// out [N, H] (written) = Σ_k topk_weight[t, k] · y_perm[pair_row[t·K + k]], k ascending, fp32 sum.
void moe_unpermute_forward(bf16* out, const bf16* y_perm, const float* topk_weight, const int32_t* pair_row, int64_t N,
                           int64_t K, int64_t H, cudaStream_t stream);

// dy_perm [N·K, H] bf16 (written, rows of valid pairs) = topk_weight[t, k] · dout[t];
// dtopk_weight [N, K] fp32 (written) = <dout[t], y_perm[pair_row[t·K + k]]> summed in fp32. K <= 32.
void moe_unpermute_backward(bf16* dy_perm, float* dtopk_weight, const bf16* dout, const bf16* y_perm,
                            const float* topk_weight, const int32_t* pair_row, int64_t N, int64_t K, int64_t H,
                            cudaStream_t stream);

// offsets [E + 1] (written) from group_sizes [E] (ragged_dot's): the running sum, a negative size
// counting as 0 and every offset clamped to num_rows (<= INT32_MAX); on the device, no host sync.
void group_offsets(int32_t* offsets, const int32_t* group_sizes, int64_t E, int64_t num_rows, cudaStream_t stream);

// Rows [offsets[E], M) of x [M, C] set to zero; the end row is read on the device.
void zero_rows_past_groups(bf16* x, const int32_t* offsets, int64_t E, int64_t M, int64_t C, cudaStream_t stream);

}  // namespace mf::cuda
