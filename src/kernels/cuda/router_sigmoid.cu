// Sigmoid MoE router, CUDA, fp32. One warp per token row; lane l holds experts e = l + 32·j
// (j < kPerLane, a compile-time bound chosen from E), so a row's loads and stores are coalesced.
//   forward   s = 1 / (1 + expf(−x)), c = s + bias. Grouped (topk_group < n_group): the warp puts c
//             in shared memory, lane g < n_group scans group g in ascending order for its running
//             top-2 (t1 + t2), and topk_group rounds of a warp arg-max pick the groups; experts of
//             the others get masked_score. Then K rounds of a warp arg-max over the experts not yet
//             taken. Every arg-max orders by (value descending, index ascending), so ties go to the
//             lower index as in the CPU reference, and lane 0's winner is broadcast so every lane
//             agrees even on NaN rows. Σ_k w[k] in k order, then / (Σ + 1e-20), then × scale.
//   backward  lane k holds slot k; Σ_k in ascending order by shuffles from lane k; each slot's ds is
//             added into the lane that owns its expert; dlogits = ds · s · (1 − s), zero elsewhere.
// Given the same σ values the choice equals the CPU's; σ itself may differ from the CPU's by an ulp
// of expf, which changes nothing but exact near-ties. All sums run in a fixed order.
#include <cuda_bf16.h>

#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/router_sigmoid.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxExperts = 1024;
constexpr int kMaxTopK = 32;
constexpr int kMaxGroups = 32;  // one lane per group
constexpr float kNormEps = 1e-20f;

struct KernelParams {
    int E, K, n_group, topk_group;
    bool norm_topk_prob;
    float routed_scaling_factor, masked_score;
};

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// The warp's best candidate by (v descending, i ascending); i < 0: no candidate. `s` travels with
// it. Every lane ends with lane 0's result.
__device__ __forceinline__ void warp_arg_max(float& v, int& i, float& s) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float other_v = __shfl_xor_sync(detail::kFullMask, v, offset);
        const int other_i = __shfl_xor_sync(detail::kFullMask, i, offset);
        const float other_s = __shfl_xor_sync(detail::kFullMask, s, offset);
        if (other_i >= 0 && (i < 0 || other_v > v || (other_v == v && other_i < i))) {
            v = other_v;
            i = other_i;
            s = other_s;
        }
    }
    v = __shfl_sync(detail::kFullMask, v, 0);
    i = __shfl_sync(detail::kFullMask, i, 0);
    s = __shfl_sync(detail::kFullMask, s, 0);
}

// Bit g set: group g is one of the topk_group best by the sum of its two largest c (in `row_c`).
__device__ uint32_t kept_groups(const float* row_c, const KernelParams& p, int lane) {
    const int G = p.E / p.n_group;
    float score = 0.0f;
    int group = -1;
    if (lane < p.n_group) {
        float t1 = -INFINITY, t2 = -INFINITY;
        for (int e = lane * G; e < (lane + 1) * G; ++e) {
            const float c = row_c[e];
            if (c > t1) {
                t2 = t1;
                t1 = c;
            } else if (c > t2) {
                t2 = c;
            }
        }
        score = t1 + t2;
        group = lane;
    }
    uint32_t kept = 0;
    for (int r = 0; r < p.topk_group; ++r) {
        float v = score, unused = 0.0f;
        int i = (group >= 0 && !(kept >> group & 1u)) ? group : -1;
        warp_arg_max(v, i, unused);
        kept |= 1u << i;
    }
    return kept;
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    router_sigmoid_forward_kernel(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits,
                                  const void* bias, bool bias_bf16, int64_t N, KernelParams p) {
    __shared__ float choice[kWarps][kPerLane * 32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
    if (row >= N) return;  // the whole warp leaves together
    const int E = p.E;

    float s[kPerLane], v[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        s[j] = 0.0f;
        v[j] = -INFINITY;
        if (e < E) {
            s[j] = sigmoid(logits[row * E + e]);
            scores[row * E + e] = s[j];
            float b = 0.0f;
            if (bias != nullptr)
                b = bias_bf16 ? __bfloat162float(static_cast<const bf16*>(bias)[e])
                              : static_cast<const float*>(bias)[e];
            v[j] = s[j] + b;
        }
    }
    if (p.topk_group < p.n_group) {
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int e = lane + 32 * j;
            if (e < E) choice[warp][e] = v[j];
        }
        __syncwarp();
        const uint32_t kept = kept_groups(choice[warp], p, lane);
        const int G = E / p.n_group;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int e = lane + 32 * j;
            if (e < E && !(kept >> (e / G) & 1u)) v[j] = p.masked_score;
        }
    }

    uint32_t taken = 0;  // bit j: expert lane + 32·j is taken
    int32_t my_idx = 0;
    float my_s = 0.0f;
    for (int k = 0; k < p.K; ++k) {
        float best_v = 0.0f, best_s = 0.0f;
        int best_i = -1;
#pragma unroll
        for (int j = 0; j < kPerLane; ++j) {
            const int e = lane + 32 * j;
            // Ascending e with a strict '>' keeps the lower index on ties within the lane.
            if (e < E && !(taken >> j & 1u) && (best_i < 0 || v[j] > best_v)) {
                best_v = v[j];
                best_s = s[j];
                best_i = e;
            }
        }
        warp_arg_max(best_v, best_i, best_s);
        if (best_i % 32 == lane) taken |= 1u << (best_i / 32);
        if (lane == k) {
            my_idx = best_i;
            my_s = best_s;
        }
    }
    float w = my_s;
    if (p.norm_topk_prob) {
        float total = 0.0f;
        for (int k = 0; k < p.K; ++k) total += __shfl_sync(detail::kFullMask, my_s, k);
        w = w / (total + kNormEps);
    }
    w = w * p.routed_scaling_factor;
    if (lane < p.K) {
        topk_idx[row * p.K + lane] = my_idx;
        topk_weight[row * p.K + lane] = w;
    }
}

template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    router_sigmoid_backward_kernel(float* dlogits, const float* dtopk_weight, const float* scores,
                                   const int32_t* topk_idx, int64_t N, int E, int K, bool norm_topk_prob,
                                   float routed_scaling_factor) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= N) return;
    const float* s_row = scores + row * E;

    // Lane k holds slot k: its expert, its weight gradient and the chosen score.
    int32_t idx = -1;
    float dw = 0.0f, s_sel = 0.0f;
    if (lane < K) {
        idx = topk_idx[row * K + lane];
        if (idx >= 0 && idx < E) {
            dw = dtopk_weight[row * K + lane];
            s_sel = s_row[idx];
        } else {
            idx = -1;
        }
    }
    float ds = routed_scaling_factor * dw;
    if (norm_topk_prob) {
        float total = 0.0f;
        for (int k = 0; k < K; ++k) total += __shfl_sync(detail::kFullMask, s_sel, k);
        const float denom = total + kNormEps;
        float dw_dot_u = 0.0f;
        for (int k = 0; k < K; ++k) {
            dw_dot_u += __shfl_sync(detail::kFullMask, dw, k) * (__shfl_sync(detail::kFullMask, s_sel, k) / denom);
        }
        ds = routed_scaling_factor * (dw - dw_dot_u) / denom;
    }
    float ds_sum[kPerLane];
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) ds_sum[j] = 0.0f;
    for (int k = 0; k < K; ++k) {
        const int e = __shfl_sync(detail::kFullMask, idx, k);
        const float d = __shfl_sync(detail::kFullMask, ds, k);
        if (e >= 0 && e % 32 == lane) {
#pragma unroll
            for (int j = 0; j < kPerLane; ++j) {
                if (j == e / 32) ds_sum[j] += d;
            }
        }
    }
#pragma unroll
    for (int j = 0; j < kPerLane; ++j) {
        const int e = lane + 32 * j;
        if (e < E) {
            const float s = s_row[e];
            dlogits[row * E + e] = ds_sum[j] * (s * (1.0f - s));
        }
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

void check_rows(const char* op, int64_t N, int64_t E, int64_t K) {
    MF_CHECK(N >= 0, op, ": N = ", N, " is negative");
    MF_CHECK(E <= kMaxExperts && K <= kMaxTopK, op, ": E = ", E, " or K = ", K, " above the supported ", kMaxExperts,
             " / ", kMaxTopK);
    MF_CHECK((N + kWarps - 1) / kWarps <= std::numeric_limits<int32_t>::max(), op, ": N = ", N, " is too large");
}

unsigned row_blocks(int64_t N) { return static_cast<unsigned>((N + kWarps - 1) / kWarps); }

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
    static void run(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits, const void* bias,
                    bool bias_bf16, int64_t N, const KernelParams& p, cudaStream_t stream) {
        router_sigmoid_forward_kernel<kPerLane>
            <<<row_blocks(N), kThreads, 0, stream>>>(scores, topk_idx, topk_weight, logits, bias, bias_bf16, N, p);
    }
};

template <int kPerLane>
struct LaunchBackward {
    static void run(float* dlogits, const float* dtopk_weight, const float* scores, const int32_t* topk_idx, int64_t N,
                    int E, int K, bool norm, float scale, cudaStream_t stream) {
        router_sigmoid_backward_kernel<kPerLane>
            <<<row_blocks(N), kThreads, 0, stream>>>(dlogits, dtopk_weight, scores, topk_idx, N, E, K, norm, scale);
    }
};

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void router_sigmoid_forward(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits,
                            const void* correction_bias, DType bias_dtype, int64_t N, int64_t E, int64_t K,
                            const RouterSigmoidParams& p, cudaStream_t stream) {
    const char* op = "router_sigmoid_forward";
    cpu::check_router_sigmoid(op, E, K, p);
    check_rows(op, N, E, K);
    MF_CHECK(p.topk_group == p.n_group || p.n_group <= kMaxGroups, op, ": n_group = ", p.n_group,
             " above the supported ", kMaxGroups, " for group-limited routing");
    MF_CHECK(correction_bias == nullptr || bias_dtype == DType::f32 || bias_dtype == DType::bf16, op,
             ": correction_bias must be f32 or bf16, not ", dtype_name(bias_dtype));
    if (N == 0) return;
    MF_CHECK(scores != nullptr && topk_idx != nullptr && topk_weight != nullptr && logits != nullptr, op,
             ": null buffer");
    const KernelParams kp{static_cast<int>(E),
                          static_cast<int>(K),
                          static_cast<int>(p.n_group),
                          static_cast<int>(p.topk_group),
                          p.norm_topk_prob,
                          p.routed_scaling_factor,
                          p.masked_score};
    dispatch_per_lane<LaunchForward>(E, scores, topk_idx, topk_weight, logits, correction_bias,
                                     bias_dtype == DType::bf16, N, kp, stream);
    MF_CHECK_CUDA(cudaGetLastError());
}

void router_sigmoid_backward(float* dlogits, const float* dtopk_weight, const float* scores, const int32_t* topk_idx,
                             int64_t N, int64_t E, int64_t K, bool norm_topk_prob, float routed_scaling_factor,
                             cudaStream_t stream) {
    const char* op = "router_sigmoid_backward";
    MF_CHECK(E >= 1 && K >= 1 && K <= E, op, ": bad shape E=", E, " K=", K, " (need 1 <= K <= E)");
    check_rows(op, N, E, K);
    if (N == 0) return;
    MF_CHECK(dlogits != nullptr && dtopk_weight != nullptr && scores != nullptr && topk_idx != nullptr, op,
             ": null buffer");
    dispatch_per_lane<LaunchBackward>(E, dlogits, dtopk_weight, scores, topk_idx, N, static_cast<int>(E),
                                      static_cast<int>(K), norm_topk_prob, routed_scaling_factor, stream);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
