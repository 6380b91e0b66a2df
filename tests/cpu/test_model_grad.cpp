// Finite-difference gradient tests for the model blocks (attention, dense MLP, dropless MoE) and for
// the whole Qwen3-MoE step, plus gradient accumulation across steps and bitwise determinism.
//
// Method. Blocks: loss = Σ y·R (+ Σ probs·Dp for the MoE router) for fixed random R, Dp, summed in
// double. Model: loss = scales.ce·ce_sum + scales.aux·aux. Numeric gradients are central differences
// (L(θ+h) − L(θ−h)) / 2h on the fp32 parameters. Analytic gradients come from backward called on
// buffers PRE-FILLED with random values (analytic = after − before), so the "+=" contract is tested
// too; activations and scratch are poisoned with NaN before use so nothing may rely on zeroed memory.
//
// Tolerance rule (one rule for every tensor): an entry passes when
//     |analytic − numeric| ≤ 2e-2 · max(|numeric|, rms) + 1e-3,
// with rms the RMS of the whole analytic gradient tensor. Loss scales are chosen so gradient RMS
// values are O(0.1–1), which keeps the 1e-3 floor small against real signals. Each tensor is checked
// on all entries when it has ≤ 48, else on 40 random entries plus the first, the last, and its
// largest positive and negative analytic entries.
//
// Top-k routing is piecewise constant in the parameters: an FD entry whose +h or −h evaluation
// changes the set of experts chosen by any token (in any MoE layer) is skipped and counted, and each
// test asserts that at least 90% of the entries were checked. For the whole model the routing is
// read by replaying the model's forward with the public blocks (RoutingProbe), which must reproduce
// step()'s ce_sum exactly.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "core/json.h"
#include "data/batch.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/rmsnorm.h"
#include "model/arch/architecture.h"
#include "model/attention_block.h"
#include "model/causal_lm.h"
#include "model/ffn_blocks.h"
#include "qwen3_config.h"
#include "train/optimizer.h"

using namespace mf;
using namespace mf::model;

namespace {

// Tensor views over test vectors (the blocks take Tensors).
Tensor tv(std::vector<float>& v, Shape shape) { return Tensor(v.data(), DType::f32, std::move(shape)); }
Tensor tc_(const std::vector<float>& v, Shape shape) {
    return Tensor(const_cast<float*>(v.data()), DType::f32, std::move(shape));
}
Tensor ti(const std::vector<int32_t>& v) {
    return Tensor(const_cast<int32_t*>(v.data()), DType::i32, {static_cast<int64_t>(v.size())});
}

constexpr double kRelTol = 2e-2;
constexpr double kAbsTol = 1e-3;
constexpr int64_t kSampleAll = 48;
constexpr int kSampleRandom = 40;
constexpr double kMinCheckedFraction = 0.9;

// --- random data ----------------------------------------------------------------------------------

std::vector<float> normal_vec(std::mt19937_64& rng, int64_t n, double std_dev, double mean = 0.0) {
    std::normal_distribution<double> dist(mean, std_dev);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(dist(rng));
    return v;
}

std::vector<float> uniform_vec(std::mt19937_64& rng, int64_t n, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    std::vector<float> v(static_cast<size_t>(n));
    for (float& x : v) x = static_cast<float>(dist(rng));
    return v;
}

double dot(const float* a, const float* b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * static_cast<double>(b[i]);
    return s;
}

// Fills a tensor with 0xFF bytes: NaN as f32, −1 as i32.
void poison(const Tensor& t) {
    if (t.numel() > 0) std::memset(t.data(), 0xFF, t.nbytes());
}

// Sizes an arena by replaying `alloc` on a measuring arena, then allocates for real.
Arena make_arena(const std::function<void(Arena&)>& alloc) {
    Arena measure = Arena::measuring(Device::cpu);
    alloc(measure);
    Arena arena(measure.high_water(), Device::cpu);
    alloc(arena);
    return arena;
}

// positions restart at 0 in each document of a row.
std::vector<int32_t> positions_from_docs(const std::vector<int32_t>& doc_ids, int64_t B, int64_t T) {
    std::vector<int32_t> pos(doc_ids.size());
    for (int64_t b = 0; b < B; ++b) {
        int32_t p = 0;
        for (int64_t t = 0; t < T; ++t) {
            const size_t i = static_cast<size_t>(b * T + t);
            if (t > 0 && doc_ids[i] != doc_ids[i - 1]) p = 0;
            pos[i] = p++;
        }
    }
    return pos;
}

// --- finite-difference checker --------------------------------------------------------------------

// One loss evaluation: the value and whether top-k routing equals the unperturbed routing.
struct Eval {
    double loss = 0;
    bool same_routing = true;
};

struct TensorReport {
    std::string name;
    int checked = 0, skipped = 0;
    double worst_ratio = 0;  // max |a − n| / bound over checked entries
    double rel_l2 = 0;       // ‖a − n‖ / ‖n‖ over checked entries
};

class FdChecker {
 public:
    FdChecker(std::string what, double h, uint64_t seed) : what_(std::move(what)), h_(h), rng_(seed) {}

    // Checks the analytic gradient `analytic[numel]` of the parameter `param[numel]` against central
    // differences of `eval`, which must read `param` (perturbed in place and restored).
    void check(const std::string& name, float* param, const std::vector<float>& analytic,
               const std::function<Eval()>& eval) {
        const int64_t numel = static_cast<int64_t>(analytic.size());
        TensorReport rep;
        rep.name = name;
        double ss = 0;
        for (float g : analytic) ss += static_cast<double>(g) * g;
        const double rms = std::sqrt(ss / static_cast<double>(std::max<int64_t>(numel, 1)));
        double err2 = 0, num2 = 0;
        int failures = 0;
        for (int64_t i : sample(analytic)) {
            const float saved = param[i];
            param[i] = static_cast<float>(saved + h_);
            const double step_plus = static_cast<double>(param[i]) - saved;  // the step really taken in fp32
            const Eval plus = eval();
            param[i] = static_cast<float>(saved - h_);
            const double step_minus = saved - static_cast<double>(param[i]);
            const Eval minus = eval();
            param[i] = saved;
            if (!plus.same_routing || !minus.same_routing) {
                ++rep.skipped;
                continue;
            }
            ++rep.checked;
            const double numeric = (plus.loss - minus.loss) / (step_plus + step_minus);
            const double a = analytic[static_cast<size_t>(i)];
            const double err = std::fabs(a - numeric);
            const double bound = kRelTol * std::max(std::fabs(numeric), rms) + kAbsTol;
            // NOTE: written so that a NaN on either side fails (every comparison with NaN is false).
            const bool ok = err <= bound;
            rep.worst_ratio = ok ? std::max(rep.worst_ratio, err / bound) : std::numeric_limits<double>::infinity();
            err2 += err * err;
            num2 += numeric * numeric;
            if (!ok && ++failures <= 5) {
                ADD_FAILURE() << what_ << ": " << name << "[" << i << "]: analytic " << a << " vs numeric " << numeric
                              << " (|diff| " << err << " > bound " << bound << ", tensor rms " << rms << ")";
            }
        }
        if (failures > 5) ADD_FAILURE() << what_ << ": " << name << ": " << failures - 5 << " more failing entries";
        rep.rel_l2 = num2 > 0 ? std::sqrt(err2 / num2) : std::sqrt(err2);
        reports_.push_back(rep);
    }

    // Asserts enough entries were checked and prints one summary line.
    void finish() {
        int checked = 0, skipped = 0;
        double worst = 0, worst_l2 = 0;
        std::string worst_name;
        for (const auto& r : reports_) {
            checked += r.checked;
            skipped += r.skipped;
            if (r.worst_ratio > worst) {
                worst = r.worst_ratio;
                worst_name = r.name;
            }
            worst_l2 = std::max(worst_l2, r.rel_l2);
        }
        const int total = checked + skipped;
        EXPECT_GT(total, 0) << what_;
        EXPECT_GE(checked, kMinCheckedFraction * total)
            << what_ << ": only " << checked << " of " << total << " FD entries kept their top-k routing";
        std::printf(
            "[fd] %-44s %2zu tensors, %5d entries checked, %3d skipped (routing), worst |err|/bound %.3f (%s), "
            "worst rel-L2 %.1e\n",
            what_.c_str(), reports_.size(), checked, skipped, worst, worst_name.c_str(), worst_l2);
    }

 private:
    std::vector<int64_t> sample(const std::vector<float>& g) {
        const int64_t n = static_cast<int64_t>(g.size());
        std::vector<int64_t> idx;
        if (n <= kSampleAll) {
            for (int64_t i = 0; i < n; ++i) idx.push_back(i);
            return idx;
        }
        const auto mx = std::max_element(g.begin(), g.end()) - g.begin();
        const auto mn = std::min_element(g.begin(), g.end()) - g.begin();
        idx = {0, n - 1, mx, mn};
        std::uniform_int_distribution<int64_t> pick(0, n - 1);
        while (static_cast<int64_t>(idx.size()) < 4 + kSampleRandom) {
            const int64_t i = pick(rng_);
            if (std::find(idx.begin(), idx.end(), i) == idx.end()) idx.push_back(i);
        }
        std::sort(idx.begin(), idx.end());
        idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
        return idx;
    }

    std::string what_;
    double h_;
    std::mt19937_64 rng_;
    std::vector<TensorReport> reports_;
};

// after − before, elementwise: the part backward added.
std::vector<float> added(const std::vector<float>& after, const std::vector<float>& before) {
    std::vector<float> d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
    return d;
}

// --- attention block -----------------------------------------------------------------------------

TEST(BlockGrad, Attention) {
    const int64_t B = 2, T = 7, N = B * T;
    const AttentionDims d{12, 4, 2, 6, 1e-6f, 10000.0f};
    const int64_t H = d.hidden, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    const std::vector<int32_t> docs = {0, 0, 0, 1, 1, 2, 2, /* row 1 */ 0, 1, 1, 1, 1, 2, 2};
    const std::vector<int32_t> pos = positions_from_docs(docs, B, T);

    std::mt19937_64 rng(101);
    std::vector<float> x = normal_vec(rng, N * H, 1.0);
    std::vector<float> wq = normal_vec(rng, Dq * H, 0.3), wk = normal_vec(rng, Dkv * H, 0.3),
                       wv = normal_vec(rng, Dkv * H, 0.3), wo = normal_vec(rng, H * Dq, 0.3);
    std::vector<float> qn = uniform_vec(rng, d.head_dim, 0.8, 1.2), kn = uniform_vec(rng, d.head_dim, 0.8, 1.2);
    const std::vector<float> R = normal_vec(rng, N * H, 1.0);
    AttentionWeights w{tv(wq, {Dq, H}), tv(wk, {Dkv, H}),     tv(wv, {Dkv, H}),
                       tv(wo, {H, Dq}), tv(qn, {d.head_dim}), tv(kn, {d.head_dim})};

    AttentionActs acts;
    AttentionScratch scratch;
    Arena arena = make_arena([&](Arena& a) {
        a.reset();
        acts.alloc(a, d, B, T, DType::f32);
        scratch.alloc(a, d, B, T, DType::f32);
    });
    for (const Tensor* t :
         {&acts.q_raw, &acts.k_raw, &acts.q_rstd, &acts.k_rstd, &acts.q, &acts.k, &acts.v, &acts.attn, &acts.lse,
          &scratch.dq, &scratch.dk, &scratch.dv, &scratch.dattn, &scratch.dq_raw, &scratch.dk_raw})
        poison(*t);

    std::vector<float> y(static_cast<size_t>(N * H));
    auto forward = [&] {
        std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());  // forward must write y
        attention_block_forward(tv(y, {N, H}), acts, tv(x, {N, H}), w, d, B, T, ti(pos), ti(docs));
        return Eval{dot(y.data(), R.data(), N * H), true};
    };
    forward();

    // Gradient buffers pre-filled with random values: backward must add to them.
    std::vector<std::vector<float>> before;
    for (int64_t n : {N * H, Dq * H, Dkv * H, Dkv * H, H * Dq, d.head_dim, d.head_dim})
        before.push_back(normal_vec(rng, n, 1.0));
    std::vector<std::vector<float>> after = before;
    AttentionWeights g{tv(after[1], {Dq, H}), tv(after[2], {Dkv, H}),     tv(after[3], {Dkv, H}),
                       tv(after[4], {H, Dq}), tv(after[5], {d.head_dim}), tv(after[6], {d.head_dim})};
    attention_block_backward(tv(after[0], {N, H}), g, scratch, tc_(R, {N, H}), tv(x, {N, H}), acts, w, d, B, T, ti(pos),
                             ti(docs));

    FdChecker fd("attention block (QK-norm, RoPE, GQA, docs)", 1e-2, 7);
    const char* names[] = {"x", "wq", "wk", "wv", "wo", "q_norm", "k_norm"};
    float* params[] = {x.data(), wq.data(), wk.data(), wv.data(), wo.data(), qn.data(), kn.data()};
    for (int i = 0; i < 7; ++i) fd.check(names[i], params[i], added(after[i], before[i]), forward);
    fd.finish();
}

// Attention stays causal and inside documents: perturbing one token's input changes no output of an
// earlier token, of another document, or of the other row.
TEST(BlockGrad, AttentionMasking) {
    const int64_t B = 2, T = 7, N = B * T;
    const AttentionDims d{12, 4, 2, 6, 1e-6f, 10000.0f};
    const int64_t H = d.hidden, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    const std::vector<int32_t> docs = {0, 0, 0, 1, 1, 1, 2, /* row 1 */ 0, 0, 0, 0, 0, 0, 0};
    const std::vector<int32_t> pos = positions_from_docs(docs, B, T);
    std::mt19937_64 rng(5);
    std::vector<float> x = normal_vec(rng, N * H, 1.0);
    std::vector<float> wq = normal_vec(rng, Dq * H, 0.3), wk = normal_vec(rng, Dkv * H, 0.3),
                       wv = normal_vec(rng, Dkv * H, 0.3), wo = normal_vec(rng, H * Dq, 0.3);
    std::vector<float> qn = uniform_vec(rng, d.head_dim, 0.8, 1.2), kn = uniform_vec(rng, d.head_dim, 0.8, 1.2);
    AttentionWeights w{tv(wq, {Dq, H}), tv(wk, {Dkv, H}),     tv(wv, {Dkv, H}),
                       tv(wo, {H, Dq}), tv(qn, {d.head_dim}), tv(kn, {d.head_dim})};
    AttentionActs acts;
    Arena arena = make_arena([&](Arena& a) {
        a.reset();
        acts.alloc(a, d, B, T, DType::f32);
    });
    std::vector<float> y0(static_cast<size_t>(N * H)), y1(y0.size());
    attention_block_forward(tv(y0, {N, H}), acts, tv(x, {N, H}), w, d, B, T, ti(pos), ti(docs));
    const int64_t perturbed = 4;  // row 0, doc 1, second token
    for (int64_t c = 0; c < H; ++c) x[static_cast<size_t>(perturbed * H + c)] += 0.5f;
    attention_block_forward(tv(y1, {N, H}), acts, tv(x, {N, H}), w, d, B, T, ti(pos), ti(docs));
    for (int64_t t = 0; t < N; ++t) {
        const bool may_change = t == 4 || t == 5;  // itself and the later token of the same document
        bool changed = false;
        for (int64_t c = 0; c < H; ++c)
            changed |= y0[static_cast<size_t>(t * H + c)] != y1[static_cast<size_t>(t * H + c)];
        if (may_change) {
            EXPECT_TRUE(changed) << "token " << t;
        } else {
            EXPECT_FALSE(changed) << "token " << t << " saw a token it must not attend to";
        }
    }
}

// --- dense MLP block -----------------------------------------------------------------------------

TEST(BlockGrad, Mlp) {
    const int64_t N = 14, H = 12, I = 6;
    std::mt19937_64 rng(202);
    std::vector<float> x = normal_vec(rng, N * H, 1.0);
    std::vector<float> gate_up = normal_vec(rng, 2 * I * H, 0.3), down = normal_vec(rng, H * I, 0.3);
    const std::vector<float> R = normal_vec(rng, N * H, 1.0);
    MlpWeights w{tv(gate_up, {2 * I, H}), tv(down, {H, I})};
    MlpActs acts;
    MlpScratch scratch;
    Arena arena = make_arena([&](Arena& a) {
        a.reset();
        acts.alloc(a, N, I, DType::f32);
        scratch.alloc(a, N, I, DType::f32);
    });
    for (const Tensor* t : {&acts.h, &acts.a, &scratch.dh, &scratch.da}) poison(*t);

    std::vector<float> y(static_cast<size_t>(N * H));
    auto forward = [&] {
        std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
        mlp_block_forward(tv(y, {N, H}), acts, tv(x, {N, H}), w);
        return Eval{dot(y.data(), R.data(), N * H), true};
    };
    forward();
    std::vector<std::vector<float>> before = {normal_vec(rng, N * H, 1.0), normal_vec(rng, 2 * I * H, 1.0),
                                              normal_vec(rng, H * I, 1.0)};
    std::vector<std::vector<float>> after = before;
    MlpWeights g{tv(after[1], {2 * I, H}), tv(after[2], {H, I})};
    mlp_block_backward(tv(after[0], {N, H}), g, scratch, tc_(R, {N, H}), tv(x, {N, H}), acts, w);

    FdChecker fd("dense SwiGLU MLP block", 1e-2, 8);
    fd.check("x", x.data(), added(after[0], before[0]), forward);
    fd.check("gate_up", gate_up.data(), added(after[1], before[1]), forward);
    fd.check("down", down.data(), added(after[2], before[2]), forward);
    fd.finish();
}

// --- MoE block -----------------------------------------------------------------------------------

struct MoeCase {
    bool norm_topk;
    bool with_dprobs;
    bool starve_expert;  // expert E−1 never chosen: its weights get exactly zero gradient
    const char* label;
};

std::ostream& operator<<(std::ostream& os, const MoeCase& c) { return os << c.label; }

class MoeBlockGrad : public ::testing::TestWithParam<MoeCase> {};

// Sorted top-k expert sets per token, to compare routing independently of the order within a token.
std::vector<int32_t> topk_sets(const MoeActs& acts, int64_t N, int64_t K) {
    std::vector<int32_t> s(acts.topk_idx.ptr<int32_t>(), acts.topk_idx.ptr<int32_t>() + N * K);
    for (int64_t t = 0; t < N; ++t) std::sort(s.begin() + t * K, s.begin() + (t + 1) * K);
    return s;
}

TEST_P(MoeBlockGrad, Gradients) {
    const MoeCase tc = GetParam();
    const int64_t N = 14;
    const MoeDims d{12, 6, 5, 2, tc.norm_topk};
    const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, K = d.top_k;
    std::mt19937_64 rng(303 + 10 * tc.norm_topk + 100 * tc.with_dprobs + 1000 * tc.starve_expert);
    std::vector<float> x = normal_vec(rng, N * H, 1.0);
    std::vector<float> router = normal_vec(rng, E * H, 0.3);
    std::vector<float> gate_up = normal_vec(rng, E * 2 * I * H, 0.3), down = normal_vec(rng, E * H * I, 0.3);
    if (tc.starve_expert) {
        // A shared positive feature and a strongly negative router weight on it for the last expert.
        for (int64_t t = 0; t < N; ++t) x[static_cast<size_t>(t * H)] = 3.0f;
        router[static_cast<size_t>((E - 1) * H)] = -3.0f;
    }
    const std::vector<float> R = normal_vec(rng, N * H, 1.0);
    const std::vector<float> Dp = normal_vec(rng, N * E, 1.0);
    MoeWeights w{tv(router, {E, H}), tv(gate_up, {E, 2 * I, H}), tv(down, {E, H, I})};
    MoeActs acts;
    MoeScratch scratch;
    Arena arena = make_arena([&](Arena& a) {
        a.reset();
        acts.alloc(a, d, N, DType::f32);
        scratch.alloc(a, d, N, DType::f32);
    });
    for (const Tensor* t :
         {&acts.logits, &acts.probs, &acts.topk_idx, &acts.topk_weight, &acts.expert_offsets, &acts.sorted_pair,
          &acts.pair_row, &acts.x_perm, &acts.h_perm, &acts.a_perm, &acts.y_perm, &scratch.dy_perm, &scratch.da_perm,
          &scratch.dh_perm, &scratch.dx_perm, &scratch.dtopk_weight, &scratch.dlogits})
        poison(*t);

    std::vector<float> y(static_cast<size_t>(N * H));
    std::vector<int32_t> base_sets;
    auto forward = [&] {
        std::fill(y.begin(), y.end(), std::numeric_limits<float>::quiet_NaN());
        moe_block_forward(tv(y, {N, H}), acts, tv(x, {N, H}), w, d);
        double loss = dot(y.data(), R.data(), N * H);
        if (tc.with_dprobs) loss += dot(acts.probs.ptr<float>(), Dp.data(), N * E);
        return Eval{loss, topk_sets(acts, N, K) == base_sets};
    };
    forward();
    base_sets = topk_sets(acts, N, K);

    // How well separated the k-th and (k+1)-th probabilities are (for the report; flips are skipped).
    double min_gap = 1;
    std::vector<int64_t> tokens_per_expert(static_cast<size_t>(E), 0);
    for (int64_t t = 0; t < N; ++t) {
        std::vector<float> p(acts.probs.ptr<float>() + t * E, acts.probs.ptr<float>() + (t + 1) * E);
        std::sort(p.begin(), p.end(), std::greater<float>());
        min_gap = std::min(min_gap, static_cast<double>(p[static_cast<size_t>(K - 1)] - p[static_cast<size_t>(K)]));
        for (int64_t k = 0; k < K; ++k)
            ++tokens_per_expert[static_cast<size_t>(acts.topk_idx.ptr<int32_t>()[t * K + k])];
    }
    if (tc.starve_expert) {
        ASSERT_EQ(tokens_per_expert[static_cast<size_t>(E - 1)], 0) << "expert was not starved";
    }

    std::vector<std::vector<float>> before = {normal_vec(rng, N * H, 1.0), normal_vec(rng, E * H, 1.0),
                                              normal_vec(rng, E * 2 * I * H, 1.0), normal_vec(rng, E * H * I, 1.0)};
    std::vector<std::vector<float>> after = before;
    MoeWeights g{tv(after[1], {E, H}), tv(after[2], {E, 2 * I, H}), tv(after[3], {E, H, I})};
    moe_block_backward(tv(after[0], {N, H}), g, scratch, tc_(R, {N, H}), tc.with_dprobs ? tc_(Dp, {N, E}) : Tensor(),
                       tv(x, {N, H}), acts, w, d);

    if (tc.starve_expert) {
        // Exactly nothing may be added to the starved expert's weights.
        const int64_t gu = 2 * I * H, dn = H * I;
        for (int64_t i = (E - 1) * gu; i < E * gu; ++i)
            ASSERT_EQ(after[2][static_cast<size_t>(i)], before[2][static_cast<size_t>(i)]) << "gate_up[" << i << "]";
        for (int64_t i = (E - 1) * dn; i < E * dn; ++i)
            ASSERT_EQ(after[3][static_cast<size_t>(i)], before[3][static_cast<size_t>(i)]) << "down[" << i << "]";
    }

    FdChecker fd(std::string("MoE block, ") + tc.label, 3e-3, 9);
    fd.check("x", x.data(), added(after[0], before[0]), forward);
    fd.check("router", router.data(), added(after[1], before[1]), forward);
    fd.check("gate_up", gate_up.data(), added(after[2], before[2]), forward);
    fd.check("down", down.data(), added(after[3], before[3]), forward);
    std::printf("[fd]   min gap p_k − p_(k+1) = %.2e, tokens per expert:", min_gap);
    for (int64_t c : tokens_per_expert) std::printf(" %lld", static_cast<long long>(c));
    std::printf("\n");
    fd.finish();
}

INSTANTIATE_TEST_SUITE_P(Cases, MoeBlockGrad,
                         ::testing::Values(MoeCase{false, false, false, "no norm_topk"},
                                           MoeCase{true, false, false, "norm_topk"},
                                           MoeCase{false, true, false, "no norm_topk + dprobs"},
                                           MoeCase{true, true, false, "norm_topk + dprobs"},
                                           MoeCase{true, true, true, "norm_topk + dprobs, starved expert"}),
                         [](const ::testing::TestParamInfo<MoeCase>& info) {
                             return std::string(info.param.norm_topk ? "Norm" : "NoNorm") +
                                    (info.param.with_dprobs ? "Dprobs" : "") +
                                    (info.param.starve_expert ? "Starved" : "");
                         });

// --- whole model ---------------------------------------------------------------------------------

test::Qwen3Config tiny_config(bool norm_topk, bool tie) {
    test::Qwen3Config c;
    c.vocab_size = 50;
    c.hidden_size = 16;
    c.intermediate_size = 12;
    c.moe_intermediate_size = 6;
    c.num_hidden_layers = 3;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 4;
    c.num_experts = 5;
    c.num_experts_per_tok = 2;
    c.decoder_sparse_step = 1;
    c.mlp_only_layers = {1};  // layers 0 and 2 are MoE, layer 1 dense
    c.norm_topk_prob = norm_topk;
    c.tie_word_embeddings = tie;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.1;
    c.rms_norm_eps = 1e-6;
    c.rope_theta = 10000.0;
    c.max_position_embeddings = 64;
    return c;
}

// Two rows of one document each: prompt tokens masked with -100 and a short, padded second row.
data::Batch row_batch(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int32_t> tok(1, 49);
    std::vector<std::vector<int32_t>> ids(2), labels(2);
    for (int i = 0; i < 8; ++i) ids[0].push_back(tok(rng));
    for (int i = 0; i < 5; ++i) ids[1].push_back(tok(rng));
    labels = ids;
    labels[0][0] = labels[0][1] = labels[0][2] = data::kIgnoreIndex;  // prompt
    labels[1][1] = data::kIgnoreIndex;
    return data::make_row_batch(ids, labels, 8, 0);
}

// Two rows holding two documents each (positions restart, attention stays inside), padding at the
// end of row 1 as its own document.
data::Batch packed_batch(uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::uniform_int_distribution<int32_t> tok(1, 49);
    data::Batch b;
    b.B = 2;
    b.T = 8;
    const std::vector<std::vector<int>> doc_lens = {{3, 5}, {4, 2}};
    for (int64_t r = 0; r < b.B; ++r) {
        int32_t doc = 0;
        for (int len : doc_lens[static_cast<size_t>(r)]) {
            std::vector<int32_t> ids;
            for (int i = 0; i < len; ++i) ids.push_back(tok(rng));
            for (int i = 0; i < len; ++i) {
                b.input_ids.push_back(ids[static_cast<size_t>(i)]);
                b.targets.push_back(i + 1 < len ? ids[static_cast<size_t>(i + 1)] : data::kIgnoreIndex);
                b.positions.push_back(i);
                b.doc_ids.push_back(doc);
                b.is_pad.push_back(0);
            }
            ++doc;
        }
        for (int64_t t = static_cast<int64_t>(b.input_ids.size()) - r * b.T; t < b.T; ++t) {
            b.input_ids.push_back(0);
            b.targets.push_back(data::kIgnoreIndex);
            b.positions.push_back(0);
            b.doc_ids.push_back(doc);
            b.is_pad.push_back(1);
        }
    }
    return b;
}

// Replays CausalLM::step's forward with the public blocks on the model's parameters, to read the
// top-k expert sets of every MoE layer (step() does not expose them). Same kernels, same order, so
// its ce_sum must equal step()'s bit for bit, which the test asserts.
class RoutingProbe {
 public:
    RoutingProbe(CausalLM& m, const test::Qwen3Config& c) : m_(m), c_(c), arena_(size_t{16} << 20, Device::cpu) {}

    std::vector<int32_t> run(const data::Batch& b, double* ce_sum) {
        const test::Qwen3Config& c = c_;
        const int64_t B = b.B, T = b.T, N = B * T, H = c.hidden_size;
        const AttentionDims ad{H,
                               c.num_attention_heads,
                               c.num_key_value_heads,
                               c.head_dim,
                               static_cast<float>(c.rms_norm_eps),
                               static_cast<float>(c.rope_theta)};
        const MoeDims md{H, c.moe_intermediate_size, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob};
        const float eps = static_cast<float>(c.rms_norm_eps);
        auto P = [&](const std::string& name) { return m_.param(name).ptr<float>(); };
        auto PT = [&](const std::string& name) { return m_.param(name); };
        arena_.reset();
        const Tensor xt = arena_.alloc(DType::f32, {N, H}), lnt = arena_.alloc(DType::f32, {N, H}),
                     outt = arena_.alloc(DType::f32, {N, H});
        float* x = xt.ptr<float>();
        float* ln = lnt.ptr<float>();
        float* out = outt.ptr<float>();
        float* rstd = arena_.alloc(DType::f32, {N}).ptr<float>();
        cpu::embedding_forward(x, b.input_ids.data(), P("model.embed_tokens.weight"), N, H);
        std::vector<int32_t> sets;
        for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
            const std::string p = "model.layers." + std::to_string(l) + ".";
            cpu::rmsnorm_forward(ln, rstd, x, P(p + "input_layernorm.weight"), N, H, eps);
            AttentionActs aa;
            aa.alloc(arena_, ad, B, T, DType::f32);
            const AttentionWeights aw{PT(p + "self_attn.q_proj.weight"), PT(p + "self_attn.k_proj.weight"),
                                      PT(p + "self_attn.v_proj.weight"), PT(p + "self_attn.o_proj.weight"),
                                      PT(p + "self_attn.q_norm.weight"), PT(p + "self_attn.k_norm.weight")};
            attention_block_forward(outt, aa, lnt, aw, ad, B, T, ti(b.positions), ti(b.doc_ids));
            for (int64_t i = 0; i < N * H; ++i) x[i] = x[i] + out[i];
            cpu::rmsnorm_forward(ln, rstd, x, P(p + "post_attention_layernorm.weight"), N, H, eps);
            if (c.is_moe_layer(l)) {
                MoeActs ma;
                ma.alloc(arena_, md, N, DType::f32);
                const MoeWeights mw{PT(p + "mlp.gate.weight"), PT(p + "mlp.experts.gate_up_proj"),
                                    PT(p + "mlp.experts.down_proj")};
                moe_block_forward(outt, ma, lnt, mw, md);
                const std::vector<int32_t> s = topk_sets(ma, N, md.top_k);
                sets.insert(sets.end(), s.begin(), s.end());
            } else {
                MlpActs ma;
                ma.alloc(arena_, N, c.intermediate_size, DType::f32);
                const MlpWeights mw{Tensor(P(p + "mlp.gate_proj.weight"), DType::f32, {2 * c.intermediate_size, H}),
                                    PT(p + "mlp.down_proj.weight")};
                mlp_block_forward(outt, ma, lnt, mw);
            }
            for (int64_t i = 0; i < N * H; ++i) x[i] = x[i] + out[i];
        }
        cpu::rmsnorm_forward(ln, rstd, x, P("model.norm.weight"), N, H, eps);
        std::vector<float> losses(static_cast<size_t>(N));
        const float* head = P(c.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
        cpu::lm_head_cross_entropy(losses.data(), nullptr, nullptr, ln, head, b.targets.data(), N, H, c.vocab_size,
                                   0.0f);
        *ce_sum = 0;
        for (float v : losses) *ce_sum += v;
        return sets;
    }

 private:
    CausalLM& m_;
    test::Qwen3Config c_;
    Arena arena_;
};

struct ModelCase {
    bool norm_topk, tie, packed;
    double ce_scale, aux_scale;  // aux_scale is multiplied by the batch's number of targets
    const char* label;
};

std::ostream& operator<<(std::ostream& os, const ModelCase& c) { return os << c.label; }

class ModelGrad : public ::testing::TestWithParam<ModelCase> {};

TEST_P(ModelGrad, FiniteDifferences) {
    const ModelCase tc = GetParam();
    CausalLM m(tiny_config(tc.norm_topk, tc.tie));
    m.init_random(11 + 2 * tc.norm_topk + 4 * tc.tie, 0.3f);
    // Norm weights around 1 ± 0.2 instead of exactly 1, so their gradients are not special-cased.
    std::mt19937_64 rng(12345);
    for (const ParamSpec& s : m.params().specs()) {
        if (s.shape.size() != 1) continue;
        const std::vector<float> v = uniform_vec(rng, s.numel, 0.8, 1.2);
        std::copy(v.begin(), v.end(), m.param_data() + s.offset);
    }
    const data::Batch batch = tc.packed ? packed_batch(21) : row_batch(22);
    ASSERT_GT(batch.num_targets(), 0);
    const LossScales scales{tc.ce_scale, tc.aux_scale * static_cast<double>(batch.num_targets())};

    // Analytic: gradient buffer pre-filled with random values, one step adds to it.
    const int64_t P = m.num_params();
    const std::vector<float> before = normal_vec(rng, P, 1.0);
    std::copy(before.begin(), before.end(), m.grad_data());
    const StepStats base = m.step(batch, &scales);
    EXPECT_EQ(base.num_targets, batch.num_targets());
    EXPECT_GT(base.aux, 0.0);
    const std::vector<float> after(m.grad_data(), m.grad_data() + P);

    RoutingProbe probe(m, tiny_config(tc.norm_topk, tc.tie));
    double probe_ce = 0;
    const std::vector<int32_t> base_sets = probe.run(batch, &probe_ce);
    ASSERT_EQ(probe_ce, base.ce_sum) << "RoutingProbe does not replay step()'s forward";

    auto eval = [&] {
        const StepStats s = m.step(batch, nullptr);
        double ce = 0;
        const bool same = probe.run(batch, &ce) == base_sets;
        return Eval{scales.ce * s.ce_sum + scales.aux * s.aux, same};
    };
    FdChecker fd(std::string("model, ") + tc.label, 3e-3, 17);
    for (const ParamSpec& s : m.params().specs()) {
        std::vector<float> analytic(static_cast<size_t>(s.numel));
        for (int64_t i = 0; i < s.numel; ++i)
            analytic[static_cast<size_t>(i)] =
                after[static_cast<size_t>(s.offset + i)] - before[static_cast<size_t>(s.offset + i)];
        fd.check(s.name, m.param_data() + s.offset, analytic, eval);
    }
    fd.finish();
}

INSTANTIATE_TEST_SUITE_P(Cases, ModelGrad,
                         ::testing::Values(ModelCase{false, false, false, 1.0, 0.1, "no norm_topk, untied, row batch"},
                                           ModelCase{true, true, false, 1.0, 0.1, "norm_topk, tied, row batch"},
                                           ModelCase{true, false, true, 1.0, 0.1, "norm_topk, untied, packed"},
                                           ModelCase{false, true, true, 1.0, 0.1, "no norm_topk, tied, packed"},
                                           ModelCase{false, false, true, 0.0, 1.0, "aux only, no norm_topk, packed"},
                                           ModelCase{true, true, false, 0.0, 1.0,
                                                     "aux only, norm_topk, tied, row batch"}),
                         [](const ::testing::TestParamInfo<ModelCase>& info) {
                             const ModelCase& c = info.param;
                             return std::string(c.ce_scale == 0 ? "AuxOnly" : "") + (c.norm_topk ? "Norm" : "NoNorm") +
                                    (c.tie ? "Tied" : "Untied") + (c.packed ? "Packed" : "Rows");
                         });

// --- accumulation and determinism ----------------------------------------------------------------

TEST(ModelGradAccumulation, TwoStepsAddUpAndZeroGradsResets) {
    CausalLM m(tiny_config(true, false));
    m.init_random(3, 0.3f);
    const data::Batch batch = packed_batch(5);
    const LossScales scales{1.0, 0.1 * static_cast<double>(batch.num_targets())};
    const int64_t P = m.num_params();
    m.zero_grads();
    const StepStats s1 = m.step(batch, &scales);
    const std::vector<float> g1(m.grad_data(), m.grad_data() + P);
    double g1_max = 0;
    for (float g : g1) g1_max = std::max(g1_max, static_cast<double>(std::fabs(g)));
    ASSERT_GT(g1_max, 0.0);

    // A forward-only step leaves the gradients alone.
    m.step(batch, nullptr);
    ASSERT_EQ(std::memcmp(g1.data(), m.grad_data(), static_cast<size_t>(P) * sizeof(float)), 0);

    const StepStats s2 = m.step(batch, &scales);
    EXPECT_EQ(s1.ce_sum, s2.ce_sum);
    EXPECT_EQ(s1.aux, s2.aux);
    const float* g2 = m.grad_data();
    for (const ParamSpec& s : m.params().specs()) {
        double tensor_max = 0;
        for (int64_t i = 0; i < s.numel; ++i)
            tensor_max = std::max(tensor_max, static_cast<double>(std::fabs(g1[static_cast<size_t>(s.offset + i)])));
        int bad = 0;
        for (int64_t i = 0; i < s.numel; ++i) {
            const double a = g1[static_cast<size_t>(s.offset + i)], b = g2[s.offset + i];
            if (std::fabs(b - 2 * a) > 1e-5 * (std::fabs(a) + tensor_max) + 1e-30 && ++bad <= 3)
                ADD_FAILURE() << s.name << "[" << i << "]: after two steps " << b << ", expected 2 × " << a;
        }
    }

    m.zero_grads();
    for (int64_t i = 0; i < P; ++i) ASSERT_EQ(m.grad_data()[i], 0.0f) << "zero_grads left entry " << i;
    m.step(batch, &scales);
    EXPECT_EQ(std::memcmp(g1.data(), m.grad_data(), static_cast<size_t>(P) * sizeof(float)), 0)
        << "a step after zero_grads differs from the first step";

    // zero_grads() leaves the expert gradients in place and has the next backward write them: with
    // no read in between, the gradients of two steps are still there when that backward runs.
    m.step(batch, &scales);
    m.zero_grads();
    m.step(batch, &scales);
    EXPECT_EQ(std::memcmp(g1.data(), m.grad_data(), static_cast<size_t>(P) * sizeof(float)), 0)
        << "a step after zero_grads added to the previous gradients";
    // ... and a read before any backward sees zeros, the expert gradients included.
    m.step(batch, &scales);
    m.zero_grads();
    const Tensor gate_up = m.grad("model.layers.0.mlp.experts.gate_up_proj");
    for (int64_t i = 0; i < gate_up.numel(); ++i) ASSERT_EQ(gate_up.ptr<float>()[i], 0.0f) << "gate_up grad " << i;
    for (int64_t i = 0; i < P; ++i) ASSERT_EQ(m.grad_data()[i], 0.0f) << "zero_grads left entry " << i;
}

// The embedding gradient from gathered rows (CausalLM::set_embedding_row_gather): a stand-in gather
// that hands back this process's rows twice, as two ranks holding the same batch would send them,
// gives twice the dense gradient; every other gradient is untouched. Tied embeddings are refused.
TEST(ModelEmbeddingRowGather, GatheredRowsAddUpLikeTheDensePath) {
    const test::Qwen3Config cfg = tiny_config(true, false);
    CausalLM dense(cfg), gathered(cfg);
    dense.init_random(5, 0.3f);
    gathered.init_random(5, 0.3f);
    int calls = 0;
    gathered.set_embedding_row_gather(
        [&calls](const Tensor& all, const Tensor& mine) {
            ++calls;
            ASSERT_EQ(all.numel(), 2 * mine.numel());
            std::memcpy(all.data(), mine.data(), mine.nbytes());
            std::memcpy(static_cast<char*>(all.data()) + mine.nbytes(), mine.data(), mine.nbytes());
        },
        2);
    const data::Batch batch = row_batch(7);
    const LossScales scales{1.0, 0.1};
    dense.step(batch, &scales);
    gathered.step(batch, &scales);
    EXPECT_EQ(calls, 2) << "ids and rows, one gather each";
    const float* gd = dense.grad_data();
    const float* gg = gathered.grad_data();
    for (const ParamSpec& s : dense.params().specs()) {
        const bool embedding = s.name == "model.embed_tokens.weight";
        double scale = 0;
        for (int64_t i = 0; i < s.numel; ++i) scale = std::max(scale, static_cast<double>(std::fabs(gd[s.offset + i])));
        int bad = 0;
        for (int64_t i = 0; i < s.numel; ++i) {
            const double want = (embedding ? 2.0 : 1.0) * gd[s.offset + i];
            if (std::fabs(gg[s.offset + i] - want) > 1e-6 * scale + 1e-30 && ++bad <= 3)
                ADD_FAILURE() << s.name << "[" << i << "]: " << gg[s.offset + i] << ", expected " << want;
        }
        if (embedding) {
            EXPECT_GT(scale, 0.0);
        }
    }
    CausalLM tied(tiny_config(true, true));
    EXPECT_THROW(tied.set_embedding_row_gather([](const Tensor&, const Tensor&) {}, 2), Error);
}

// The global norm is per-tensor square sums added in table order: the same as one sum over the
// whole buffer up to double rounding, and slots marked done are taken as they are.
TEST(ModelGradNorm, PerTensorSumsAndPrefilledSlots) {
    CausalLM m(tiny_config(true, false));
    m.init_random(8, 0.3f);
    const LossScales scales{1.0, 0.1};
    m.step(row_batch(6), &scales);
    const auto& specs = m.params().specs();
    double whole = 0;
    for (int64_t i = 0; i < m.num_params(); ++i) whole += static_cast<double>(m.grad_data()[i]) * m.grad_data()[i];
    const std::vector<double> sums = mf::train::gradient_square_sums(m);
    ASSERT_EQ(sums.size(), specs.size());
    double total = 0;
    for (size_t i = 0; i < specs.size(); ++i) {
        double own = 0;
        for (int64_t k = 0; k < specs[i].numel; ++k)
            own += static_cast<double>(m.grad_data()[specs[i].offset + k]) * m.grad_data()[specs[i].offset + k];
        EXPECT_NEAR(sums[i], own, 1e-12 * (own + 1e-30)) << specs[i].name;
        total += sums[i];
    }
    EXPECT_NEAR(mf::train::grad_norm(m), std::sqrt(whole), 1e-12 * std::sqrt(whole));
    EXPECT_EQ(mf::train::grad_norm(m), std::sqrt(total));

    Buffer slots(specs.size() * sizeof(double), Device::cpu);
    const Tensor t = slots.as(DType::f64, {static_cast<int64_t>(specs.size())});
    std::vector<bool> done(specs.size(), false);
    done[1] = true;
    t.ptr<double>()[1] = -7.0;  // a value computed elsewhere: kept as it is
    const std::vector<double> mixed = mf::train::gradient_square_sums(m, t, done);
    EXPECT_EQ(mixed[1], -7.0);
    EXPECT_EQ(mixed[0], sums[0]);
    EXPECT_EQ(mixed.back(), sums.back());
    EXPECT_THROW(mf::train::gradient_square_sums(m, t, std::vector<bool>(3, false)), Error);
}

// The expert gradients' square sums formed by the backward (CausalLM::set_grad_square_sums): only
// the flagged stacked expert specs are filled, with the sums a separate pass gives, on both the
// written (after zero_grads) and the accumulated backward; a second step's sums are of the
// accumulated gradient; a slot table of the wrong size is refused.
TEST(ModelGradNorm, BackwardFormedExpertSquareSums) {
    CausalLM m(tiny_config(true, false));
    m.init_random(8, 0.3f);
    const LossScales scales{1.0, 0.1};
    const auto& specs = m.params().specs();
    const int64_t n = static_cast<int64_t>(specs.size());
    Buffer slots(static_cast<size_t>(n) * sizeof(double), Device::cpu);
    const Tensor t = slots.as(DType::f64, {n});
    std::vector<bool> wanted(specs.size());
    for (size_t i = 0; i < specs.size(); ++i) wanted[i] = specs[i].is_expert || specs[i].layer == 0;
    m.zero_grads();
    for (int round = 0; round < 2; ++round) {  // written, then accumulated onto the first step's
        std::fill(t.ptr<double>(), t.ptr<double>() + n, -1.0);
        const std::vector<bool> filled = m.set_grad_square_sums(t, wanted);
        m.step(row_batch(6), &scales);
        m.set_grad_square_sums(Tensor(), {});
        const std::vector<double> plain = mf::train::gradient_square_sums(m);
        int count = 0;
        for (size_t i = 0; i < specs.size(); ++i) {
            EXPECT_EQ(filled[i], specs[i].is_expert) << specs[i].name;
            if (!filled[i]) {
                EXPECT_EQ(t.ptr<double>()[i], -1.0) << specs[i].name << ": not asked for, must stay";
                continue;
            }
            ++count;
            EXPECT_EQ(t.ptr<double>()[i], plain[i]) << specs[i].name << " (round " << round << ")";
            EXPECT_GT(plain[i], 0.0) << specs[i].name;
        }
        EXPECT_GT(count, 0);
    }
    EXPECT_THROW(m.set_grad_square_sums(slots.as(DType::f64, {n - 1}), wanted), Error);
}

TEST(ModelGradDeterminism, SameSeedSameBits) {
    for (const bool packed : {false, true}) {
        const test::Qwen3Config cfg = tiny_config(packed, !packed);
        CausalLM a(cfg), b(cfg);
        a.init_random(99, 0.3f);
        b.init_random(99, 0.3f);
        ASSERT_EQ(std::memcmp(a.param_data(), b.param_data(), static_cast<size_t>(a.num_params()) * sizeof(float)), 0);
        const data::Batch batch = packed ? packed_batch(8) : row_batch(8);
        const LossScales scales{1.0, 0.1};
        const int64_t NV = batch.num_tokens() * cfg.vocab_size;
        std::vector<float> la(static_cast<size_t>(NV)), lb(static_cast<size_t>(NV));
        // Model b runs a different batch first, so its arena holds stale data when the real step runs.
        b.step(packed ? row_batch(9) : packed_batch(9), &scales);
        b.zero_grads();
        const StepStats sa = a.step(batch, &scales, la.data());
        const StepStats sb = b.step(batch, &scales, lb.data());
        EXPECT_EQ(std::memcmp(&sa.ce_sum, &sb.ce_sum, sizeof(double)), 0) << sa.ce_sum << " vs " << sb.ce_sum;
        EXPECT_EQ(std::memcmp(&sa.aux, &sb.aux, sizeof(double)), 0) << sa.aux << " vs " << sb.aux;
        EXPECT_EQ(sa.num_targets, sb.num_targets);
        EXPECT_EQ(std::memcmp(la.data(), lb.data(), la.size() * sizeof(float)), 0) << "logits differ";
        EXPECT_EQ(std::memcmp(a.grad_data(), b.grad_data(), static_cast<size_t>(a.num_params()) * sizeof(float)), 0)
            << "gradients differ (packed=" << packed << ")";
    }
}

}  // namespace

// Recomputation changes memory, never results: the same step under none, moe and full gives
// bitwise-identical losses and gradients, and the activation plan shrinks.
TEST(Recompute, BitwiseIdenticalAndSmaller) {
    std::vector<std::vector<float>> grads;
    std::vector<double> losses;
    std::vector<size_t> bytes;
    const data::Batch batch = packed_batch(33);
    for (Recompute r : {Recompute::none, Recompute::moe, Recompute::full}) {
        CausalLM m(tiny_config(true, false));
        m.init_random(5, 0.3f);
        m.set_recompute(r);
        const LossScales scales{1.0 / static_cast<double>(batch.num_targets()), 0.1};
        const StepStats s = m.step(batch, &scales);
        losses.push_back(s.ce_sum + s.aux);
        grads.emplace_back(m.grad_data(), m.grad_data() + m.num_params());
        bytes.push_back(m.activation_bytes());
    }
    EXPECT_EQ(losses[0], losses[1]);
    EXPECT_EQ(losses[0], losses[2]);
    EXPECT_TRUE(grads[0] == grads[1]) << "recompute=moe changed gradients";
    EXPECT_TRUE(grads[0] == grads[2]) << "recompute=full changed gradients";
    EXPECT_LT(bytes[1], bytes[0]);
    EXPECT_LT(bytes[2], bytes[1]);
}

// --- every block variant of the families, through the whole model ----------------------------------

// A tiny model of each family's layer plan (model/arch/), with variants no family has yet (o_proj bias,
// partial rotary): the finite-difference check of every parameter, as ModelGrad does for Qwen3-MoE.
struct FamilyCase {
    const char* label;
    const char* config;                           // config.json of the family
    std::function<void(model::ModelSpec&)> edit;  // spec variants beyond the config
    bool packed;
};

std::ostream& operator<<(std::ostream& os, const FamilyCase& c) { return os << c.label; }

class FamilyGrad : public ::testing::TestWithParam<FamilyCase> {};

// Sizes shared by the cases: vocab 50, hidden 16, 3 layers, 4 heads of dim 4 (2 kv heads), 5 experts top-2.
constexpr const char* kFamilySizes = R"("vocab_size": 50, "hidden_size": 16, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "max_position_embeddings": 64, "output_router_logits": true,
    "router_aux_loss_coef": 0.1)";

std::string family_config(const char* own) { return std::string("{") + kFamilySizes + ", " + own + "}"; }

TEST_P(FamilyGrad, FiniteDifferences) {
    const FamilyCase tc = GetParam();
    model::ModelSpec spec = model::parse_model_config(json::parse(family_config(tc.config), tc.label), tc.label);
    if (tc.edit) tc.edit(spec);
    CausalLM m(spec);
    m.init_random(29, 0.3f);
    // Norms around 1 and biases around 0 (both ± 0.2), so that neither is a special point.
    std::mt19937_64 rng(777);
    for (const ParamSpec& s : m.params().specs()) {
        if (s.role != ParamRole::norm && s.role != ParamRole::bias) continue;
        const double centre = s.role == ParamRole::norm ? 1.0 : 0.0;
        const std::vector<float> v = uniform_vec(rng, s.numel, centre - 0.2, centre + 0.2);
        std::copy(v.begin(), v.end(), m.param_data() + s.offset);
    }
    const data::Batch batch = tc.packed ? packed_batch(31) : row_batch(32);
    const LossScales scales{1.0, 0.1 * static_cast<double>(batch.num_targets())};
    const int64_t P = m.num_params();
    const std::vector<float> before = normal_vec(rng, P, 1.0);
    std::copy(before.begin(), before.end(), m.grad_data());
    const StepStats base = m.step(batch, &scales);
    const std::vector<float> after(m.grad_data(), m.grad_data() + P);
    auto routings = [&] {
        std::vector<int32_t> all;
        for (int64_t l = 0; l < m.spec().num_layers(); ++l)
            if (m.spec().is_moe_layer(l)) {
                const std::vector<int32_t> r = m.routing(l);
                all.insert(all.end(), r.begin(), r.end());
            }
        return all;
    };
    const std::vector<int32_t> base_sets = routings();
    ASSERT_FALSE(base_sets.empty());
    if (m.spec().adds_aux_loss()) {
        EXPECT_GT(base.aux, 0.0);
    }
    auto eval = [&] {
        const StepStats s = m.step(batch, nullptr);
        return Eval{scales.ce * s.ce_sum + scales.aux * s.aux, routings() == base_sets};
    };
    FdChecker fd(std::string("family model, ") + tc.label, 3e-3, 17);
    for (const ParamSpec& s : m.params().specs()) {
        std::vector<float> analytic(static_cast<size_t>(s.numel));
        for (int64_t i = 0; i < s.numel; ++i)
            analytic[static_cast<size_t>(i)] =
                after[static_cast<size_t>(s.offset + i)] - before[static_cast<size_t>(s.offset + i)];
        fd.check(s.name, m.param_data() + s.offset, analytic, eval);
    }
    fd.finish();
}

void with_attention(model::ModelSpec& spec, const std::function<void(model::AttentionBranch&)>& f) {
    for (model::LayerSpec& layer : spec.layers)
        for (model::Branch& b : layer.branches)
            if (b.kind == model::BranchKind::attention) f(b.attention);
}

INSTANTIATE_TEST_SUITE_P(
    Families, FamilyGrad,
    ::testing::Values(
        // Mixtral: no QK-norm, softmax → top-k → renormalised, every layer sparse.
        FamilyCase{"mixtral", R"("model_type": "mixtral", "intermediate_size": 6, "num_local_experts": 5)", {}, false},
        // OLMoE: RMSNorm over the whole q and k projections, no renormalisation. (Its padding row is no
        // true gradient, HF's nn.Embedding(padding_idx) rule: the HF parity fixture checks that one.)
        FamilyCase{"olmoe", R"("model_type": "olmoe", "intermediate_size": 6, "num_experts": 5)", {}, true},
        // Qwen2-MoE: q/k/v biases, a gated shared expert, a dense layer.
        FamilyCase{"qwen2_moe",
                   R"("model_type": "qwen2_moe", "intermediate_size": 12, "moe_intermediate_size": 6,
                      "shared_expert_intermediate_size": 8, "num_experts": 5, "mlp_only_layers": [1])",
                   {},
                   false},
        FamilyCase{"qwen2_moe_tied_renormalised",
                   R"("model_type": "qwen2_moe", "intermediate_size": 12, "moe_intermediate_size": 6,
                      "shared_expert_intermediate_size": 8, "num_experts": 5, "norm_topk_prob": true,
                      "tie_word_embeddings": true)",
                   {},
                   true},
        // Variants ahead of their families: an o_proj bias, partial rotary, a shared expert without a gate.
        FamilyCase{"o_bias_partial_rotary_ungated_shared",
                   R"("model_type": "qwen2_moe", "intermediate_size": 12, "moe_intermediate_size": 6,
                      "shared_expert_intermediate_size": 8, "num_experts": 5)",
                   [](model::ModelSpec& s) {
                       with_attention(s, [](model::AttentionBranch& a) {
                           a.o_bias = true;
                           a.rotary_dim = 2;
                       });
                       for (model::LayerSpec& layer : s.layers)
                           for (model::Branch& b : layer.branches) b.moe.shared_gate = false;
                   },
                   false},
        // Nemotron-H: Mamba-2 (conv, scan over several chunks, gated norm), a relu² dense MLP, the sigmoid
        // router with groups and scaling over relu² experts and a relu² shared expert, NoPE attention; no
        // aux loss. dt unclamped (time_step_min 0): the clamp's kink is the kernel tests' (test_mamba2).
        FamilyCase{"nemotron_h_mamba_mlp_moe",
                   R"("model_type": "nemotron_h", "hybrid_override_pattern": "M-E", "head_dim": 4,
                      "mamba_num_heads": 4, "mamba_head_dim": 2, "n_groups": 2, "ssm_state_size": 3,
                      "conv_kernel": 3, "chunk_size": 3, "n_routed_experts": 6, "n_group": 2, "topk_group": 1,
                      "moe_intermediate_size": 5, "moe_shared_expert_intermediate_size": 6,
                      "intermediate_size": 7, "routed_scaling_factor": 2.5, "time_step_min": 0.0)",
                   {},
                   false},
        FamilyCase{"nemotron_h_attention_moe_mamba",
                   R"("model_type": "nemotron_h", "hybrid_override_pattern": "*EM", "head_dim": 4,
                      "mamba_num_heads": 2, "mamba_head_dim": 3, "n_groups": 1, "ssm_state_size": 2,
                      "conv_kernel": 4, "chunk_size": 2, "n_routed_experts": 6, "norm_topk_prob": false,
                      "moe_intermediate_size": 5, "moe_shared_expert_intermediate_size": 6,
                      "time_step_min": 0.0)",
                   {},
                   true},
        // LatentMoE: the routed experts between fc1_latent_proj and fc2_latent_proj.
        FamilyCase{"nemotron_h_latent_moe",
                   R"("model_type": "nemotron_h", "hybrid_override_pattern": "EM*", "head_dim": 4,
                      "mamba_num_heads": 2, "mamba_head_dim": 2, "n_groups": 1, "ssm_state_size": 2,
                      "conv_kernel": 2, "chunk_size": 4, "n_routed_experts": 6, "moe_latent_size": 6,
                      "moe_intermediate_size": 5, "moe_shared_expert_intermediate_size": 6,
                      "time_step_min": 0.0)",
                   {},
                   true},
        FamilyCase{"full_width_qk_norm_with_biases",
                   R"("model_type": "olmoe", "intermediate_size": 6, "num_experts": 5)",
                   [](model::ModelSpec& s) {
                       with_attention(s, [](model::AttentionBranch& a) {
                           a.qkv_bias = true;
                           a.o_bias = true;
                       });
                   },
                   true}),
    [](const ::testing::TestParamInfo<FamilyCase>& info) { return std::string(info.param.label); });
