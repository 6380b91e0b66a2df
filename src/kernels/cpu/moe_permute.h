// Dropless token permutation for MoE. The N·K (token, slot) pairs are grouped by expert,
// stable in pair order p = t·K + k, so every expert's rows are contiguous and in token order:
//   expert_offsets[E + 1]   rows of expert e are [expert_offsets[e], expert_offsets[e + 1])
//   sorted_pair[N·K]        row r holds pair sorted_pair[r]
//   pair_row[N·K]           inverse: pair p sits at row pair_row[p]
// A pair whose expert lies outside [0, E) (an EP sentinel) is dropped: pair_row = -1, and the rows
// past expert_offsets[E] hold sorted_pair = -1; gather gives them zero rows, the sums skip them.
// Sums run in a fixed order (slot 0..K-1), never with atomics, so results are deterministic.
#pragma once

#include <cstdint>

namespace mf::cpu {

void moe_permute_indices(int32_t* expert_offsets, int32_t* sorted_pair, int32_t* pair_row, const int32_t* topk_idx,
                         int64_t N, int64_t K, int64_t E);

// x_perm[N·K, H]: row r = x[sorted_pair[r] / K].
void moe_gather_forward(float* x_perm, const float* x, const int32_t* sorted_pair, int64_t N, int64_t K, int64_t H);
// dx[N, H] += Σ_k dx_perm[pair_row[t·K + k]]  (k ascending).
void moe_gather_backward(float* dx, const float* dx_perm, const int32_t* pair_row, int64_t N, int64_t K, int64_t H);

// out[N, H] = Σ_k topk_weight[t, k] · y_perm[pair_row[t·K + k]]  (written, k ascending).
void moe_unpermute_forward(float* out, const float* y_perm, const float* topk_weight, const int32_t* pair_row,
                           int64_t N, int64_t K, int64_t H);
// dy_perm[N·K, H] (written) = topk_weight · dout[token];  dtopk_weight[N, K] (written) = <dout[t], y_perm[row]>.
void moe_unpermute_backward(float* dy_perm, float* dtopk_weight, const float* dout, const float* y_perm,
                            const float* topk_weight, const int32_t* pair_row, int64_t N, int64_t K, int64_t H);

// Group sizes to offsets (ragged_dot's group_sizes): offsets[E + 1] (written) = 0, then the running
// sum of group_sizes[E], a negative size counting as 0 and every offset clamped to num_rows, so that
// no group reaches past the rows.
void group_offsets(int32_t* offsets, const int32_t* group_sizes, int64_t E, int64_t num_rows);
// Rows [offsets[E], M) of x [M, C] set to zero (the rows no group covers).
void zero_rows_past_groups(float* x, const int32_t* offsets, int64_t E, int64_t M, int64_t C);

}  // namespace mf::cpu
