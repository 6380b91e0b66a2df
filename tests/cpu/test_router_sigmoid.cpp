// The sigmoid MoE router (DeepSeek-V3, Nemotron-H) and the squared ReLU on the CPU, through ops.h:
//   forward   against a naive implementation written here the way HF writes it (sorts instead of
//             scans: the group score from a sorted group, groups and experts ordered by a stable
//             sort), on random rows with and without groups and correction bias; hand-built rows
//             whose answers follow from the spec alone (the bias changes the choice but not the
//             weight, group masking drops the best single expert, masked_score −inf vs 0, ties);
//             NaN rows still name K distinct experts in range
//   backward  against central finite differences of the weights as a function of the logits (the
//             indices fixed), in fp64, with groups, norm on/off and a scaling ≠ 1; and against
//             finite differences through the op's own fp32 forward
//   relu2     forward against max(x, 0)², backward against finite differences, in place = out of place
//   refusals  every bad geometry and tensor named, nothing written.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace {

using mf::DType;
using mf::Shape;
using mf::Tensor;

constexpr float kInf = INFINITY;

Tensor view(std::vector<float>& v, Shape shape) { return Tensor(v.data(), DType::f32, std::move(shape)); }
Tensor view(std::vector<int32_t>& v, Shape shape) { return Tensor(v.data(), DType::i32, std::move(shape)); }

std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo, float hi) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

float logit_of(double s) { return static_cast<float>(std::log(s / (1.0 - s))); }

struct Config {
    int64_t N, E, K, n_group, topk_group;
    bool norm;
    float scale;
    float masked = -kInf;
};

std::string name_of(const Config& c, bool bias) {
    return "N=" + std::to_string(c.N) + " E=" + std::to_string(c.E) + " K=" + std::to_string(c.K) +
           " groups=" + std::to_string(c.topk_group) + "/" + std::to_string(c.n_group) + (c.norm ? " norm" : "") +
           " scale=" + std::to_string(c.scale) + (bias ? " bias" : "") + (std::isinf(c.masked) ? "" : " masked=0");
}

struct Routed {
    std::vector<float> scores, weight;
    std::vector<int32_t> idx;
};

// HF's route_tokens_to_experts, written out: sigmoid, + bias, per group the sum of its two largest
// (a sorted copy), the topk_group best groups (a stable sort: ties to the lower group), masked
// experts set to `masked`, the K best experts (a stable sort: ties to the lower index), the scores
// gathered, normalised, scaled.
Routed naive_route(const std::vector<float>& logits, const std::vector<float>& bias, const Config& c) {
    Routed r{std::vector<float>(logits.size()), std::vector<float>(static_cast<size_t>(c.N * c.K)),
             std::vector<int32_t>(static_cast<size_t>(c.N * c.K))};
    const int64_t G = c.E / c.n_group;
    for (int64_t n = 0; n < c.N; ++n) {
        std::vector<float> s(static_cast<size_t>(c.E)), choice(static_cast<size_t>(c.E));
        for (int64_t e = 0; e < c.E; ++e) {
            s[e] = 1.0f / (1.0f + std::exp(-logits[n * c.E + e]));
            choice[e] = s[e] + (bias.empty() ? 0.0f : bias[e]);
            r.scores[n * c.E + e] = s[e];
        }
        if (G >= 2) {
            std::vector<float> group_score(static_cast<size_t>(c.n_group));
            for (int64_t g = 0; g < c.n_group; ++g) {
                std::vector<float> members(choice.begin() + g * G, choice.begin() + (g + 1) * G);
                std::sort(members.begin(), members.end(), std::greater<float>());
                group_score[g] = members[0] + members[1];
            }
            std::vector<int64_t> groups(static_cast<size_t>(c.n_group));
            std::iota(groups.begin(), groups.end(), 0);
            std::stable_sort(groups.begin(), groups.end(),
                             [&](int64_t a, int64_t b) { return group_score[a] > group_score[b]; });
            std::vector<bool> kept(static_cast<size_t>(c.n_group), false);
            for (int64_t i = 0; i < c.topk_group; ++i) kept[groups[i]] = true;
            for (int64_t e = 0; e < c.E; ++e)
                if (!kept[e / G]) choice[e] = c.masked;
        }
        std::vector<int64_t> experts(static_cast<size_t>(c.E));
        std::iota(experts.begin(), experts.end(), 0);
        std::stable_sort(experts.begin(), experts.end(), [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
        float total = 0.0f;
        for (int64_t k = 0; k < c.K; ++k) {
            r.idx[n * c.K + k] = static_cast<int32_t>(experts[k]);
            r.weight[n * c.K + k] = s[experts[k]];
            total += s[experts[k]];
        }
        for (int64_t k = 0; k < c.K; ++k) {
            float& w = r.weight[n * c.K + k];
            if (c.norm) w = w / (total + 1e-20f);
            w = w * c.scale;
        }
    }
    return r;
}

Routed op_route(std::vector<float>& logits, std::vector<float>& bias, const Config& c) {
    Routed r{std::vector<float>(logits.size(), -1.0f), std::vector<float>(static_cast<size_t>(c.N * c.K), -1.0f),
             std::vector<int32_t>(static_cast<size_t>(c.N * c.K), -1)};
    const Tensor bias_t = bias.empty() ? Tensor() : view(bias, {c.E});
    mf::ops::router_sigmoid_forward(view(r.scores, {c.N, c.E}), view(r.idx, {c.N, c.K}), view(r.weight, {c.N, c.K}),
                                    view(logits, {c.N, c.E}), bias_t, c.n_group, c.topk_group, c.norm, c.scale,
                                    c.masked);
    return r;
}

void expect_near_rel(const std::vector<float>& got, const std::vector<float>& want, double rel, double abs,
                     const std::string& what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i)
        ASSERT_NEAR(got[i], want[i], abs + rel * std::fabs(want[i])) << what << " element " << i;
}

void expect_routed(const Routed& got, const Routed& want, const std::string& what) {
    EXPECT_EQ(got.idx, want.idx) << what << ": topk_idx";
    expect_near_rel(got.scores, want.scores, 1e-6, 0.0, what + " scores");
    expect_near_rel(got.weight, want.weight, 1e-6, 0.0, what + " topk_weight");
}

// ---------------------------------------------------------------------------------------------
// forward

TEST(RouterSigmoid, ForwardMatchesNaiveHfRouting) {
    std::mt19937 rng(7);
    const Config configs[] = {
        {33, 128, 6, 1, 1, true, 2.5f},  // Nemotron 3 Nano
        {17, 256, 8, 8, 4, true, 2.5f},  // DeepSeek-V3
        {21, 64, 6, 8, 3, false, 1.0f},      {13, 15, 4, 3, 2, true, 1.0f}, {9, 7, 3, 1, 1, false, 0.5f},
        {11, 32, 4, 4, 1, true, 1.5f},       {6, 12, 8, 6, 4, true, 1.0f},  {5, 1, 1, 1, 1, true, 1.0f},
        {12, 16, 4, 4, 2, true, 2.0f, 0.0f}, {0, 8, 2, 2, 1, true, 1.0f},
    };
    for (const Config& c : configs) {
        for (const bool with_bias : {false, true}) {
            std::vector<float> logits = random_vec(rng, static_cast<size_t>(c.N * c.E), -4.0f, 4.0f);
            // A bias as large as the scores' spread, so it changes the choice in most rows; with
            // masked = 0 it pushes most choice values below 0.
            std::vector<float> bias =
                with_bias ? random_vec(rng, static_cast<size_t>(c.E), c.masked == 0.0f ? -1.0f : -0.3f, 0.3f)
                          : std::vector<float>();
            const std::string name = name_of(c, with_bias);
            expect_routed(op_route(logits, bias, c), naive_route(logits, bias, c), name);
        }
    }
}

TEST(RouterSigmoid, BiasChoosesButDoesNotWeigh) {
    // s = σ(x): expert 0 is the best score, but a bias of 0.6 lifts expert 5 (s = 0.5) above it.
    const Config c{1, 8, 2, 1, 1, false, 1.0f};
    std::vector<float> logits = {2.0f, 1.0f, 0.0f, -0.5f, -1.0f, 0.0f, -2.0f, -3.0f};
    std::vector<float> bias = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.6f, 0.0f, 0.0f}, no_bias;
    const Routed with = op_route(logits, bias, c), without = op_route(logits, no_bias, c);
    EXPECT_EQ(without.idx, (std::vector<int32_t>{0, 1}));
    EXPECT_EQ(with.idx, (std::vector<int32_t>{5, 0}));
    EXPECT_FLOAT_EQ(with.weight[0], 0.5f) << "expert 5 weighs σ(0), not σ(0) + bias";
    EXPECT_FLOAT_EQ(with.weight[1], 1.0f / (1.0f + std::exp(-2.0f)));
    EXPECT_EQ(with.scores, without.scores) << "the bias does not touch the scores";
}

TEST(RouterSigmoid, GroupMaskingDropsTheBestSingleExpert) {
    // 4 groups of 2, keep 2. Scores: group 0 {0.9, 0.1} (sum 1.0), group 1 {0.6, 0.59} (1.19),
    // group 2 {0.55, 0.56} (1.11), group 3 {0.2, 0.3} (0.5): groups 1 and 2 survive, so expert 0,
    // the best single score, is not chosen.
    const std::vector<double> s = {0.9, 0.1, 0.6, 0.59, 0.55, 0.56, 0.2, 0.3};
    std::vector<float> logits;
    for (const double v : s) logits.push_back(logit_of(v));
    std::vector<float> no_bias;
    for (const bool norm : {false, true}) {
        const Config c{1, 8, 2, 4, 2, norm, 2.5f};
        const Routed r = op_route(logits, no_bias, c);
        EXPECT_EQ(r.idx, (std::vector<int32_t>{2, 3}));
        const double total = norm ? s[2] + s[3] : 1.0;
        EXPECT_NEAR(r.weight[0], 2.5 * s[2] / total, 1e-6);
        EXPECT_NEAR(r.weight[1], 2.5 * s[3] / total, 1e-6);
    }
    // A bias of 0.8 on expert 7 makes group 3 the best (0.2 + 1.1) and expert 7 the first choice;
    // its weight stays its score, 0.3.
    std::vector<float> bias(8, 0.0f);
    bias[7] = 0.8f;
    const Config c{1, 8, 2, 4, 2, false, 1.0f};
    const Routed r = op_route(logits, bias, c);
    EXPECT_EQ(r.idx, (std::vector<int32_t>{7, 2}));
    EXPECT_NEAR(r.weight[0], 0.3, 1e-6);
    EXPECT_NEAR(r.weight[1], 0.6, 1e-6);
}

TEST(RouterSigmoid, MaskedScoreMinusInfinityOrZero) {
    // 2 groups of 2, keep 1; a bias of −1 makes every choice value negative. Group 0 wins
    // (−0.1 − 0.2 > −0.7 − 0.8). With masked = −inf its experts are chosen; with masked = 0 (HF
    // DeepSeek-V3's fill) the dropped group's experts (choice value 0) beat them, lower index first.
    std::vector<float> logits = {logit_of(0.9), logit_of(0.8), logit_of(0.3), logit_of(0.2)};
    std::vector<float> bias(4, -1.0f);
    Config c{1, 4, 2, 2, 1, false, 1.0f};
    const Routed inf = op_route(logits, bias, c);
    EXPECT_EQ(inf.idx, (std::vector<int32_t>{0, 1}));
    c.masked = 0.0f;
    const Routed zero = op_route(logits, bias, c);
    EXPECT_EQ(zero.idx, (std::vector<int32_t>{2, 3}));
    EXPECT_NEAR(zero.weight[0], 0.3, 1e-6);
    EXPECT_NEAR(zero.weight[1], 0.2, 1e-6);
    expect_routed(zero, naive_route(logits, bias, c), "masked = 0");
}

TEST(RouterSigmoid, TiesGoToTheLowerIndex) {
    std::vector<float> no_bias;
    {  // all equal: the first K experts, equal weights
        std::vector<float> logits(10, 0.25f);
        const Config c{1, 10, 4, 1, 1, true, 1.0f};
        const Routed r = op_route(logits, no_bias, c);
        EXPECT_EQ(r.idx, (std::vector<int32_t>{0, 1, 2, 3}));
        for (const float w : r.weight) EXPECT_FLOAT_EQ(w, 0.25f);
    }
    {  // all equal in 4 groups of 3, keep 2: groups 0 and 1, experts in index order
        std::vector<float> logits(12, -1.0f);
        const Config c{1, 12, 5, 4, 2, false, 1.0f};
        EXPECT_EQ(op_route(logits, no_bias, c).idx, (std::vector<int32_t>{0, 1, 2, 3, 4}));
    }
    {  // experts 3 and 1 tie for the top, 6 and 4 for the next place; groups 2 and 3 tie (sum 2·σ(1))
        std::vector<float> logits = {0.0f, 2.0f, 0.0f, 2.0f, 1.0f, 0.0f, 1.0f, -1.0f};
        const Config c{1, 8, 3, 1, 1, false, 1.0f};
        EXPECT_EQ(op_route(logits, no_bias, c).idx, (std::vector<int32_t>{1, 3, 4}));
        std::vector<float> grouped = {1.0f, 1.0f, 1.0f, 1.0f, -3.0f, 0.0f, 2.0f, 2.0f};
        const Config g{1, 8, 2, 4, 2, false, 1.0f};  // groups 0 and 1 tie; group 3 is the best
        EXPECT_EQ(op_route(grouped, no_bias, g).idx, (std::vector<int32_t>{6, 7}));
        const Config g3{1, 8, 6, 4, 3, false, 1.0f};  // groups 3, 0, 1 kept (0 before 1 on the tie)
        EXPECT_EQ(op_route(grouped, no_bias, g3).idx, (std::vector<int32_t>{6, 7, 0, 1, 2, 3}));
    }
}

TEST(RouterSigmoid, NanRowsStillChooseDistinctExperts) {
    // A NaN logit (a diverged step) must not make the router emit an index that later ops would
    // read out of bounds: every row still names K distinct experts in range.
    std::vector<float> logits = {NAN, NAN, NAN, NAN, NAN, NAN, NAN, NAN, 0.5f, NAN, 1.0f, NAN, -1.0f, NAN, 2.0f, NAN};
    std::vector<float> no_bias;
    for (const Config& c : {Config{2, 8, 3, 1, 1, true, 1.0f}, Config{2, 8, 3, 4, 2, true, 1.0f}}) {
        const Routed r = op_route(logits, no_bias, c);
        for (int64_t n = 0; n < c.N; ++n) {
            std::vector<int32_t> row(r.idx.begin() + n * c.K, r.idx.begin() + (n + 1) * c.K);
            for (const int32_t e : row) EXPECT_TRUE(e >= 0 && e < c.E) << name_of(c, false) << " row " << n;
            std::sort(row.begin(), row.end());
            EXPECT_TRUE(std::adjacent_find(row.begin(), row.end()) == row.end()) << name_of(c, false) << " row " << n;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// backward

// L = Σ_k dw_k · w_k(x) in fp64, the indices fixed.
double weight_loss(const std::vector<double>& x, const int32_t* idx, const float* dw, int64_t K, bool norm,
                   double scale) {
    std::vector<double> s(static_cast<size_t>(K));
    double total = 0.0;
    for (int64_t k = 0; k < K; ++k) {
        s[k] = 1.0 / (1.0 + std::exp(-x[idx[k]]));
        total += s[k];
    }
    double loss = 0.0;
    for (int64_t k = 0; k < K; ++k) loss += dw[k] * scale * (norm ? s[k] / (total + 1e-20) : s[k]);
    return loss;
}

TEST(RouterSigmoid, BackwardMatchesFiniteDifferences) {
    std::mt19937 rng(11);
    const Config configs[] = {
        {4, 16, 4, 4, 2, true, 2.5f},  {4, 16, 4, 4, 2, false, 2.5f}, {3, 24, 6, 8, 3, true, 1.0f},
        {3, 24, 6, 8, 3, false, 1.0f}, {5, 9, 3, 1, 1, true, 0.7f},   {2, 6, 6, 1, 1, true, 1.0f},
    };
    for (const Config& c : configs) {
        const std::string name = name_of(c, true);
        std::vector<float> logits = random_vec(rng, static_cast<size_t>(c.N * c.E), -3.0f, 3.0f);
        std::vector<float> bias = random_vec(rng, static_cast<size_t>(c.E), -0.2f, 0.2f);
        Routed r = op_route(logits, bias, c);
        std::vector<float> dw = random_vec(rng, static_cast<size_t>(c.N * c.K), -1.0f, 1.0f);
        std::vector<float> dlogits(logits.size(), -7.0f);
        mf::ops::router_sigmoid_backward(view(dlogits, {c.N, c.E}), view(dw, {c.N, c.K}), view(r.scores, {c.N, c.E}),
                                         view(r.idx, {c.N, c.K}), c.norm, c.scale);
        const double h = 1e-6;
        for (int64_t n = 0; n < c.N; ++n) {
            std::vector<double> x(logits.begin() + n * c.E, logits.begin() + (n + 1) * c.E);
            for (int64_t e = 0; e < c.E; ++e) {
                const double x0 = x[e];
                x[e] = x0 + h;
                const double up = weight_loss(x, &r.idx[n * c.K], &dw[n * c.K], c.K, c.norm, c.scale);
                x[e] = x0 - h;
                const double down = weight_loss(x, &r.idx[n * c.K], &dw[n * c.K], c.K, c.norm, c.scale);
                x[e] = x0;
                const double fd = (up - down) / (2 * h);
                EXPECT_NEAR(dlogits[n * c.E + e], fd, 2e-6 + 1e-5 * std::fabs(fd))
                    << name << " row " << n << " expert " << e;
            }
        }
    }
}

TEST(RouterSigmoid, BackwardMatchesFiniteDifferencesOfTheForwardOp) {
    // Through the op's own fp32 forward: the gradient it returns is the one of the weights it gives.
    std::mt19937 rng(12);
    const Config c{3, 16, 4, 4, 2, true, 2.5f};
    std::vector<float> logits = random_vec(rng, static_cast<size_t>(c.N * c.E), -2.0f, 2.0f);
    std::vector<float> bias = random_vec(rng, static_cast<size_t>(c.E), -0.1f, 0.1f);
    Routed r = op_route(logits, bias, c);
    std::vector<float> dw = random_vec(rng, static_cast<size_t>(c.N * c.K), -1.0f, 1.0f);
    std::vector<float> dlogits(logits.size());
    mf::ops::router_sigmoid_backward(view(dlogits, {c.N, c.E}), view(dw, {c.N, c.K}), view(r.scores, {c.N, c.E}),
                                     view(r.idx, {c.N, c.K}), c.norm, c.scale);
    auto loss = [&](std::vector<float>& x) {
        const Routed p = op_route(x, bias, c);
        EXPECT_EQ(p.idx, r.idx) << "the step changed the choice";
        double l = 0.0;
        for (size_t i = 0; i < dw.size(); ++i) l += static_cast<double>(dw[i]) * p.weight[i];
        return l;
    };
    const float h = 1e-2f;
    for (size_t i = 0; i < logits.size(); ++i) {
        std::vector<float> x = logits;
        x[i] = logits[i] + h;
        const double up = loss(x);
        x[i] = logits[i] - h;
        const double down = loss(x);
        const double fd = (up - down) / (2.0 * h);
        EXPECT_NEAR(dlogits[i], fd, 2e-4 + 1e-3 * std::fabs(fd)) << "logit " << i;
    }
}

// ---------------------------------------------------------------------------------------------
// relu2

TEST(Relu2, ForwardBackwardAndInPlace) {
    std::mt19937 rng(13);
    const int64_t R = 5, C = 7;
    std::vector<float> x = random_vec(rng, R * C, -3.0f, 3.0f);
    x[3] = 0.0f;
    x[4] = -0.0f;
    std::vector<float> y(x.size(), -1.0f);
    mf::ops::relu2_forward(view(y, {R, C}), view(x, {R, C}));
    for (size_t i = 0; i < x.size(); ++i) {
        const float r = std::max(x[i], 0.0f);
        EXPECT_EQ(y[i], r * r) << "element " << i;
    }
    std::vector<float> dy = random_vec(rng, x.size(), -1.0f, 1.0f), dx(x.size(), -1.0f);
    mf::ops::relu2_backward(view(dx, {R, C}), view(dy, {R, C}), view(x, {R, C}));
    const double h = 1e-3;
    for (size_t i = 0; i < x.size(); ++i) {
        if (x[i] == 0.0f) {
            EXPECT_EQ(dx[i], 0.0f) << "relu2'(0) = 0";
            continue;
        }
        if (std::fabs(x[i]) < 2 * h) continue;  // the difference would straddle the kink
        auto f = [](double v) { return v > 0 ? v * v : 0.0; };
        const double fd = dy[i] * (f(x[i] + h) - f(x[i] - h)) / (2 * h);
        EXPECT_NEAR(dx[i], fd, 1e-5 + 1e-5 * std::fabs(fd)) << "element " << i;
    }
    std::vector<float> in_place = x;
    mf::ops::relu2_forward(view(in_place, {R * C}), view(in_place, {R * C}));
    EXPECT_EQ(std::memcmp(in_place.data(), y.data(), y.size() * 4), 0) << "in place = out of place (forward)";
    std::vector<float> grad_in_place = dy;
    mf::ops::relu2_backward(view(grad_in_place, {R, C}), view(grad_in_place, {R, C}), view(x, {R, C}));
    EXPECT_EQ(std::memcmp(grad_in_place.data(), dx.data(), dx.size() * 4), 0) << "dinp aliasing dout";
}

// ---------------------------------------------------------------------------------------------
// refusals

void expect_error(const std::string& what, const std::string& needle, const std::function<void()>& f) {
    try {
        f();
        ADD_FAILURE() << what << ": accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos)
            << what << ": message '" << e.what() << "' does not mention '" << needle << "'";
    }
}

TEST(RouterSigmoid, RefusesBadArgumentsAndWritesNothing) {
    const int64_t N = 3, E = 16, K = 4;
    // idx and w have room for the K = 5 the refused calls ask for.
    std::vector<float> logits(N * E, 0.5f), scores(N * E, -1.0f), w(N * 8, -1.0f), bias(E, 0.0f), dw(N * K, 1.0f);
    std::vector<int32_t> idx(N * 8, -1);
    std::vector<float> bias_short(E - 1, 0.0f), scores_short((N - 1) * E, -1.0f);
    auto fwd = [&](std::vector<float>& b, std::vector<float>& s, int64_t s_rows, int64_t n_group, int64_t topk_group,
                   int64_t k, float scale, float masked) {
        return [&, s_rows, n_group, topk_group, k, scale, masked] {
            mf::ops::router_sigmoid_forward(view(s, {s_rows, E}), view(idx, {N, k}), view(w, {N, k}),
                                            view(logits, {N, E}), view(b, {static_cast<int64_t>(b.size())}), n_group,
                                            topk_group, true, scale, masked);
        };
    };
    expect_error("n_group not dividing E", "does not divide", fwd(bias, scores, N, 3, 1, 2, 1.0f, -kInf));
    expect_error("topk_group > n_group", "topk_group", fwd(bias, scores, N, 4, 5, 2, 1.0f, -kInf));
    expect_error("topk_group 0", "topk_group", fwd(bias, scores, N, 4, 0, 2, 1.0f, -kInf));
    expect_error("n_group 0", "n_group", fwd(bias, scores, N, 0, 0, 2, 1.0f, -kInf));
    expect_error("K above the kept groups' experts", "exceeds", fwd(bias, scores, N, 4, 1, 5, 1.0f, -kInf));
    expect_error("groups of one expert", "groups of 1", fwd(bias, scores, N, 16, 2, 2, 1.0f, -kInf));
    expect_error("bias of the wrong size", "correction_bias", fwd(bias_short, scores, N, 1, 1, 2, 1.0f, -kInf));
    expect_error("scores of the wrong rows", "scores", fwd(bias, scores_short, N - 1, 1, 1, 2, 1.0f, -kInf));
    expect_error("non-finite scale", "routed_scaling_factor", fwd(bias, scores, N, 1, 1, 2, kInf, -kInf));
    expect_error("NaN masked score", "masked_score", fwd(bias, scores, N, 4, 2, 2, 1.0f, NAN));
    {  // a bf16 bias on the CPU, i32 logits
        std::vector<uint16_t> bias_bf16(E, 0);
        const Tensor b(bias_bf16.data(), DType::bf16, {E});
        expect_error("bf16 bias on the CPU", "correction_bias", [&] {
            mf::ops::router_sigmoid_forward(view(scores, {N, E}), Tensor(idx.data(), DType::i32, {N, K}),
                                            Tensor(w.data(), DType::f32, {N, K}), view(logits, {N, E}), b, 1, 1, true,
                                            1.0f, -kInf);
        });
        std::vector<int32_t> int_logits(N * E, 0);
        expect_error("i32 logits", "logits", [&] {
            mf::ops::router_sigmoid_forward(view(scores, {N, E}), Tensor(idx.data(), DType::i32, {N, K}),
                                            Tensor(w.data(), DType::f32, {N, K}), view(int_logits, {N, E}), Tensor(), 1,
                                            1, true, 1.0f, -kInf);
        });
    }
    EXPECT_TRUE(std::all_of(scores.begin(), scores.end(), [](float v) { return v == -1.0f; })) << "scores written";
    EXPECT_TRUE(std::all_of(w.begin(), w.end(), [](float v) { return v == -1.0f; })) << "topk_weight written";
    EXPECT_TRUE(std::all_of(idx.begin(), idx.end(), [](int32_t v) { return v == -1; })) << "topk_idx written";

    // Backward: an index outside [0, E) in the last row; nothing is written.
    std::vector<int32_t> bad_idx(N * K, 0);
    for (int64_t i = 0; i < N * K; ++i) bad_idx[i] = static_cast<int32_t>(i % K);
    bad_idx[N * K - 1] = static_cast<int32_t>(E);
    std::vector<float> dlogits(N * E, -1.0f);
    expect_error("topk_idx out of range", "outside [0, 16)", [&] {
        mf::ops::router_sigmoid_backward(view(dlogits, {N, E}), view(dw, {N, K}), view(scores, {N, E}),
                                         view(bad_idx, {N, K}), true, 1.0f);
    });
    expect_error("dtopk_weight of the wrong width", "dtopk_weight", [&] {
        mf::ops::router_sigmoid_backward(view(dlogits, {N, E}), view(dw, {N * K / 2, 2}), view(scores, {N, E}),
                                         Tensor(idx.data(), DType::i32, {N, K}), true, 1.0f);
    });
    EXPECT_TRUE(std::all_of(dlogits.begin(), dlogits.end(), [](float v) { return v == -1.0f; })) << "dlogits written";

    std::vector<float> a(6, 1.0f), b(5, 1.0f);
    expect_error("relu2 sizes", "differ in size", [&] { mf::ops::relu2_forward(view(a, {6}), view(b, {5})); });
    expect_error("relu2_backward sizes", "differ in size",
                 [&] { mf::ops::relu2_backward(view(a, {6}), view(a, {6}), view(b, {5})); });
    EXPECT_TRUE(std::all_of(a.begin(), a.end(), [](float v) { return v == 1.0f; })) << "relu2 wrote";
}

}  // namespace
