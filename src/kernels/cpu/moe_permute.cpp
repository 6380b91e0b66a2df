// Dropless MoE token permutation, CPU reference.
//   indices    a counting sort of the N·K (token, slot) pairs by expert, stable in pair order
//              p = t·K + k: count per expert, exclusive prefix sum into expert_offsets, then place
//              the pairs in order, so each expert's rows are contiguous and in token order.
//   gather     x_perm[r] = x[sorted_pair[r] / K]                       (a row copy)
//   unpermute  out[t] = Σ_k topk_weight[t, k] · y_perm[pair_row[t·K + k]]
// Every sum over a token's K slots runs k = 0..K-1, starting from 0, on one thread, so results
// are deterministic (no scatter-add, no atomics). A pair whose expert index lies outside [0, E) (an
// EP sentinel: an expert another rank holds) is dropped, as the CUDA kernels drop it: pair_row = -1,
// and the rows past expert_offsets[E] hold sorted_pair = -1. Every kernel below skips a row or pair
// index outside its range (a gathered row of zeros, a term that adds nothing, a weight gradient 0).
#include "kernels/cpu/moe_permute.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {

void check_shape(int64_t N, int64_t K, int64_t H) {
    MF_CHECK(N >= 0 && K > 0 && H >= 0, "moe_permute: bad shape N=", N, " K=", K, " H=", H);
    MF_CHECK(N <= std::numeric_limits<int32_t>::max() / K, "moe_permute: N·K = ", N, "·", K,
             " does not fit the int32 row indices");
}

}  // namespace

void moe_permute_indices(int32_t* expert_offsets, int32_t* sorted_pair, int32_t* pair_row, const int32_t* topk_idx,
                         int64_t N, int64_t K, int64_t E) {
    check_shape(N, K, 0);
    MF_CHECK(E > 0, "moe_permute: need at least one expert, got E=", E);
    const int64_t num_pairs = N * K;
    std::vector<int64_t> counts(static_cast<size_t>(E), 0);
    auto kept = [&](int32_t e) { return e >= 0 && e < E; };
    for (int64_t p = 0; p < num_pairs; ++p)
        if (kept(topk_idx[p])) ++counts[topk_idx[p]];
    std::vector<int64_t> cursor(static_cast<size_t>(E));
    int64_t offset = 0;
    for (int64_t e = 0; e < E; ++e) {
        expert_offsets[e] = static_cast<int32_t>(offset);
        cursor[e] = offset;
        offset += counts[e];
    }
    expert_offsets[E] = static_cast<int32_t>(offset);
    for (int64_t p = 0; p < num_pairs; ++p) {
        if (!kept(topk_idx[p])) {
            pair_row[p] = -1;
            continue;
        }
        const int64_t row = cursor[topk_idx[p]]++;
        sorted_pair[row] = static_cast<int32_t>(p);
        pair_row[p] = static_cast<int32_t>(row);
    }
    std::fill(sorted_pair + offset, sorted_pair + num_pairs, -1);
}

void moe_gather_forward(float* x_perm, const float* x, const int32_t* sorted_pair, int64_t N, int64_t K, int64_t H) {
    check_shape(N, K, H);
    const int64_t num_pairs = N * K;
    for (int64_t r = 0; r < num_pairs; ++r) {
        const int32_t p = sorted_pair[r];
        if (p >= 0 && p < num_pairs)
            std::copy_n(x + (p / K) * H, H, x_perm + r * H);
        else
            std::fill_n(x_perm + r * H, H, 0.0f);
    }
}

void moe_gather_backward(float* dx, const float* dx_perm, const int32_t* pair_row, int64_t N, int64_t K, int64_t H) {
    check_shape(N, K, H);
    const int64_t num_pairs = N * K;
    std::vector<float> acc(static_cast<size_t>(H));
    for (int64_t t = 0; t < N; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = 0; k < K; ++k) {
            const int32_t row = pair_row[t * K + k];
            if (row < 0 || row >= num_pairs) continue;
            const float* g = dx_perm + row * H;
            for (int64_t h = 0; h < H; ++h) acc[h] += g[h];
        }
        float* d = dx + t * H;
        for (int64_t h = 0; h < H; ++h) d[h] += acc[h];
    }
}

void moe_unpermute_forward(float* out, const float* y_perm, const float* topk_weight, const int32_t* pair_row,
                           int64_t N, int64_t K, int64_t H) {
    check_shape(N, K, H);
    const int64_t num_pairs = N * K;
    for (int64_t t = 0; t < N; ++t) {
        float* o = out + t * H;
        std::fill(o, o + H, 0.0f);
        for (int64_t k = 0; k < K; ++k) {
            const int32_t row = pair_row[t * K + k];
            if (row < 0 || row >= num_pairs) continue;
            const float w = topk_weight[t * K + k];
            const float* y = y_perm + row * H;
            for (int64_t h = 0; h < H; ++h) o[h] += w * y[h];
        }
    }
}

void moe_unpermute_backward(float* dy_perm, float* dtopk_weight, const float* dout, const float* y_perm,
                            const float* topk_weight, const int32_t* pair_row, int64_t N, int64_t K, int64_t H) {
    check_shape(N, K, H);
    const int64_t num_pairs = N * K;
    for (int64_t t = 0; t < N; ++t) {
        const float* g = dout + t * H;
        for (int64_t k = 0; k < K; ++k) {
            const int32_t row = pair_row[t * K + k];
            if (row < 0 || row >= num_pairs) {
                dtopk_weight[t * K + k] = 0.0f;
                continue;
            }
            const float w = topk_weight[t * K + k];
            float* dy = dy_perm + row * H;
            for (int64_t h = 0; h < H; ++h) dy[h] = w * g[h];
            dtopk_weight[t * K + k] = lane_dot(g, y_perm + row * H, H);
        }
    }
}

void group_offsets(int32_t* offsets, const int32_t* group_sizes, int64_t E, int64_t num_rows) {
    MF_CHECK(E >= 0 && num_rows >= 0 && num_rows <= std::numeric_limits<int32_t>::max(), "group_offsets: E = ", E,
             ", num_rows = ", num_rows);
    int64_t sum = 0;
    offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e) {
        sum = std::min(sum + std::max<int64_t>(group_sizes[e], 0), num_rows);
        offsets[e + 1] = static_cast<int32_t>(sum);
    }
}

void zero_rows_past_groups(float* x, const int32_t* offsets, int64_t E, int64_t M, int64_t C) {
    const int64_t end = std::clamp<int64_t>(offsets[E], 0, M);
    std::fill(x + end * C, x + M * C, 0.0f);
}

}  // namespace mf::cpu
