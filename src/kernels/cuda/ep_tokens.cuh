// Expert-parallel token exchange on the GPU: the ops of ops.h's "expert-parallel token exchange",
// bitwise the CPU reference's for the index and copy ops, fp32 sums in the same order for the rest.
// Rows bf16 (H elements), routing weights and weight gradients fp32, indices int32. Block buffers,
// meta and the skipping of invalid indices: kernels/cpu/ep_tokens.h (the spec). The block offsets
// off(v) = Σ_{v'<v} max(counts[v'], 0) are computed on the device from counts (no host sync).
// Limits: V <= kEpMaxDestinations, E <= kEpMaxExperts (positions), K <= kEpMaxTopK (one slot per
// lane). N·K < 2^31.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

constexpr int64_t kEpMaxDestinations = 1024;
constexpr int64_t kEpMaxExperts = 65536;
constexpr int64_t kEpMaxTopK = 32;

// send_pos [V, N], counts [V] (written) from topk_idx [N, K], expert_dest [E].
void ep_token_positions(int32_t* send_pos, int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest,
                        int64_t N, int64_t K, int64_t E, int64_t V, cudaStream_t stream);

// rows [num_rows, H]: block v's row send_pos[v, t] = src[t] (src [N, H]); other rows untouched.
void ep_pack_rows(bf16* rows, int64_t num_rows, const bf16* src, const int32_t* send_pos, const int32_t* counts,
                  int64_t N, int64_t V, int64_t H, cudaStream_t stream);

// meta [num_rows, 2K] of the same rows (expert_offsets [E + 1], row_base [E], pair_row [N·K]).
void ep_pack_meta(int32_t* meta, int64_t num_rows, const int32_t* send_pos, const int32_t* counts,
                  const int32_t* topk_idx, const float* topk_weight, const int32_t* pair_row,
                  const int32_t* expert_offsets, const int32_t* row_base, const int32_t* expert_dest, int64_t N,
                  int64_t K, int64_t E, int64_t V, cudaStream_t stream);

// local [num_local, H]: local[meta[i, k]] = rows[i] (rows, meta: M rows).
void ep_scatter_rows(bf16* local, int64_t num_local, const bf16* rows, const int32_t* meta, int64_t M, int64_t K,
                     int64_t H, cudaStream_t stream);

// dlocal[d] = w[i, k] · drows[i] (bf16, written), dweight [M, K] fp32 (written) = <drows[i], y_local[d]>.
void ep_scatter_grad(bf16* dlocal, float* dweight, const bf16* drows, const int32_t* meta, const bf16* y_local,
                     int64_t num_local, int64_t M, int64_t K, int64_t H, cudaStream_t stream);

// out [M, H] (written) = Σ_k (weighted ? w[i, k] : 1) · local[meta[i, k]], fp32, k ascending; out bf16
// (rounded once) or fp32 (the partial sums the EP combine sends back unrounded).
void ep_reduce_rows(bf16* out, const bf16* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted, cudaStream_t stream);
void ep_reduce_rows(float* out, const bf16* local, int64_t num_local, const int32_t* meta, int64_t M, int64_t K,
                    int64_t H, bool weighted, cudaStream_t stream);

// out [N, H] = (accumulate ? old + : ) Σ_v rows[off(v) + send_pos[v, t]], fp32, v ascending.
// rows bf16 or fp32.
void ep_sum_blocks(bf16* out, bool accumulate, const bf16* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H, cudaStream_t stream);
void ep_sum_blocks(bf16* out, bool accumulate, const float* rows, int64_t num_rows, const int32_t* send_pos,
                   const int32_t* counts, int64_t N, int64_t V, int64_t H, cudaStream_t stream);

// dtopk_weight [N, K] fp32 (written) = dweight_rows[off(v) + send_pos[v, t], k], v = expert_dest[topk_idx[t, k]].
void ep_gather_slots(float* dtopk_weight, const float* dweight_rows, int64_t num_rows, const int32_t* send_pos,
                     const int32_t* counts, const int32_t* topk_idx, const int32_t* expert_dest, int64_t N, int64_t K,
                     int64_t E, int64_t V, cudaStream_t stream);

}  // namespace mf::cuda
