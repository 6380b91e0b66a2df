// MoE router, fp32 CPU reference, as HF Qwen3-MoE computes it:
//   probs = softmax(logits) in fp32 (max subtracted, exp, divided by the sum)
//   topk_idx = the K largest probs in descending order; ties go to the lower expert index
//   topk_weight[k] = probs[topk_idx[k]], divided by Σ_k probs[topk_idx[k]] when norm_topk_prob
// Backward (the top-k selection is piecewise constant, so gradients flow through the values):
//   with S = Σ_j p_sel[j], w = p_sel / S:   dp_sel[j] = (dw[j] − Σ_k dw[k]·w[k]) / S   (norm)
//                                           dp_sel[j] = dw[j]                          (no norm)
//   dp = dprobs (or 0) + scatter(dp_sel);   dlogits = p ⊙ (dp − Σ_e p_e·dp_e)
// Sums over K and E run in ascending index order. Top-k is K passes of a strict-greater scan over
// the experts not yet taken, which is what makes ties go to the lower index.
#include "kernels/cpu/router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"

namespace mf::cpu {

namespace {

void check_shape(int64_t N, int64_t E, int64_t K) {
    MF_CHECK(N >= 0 && E > 0 && K > 0 && K <= E, "router: bad shape N=", N, " E=", E, " K=", K, " (need 0 < K <= E)");
}

}  // namespace

void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int64_t E,
                    int64_t K, bool norm_topk_prob) {
    check_shape(N, E, K);
    std::vector<char> taken(static_cast<size_t>(E));
    for (int64_t n = 0; n < N; ++n) {
        const float* x = logits + n * E;
        float* p = probs + n * E;
        float m = x[0];
        for (int64_t e = 1; e < E; ++e) m = std::max(m, x[e]);
        float sum = 0.0f;
        for (int64_t e = 0; e < E; ++e) {
            p[e] = std::exp(x[e] - m);
            sum += p[e];
        }
        for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;

        int32_t* idx = topk_idx + n * K;
        float* w = topk_weight + n * K;
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t k = 0; k < K; ++k) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; ++e) {
                // NOTE: strict '>' keeps the lower index on ties; best < 0 also catches NaN rows.
                if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
            }
            taken[best] = 1;
            idx[k] = static_cast<int32_t>(best);
            w[k] = p[best];
        }
        if (norm_topk_prob) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; ++k) total += w[k];
            for (int64_t k = 0; k < K; ++k) w[k] = w[k] / total;
        }
    }
}

void router_backward(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                     const int32_t* topk_idx, int64_t N, int64_t E, int64_t K, bool norm_topk_prob) {
    check_shape(N, E, K);
    std::vector<float> dp(static_cast<size_t>(E));
    for (int64_t n = 0; n < N; ++n) {
        const float* p = probs + n * E;
        const int32_t* idx = topk_idx + n * K;
        const float* dw = dtopk_weight + n * K;
        for (int64_t k = 0; k < K; ++k) {
            MF_CHECK(idx[k] >= 0 && idx[k] < E, "router: topk_idx[", n, ", ", k, "] = ", idx[k], " outside [0, ", E,
                     ")");
        }
        if (dprobs != nullptr) {
            std::copy_n(dprobs + n * E, E, dp.begin());
        } else {
            std::fill(dp.begin(), dp.end(), 0.0f);
        }
        if (norm_topk_prob) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; ++k) total += p[idx[k]];
            float dw_dot_w = 0.0f;
            for (int64_t k = 0; k < K; ++k) dw_dot_w += dw[k] * (p[idx[k]] / total);
            for (int64_t k = 0; k < K; ++k) dp[idx[k]] += (dw[k] - dw_dot_w) / total;
        } else {
            for (int64_t k = 0; k < K; ++k) dp[idx[k]] += dw[k];
        }
        float p_dot_dp = 0.0f;
        for (int64_t e = 0; e < E; ++e) p_dot_dp += p[e] * dp[e];
        float* dx = dlogits + n * E;
        for (int64_t e = 0; e < E; ++e) dx[e] = p[e] * (dp[e] - p_dot_dp);
    }
}

}  // namespace mf::cpu
