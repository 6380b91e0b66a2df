// MoE router, CUDA, fp32. One warp per token row; lane l holds experts e = l + 32·j (j < kPerLane,
// a compile-time bound chosen from E), so loads and stores of a row are coalesced.
//   forward   max and Σ exp by xor butterflies; p = exp(x − max) / Σ; top-k is K rounds of a
//             warp arg-max over the experts not yet taken, ordered by (p descending, index
//             ascending) so ties go to the lower index, as in the CPU reference; lane 0's winner is
//             broadcast so every lane agrees even on NaN rows. Renormalisation divides by
//             Σ_k w[k] summed in k order (the CPU order).
//   backward  as kernels/cpu/router.cpp: sums over k in ascending order (shuffles from lane k), the
//             selected gradients scattered into the lane that owns each expert, Σ_e p·dp by a
//             butterfly, dlogits = p ⊙ (dp − Σ p·dp).
//   aux stats a fixed number of blocks, each owning a contiguous range of rows; thread e of a block
//             sums probs[n, e] and the top-k hits of e over its rows in order into scratch
//             [2][block][E]; reduce_partial_rows adds the blocks in order into counts / prob_sums.
// All reductions run in a fixed order: results are bitwise reproducible.
#include <algorithm>
#include <cmath>
#include <limits>

#include "core/cuda_check.h"
#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/router.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int64_t kStatsRowsPerBlock = 16;
constexpr int64_t kMaxStatsBlocks = 1024;

int64_t stats_blocks(int64_t N) {
    return std::clamp<int64_t>((N + kStatsRowsPerBlock - 1) / kStatsRowsPerBlock, 1, kMaxStatsBlocks);
}

// ----------------------------------------------------------------------------------------------
// kernels

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    router_forward_kernel(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int E,
                          int K, bool norm_topk_prob) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp leaves together
    const float* x = logits + row * E;

    float p[kPerLane];
    float m = -INFINITY;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? x[e] : -INFINITY;
        m = fmaxf(m, p[j]);
    }
    m = detail::warp_max(m);
    float sum = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? expf(p[j] - m) : 0.0f;
        sum += p[j];
    }
    sum = detail::group_sum<32>(sum);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < E) {
            p[j] = p[j] / sum;
            probs[row * E + e] = p[j];
        }
    }

    uint32_t taken = 0;  // bit j: expert lane + 32·j is taken
    int32_t my_idx = 0;
    float my_w = 0.0f;
    for (int k = 0; k < K; ++k) {
        float best_v = 0.0f;
        int best_i = -1;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int e = lane + 32 * j;
            // Ascending e with a strict '>' keeps the lower index on ties within the lane.
            if (e < E && !(taken >> j & 1u) && (best_i < 0 || p[j] > best_v)) {
                best_v = p[j];
                best_i = e;
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float other_v = __shfl_xor_sync(detail::kFullMask, best_v, offset);
            const int other_i = __shfl_xor_sync(detail::kFullMask, best_i, offset);
            const bool better =
                other_i >= 0 && (best_i < 0 || other_v > best_v || (other_v == best_v && other_i < best_i));
            if (better) {
                best_v = other_v;
                best_i = other_i;
            }
        }
        best_v = __shfl_sync(detail::kFullMask, best_v, 0);
        best_i = __shfl_sync(detail::kFullMask, best_i, 0);
        if (best_i % 32 == lane) taken |= 1u << (best_i / 32);
        if (lane == k) {
            my_idx = best_i;
            my_w = best_v;
        }
    }
    if (norm_topk_prob) {
        float total = 0.0f;
        for (int k = 0; k < K; ++k) total += __shfl_sync(detail::kFullMask, my_w, k);
        my_w = my_w / total;
    }
    if (lane < K) {
        topk_idx[row * K + lane] = my_idx;
        topk_weight[row * K + lane] = my_w;
    }
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    router_backward_kernel(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                           const int32_t* topk_idx, int64_t N, int E, int K, bool norm_topk_prob) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= N) return;
    const float* p_row = probs + row * E;

    float p[kPerLane], dp[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        p[j] = e < E ? p_row[e] : 0.0f;
        dp[j] = (e < E && dprobs != nullptr) ? dprobs[row * E + e] : 0.0f;
    }
    // Lane k holds slot k: its expert, its weight gradient and the selected probability.
    int32_t idx = -1;
    float dw = 0.0f, p_sel = 0.0f;
    if (lane < K) {
        idx = topk_idx[row * K + lane];
        if (idx >= 0 && idx < E) {
            dw = dtopk_weight[row * K + lane];
            p_sel = p_row[idx];
        } else {
            idx = -1;
        }
    }
    float dp_sel = dw;
    if (norm_topk_prob) {
        float total = 0.0f;
        for (int k = 0; k < K; ++k) total += __shfl_sync(detail::kFullMask, p_sel, k);
        float dw_dot_w = 0.0f;
        for (int k = 0; k < K; ++k) {
            dw_dot_w += __shfl_sync(detail::kFullMask, dw, k) * (__shfl_sync(detail::kFullMask, p_sel, k) / total);
        }
        dp_sel = (dw - dw_dot_w) / total;
    }
    for (int k = 0; k < K; ++k) {
        const int e = __shfl_sync(detail::kFullMask, idx, k);
        const float d = __shfl_sync(detail::kFullMask, dp_sel, k);
        if (e >= 0 && e % 32 == lane) {
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                if (j == e / 32) dp[j] += d;
            }
        }
    }
    float p_dot_dp = 0.0f;
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) p_dot_dp += p[j] * dp[j];
    p_dot_dp = detail::group_sum<32>(p_dot_dp);
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < E) dlogits[row * E + e] = p[j] * (dp[j] - p_dot_dp);
    }
}

// partial: [2][gridDim.x][E]: counts, then probability sums.
__global__ void router_aux_stats_kernel(float* partial, const float* probs, const int32_t* topk_idx,
                                        const float* row_mask, int64_t N, int E, int K, int64_t rows_per_block) {
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_block;
    const int64_t end = min(N, begin + rows_per_block);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        float count = 0.0f, prob_sum = 0.0f;
        // Loads are unconditional (and the loop unrolled) so that several rows are in flight at once.
#pragma unroll 4
        for (int64_t n = begin; n < end; ++n) {
            const bool counted = row_mask == nullptr || row_mask[n] != 0.0f;
            const float p = probs[n * E + e];
            float hits = 0.0f;
            for (int k = 0; k < K; ++k) hits += topk_idx[n * K + k] == e ? 1.0f : 0.0f;
            if (counted) {
                prob_sum += p;
                count += hits;
            }
        }
        partial[static_cast<int64_t>(blockIdx.x) * E + e] = count;
        partial[(static_cast<int64_t>(gridDim.x) + blockIdx.x) * E + e] = prob_sum;
    }
}

__global__ void router_aux_dprobs_kernel(float* dprobs, const float* counts, const float* row_mask, double scale,
                                         int64_t N, int E) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N * E; i += stride) {
        const int64_t n = i / E;
        const int e = static_cast<int>(i - n * E);
        const float mask = row_mask != nullptr ? row_mask[n] : 1.0f;
        dprobs[i] = static_cast<float>(scale * static_cast<double>(counts[e])) * mask;
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

void check_shape(const char* op, int64_t N, int64_t E, int64_t K) {
    MF_CHECK(N >= 0 && E > 0 && K > 0 && K <= E, op, ": bad shape N=", N, " E=", E, " K=", K, " (need 0 < K <= E)");
    MF_CHECK(E <= kMaxExperts && K <= kMaxTopK, op, ": E = ", E, " or K = ", K, " above the supported ", kMaxExperts,
             " / ", kMaxTopK);
    MF_CHECK((N + kWarps - 1) / kWarps <= std::numeric_limits<int32_t>::max(), op, ": N = ", N, " is too large");
}

template <template <int> class Launch, typename... Args>
void dispatch_per_lane(int64_t E, Args&&... args) {
    const int64_t per_lane = (E + 31) / 32;
    if (per_lane <= 1) {
        Launch<1>::run(args...);
    } else if (per_lane <= 2) {
        Launch<2>::run(args...);
    } else if (per_lane <= 4) {
        Launch<4>::run(args...);
    } else if (per_lane <= 8) {
        Launch<8>::run(args...);
    } else if (per_lane <= 16) {
        Launch<16>::run(args...);
    } else {
        Launch<32>::run(args...);
    }
}

template <int kPerLane>
struct LaunchForward {
    static void run(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int64_t E,
                    int64_t K, bool norm, cudaStream_t stream) {
        const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
        router_forward_kernel<kPerLane><<<blocks, kThreads, 0, stream>>>(
            probs, topk_idx, topk_weight, logits, N, static_cast<int>(E), static_cast<int>(K), norm);
    }
};

template <int kPerLane>
struct LaunchBackward {
    static void run(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                    const int32_t* topk_idx, int64_t N, int64_t E, int64_t K, bool norm, cudaStream_t stream) {
        const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
        router_backward_kernel<kPerLane><<<blocks, kThreads, 0, stream>>>(
            dlogits, dtopk_weight, dprobs, probs, topk_idx, N, static_cast<int>(E), static_cast<int>(K), norm);
    }
};

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int64_t E,
                    int64_t K, bool norm_topk_prob, cudaStream_t stream) {
    check_shape("router_forward", N, E, K);
    if (N == 0) return;
    MF_CHECK(probs != nullptr && topk_idx != nullptr && topk_weight != nullptr && logits != nullptr,
             "router_forward: null buffer");
    dispatch_per_lane<LaunchForward>(E, probs, topk_idx, topk_weight, logits, N, E, K, norm_topk_prob, stream);
    MF_CHECK_CUDA(cudaGetLastError());
}

void router_backward(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                     const int32_t* topk_idx, int64_t N, int64_t E, int64_t K, bool norm_topk_prob,
                     cudaStream_t stream) {
    check_shape("router_backward", N, E, K);
    if (N == 0) return;
    MF_CHECK(dlogits != nullptr && dtopk_weight != nullptr && probs != nullptr && topk_idx != nullptr,
             "router_backward: null buffer");
    dispatch_per_lane<LaunchBackward>(E, dlogits, dtopk_weight, dprobs, probs, topk_idx, N, E, K, norm_topk_prob,
                                      stream);
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t router_aux_stats_scratch_bytes(int64_t N, int64_t E) {
    MF_CHECK(N >= 0 && E > 0, "router_aux_stats: bad shape N=", N, " E=", E);
    return static_cast<size_t>(2 * stats_blocks(N) * E) * sizeof(float);
}

void router_aux_stats(float* counts, float* prob_sums, const float* probs, const int32_t* topk_idx,
                      const float* row_mask, int64_t N, int64_t E, int64_t K, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream) {
    check_shape("router_aux_stats", N, E, K);
    MF_CHECK(counts != nullptr && prob_sums != nullptr, "router_aux_stats: null output");
    if (N == 0) return;
    MF_CHECK(probs != nullptr && topk_idx != nullptr, "router_aux_stats: null input");
    const size_t needed = router_aux_stats_scratch_bytes(N, E);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed, "router_aux_stats: scratch has ", scratch_bytes,
             " bytes, needs ", needed);
    MF_CHECK(aligned_to(16, scratch), "router_aux_stats: scratch must be 16-byte aligned");
    const int64_t blocks = stats_blocks(N);
    const int64_t rows_per_block = (N + blocks - 1) / blocks;
    const int threads = static_cast<int>(std::min<int64_t>((E + 31) / 32 * 32, 256));
    float* partial = static_cast<float*>(scratch);
    router_aux_stats_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(
        partial, probs, topk_idx, row_mask, N, static_cast<int>(E), static_cast<int>(K), rows_per_block);
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(counts, DType::f32, partial, blocks, E, /*accumulate=*/true, stream);
    reduce_partial_rows(prob_sums, DType::f32, partial + blocks * E, blocks, E, /*accumulate=*/true, stream);
}

void router_aux_dprobs(float* dprobs, const float* counts, const float* row_mask, double scale, int64_t N, int64_t E,
                       cudaStream_t stream) {
    MF_CHECK(N >= 0 && E > 0 && E <= kMaxExperts, "router_aux_dprobs: bad shape N=", N, " E=", E);
    if (N == 0) return;
    MF_CHECK(dprobs != nullptr && counts != nullptr, "router_aux_dprobs: null buffer");
    const int64_t blocks = std::clamp<int64_t>((N * E + kThreads - 1) / kThreads, 1, 65536);
    router_aux_dprobs_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(dprobs, counts, row_mask, scale, N,
                                                                                     static_cast<int>(E));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
