// Tests for the fp32 CPU reference kernels (src/kernels/cpu).
//
// Forward checks compare each kernel with a naive reference written here, independently of the
// kernel code. Each reference is a template instantiated twice: in double (the truth) and in float
// (the "naive fp32" computation). The tolerance rule is the one of CONVENTIONS.md:
//     max_i |kernel_i − ref64_i| <= 2 · max_i |naive32_i − ref64_i| + floor,
//     floor = 1e-6 · max(1, max_i |ref64_i|)   (a few fp32 ulps of the largest value)
// Permutations, copies and index outputs are compared exactly.
//
// Gradient checks: loss(x) = Σ_i out_i(x) · r_i with a fixed random projection r, accumulated in
// double from the fp32 kernel outputs. For every element j of every input x with a gradient:
//     numeric_j = (loss(x⁺) − loss(x⁻)) / (x⁺_j − x⁻_j),   x±_j = fp32(x_j ± h),  h = 1e-2
// (dividing by the step actually taken in fp32). Inputs are O(1), so the central-difference
// truncation error (h^2 |f'''| / 6, about 2e-5) and the fp32 rounding of the loss (about
// 1e-7 * sum|out*r| / 2h, about 1e-5 at these sizes) both stay well below the pass rule
//     |analytic_j - numeric_j| <= 2e-3 * max(|analytic_j|, |numeric_j|) + 2e-4
// (relative 2e-3 with an absolute floor of 2e-4; observed errors stay below 1/5 of it). Analytic
// gradients of kernels that accumulate (+=) are taken as (value after backward) − (non-zero value
// before), which also checks that they really accumulate.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cpu/attention.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/cross_entropy.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/grouped_matmul.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/moe_permute.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/sigmoid_gate.h"
#include "kernels/cpu/swiglu.h"

namespace {

using namespace mf::cpu;
using FloatVec = std::vector<float>;
using DoubleVec = std::vector<double>;

// ---------------------------------------------------------------------------------------------
// helpers

FloatVec random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    FloatVec v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

template <typename T>
std::vector<T> cast_vec(const FloatVec& v) {
    return std::vector<T>(v.begin(), v.end());
}

// CONVENTIONS rule: max|got − ref64| <= 2 · max|naive32 − ref64| + 1e-6 · max(1, max|ref64|).
void expect_within_rule(const std::string& what, const FloatVec& got, const DoubleVec& ref64, const FloatVec& naive32) {
    ASSERT_EQ(got.size(), ref64.size()) << what;
    ASSERT_EQ(naive32.size(), ref64.size()) << what;
    double err = 0.0, naive_err = 0.0, scale = 1.0;
    size_t worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double e = std::abs(static_cast<double>(got[i]) - ref64[i]);
        ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i << " is not finite";
        if (e > err) {
            err = e;
            worst = i;
        }
        naive_err = std::max(naive_err, std::abs(static_cast<double>(naive32[i]) - ref64[i]));
        scale = std::max(scale, std::abs(ref64[i]));
    }
    const double bound = 2.0 * naive_err + 1e-6 * scale;
    EXPECT_LE(err, bound) << what << ": worst element " << worst << " got " << got[worst] << " want " << ref64[worst]
                          << " (naive fp32 error " << naive_err << ")";
}

void expect_bitwise_equal(const std::string& what, const FloatVec& a, const FloatVec& b) {
    ASSERT_EQ(a.size(), b.size()) << what;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " differs bit-wise";
}

double project(const FloatVec& out, const FloatVec& r) {
    double sum = 0.0;
    for (size_t i = 0; i < out.size(); ++i) sum += static_cast<double>(out[i]) * r[i];
    return sum;
}

constexpr double kFdStep = 1e-2;
constexpr double kGradRtol = 2e-3;
constexpr double kGradAtol = 2e-4;

// Central differences of loss() with respect to every element of x (restored afterwards), against
// the analytic gradient, by the pass rule in the file comment.
void check_grad(const std::string& what, FloatVec& x, const FloatVec& analytic, const std::function<double()>& loss) {
    ASSERT_EQ(x.size(), analytic.size()) << what;
    int failures = 0;
    for (size_t j = 0; j < x.size(); ++j) {
        const float saved = x[j];
        const float plus = static_cast<float>(saved + kFdStep);
        const float minus = static_cast<float>(saved - kFdStep);
        x[j] = plus;
        const double loss_plus = loss();
        x[j] = minus;
        const double loss_minus = loss();
        x[j] = saved;
        const double numeric = (loss_plus - loss_minus) / (static_cast<double>(plus) - static_cast<double>(minus));
        const double a = analytic[j];
        const double tol = kGradRtol * std::max(std::abs(a), std::abs(numeric)) + kGradAtol;
        if (!(std::abs(a - numeric) <= tol) && failures++ < 5) {
            ADD_FAILURE() << what << "[" << j << "]: analytic " << a << " numeric " << numeric;
        }
    }
    EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << x.size() << " elements out of tolerance";
}

FloatVec minus(const FloatVec& after, const FloatVec& before) {
    FloatVec d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
    return d;
}

// ---------------------------------------------------------------------------------------------
// matmul

template <typename T>
std::vector<T> ref_matmul(const FloatVec& inp, const FloatVec& w, int64_t N, int64_t C, int64_t OC) {
    std::vector<T> out(N * OC);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t o = 0; o < OC; ++o) {
            T acc = 0;
            for (int64_t c = 0; c < C; ++c) acc += static_cast<T>(inp[n * C + c]) * static_cast<T>(w[o * C + c]);
            out[n * OC + o] = acc;
        }
    }
    return out;
}

struct MatmulCase {
    int64_t N, C, OC;
};

TEST(Matmul, ForwardMatchesTripleLoop) {
    std::mt19937 rng(1);
    for (MatmulCase s : {MatmulCase{1, 1, 1}, MatmulCase{3, 5, 2}, MatmulCase{7, 19, 13}, MatmulCase{37, 45, 70},
                         MatmulCase{5, 300, 17}, MatmulCase{64, 64, 64}}) {
        FloatVec inp = random_vec(rng, s.N * s.C), w = random_vec(rng, s.OC * s.C);
        FloatVec out(s.N * s.OC, std::numeric_limits<float>::quiet_NaN());
        matmul_forward(out.data(), inp.data(), w.data(), s.N, s.C, s.OC);
        const std::string name =
            "matmul " + std::to_string(s.N) + "x" + std::to_string(s.C) + "x" + std::to_string(s.OC);
        expect_within_rule(name, out, ref_matmul<double>(inp, w, s.N, s.C, s.OC),
                           ref_matmul<float>(inp, w, s.N, s.C, s.OC));
    }
}

TEST(Matmul, RowsDoNotDependOnBatch) {
    // A row computed alone is bit-identical to the same row inside a batch (tile invariance).
    std::mt19937 rng(2);
    const int64_t N = 11, C = 23, OC = 37;
    FloatVec inp = random_vec(rng, N * C), w = random_vec(rng, OC * C);
    FloatVec all(N * OC), one(OC);
    matmul_forward(all.data(), inp.data(), w.data(), N, C, OC);
    for (int64_t n = 0; n < N; ++n) {
        matmul_forward(one.data(), inp.data() + n * C, w.data(), 1, C, OC);
        expect_bitwise_equal("row " + std::to_string(n), one,
                             FloatVec(all.begin() + n * OC, all.begin() + (n + 1) * OC));
    }
}

TEST(Matmul, GradientsFiniteDifference) {
    std::mt19937 rng(3);
    for (MatmulCase s : {MatmulCase{3, 5, 2}, MatmulCase{6, 17, 21}}) {
        FloatVec inp = random_vec(rng, s.N * s.C), w = random_vec(rng, s.OC * s.C), r = random_vec(rng, s.N * s.OC);
        FloatVec dinp0 = random_vec(rng, s.N * s.C), dw0 = random_vec(rng, s.OC * s.C);
        FloatVec dinp = dinp0, dw = dw0;
        matmul_backward(dinp.data(), dw.data(), r.data(), inp.data(), w.data(), s.N, s.C, s.OC);
        auto loss = [&] {
            FloatVec out(s.N * s.OC);
            matmul_forward(out.data(), inp.data(), w.data(), s.N, s.C, s.OC);
            return project(out, r);
        };
        check_grad("matmul dinp", inp, minus(dinp, dinp0), loss);
        check_grad("matmul dweight", w, minus(dw, dw0), loss);

        // Null outputs are skipped; each output alone equals the combined call.
        FloatVec dinp_only = dinp0, dw_only = dw0;
        matmul_backward(dinp_only.data(), nullptr, r.data(), inp.data(), w.data(), s.N, s.C, s.OC);
        matmul_backward(nullptr, dw_only.data(), r.data(), inp.data(), w.data(), s.N, s.C, s.OC);
        expect_bitwise_equal("dinp alone", dinp_only, dinp);
        expect_bitwise_equal("dweight alone", dw_only, dw);
    }
}

TEST(Matmul, BackwardMatchesTripleLoop) {
    std::mt19937 rng(4);
    const int64_t N = 29, C = 33, OC = 18;
    FloatVec inp = random_vec(rng, N * C), w = random_vec(rng, OC * C), dout = random_vec(rng, N * OC);
    FloatVec dinp(N * C, 0.0f), dw(OC * C, 0.0f);
    matmul_backward(dinp.data(), dw.data(), dout.data(), inp.data(), w.data(), N, C, OC);
    // dinp = dout · w  is  matmul(dout, wᵀ);  dw = doutᵀ · inp  is  matmul(doutᵀ, inpᵀ).
    FloatVec w_t(C * OC), dout_t(OC * N), inp_t(C * N);
    for (int64_t o = 0; o < OC; ++o)
        for (int64_t c = 0; c < C; ++c) w_t[c * OC + o] = w[o * C + c];
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t o = 0; o < OC; ++o) dout_t[o * N + n] = dout[n * OC + o];
        for (int64_t c = 0; c < C; ++c) inp_t[c * N + n] = inp[n * C + c];
    }
    expect_within_rule("dinp", dinp, ref_matmul<double>(dout, w_t, N, OC, C), ref_matmul<float>(dout, w_t, N, OC, C));
    expect_within_rule("dweight", dw, ref_matmul<double>(dout_t, inp_t, OC, N, C),
                       ref_matmul<float>(dout_t, inp_t, OC, N, C));
}

// ---------------------------------------------------------------------------------------------
// bias

TEST(Bias, ForwardAndColumnSumsMatchReference) {
    std::mt19937 rng(30);
    for (auto [N, C] : {std::pair<int64_t, int64_t>{1, 1}, {1, 7}, {5, 3}, {37, 19}, {300, 64}}) {
        const std::string name = "bias N=" + std::to_string(N) + " C=" + std::to_string(C);
        const FloatVec x = random_vec(rng, N * C, -2.0f, 2.0f), b = random_vec(rng, C);
        FloatVec out = x;
        add_bias(out.data(), b.data(), N, C);
        // One fp32 addition per element: exact against the same addition done here.
        for (int64_t n = 0; n < N; ++n)
            for (int64_t c = 0; c < C; ++c) ASSERT_EQ(out[n * C + c], x[n * C + c] + b[c]) << name;

        // dbias += Σ_n dout[n, :]: against the sum in double (truth) and a plain fp32 running sum.
        const FloatVec dout = random_vec(rng, N * C), db0 = random_vec(rng, C);
        FloatVec db = db0;
        bias_backward(db.data(), dout.data(), N, C);
        DoubleVec ref64(C);
        FloatVec naive32(C);
        for (int64_t c = 0; c < C; ++c) {
            double sum64 = 0.0;
            float sum32 = 0.0f;
            for (int64_t n = 0; n < N; ++n) {
                sum64 += dout[n * C + c];
                sum32 += dout[n * C + c];
            }
            ref64[c] = db0[c] + sum64;
            naive32[c] = db0[c] + sum32;
        }
        expect_within_rule(name + " dbias", db, ref64, naive32);
    }
}

TEST(Bias, GradientFiniteDifference) {
    std::mt19937 rng(31);
    const int64_t N = 6, C = 9;
    FloatVec x = random_vec(rng, N * C), b = random_vec(rng, C), r = random_vec(rng, N * C);
    const FloatVec db0 = random_vec(rng, C);
    FloatVec db = db0;
    bias_backward(db.data(), r.data(), N, C);
    check_grad("bias dbias", b, minus(db, db0), [&] {
        FloatVec out = x;
        add_bias(out.data(), b.data(), N, C);
        return project(out, r);
    });
    EXPECT_THROW(add_bias(x.data(), b.data(), -1, C), mf::Error);
    EXPECT_THROW(bias_backward(db.data(), r.data(), N, -1), mf::Error);
}

// ---------------------------------------------------------------------------------------------
// embedding

TEST(Embedding, ForwardAndBackward) {
    std::mt19937 rng(5);
    const int64_t V = 9, C = 7, N = 15;
    FloatVec wte = random_vec(rng, V * C);
    std::vector<int32_t> ids = {3, 0, 8, 3, 3, 5, 1, 0, 8, 2, 3, 7, 6, 6, 4};
    FloatVec out(N * C);
    embedding_forward(out.data(), ids.data(), wte.data(), N, C);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) ASSERT_EQ(out[n * C + c], wte[ids[n] * C + c]);

    FloatVec r = random_vec(rng, N * C), dwte0 = random_vec(rng, V * C), dwte = dwte0;
    embedding_backward(dwte.data(), r.data(), ids.data(), N, C);
    // Reference: repeated ids accumulate all their rows.
    DoubleVec ref(V * C, 0.0);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t c = 0; c < C; ++c) ref[ids[n] * C + c] += r[n * C + c];
    FloatVec got = minus(dwte, dwte0);
    for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(got[i], ref[i], 1e-5) << i;
    check_grad("embedding dwte", wte, got, [&] {
        FloatVec o(N * C);
        embedding_forward(o.data(), ids.data(), wte.data(), N, C);
        return project(o, r);
    });
}

// ---------------------------------------------------------------------------------------------
// rmsnorm

template <typename T>
std::vector<T> ref_rmsnorm(const FloatVec& x, const FloatVec& w, int64_t N, int64_t C, float eps) {
    std::vector<T> out(N * C);
    for (int64_t n = 0; n < N; ++n) {
        T ss = 0;
        for (int64_t c = 0; c < C; ++c) ss += static_cast<T>(x[n * C + c]) * static_cast<T>(x[n * C + c]);
        const T rstd = T(1) / std::sqrt(ss / static_cast<T>(C) + static_cast<T>(eps));
        for (int64_t c = 0; c < C; ++c) out[n * C + c] = static_cast<T>(w[c]) * (static_cast<T>(x[n * C + c]) * rstd);
    }
    return out;
}

TEST(RmsNorm, ForwardMatchesReference) {
    std::mt19937 rng(6);
    const float eps = 1e-6f;
    for (auto [N, C] : {std::pair<int64_t, int64_t>{5, 3}, {9, 37}, {4, 200}}) {
        FloatVec x = random_vec(rng, N * C, -2.0f, 2.0f), w = random_vec(rng, C, 0.5f, 1.5f);
        FloatVec out(N * C), rstd(N);
        rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
        expect_within_rule("rmsnorm C=" + std::to_string(C), out, ref_rmsnorm<double>(x, w, N, C, eps),
                           ref_rmsnorm<float>(x, w, N, C, eps));
        // In place (out aliases inp) gives the same bits.
        FloatVec inplace = x, rstd2(N);
        rmsnorm_forward(inplace.data(), rstd2.data(), inplace.data(), w.data(), N, C, eps);
        expect_bitwise_equal("rmsnorm in place", inplace, out);
        for (int64_t n = 0; n < N; ++n) {
            double ss = 0;
            for (int64_t c = 0; c < C; ++c) ss += static_cast<double>(x[n * C + c]) * x[n * C + c];
            EXPECT_NEAR(rstd[n], 1.0 / std::sqrt(ss / C + eps), 1e-5 * rstd[n]);
        }
    }
}

TEST(RmsNorm, GradientsFiniteDifference) {
    std::mt19937 rng(7);
    const int64_t N = 4, C = 19;
    const float eps = 1e-5f;
    FloatVec x = random_vec(rng, N * C), w = random_vec(rng, C, 0.5f, 1.5f), r = random_vec(rng, N * C);
    FloatVec out(N * C), rstd(N);
    rmsnorm_forward(out.data(), rstd.data(), x.data(), w.data(), N, C, eps);
    FloatVec dx0 = random_vec(rng, N * C), dw0 = random_vec(rng, C), dx = dx0, dw = dw0;
    rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
    auto loss = [&] {
        FloatVec o(N * C), rs(N);
        rmsnorm_forward(o.data(), rs.data(), x.data(), w.data(), N, C, eps);
        return project(o, r);
    };
    check_grad("rmsnorm dinp", x, minus(dx, dx0), loss);
    check_grad("rmsnorm dweight", w, minus(dw, dw0), loss);
}

// ---------------------------------------------------------------------------------------------
// rope

// HF rotate_half with angles in T precision: inv_freq = 1/θ^(2i/D), angle = pos · inv_freq.
template <typename T>
std::vector<T> ref_rope(const FloatVec& x, const std::vector<int32_t>& pos, int64_t N, int64_t H, int64_t D,
                        float theta) {
    std::vector<T> out(x.size());
    const int64_t half = D / 2;
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < half; ++i) {
            const T inv_freq = T(1) / std::pow(static_cast<T>(theta), static_cast<T>(2 * i) / static_cast<T>(D));
            const T angle = static_cast<T>(pos[n]) * inv_freq;
            const T c = std::cos(angle), s = std::sin(angle);
            for (int64_t h = 0; h < H; ++h) {
                const int64_t base = (n * H + h) * D;
                const T a = x[base + i], b = x[base + i + half];
                out[base + i] = a * c - b * s;
                out[base + i + half] = b * c + a * s;
            }
        }
    }
    return out;
}

TEST(Rope, ForwardMatchesReferenceAndInverts) {
    std::mt19937 rng(8);
    const int64_t N = 7, H = 3, D = 10;
    const float theta = 10000.0f;
    FloatVec x = random_vec(rng, N * H * D);
    std::vector<int32_t> pos = {0, 1, 2, 17, 5, 63, 40};
    FloatVec y = x;
    rope_forward(y.data(), pos.data(), N, H, D, theta);
    expect_within_rule("rope forward", y, ref_rope<double>(x, pos, N, H, D, theta),
                       ref_rope<float>(x, pos, N, H, D, theta));
    // Position 0 is the identity.
    for (int64_t i = 0; i < H * D; ++i) EXPECT_EQ(y[i], x[i]);
    FloatVec back = y;
    rope_backward(back.data(), pos.data(), N, H, D, theta);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(back[i], x[i], 1e-6) << i;
}

TEST(Rope, AnglesAreFp32LikeHf) {
    // At large positions fp32 angles (what HF computes) differ visibly from exact ones; the kernel must
    // follow fp32: angle = fp32(pos) · fp32(1 / powf(θ, 2i/D)).
    const int64_t N = 3, H = 1, D = 8;
    const float theta = 1000000.0f;
    std::vector<int32_t> pos = {30011, 65535, 131071};
    FloatVec x(N * H * D, 1.0f);
    FloatVec y = x;
    rope_forward(y.data(), pos.data(), N, H, D, theta);
    double max_err_vs_fp32_angles = 0.0;
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < D / 2; ++i) {
            const float inv_freq = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(D));
            const double angle = static_cast<double>(static_cast<float>(pos[n]) * inv_freq);
            const double lo = std::cos(angle) - std::sin(angle), hi = std::cos(angle) + std::sin(angle);
            max_err_vs_fp32_angles = std::max(max_err_vs_fp32_angles, std::abs(y[n * D + i] - lo));
            max_err_vs_fp32_angles = std::max(max_err_vs_fp32_angles, std::abs(y[n * D + i + D / 2] - hi));
        }
    }
    EXPECT_LT(max_err_vs_fp32_angles, 1e-5);
}

TEST(Rope, GradientFiniteDifference) {
    std::mt19937 rng(9);
    const int64_t N = 5, H = 2, D = 6;
    const float theta = 500.0f;
    FloatVec x = random_vec(rng, N * H * D), r = random_vec(rng, N * H * D);
    std::vector<int32_t> pos = {3, 0, 9, 2, 11};
    FloatVec dx = r;
    rope_backward(dx.data(), pos.data(), N, H, D, theta);
    check_grad("rope dx", x, dx, [&] {
        FloatVec y = x;
        rope_forward(y.data(), pos.data(), N, H, D, theta);
        return project(y, r);
    });
}

// The rotation of cos/sin tables [N, D] (transformers' position_embeddings), whose two halves may
// differ: y[i] = x[i]·c[i] − x[i+h]·s[i], y[i+h] = x[i+h]·c[i+h] + x[i]·s[i+h].
template <typename T>
std::vector<T> ref_rope_table(const FloatVec& x, const FloatVec& cos, const FloatVec& sin, int64_t N, int64_t H,
                              int64_t D) {
    std::vector<T> out(x.size());
    const int64_t half = D / 2;
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t h = 0; h < H; ++h) {
            const int64_t base = (n * H + h) * D;
            for (int64_t i = 0; i < half; ++i) {
                const T a = x[base + i], b = x[base + i + half];
                out[base + i] = a * T(cos[n * D + i]) - b * T(sin[n * D + i]);
                out[base + i + half] = b * T(cos[n * D + half + i]) + a * T(sin[n * D + half + i]);
            }
        }
    }
    return out;
}

TEST(Rope, TablesMatchReferenceAndThePositionsPath) {
    std::mt19937 rng(31);
    const int64_t N = 6, H = 3, D = 10;
    const float theta = 10000.0f;
    FloatVec x = random_vec(rng, N * H * D);
    // Tables whose halves differ (the general case) against the reference.
    FloatVec cos = random_vec(rng, N * D), sin = random_vec(rng, N * D);
    FloatVec y = x;
    rope_table_forward(y.data(), cos.data(), sin.data(), N, H, D);
    expect_within_rule("rope table forward", y, ref_rope_table<double>(x, cos, sin, N, H, D),
                       ref_rope_table<float>(x, cos, sin, N, H, D));
    // Tables made from positions as the positions path makes its angles: the same bits both ways.
    std::vector<int32_t> pos = {0, 1, 2, 17, 5, 4095};
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < D / 2; ++i) {
            const float inv_freq = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(D));
            const float angle = static_cast<float>(pos[n]) * inv_freq;
            cos[n * D + i] = cos[n * D + D / 2 + i] = std::cos(angle);
            sin[n * D + i] = sin[n * D + D / 2 + i] = std::sin(angle);
        }
    }
    for (const bool forward : {true, false}) {
        FloatVec by_table = x, by_positions = x;
        if (forward) {
            rope_table_forward(by_table.data(), cos.data(), sin.data(), N, H, D);
            rope_forward(by_positions.data(), pos.data(), N, H, D, theta);
        } else {
            rope_table_backward(by_table.data(), cos.data(), sin.data(), N, H, D);
            rope_backward(by_positions.data(), pos.data(), N, H, D, theta);
        }
        expect_bitwise_equal(forward ? "rope table forward = positions" : "rope table backward = positions", by_table,
                             by_positions);
    }
    EXPECT_THROW(rope_table_forward(y.data(), cos.data(), sin.data(), N, H, 7), mf::Error) << "an odd head dim";
}

TEST(Rope, TableGradientFiniteDifference) {
    std::mt19937 rng(32);
    const int64_t N = 4, H = 2, D = 8;
    FloatVec x = random_vec(rng, N * H * D), r = random_vec(rng, N * H * D);
    const FloatVec cos = random_vec(rng, N * D), sin = random_vec(rng, N * D);
    FloatVec dx = r;
    rope_table_backward(dx.data(), cos.data(), sin.data(), N, H, D);
    check_grad("rope table dx", x, dx, [&] {
        FloatVec y = x;
        rope_table_forward(y.data(), cos.data(), sin.data(), N, H, D);
        return project(y, r);
    });
}

// Partial rotary (HF partial_rotary_factor), in double and float: the first R dims of each head
// rotate with inv_freq over R, the rest are copied.
template <typename T>
std::vector<T> ref_partial_rope(const FloatVec& x, const std::vector<int32_t>& pos, int64_t N, int64_t H, int64_t D,
                                int64_t R, float theta, T sign) {
    std::vector<T> out = cast_vec<T>(x);
    const int64_t half = R / 2;
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < half; ++i) {
            const T inv_freq = T(1) / std::pow(static_cast<T>(theta), static_cast<T>(2 * i) / static_cast<T>(R));
            const T angle = static_cast<T>(pos[n]) * inv_freq;
            const T c = std::cos(angle), s = sign * std::sin(angle);
            for (int64_t h = 0; h < H; ++h) {
                const int64_t base = (n * H + h) * D;
                const T a = x[base + i], b = x[base + i + half];
                out[base + i] = a * c - b * s;
                out[base + i + half] = b * c + a * s;
            }
        }
    }
    return out;
}

struct PartialRopeCase {
    int64_t N, H, D, R;
};

TEST(Rope, PartialRotaryMatchesReference) {
    std::mt19937 rng(32);
    const float theta = 10000.0f;
    for (const PartialRopeCase& s : {PartialRopeCase{7, 3, 10, 4}, PartialRopeCase{5, 2, 64, 16},
                                     PartialRopeCase{1, 1, 7, 2}, PartialRopeCase{9, 4, 12, 12}}) {
        const std::string name = "rope D=" + std::to_string(s.D) + " R=" + std::to_string(s.R);
        const FloatVec x = random_vec(rng, s.N * s.H * s.D);
        std::vector<int32_t> pos(static_cast<size_t>(s.N));
        for (auto& p : pos) p = static_cast<int32_t>(rng() % 2048);
        pos[0] = 0;
        for (const float sign : {1.0f, -1.0f}) {
            FloatVec y = x;
            if (sign > 0)
                rope_forward(y.data(), pos.data(), s.N, s.H, s.D, s.R, theta);
            else
                rope_backward(y.data(), pos.data(), s.N, s.H, s.D, s.R, theta);
            const std::string what = name + (sign > 0 ? " forward" : " backward");
            expect_within_rule(what, y, ref_partial_rope<double>(x, pos, s.N, s.H, s.D, s.R, theta, 1.0 * sign),
                               ref_partial_rope<float>(x, pos, s.N, s.H, s.D, s.R, theta, sign));
            // The pass-through dims are the input's bits; position 0 is the identity.
            for (int64_t nh = 0; nh < s.N * s.H; ++nh)
                for (int64_t d = s.R; d < s.D; ++d) ASSERT_EQ(y[nh * s.D + d], x[nh * s.D + d]) << what;
            for (int64_t i = 0; i < s.H * s.D; ++i) ASSERT_EQ(y[i], x[i]) << what;
        }
    }
}

TEST(Rope, FullRotaryDimIsTheWholeHeadRope) {
    // rotary_dim == head_dim is the whole-head rope the QK-norm path uses, bit for bit.
    std::mt19937 rng(33);
    const int64_t N = 11, H = 3, D = 64;
    const float theta = 1000000.0f;
    const FloatVec x = random_vec(rng, N * H * D);
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (auto& p : pos) p = static_cast<int32_t>(rng() % 65536);
    FloatVec full = x, partial = x;
    rope_forward(full.data(), pos.data(), N, H, D, theta);
    rope_forward(partial.data(), pos.data(), N, H, D, D, theta);
    expect_bitwise_equal("rope forward rotary_dim = D", partial, full);
    rope_backward(full.data(), pos.data(), N, H, D, theta);
    rope_backward(partial.data(), pos.data(), N, H, D, D, theta);
    expect_bitwise_equal("rope backward rotary_dim = D", partial, full);
}

TEST(Rope, PartialRotaryGradientFiniteDifference) {
    std::mt19937 rng(34);
    const float theta = 500.0f;
    for (const PartialRopeCase& s : {PartialRopeCase{5, 2, 10, 6}, PartialRopeCase{4, 3, 8, 8}}) {
        FloatVec x = random_vec(rng, s.N * s.H * s.D), r = random_vec(rng, s.N * s.H * s.D);
        const std::vector<int32_t> pos = {3, 0, 9, 2, 11};
        FloatVec dx = r;
        rope_backward(dx.data(), pos.data(), s.N, s.H, s.D, s.R, theta);
        check_grad("rope dx D=" + std::to_string(s.D) + " R=" + std::to_string(s.R), x, dx, [&] {
            FloatVec y = x;
            rope_forward(y.data(), pos.data(), s.N, s.H, s.D, s.R, theta);
            return project(y, r);
        });
    }
}

TEST(Rope, RejectsBadRotaryDim) {
    FloatVec x(2 * 8, 0.0f);
    const std::vector<int32_t> pos = {0, 1};
    for (const int64_t R : {int64_t{0}, int64_t{3}, int64_t{10}, int64_t{-2}})
        EXPECT_THROW(rope_forward(x.data(), pos.data(), 2, 1, 8, R, 1e4f), mf::Error) << "rotary_dim " << R;
}

// ---------------------------------------------------------------------------------------------
// attention

// Explicit masked score matrix per (b, h): S[t, s] = scale · q_t·k_s where allowed, softmax per row.
template <typename T>
void ref_attention(std::vector<T>& out, std::vector<T>& lse, const FloatVec& q, const FloatVec& k, const FloatVec& v,
                   const std::vector<int32_t>& doc, const AttentionShape& s) {
    out.assign(s.B * s.T * s.Hq * s.D, T(0));
    lse.assign(s.B * s.Hq * s.T, T(0));
    const T scale = T(1) / std::sqrt(static_cast<T>(s.D));
    const T neg_inf = -std::numeric_limits<T>::infinity();
    std::vector<T> scores(s.T * s.T);
    for (int64_t b = 0; b < s.B; ++b) {
        for (int64_t h = 0; h < s.Hq; ++h) {
            const int64_t hk = h / (s.Hq / s.Hkv);
            for (int64_t t = 0; t < s.T; ++t) {
                for (int64_t j = 0; j < s.T; ++j) {
                    const bool allowed = j <= t && (doc.empty() || doc[b * s.T + j] == doc[b * s.T + t]);
                    T dot = 0;
                    for (int64_t d = 0; d < s.D; ++d) {
                        dot += static_cast<T>(q[((b * s.T + t) * s.Hq + h) * s.D + d]) *
                               static_cast<T>(k[((b * s.T + j) * s.Hkv + hk) * s.D + d]);
                    }
                    scores[t * s.T + j] = allowed ? dot * scale : neg_inf;
                }
            }
            for (int64_t t = 0; t < s.T; ++t) {
                T m = neg_inf;
                for (int64_t j = 0; j < s.T; ++j) m = std::max(m, scores[t * s.T + j]);
                T l = 0;
                for (int64_t j = 0; j < s.T; ++j) l += std::exp(scores[t * s.T + j] - m);
                lse[(b * s.Hq + h) * s.T + t] = m + std::log(l);
                for (int64_t d = 0; d < s.D; ++d) {
                    T acc = 0;
                    for (int64_t j = 0; j < s.T; ++j) {
                        acc += std::exp(scores[t * s.T + j] - m) / l *
                               static_cast<T>(v[((b * s.T + j) * s.Hkv + hk) * s.D + d]);
                    }
                    out[((b * s.T + t) * s.Hq + h) * s.D + d] = acc;
                }
            }
        }
    }
}

// Two packed rows, 3 and 2 documents; document ids need not be sorted or contiguous in value.
std::vector<int32_t> packed_docs(int64_t B, int64_t T) {
    std::vector<int32_t> doc(B * T);
    for (int64_t t = 0; t < T; ++t) {
        doc[t] = t < 4 ? 0 : (t < 9 ? 1 : 2);
        if (B > 1) doc[T + t] = t < 7 ? 5 : 3;
    }
    for (int64_t b = 2; b < B; ++b)
        for (int64_t t = 0; t < T; ++t) doc[b * T + t] = static_cast<int32_t>(t / 5);
    return doc;
}

TEST(Attention, ForwardMatchesExplicitSoftmax) {
    std::mt19937 rng(10);
    struct Case {
        AttentionShape shape;
        bool docs;
    };
    for (Case c : {Case{{2, 13, 4, 2, 10}, true}, Case{{2, 13, 4, 2, 10}, false}, Case{{1, 9, 3, 3, 16}, true},
                   Case{{3, 11, 6, 1, 7}, true}, Case{{1, 1, 2, 1, 5}, false}}) {
        const AttentionShape& s = c.shape;
        FloatVec q = random_vec(rng, s.B * s.T * s.Hq * s.D, -2.0f, 2.0f);
        FloatVec k = random_vec(rng, s.B * s.T * s.Hkv * s.D, -2.0f, 2.0f);
        FloatVec v = random_vec(rng, s.B * s.T * s.Hkv * s.D);
        std::vector<int32_t> doc = c.docs ? packed_docs(s.B, s.T) : std::vector<int32_t>{};
        FloatVec out(q.size()), lse(s.B * s.Hq * s.T);
        attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), c.docs ? doc.data() : nullptr, s);
        DoubleVec out64, lse64;
        FloatVec out32, lse32;
        ref_attention(out64, lse64, q, k, v, doc, s);
        ref_attention(out32, lse32, q, k, v, doc, s);
        const std::string name = "attention T=" + std::to_string(s.T) + " Hq=" + std::to_string(s.Hq) +
                                 " Hkv=" + std::to_string(s.Hkv) + (c.docs ? " packed" : " causal");
        expect_within_rule(name + " out", out, out64, out32);
        expect_within_rule(name + " lse", lse, lse64, lse32);
    }
}

TEST(Attention, DocumentStartsAttendOnlyThemselves) {
    // The first token of each packed document sees only itself, so its output is its own v row.
    std::mt19937 rng(11);
    const AttentionShape s{2, 13, 4, 2, 10};
    FloatVec q = random_vec(rng, s.B * s.T * s.Hq * s.D), k = random_vec(rng, s.B * s.T * s.Hkv * s.D);
    FloatVec v = random_vec(rng, s.B * s.T * s.Hkv * s.D);
    std::vector<int32_t> doc = packed_docs(s.B, s.T);
    FloatVec out(q.size()), lse(s.B * s.Hq * s.T);
    attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), doc.data(), s);
    for (int64_t b = 0; b < s.B; ++b) {
        for (int64_t t = 0; t < s.T; ++t) {
            if (t > 0 && doc[b * s.T + t] == doc[b * s.T + t - 1]) continue;
            for (int64_t h = 0; h < s.Hq; ++h)
                for (int64_t d = 0; d < s.D; ++d)
                    EXPECT_EQ(out[((b * s.T + t) * s.Hq + h) * s.D + d], v[((b * s.T + t) * s.Hkv + h / 2) * s.D + d]);
        }
    }
}

TEST(Attention, GradientsFiniteDifference) {
    std::mt19937 rng(12);
    for (const AttentionShape& s : {AttentionShape{2, 13, 4, 2, 10}, AttentionShape{1, 7, 2, 2, 9}}) {
        FloatVec q = random_vec(rng, s.B * s.T * s.Hq * s.D), k = random_vec(rng, s.B * s.T * s.Hkv * s.D);
        FloatVec v = random_vec(rng, s.B * s.T * s.Hkv * s.D), r = random_vec(rng, q.size());
        std::vector<int32_t> doc = packed_docs(s.B, s.T);
        FloatVec out(q.size()), lse(s.B * s.Hq * s.T);
        attention_forward(out.data(), lse.data(), q.data(), k.data(), v.data(), doc.data(), s);
        FloatVec dq0 = random_vec(rng, q.size()), dk0 = random_vec(rng, k.size()), dv0 = random_vec(rng, v.size());
        FloatVec dq = dq0, dk = dk0, dv = dv0;
        attention_backward(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(), v.data(), out.data(),
                           lse.data(), doc.data(), s);
        auto loss = [&] {
            FloatVec o(q.size()), l(lse.size());
            attention_forward(o.data(), l.data(), q.data(), k.data(), v.data(), doc.data(), s);
            return project(o, r);
        };
        check_grad("attention dq", q, minus(dq, dq0), loss);
        check_grad("attention dk", k, minus(dk, dk0), loss);
        check_grad("attention dv", v, minus(dv, dv0), loss);

        // Same inputs, same bits.
        FloatVec dq2 = dq0, dk2 = dk0, dv2 = dv0;
        attention_backward(dq2.data(), dk2.data(), dv2.data(), r.data(), q.data(), k.data(), v.data(), out.data(),
                           lse.data(), doc.data(), s);
        expect_bitwise_equal("attention dq rerun", dq2, dq);
        expect_bitwise_equal("attention dk rerun", dk2, dk);
        expect_bitwise_equal("attention dv rerun", dv2, dv);
    }
}

TEST(Attention, RejectsBadHeads) {
    FloatVec buf(64);
    EXPECT_THROW(attention_forward(buf.data(), buf.data(), buf.data(), buf.data(), buf.data(), nullptr,
                                   AttentionShape{1, 2, 3, 2, 4}),
                 mf::Error);
}

// ---------------------------------------------------------------------------------------------
// swiglu

template <typename T>
std::vector<T> ref_swiglu(const FloatVec& inp, int64_t N, int64_t I) {
    std::vector<T> out(N * I);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < I; ++i) {
            const T g = inp[n * 2 * I + i], u = inp[n * 2 * I + I + i];
            out[n * I + i] = g / (T(1) + std::exp(-g)) * u;
        }
    }
    return out;
}

TEST(SwiGlu, ForwardAndGradients) {
    std::mt19937 rng(13);
    const int64_t N = 5, I = 11;
    FloatVec inp = random_vec(rng, N * 2 * I, -4.0f, 4.0f);
    inp[0] = -90.0f;  // exp(−g) overflows: silu must be −0, not NaN
    inp[1] = 90.0f;
    FloatVec out(N * I);
    swiglu_forward(out.data(), inp.data(), N, I);
    expect_within_rule("swiglu", out, ref_swiglu<double>(inp, N, I), ref_swiglu<float>(inp, N, I));

    FloatVec r = random_vec(rng, N * I), dinp(N * 2 * I, std::numeric_limits<float>::quiet_NaN());
    swiglu_backward(dinp.data(), r.data(), inp.data(), N, I);
    for (float d : dinp) ASSERT_TRUE(std::isfinite(d));
    check_grad("swiglu dinp", inp, dinp, [&] {
        FloatVec o(N * I);
        swiglu_forward(o.data(), inp.data(), N, I);
        return project(o, r);
    });
}

// ---------------------------------------------------------------------------------------------
// sigmoid gate

template <typename T>
T ref_sigmoid(float g) {
    return T(1) / (T(1) + std::exp(-static_cast<T>(g)));
}

TEST(SigmoidGate, ForwardAndBackwardMatchReference) {
    std::mt19937 rng(35);
    for (auto [N, H] : {std::pair<int64_t, int64_t>{1, 1}, {1, 9}, {6, 13}, {40, 64}, {3, 300}}) {
        const std::string name = "sigmoid gate N=" + std::to_string(N) + " H=" + std::to_string(H);
        const FloatVec y0 = random_vec(rng, N * H), value = random_vec(rng, N * H, -2.0f, 2.0f);
        FloatVec g = random_vec(rng, N, -4.0f, 4.0f);
        g[0] = N > 1 ? -90.0f : 0.5f;  // exp(−g) overflows: s = 0
        if (N > 2) g[1] = 90.0f;       // s = 1, s · (1 − s) = 0
        FloatVec y = y0;
        sigmoid_gate_forward(y.data(), value.data(), g.data(), N, H);
        DoubleVec y64(N * H);
        FloatVec y32(N * H);
        for (int64_t n = 0; n < N; ++n) {
            for (int64_t h = 0; h < H; ++h) {
                y64[n * H + h] = y0[n * H + h] + ref_sigmoid<double>(g[n]) * value[n * H + h];
                y32[n * H + h] = y0[n * H + h] + ref_sigmoid<float>(g[n]) * value[n * H + h];
            }
        }
        expect_within_rule(name + " forward", y, y64, y32);

        const FloatVec dy = random_vec(rng, N * H);
        FloatVec dvalue(N * H, std::numeric_limits<float>::quiet_NaN()), dg(N, std::numeric_limits<float>::quiet_NaN());
        sigmoid_gate_backward(dvalue.data(), dg.data(), dy.data(), value.data(), g.data(), N, H);
        DoubleVec dv64(N * H), dg64(N);
        FloatVec dv32(N * H), dg32(N);
        for (int64_t n = 0; n < N; ++n) {
            const double s64 = ref_sigmoid<double>(g[n]);
            const float s32 = ref_sigmoid<float>(g[n]);
            double dot64 = 0.0;
            float dot32 = 0.0f;
            for (int64_t h = 0; h < H; ++h) {
                dv64[n * H + h] = s64 * dy[n * H + h];
                dv32[n * H + h] = s32 * dy[n * H + h];
                dot64 += static_cast<double>(dy[n * H + h]) * value[n * H + h];
                dot32 += dy[n * H + h] * value[n * H + h];
            }
            dg64[n] = s64 * (1.0 - s64) * dot64;
            dg32[n] = s32 * (1.0f - s32) * dot32;
        }
        expect_within_rule(name + " dvalue", dvalue, dv64, dv32);
        expect_within_rule(name + " dgate_logits", dg, dg64, dg32);

        // dvalue may alias dy: the same bits.
        FloatVec inplace = dy, dg2(N);
        sigmoid_gate_backward(inplace.data(), dg2.data(), inplace.data(), value.data(), g.data(), N, H);
        expect_bitwise_equal(name + " dvalue in place", inplace, dvalue);
        expect_bitwise_equal(name + " dgate_logits in place", dg2, dg);
    }
}

TEST(SigmoidGate, GradientsFiniteDifference) {
    std::mt19937 rng(36);
    const int64_t N = 5, H = 11;
    FloatVec y0 = random_vec(rng, N * H), value = random_vec(rng, N * H), g = random_vec(rng, N, -2.0f, 2.0f);
    const FloatVec r = random_vec(rng, N * H);
    FloatVec dvalue(N * H), dg(N);
    sigmoid_gate_backward(dvalue.data(), dg.data(), r.data(), value.data(), g.data(), N, H);
    auto loss = [&] {
        FloatVec y = y0;
        sigmoid_gate_forward(y.data(), value.data(), g.data(), N, H);
        return project(y, r);
    };
    check_grad("sigmoid gate dvalue", value, dvalue, loss);
    check_grad("sigmoid gate dgate_logits", g, dg, loss);
}

// ---------------------------------------------------------------------------------------------
// router

// Softmax in T, top-k by a stable sort on (probability descending, index ascending).
template <typename T>
void ref_router(std::vector<T>& probs, std::vector<int32_t>& idx, std::vector<T>& w, const FloatVec& logits, int64_t N,
                int64_t E, int64_t K, bool norm) {
    probs.assign(N * E, T(0));
    idx.assign(N * K, -1);
    w.assign(N * K, T(0));
    for (int64_t n = 0; n < N; ++n) {
        T m = -std::numeric_limits<T>::infinity(), sum = 0;
        for (int64_t e = 0; e < E; ++e) m = std::max(m, static_cast<T>(logits[n * E + e]));
        for (int64_t e = 0; e < E; ++e) sum += std::exp(static_cast<T>(logits[n * E + e]) - m);
        for (int64_t e = 0; e < E; ++e) probs[n * E + e] = std::exp(static_cast<T>(logits[n * E + e]) - m) / sum;
        std::vector<int32_t> order(E);
        std::iota(order.begin(), order.end(), 0);
        // Sort on the fp32 logits (softmax is monotone), so ties are decided the same in both precisions.
        std::stable_sort(order.begin(), order.end(),
                         [&](int32_t a, int32_t b) { return logits[n * E + a] > logits[n * E + b]; });
        T total = 0;
        for (int64_t k = 0; k < K; ++k) total += probs[n * E + order[k]];
        for (int64_t k = 0; k < K; ++k) {
            idx[n * K + k] = order[k];
            w[n * K + k] = norm ? probs[n * E + order[k]] / total : probs[n * E + order[k]];
        }
    }
}

// Logits with distinct values at least 0.2 apart, so finite differences never flip the top-k.
FloatVec separated_logits(std::mt19937& rng, int64_t N, int64_t E) {
    FloatVec logits(N * E);
    std::vector<int32_t> rank(E);
    std::iota(rank.begin(), rank.end(), 0);
    for (int64_t n = 0; n < N; ++n) {
        std::shuffle(rank.begin(), rank.end(), rng);
        FloatVec jitter = random_vec(rng, E, -0.05f, 0.05f);
        for (int64_t e = 0; e < E; ++e) logits[n * E + e] = 0.3f * static_cast<float>(rank[e]) - 1.0f + jitter[e];
    }
    return logits;
}

TEST(Router, ForwardMatchesSortedReference) {
    std::mt19937 rng(14);
    const int64_t N = 9, E = 7, K = 3;
    for (bool norm : {true, false}) {
        FloatVec logits = random_vec(rng, N * E, -3.0f, 3.0f);
        // Ties: row 0 all equal, row 1 has a tie across the top-k boundary.
        for (int64_t e = 0; e < E; ++e) logits[e] = 0.25f;
        logits[E + 1] = logits[E + 4] = logits[E + 6] = 5.0f;
        logits[E + 2] = logits[E + 5] = 4.0f;
        FloatVec probs(N * E), w(N * K);
        std::vector<int32_t> idx(N * K);
        router_forward(probs.data(), idx.data(), w.data(), logits.data(), N, E, K, norm);
        DoubleVec p64, w64;
        FloatVec p32, w32;
        std::vector<int32_t> idx64, idx32;
        ref_router(p64, idx64, w64, logits, N, E, K, norm);
        ref_router(p32, idx32, w32, logits, N, E, K, norm);
        EXPECT_EQ(idx, idx64);
        expect_within_rule("router probs", probs, p64, p32);
        expect_within_rule("router weights", w, w64, w32);
        EXPECT_EQ((std::vector<int32_t>(idx.begin(), idx.begin() + K)), (std::vector<int32_t>{0, 1, 2}));
        EXPECT_EQ((std::vector<int32_t>(idx.begin() + K, idx.begin() + 2 * K)), (std::vector<int32_t>{1, 4, 6}));
    }
}

TEST(Router, GradientsFiniteDifference) {
    std::mt19937 rng(15);
    const int64_t N = 6, E = 8, K = 3;
    for (bool norm : {true, false}) {
        for (bool with_dprobs : {false, true}) {
            FloatVec logits = separated_logits(rng, N, E);
            FloatVec r_w = random_vec(rng, N * K), r_p = random_vec(rng, N * E);
            FloatVec probs(N * E), w(N * K);
            std::vector<int32_t> idx(N * K);
            router_forward(probs.data(), idx.data(), w.data(), logits.data(), N, E, K, norm);
            FloatVec dlogits(N * E, std::numeric_limits<float>::quiet_NaN());
            router_backward(dlogits.data(), r_w.data(), with_dprobs ? r_p.data() : nullptr, probs.data(), idx.data(), N,
                            E, K, norm);
            const std::string name =
                std::string("router dlogits") + (norm ? " norm" : "") + (with_dprobs ? " +dprobs" : "");
            check_grad(name, logits, dlogits, [&] {
                FloatVec p(N * E), ww(N * K);
                std::vector<int32_t> ii(N * K);
                router_forward(p.data(), ii.data(), ww.data(), logits.data(), N, E, K, norm);
                EXPECT_EQ(ii, idx) << "finite-difference step changed the top-k selection";
                return project(ww, r_w) + (with_dprobs ? project(p, r_p) : 0.0);
            });
        }
    }
}

// ---------------------------------------------------------------------------------------------
// moe_permute

struct PermuteCase {
    int64_t N, K, E;
    std::vector<int32_t> topk;  // N·K expert ids
};

// Experts 0 and 4 get no tokens, expert 2 gets many: ragged groups and empty groups.
PermuteCase ragged_case(std::mt19937& rng) {
    PermuteCase c{13, 3, 7, {}};
    for (int64_t t = 0; t < c.N; ++t) {
        std::vector<int32_t> pick = {1, 2, 3, 5, 6};
        std::shuffle(pick.begin(), pick.end(), rng);
        if (t % 2 == 0) std::swap(pick[0], *std::find(pick.begin(), pick.end(), 2));  // expert 2 is popular
        for (int64_t k = 0; k < c.K; ++k) c.topk.push_back(pick[k]);
    }
    return c;
}

TEST(MoePermute, IndicesMatchStableGrouping) {
    std::mt19937 rng(16);
    PermuteCase c = ragged_case(rng);
    const int64_t P = c.N * c.K;
    std::vector<int32_t> offsets(c.E + 1), sorted_pair(P), pair_row(P);
    moe_permute_indices(offsets.data(), sorted_pair.data(), pair_row.data(), c.topk.data(), c.N, c.K, c.E);
    // Reference: for each expert in order, its pairs in pair order.
    std::vector<int32_t> ref_sorted, ref_offsets = {0};
    for (int32_t e = 0; e < c.E; ++e) {
        for (int32_t p = 0; p < P; ++p)
            if (c.topk[p] == e) ref_sorted.push_back(p);
        ref_offsets.push_back(static_cast<int32_t>(ref_sorted.size()));
    }
    EXPECT_EQ(offsets, ref_offsets);
    EXPECT_EQ(sorted_pair, ref_sorted);
    EXPECT_EQ(offsets[1] - offsets[0], 0);  // expert 0 is empty
    EXPECT_EQ(offsets[5] - offsets[4], 0);  // expert 4 is empty
    for (int32_t p = 0; p < P; ++p) EXPECT_EQ(sorted_pair[pair_row[p]], p);
}

TEST(MoePermute, GatherUnpermuteRoundTrip) {
    std::mt19937 rng(17);
    PermuteCase c = ragged_case(rng);
    const int64_t P = c.N * c.K, H = 9;
    std::vector<int32_t> offsets(c.E + 1), sorted_pair(P), pair_row(P);
    moe_permute_indices(offsets.data(), sorted_pair.data(), pair_row.data(), c.topk.data(), c.N, c.K, c.E);
    FloatVec x = random_vec(rng, c.N * H), x_perm(P * H);
    moe_gather_forward(x_perm.data(), x.data(), sorted_pair.data(), c.N, c.K, H);
    for (int64_t r = 0; r < P; ++r)
        for (int64_t h = 0; h < H; ++h) ASSERT_EQ(x_perm[r * H + h], x[(sorted_pair[r] / c.K) * H + h]);
    // Each expert's rows hold its tokens in token order.
    for (int64_t e = 0; e < c.E; ++e) {
        for (int32_t r = offsets[e]; r < offsets[e + 1]; ++r) {
            EXPECT_EQ(c.topk[sorted_pair[r]], e);
            if (r > offsets[e]) {
                EXPECT_LT(sorted_pair[r - 1], sorted_pair[r]);
            }
        }
    }
    // Unpermute of the gathered rows: out[t] = Σ_k w[t, k] · x[t].
    FloatVec w = random_vec(rng, P, 0.0f, 1.0f), out(c.N * H);
    moe_unpermute_forward(out.data(), x_perm.data(), w.data(), pair_row.data(), c.N, c.K, H);
    DoubleVec ref64(c.N * H);
    FloatVec ref32(c.N * H);
    for (int64_t t = 0; t < c.N; ++t) {
        for (int64_t h = 0; h < H; ++h) {
            double a = 0;
            float b = 0;
            for (int64_t k = 0; k < c.K; ++k) {
                a += static_cast<double>(w[t * c.K + k]) * x[t * H + h];
                b += w[t * c.K + k] * x[t * H + h];
            }
            ref64[t * H + h] = a;
            ref32[t * H + h] = b;
        }
    }
    expect_within_rule("unpermute of gather", out, ref64, ref32);

    // K = 1 with weight 1 is the exact identity.
    std::vector<int32_t> top1(c.N);
    for (int64_t t = 0; t < c.N; ++t) top1[t] = c.topk[t * c.K];
    std::vector<int32_t> off1(c.E + 1), sorted1(c.N), row1(c.N);
    moe_permute_indices(off1.data(), sorted1.data(), row1.data(), top1.data(), c.N, 1, c.E);
    FloatVec perm1(c.N * H), ones(c.N, 1.0f), back(c.N * H);
    moe_gather_forward(perm1.data(), x.data(), sorted1.data(), c.N, 1, H);
    moe_unpermute_forward(back.data(), perm1.data(), ones.data(), row1.data(), c.N, 1, H);
    expect_bitwise_equal("top-1 round trip", back, x);
}

TEST(MoePermute, GradientsFiniteDifference) {
    std::mt19937 rng(18);
    PermuteCase c = ragged_case(rng);
    const int64_t P = c.N * c.K, H = 5;
    std::vector<int32_t> offsets(c.E + 1), sorted_pair(P), pair_row(P);
    moe_permute_indices(offsets.data(), sorted_pair.data(), pair_row.data(), c.topk.data(), c.N, c.K, c.E);

    // gather: loss = Σ x_perm · r
    FloatVec x = random_vec(rng, c.N * H), r_perm = random_vec(rng, P * H);
    FloatVec dx0 = random_vec(rng, c.N * H), dx = dx0;
    moe_gather_backward(dx.data(), r_perm.data(), pair_row.data(), c.N, c.K, H);
    check_grad("gather dx", x, minus(dx, dx0), [&] {
        FloatVec xp(P * H);
        moe_gather_forward(xp.data(), x.data(), sorted_pair.data(), c.N, c.K, H);
        return project(xp, r_perm);
    });

    // unpermute: loss = Σ out · r
    FloatVec y = random_vec(rng, P * H), w = random_vec(rng, P), r = random_vec(rng, c.N * H);
    FloatVec dy(P * H, std::numeric_limits<float>::quiet_NaN()), dw(P, std::numeric_limits<float>::quiet_NaN());
    moe_unpermute_backward(dy.data(), dw.data(), r.data(), y.data(), w.data(), pair_row.data(), c.N, c.K, H);
    auto loss = [&] {
        FloatVec o(c.N * H);
        moe_unpermute_forward(o.data(), y.data(), w.data(), pair_row.data(), c.N, c.K, H);
        return project(o, r);
    };
    check_grad("unpermute dy_perm", y, dy, loss);
    check_grad("unpermute dtopk_weight", w, dw, loss);
}

// Experts outside [0, E) (EP sentinels, or -1) are dropped as the CUDA kernels drop them: no row,
// pair_row -1, trailing sorted_pair -1; gather gives such rows zeros and the sums skip them.
TEST(MoePermute, DropsPairsOfExpertsOutsideTheRange) {
    const std::vector<int32_t> topk = {0, 3, 1, 7, -1, 1};  // N = 3, K = 2, E = 4
    std::vector<int32_t> offsets(5), sorted(6, 99), rows(6, 99);
    moe_permute_indices(offsets.data(), sorted.data(), rows.data(), topk.data(), 3, 2, 4);
    EXPECT_EQ(offsets, (std::vector<int32_t>{0, 1, 3, 3, 4}));
    EXPECT_EQ(sorted, (std::vector<int32_t>{0, 2, 5, 1, -1, -1}));
    EXPECT_EQ(rows, (std::vector<int32_t>{0, 3, 1, -1, -1, 2}));
    const int64_t H = 2;
    const FloatVec x = {1, 2, 3, 4, 5, 6};
    FloatVec x_perm(6 * H, 7.0f);
    moe_gather_forward(x_perm.data(), x.data(), sorted.data(), 3, 2, H);
    EXPECT_EQ(x_perm, (FloatVec{1, 2, 3, 4, 5, 6, 1, 2, 0, 0, 0, 0}));
    const FloatVec w = {0.5f, 0.25f, 2.0f, 3.0f, 4.0f, 1.0f};
    FloatVec out(3 * H);
    moe_unpermute_forward(out.data(), x_perm.data(), w.data(), rows.data(), 3, 2, H);
    // token 1: 2·x[1] (its second pair dropped); token 2: 1·x[2] (its first dropped).
    EXPECT_EQ(out, (FloatVec{0.5f + 0.25f, 1.0f + 0.5f, 6.0f, 8.0f, 5.0f, 6.0f}));
    FloatVec dy_perm(6 * H, 9.0f), dw(6, 9.0f);
    moe_unpermute_backward(dy_perm.data(), dw.data(), out.data(), x_perm.data(), w.data(), rows.data(), 3, 2, H);
    EXPECT_EQ(dw[3], 0.0f);
    EXPECT_EQ(dw[4], 0.0f);
    EXPECT_EQ(dy_perm[4 * H], 9.0f) << "a dropped row is not written";
}

// ---------------------------------------------------------------------------------------------
// grouped_matmul

TEST(GroupedMatmul, ForwardBackwardWithEmptyGroups) {
    std::mt19937 rng(19);
    const int64_t E = 6, C = 11, OC = 7;
    const std::vector<int32_t> offsets = {0, 0, 5, 6, 6, 13, 13};  // experts 0, 3 and 5 are empty
    const int64_t M = offsets[E];
    FloatVec inp = random_vec(rng, M * C), w = random_vec(rng, E * OC * C), out(M * OC);
    grouped_matmul_forward(out.data(), inp.data(), w.data(), offsets.data(), E, C, OC);
    DoubleVec ref64(M * OC);
    FloatVec ref32(M * OC);
    for (int64_t e = 0; e < E; ++e) {
        const int64_t rows = offsets[e + 1] - offsets[e];
        FloatVec in_e(inp.begin() + offsets[e] * C, inp.begin() + offsets[e + 1] * C);
        FloatVec w_e(w.begin() + e * OC * C, w.begin() + (e + 1) * OC * C);
        DoubleVec r64 = ref_matmul<double>(in_e, w_e, rows, C, OC);
        FloatVec r32 = ref_matmul<float>(in_e, w_e, rows, C, OC);
        std::copy(r64.begin(), r64.end(), ref64.begin() + offsets[e] * OC);
        std::copy(r32.begin(), r32.end(), ref32.begin() + offsets[e] * OC);
    }
    expect_within_rule("grouped forward", out, ref64, ref32);

    FloatVec r = random_vec(rng, M * OC), dinp0 = random_vec(rng, M * C), dw0 = random_vec(rng, E * OC * C);
    FloatVec dinp = dinp0, dw = dw0;
    grouped_matmul_backward(dinp.data(), dw.data(), r.data(), inp.data(), w.data(), offsets.data(), E, C, OC);
    for (int64_t e : {0, 3, 5}) {
        for (int64_t i = e * OC * C; i < (e + 1) * OC * C; ++i) ASSERT_EQ(dw[i], dw0[i]) << "empty expert " << e;
    }
    auto loss = [&] {
        FloatVec o(M * OC);
        grouped_matmul_forward(o.data(), inp.data(), w.data(), offsets.data(), E, C, OC);
        return project(o, r);
    };
    check_grad("grouped dinp", inp, minus(dinp, dinp0), loss);
    check_grad("grouped dweight", w, minus(dw, dw0), loss);

    FloatVec dinp_only = dinp0;
    grouped_matmul_backward(dinp_only.data(), nullptr, r.data(), inp.data(), w.data(), offsets.data(), E, C, OC);
    expect_bitwise_equal("grouped dinp alone", dinp_only, dinp);

    const std::vector<int32_t> bad = {0, 4, 2, 6, 6, 13, 13};
    EXPECT_THROW(grouped_matmul_forward(out.data(), inp.data(), w.data(), bad.data(), E, C, OC), mf::Error);
}

// ---------------------------------------------------------------------------------------------
// cross_entropy

template <typename T>
std::vector<T> ref_cross_entropy(const FloatVec& h, const FloatVec& w, const std::vector<int32_t>& targets, int64_t N,
                                 int64_t C, int64_t V) {
    std::vector<T> logits = ref_matmul<T>(h, w, N, C, V);
    std::vector<T> loss(N, T(0));
    for (int64_t n = 0; n < N; ++n) {
        if (targets[n] == kIgnoreIndex) continue;
        T m = -std::numeric_limits<T>::infinity(), s = 0;
        for (int64_t v = 0; v < V; ++v) m = std::max(m, logits[n * V + v]);
        for (int64_t v = 0; v < V; ++v) s += std::exp(logits[n * V + v] - m);
        loss[n] = m + std::log(s) - logits[n * V + targets[n]];
    }
    return loss;
}

TEST(CrossEntropy, LossMatchesExplicitLogits) {
    std::mt19937 rng(20);
    // N = 70 spans two chunks of 64 tokens.
    const int64_t N = 70, C = 9, V = 23;
    FloatVec h = random_vec(rng, N * C, -2.0f, 2.0f), w = random_vec(rng, V * C);
    std::vector<int32_t> targets(N);
    std::uniform_int_distribution<int32_t> pick(0, V - 1);
    for (int64_t n = 0; n < N; ++n) targets[n] = n % 7 == 3 ? kIgnoreIndex : pick(rng);
    FloatVec losses(N, std::numeric_limits<float>::quiet_NaN());
    lm_head_cross_entropy(losses.data(), nullptr, nullptr, h.data(), w.data(), targets.data(), N, C, V, 1.0f);
    expect_within_rule("cross-entropy loss", losses, ref_cross_entropy<double>(h, w, targets, N, C, V),
                       ref_cross_entropy<float>(h, w, targets, N, C, V));
    for (int64_t n = 0; n < N; ++n) {
        if (targets[n] == kIgnoreIndex) {
            EXPECT_EQ(losses[n], 0.0f);
        }
    }

    // Asking for gradients does not change the losses.
    FloatVec losses2(N), dh(N * C, 0.0f), dw(V * C, 0.0f);
    lm_head_cross_entropy(losses2.data(), dh.data(), dw.data(), h.data(), w.data(), targets.data(), N, C, V, 1.0f);
    expect_bitwise_equal("losses with gradients", losses2, losses);
}

TEST(CrossEntropy, GradientsFiniteDifference) {
    std::mt19937 rng(21);
    const int64_t N = 67, C = 6, V = 13;
    const float grad_scale = 0.37f;
    FloatVec h = random_vec(rng, N * C), w = random_vec(rng, V * C);
    std::vector<int32_t> targets(N);
    std::uniform_int_distribution<int32_t> pick(0, V - 1);
    for (int64_t n = 0; n < N; ++n) targets[n] = n % 5 == 1 ? kIgnoreIndex : pick(rng);
    FloatVec losses(N), dh0 = random_vec(rng, N * C), dw0 = random_vec(rng, V * C), dh = dh0, dw = dw0;
    lm_head_cross_entropy(losses.data(), dh.data(), dw.data(), h.data(), w.data(), targets.data(), N, C, V, grad_scale);
    auto loss = [&] {
        FloatVec l(N);
        lm_head_cross_entropy(l.data(), nullptr, nullptr, h.data(), w.data(), targets.data(), N, C, V, 1.0f);
        return grad_scale * std::accumulate(l.begin(), l.end(), 0.0);
    };
    FloatVec dh_delta = minus(dh, dh0);
    for (int64_t n = 0; n < N; ++n) {
        if (targets[n] != kIgnoreIndex) continue;
        for (int64_t c = 0; c < C; ++c) EXPECT_EQ(dh_delta[n * C + c], 0.0f) << "ignored token " << n;
    }
    check_grad("cross-entropy dh", h, dh_delta, loss);
    check_grad("cross-entropy dw", w, minus(dw, dw0), loss);
}

TEST(CrossEntropy, RejectsBadTargets) {
    FloatVec h(4, 0.5f), w(6, 0.5f), losses(2);
    std::vector<int32_t> targets = {1, 3};
    EXPECT_THROW(
        lm_head_cross_entropy(losses.data(), nullptr, nullptr, h.data(), w.data(), targets.data(), 2, 2, 3, 1.0f),
        mf::Error);
    targets[1] = -1;
    EXPECT_THROW(
        lm_head_cross_entropy(losses.data(), nullptr, nullptr, h.data(), w.data(), targets.data(), 2, 2, 3, 1.0f),
        mf::Error);
}

// ---------------------------------------------------------------------------------------------
// adamw

// The header's formula, transcribed in T:
//   p ← p·(1 − lr·wd);  m ← β1·m + (1−β1)·g;  v ← β2·v + (1−β2)·g²
//   p ← p − (lr / (1−β1^t)) · m / (sqrt(v) / sqrt(1−β2^t) + eps)
template <typename T>
void ref_adamw_step(std::vector<T>& p, std::vector<T>& m, std::vector<T>& v, const FloatVec& g, const AdamWParams& hp) {
    const T lr = hp.lr, b1 = hp.beta1, b2 = hp.beta2, eps = hp.eps, wd = hp.weight_decay;
    const T t = static_cast<T>(hp.step);
    for (size_t i = 0; i < p.size(); ++i) {
        p[i] = p[i] * (T(1) - lr * wd);
        m[i] = b1 * m[i] + (T(1) - b1) * g[i];
        v[i] = b2 * v[i] + (T(1) - b2) * g[i] * g[i];
        p[i] =
            p[i] - (lr / (T(1) - std::pow(b1, t))) * m[i] / (std::sqrt(v[i]) / std::sqrt(T(1) - std::pow(b2, t)) + eps);
    }
}

TEST(AdamW, ThreeStepsMatchTorchFormula) {
    std::mt19937 rng(22);
    const int64_t n = 101;
    // beta1 = 0.9 uses torch.lerp's first branch (weight 0.1 < 0.5), beta1 = 0.3 the second.
    for (float beta1 : {0.9f, 0.3f}) {
        AdamWParams hp{1e-2f, beta1, 0.95f, 1e-8f, 0.1f, 0};
        FloatVec p = random_vec(rng, n), m(n, 0.0f), v(n, 0.0f);
        p[0] = 0.0f;  // a parameter whose gradient is 0 throughout
        DoubleVec p64 = cast_vec<double>(p), m64(n, 0.0), v64(n, 0.0);
        FloatVec p32 = p, m32(n, 0.0f), v32(n, 0.0f);
        for (int64_t step = 1; step <= 3; ++step) {
            FloatVec g = random_vec(rng, n, -2.0f, 2.0f);
            g[0] = 0.0f;
            hp.step = step;
            adamw_update(p.data(), m.data(), v.data(), g.data(), n, hp);
            ref_adamw_step(p64, m64, v64, g, hp);
            ref_adamw_step(p32, m32, v32, g, hp);
        }
        expect_within_rule("adamw param", p, p64, p32);
        expect_within_rule("adamw m", m, m64, m32);
        expect_within_rule("adamw v", v, v64, v32);
        EXPECT_EQ(m[0], 0.0f);
        EXPECT_EQ(p[0], 0.0f);
    }
    FloatVec x(1);
    EXPECT_THROW(
        adamw_update(x.data(), x.data(), x.data(), x.data(), 1, AdamWParams{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0}),
        mf::Error);
}

// grad_scale s (the fused clipping factor): the same update as on gradients multiplied by s in fp32
// first, bit for bit (what clipping in place before the step gave).
TEST(AdamW, GradScaleEqualsScaledGradients) {
    std::mt19937 rng(24);
    const int64_t n = 257;
    FloatVec p = random_vec(rng, n), m(n, 0.0f), v(n, 0.0f);
    FloatVec q = p, mq = m, vq = v;
    for (int64_t step = 1; step <= 3; ++step) {
        const FloatVec g = random_vec(rng, n, -2.0f, 2.0f);
        const float s = 0.37f + 0.2f * static_cast<float>(step);
        FloatVec g_scaled = g;
        for (float& x : g_scaled) x *= s;
        AdamWParams fused{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step, s};
        adamw_update(p.data(), m.data(), v.data(), g.data(), n, fused);
        AdamWParams plain{1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, step};
        adamw_update(q.data(), mq.data(), vq.data(), g_scaled.data(), n, plain);
    }
    EXPECT_EQ(std::memcmp(p.data(), q.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(m.data(), mq.data(), n * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(v.data(), vq.data(), n * sizeof(float)), 0);
}

// ---------------------------------------------------------------------------------------------
// reduce

TEST(Reduce, SumSquaresScaleFinite) {
    std::mt19937 rng(23);
    FloatVec x = random_vec(rng, 1003, -3.0f, 3.0f);
    long double ref = 0;
    for (float a : x) ref += static_cast<long double>(a) * a;
    EXPECT_NEAR(sum_squares(x.data(), static_cast<int64_t>(x.size())), static_cast<double>(ref), 1e-12 * ref);
    EXPECT_EQ(sum_squares(x.data(), 0), 0.0);

    FloatVec y = x;
    scale_inplace(y.data(), 0.25f, static_cast<int64_t>(y.size()));
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(y[i], x[i] * 0.25f);

    EXPECT_TRUE(all_finite(x.data(), static_cast<int64_t>(x.size())));
    x[500] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_FALSE(all_finite(x.data(), static_cast<int64_t>(x.size())));
    x[500] = -std::numeric_limits<float>::infinity();
    EXPECT_FALSE(all_finite(x.data(), static_cast<int64_t>(x.size())));
    EXPECT_TRUE(all_finite(x.data(), 500));
}

}  // namespace
