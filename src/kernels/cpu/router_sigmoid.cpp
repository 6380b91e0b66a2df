// Sigmoid MoE router, fp32 CPU reference (spec: router_sigmoid.h), as HF DeepSeek-V3 / Nemotron-H
// compute it, with a deterministic order:
//   every arg-max (groups, then experts) is a strict-greater scan in ascending index over the
//   candidates not yet taken, so ties go to the lower index, and a row of NaNs still yields distinct
//   in-range indices (the first candidate stands when nothing compares greater);
//   the group score is t1 + t2 of a running top-2 (an exact tie of the maximum counts twice, as topk(2));
//   Σ_k in ascending k. Backward: kernels/cpu/router_sigmoid.h's formulas, the sums over k ascending.
// The CUDA kernel (kernels/cuda/router_sigmoid.cu) makes the same comparisons in the same order, so
// given the same σ values both choose the same experts in the same slot order.
#include "kernels/cpu/router_sigmoid.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/check.h"

namespace mf::cpu {

namespace {

constexpr float kNormEps = 1e-20f;  // HF's denominator guard

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

// The largest v[i] over i < n with !taken[i] (the callers leave at least one); ties to the lower
// index. Marks it taken.
int64_t take_arg_max(const float* v, std::vector<char>& taken, int64_t n) {
    size_t best = 0;
    while (taken[best]) ++best;
    for (size_t i = best + 1; i < static_cast<size_t>(n); ++i) {
        // NOTE: strict '>' keeps the lower index on ties; starting from the first candidate also
        // catches NaN.
        if (!taken[i] && v[i] > v[best]) best = i;
    }
    taken[best] = 1;
    return static_cast<int64_t>(best);
}

// v[e] = c[e] for experts of the topk_group best groups (score: sum of the group's two largest c),
// masked_score for the others.
void mask_groups(float* v, const float* c, int64_t E, const RouterSigmoidParams& p, std::vector<float>& group_score,
                 std::vector<char>& group_taken) {
    const int64_t G = E / p.n_group;
    for (int64_t g = 0; g < p.n_group; ++g) {
        float t1 = -INFINITY, t2 = -INFINITY;
        for (int64_t i = g * G; i < (g + 1) * G; ++i) {
            if (c[i] > t1) {
                t2 = t1;
                t1 = c[i];
            } else if (c[i] > t2) {
                t2 = c[i];
            }
        }
        group_score[static_cast<size_t>(g)] = t1 + t2;
    }
    std::fill(group_taken.begin(), group_taken.end(), 0);
    for (int64_t r = 0; r < p.topk_group; ++r) take_arg_max(group_score.data(), group_taken, p.n_group);
    for (int64_t e = 0; e < E; ++e) v[e] = group_taken[static_cast<size_t>(e / G)] ? c[e] : p.masked_score;
}

}  // namespace

void check_router_sigmoid(const char* op, int64_t E, int64_t K, const RouterSigmoidParams& p) {
    MF_CHECK(E >= 1 && K >= 1, op, ": bad shape E=", E, " K=", K, " (need E >= 1, K >= 1)");
    MF_CHECK(p.n_group >= 1 && E % p.n_group == 0, op, ": n_group = ", p.n_group, " does not divide E = ", E,
             " into groups");
    MF_CHECK(p.topk_group >= 1 && p.topk_group <= p.n_group, op, ": topk_group = ", p.topk_group,
             " outside [1, n_group = ", p.n_group, "]");
    MF_CHECK(p.n_group == 1 || E / p.n_group >= 2, op, ": groups of ", E / p.n_group, " expert(s) (E = ", E,
             ", n_group = ", p.n_group, "); the group score needs >= 2");
    const int64_t selectable = p.topk_group * (E / p.n_group);
    MF_CHECK(K <= selectable, op, ": K = ", K, " exceeds the ", selectable, " experts of topk_group = ", p.topk_group,
             " kept groups of ", E / p.n_group);
    MF_CHECK(std::isfinite(p.routed_scaling_factor), op, ": routed_scaling_factor = ", p.routed_scaling_factor,
             " is not finite");
    MF_CHECK(!std::isnan(p.masked_score), op, ": masked_score is NaN");
}

void router_sigmoid_forward(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits,
                            const float* correction_bias, int64_t N, int64_t E, int64_t K,
                            const RouterSigmoidParams& p) {
    check_router_sigmoid("router_sigmoid_forward", E, K, p);
    MF_CHECK(N >= 0, "router_sigmoid_forward: N = ", N, " is negative");
    const bool grouped = p.topk_group < p.n_group;
    std::vector<float> c(static_cast<size_t>(E)), v(static_cast<size_t>(E)),
        group_score(static_cast<size_t>(p.n_group));
    std::vector<char> taken(static_cast<size_t>(E)), group_taken(static_cast<size_t>(p.n_group));
    for (int64_t n = 0; n < N; ++n) {
        const float* x = logits + n * E;
        float* s = scores + n * E;
        for (int64_t e = 0; e < E; ++e) {
            s[e] = sigmoid(x[e]);
            c[static_cast<size_t>(e)] = correction_bias != nullptr ? s[e] + correction_bias[e] : s[e];
        }
        if (grouped) {
            mask_groups(v.data(), c.data(), E, p, group_score, group_taken);
        } else {
            v = c;
        }

        int32_t* idx = topk_idx + n * K;
        float* w = topk_weight + n * K;
        std::fill(taken.begin(), taken.end(), 0);
        for (int64_t k = 0; k < K; ++k) {
            const int64_t e = take_arg_max(v.data(), taken, E);
            idx[k] = static_cast<int32_t>(e);
            w[k] = s[e];
        }
        if (p.norm_topk_prob) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; ++k) total += w[k];
            const float denom = total + kNormEps;
            for (int64_t k = 0; k < K; ++k) w[k] = w[k] / denom;
        }
        for (int64_t k = 0; k < K; ++k) w[k] = w[k] * p.routed_scaling_factor;
    }
}

void router_sigmoid_backward(float* dlogits, const float* dtopk_weight, const float* scores, const int32_t* topk_idx,
                             int64_t N, int64_t E, int64_t K, bool norm_topk_prob, float routed_scaling_factor) {
    MF_CHECK(N >= 0 && E >= 1 && K >= 1, "router_sigmoid_backward: bad shape N=", N, " E=", E, " K=", K);
    for (int64_t i = 0; i < N * K; ++i) {  // all checked before anything is written
        MF_CHECK(topk_idx[i] >= 0 && topk_idx[i] < E, "router_sigmoid_backward: topk_idx[", i / K, ", ", i % K,
                 "] = ", topk_idx[i], " outside [0, ", E, ")");
    }
    std::vector<float> ds(static_cast<size_t>(E));
    for (int64_t n = 0; n < N; ++n) {
        const float* s = scores + n * E;
        const int32_t* idx = topk_idx + n * K;
        const float* dw = dtopk_weight + n * K;
        std::fill(ds.begin(), ds.end(), 0.0f);
        if (norm_topk_prob) {
            float total = 0.0f;
            for (int64_t k = 0; k < K; ++k) total += s[idx[k]];
            const float denom = total + kNormEps;
            float dw_dot_u = 0.0f;
            for (int64_t k = 0; k < K; ++k) dw_dot_u += dw[k] * (s[idx[k]] / denom);
            for (int64_t k = 0; k < K; ++k)
                ds[static_cast<size_t>(idx[k])] += routed_scaling_factor * (dw[k] - dw_dot_u) / denom;
        } else {
            for (int64_t k = 0; k < K; ++k) ds[static_cast<size_t>(idx[k])] += routed_scaling_factor * dw[k];
        }
        float* dx = dlogits + n * E;
        for (int64_t e = 0; e < E; ++e) dx[e] = ds[static_cast<size_t>(e)] * (s[e] * (1.0f - s[e]));
    }
}

}  // namespace mf::cpu
