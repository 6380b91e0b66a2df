// The Mamba-2 ops of ops.h on CPU tensors (the fp32 reference kernels behind the ops layer's checks):
// conv1d_silu, ssd_scan and gated_rmsnorm.
//
// Forward: each op against a naive reference written here, independently of the kernel code (the
// scan as an explicit O(T²) sum over earlier tokens of the segment, y_t = Σ_{s<=t} (C_t·B_s) ·
// exp(A·Σ_{s<r<=t} δ_r) · δ_s · x_s + D·x_t), instantiated in double (the truth) and in float (the
// naive fp32 computation); the CONVENTIONS rule:
//     max|kernel − ref64| <= 2 · max|naive32 − ref64| + 1e-6 · max(1, max|ref64|).
// Gradients: loss = Σ out · r (r fixed random, summed in double); numeric = central differences
// (loss(x⁺) − loss(x⁻)) / (x⁺ − x⁻), x± = fp32(x ± 1e-2), against the analytic gradient from the
// backward with dout = r, passing when |analytic − numeric| <= 2e-3 · max(|analytic|, |numeric|) + 2e-4
// (test_kernels.cpp's rule). Written outputs are poisoned with NaN first; parameter gradients start
// from random values and the analytic gradient is (after − before), which checks that they accumulate.
// The dt clamp is a kink: inputs are moved at least 0.05 (in softplus output) away from it, so no
// central difference straddles it, and each clamped geometry asserts that both sides are populated.
//
// Documents: a packed row of three documents gives bit for bit the outputs and activation gradients of
// each document run alone, and rows never mix; parameter gradients, summed over tokens in double and
// added once per call, equal the sum of the separate runs' within the rounding of those additions.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace {

using mf::Device;
using mf::DType;
using mf::Shape;
using mf::Tensor;
using FloatVec = std::vector<float>;
using DoubleVec = std::vector<double>;
using IdVec = std::vector<int32_t>;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// ---------------------------------------------------------------------------------------------
// helpers

FloatVec random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    FloatVec v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

Tensor view(FloatVec& v, Shape shape) { return Tensor(v.data(), DType::f32, std::move(shape)); }
// doc ids: empty = undefined (every row one document).
Tensor doc_view(IdVec& v) { return v.empty() ? Tensor() : Tensor(v.data(), DType::i32, {int64_t(v.size())}); }

// Rows [begin, end) of a row-major [*, cols] vector.
template <typename V>
V row_range(const V& v, int64_t cols, int64_t begin, int64_t end) {
    return V(v.begin() + begin * cols, v.begin() + end * cols);
}

void expect_bits(const FloatVec& a, const FloatVec& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " differs bit-wise";
}

void expect_finite(const FloatVec& v, const std::string& what) {
    for (size_t i = 0; i < v.size(); ++i) ASSERT_TRUE(std::isfinite(v[i])) << what << "[" << i << "] = " << v[i];
}

// CONVENTIONS rule: max|got − ref64| <= 2 · max|naive32 − ref64| + 1e-6 · max(1, max|ref64|).
void expect_within_rule(const std::string& what, const FloatVec& got, const DoubleVec& ref64, const FloatVec& naive32) {
    ASSERT_EQ(got.size(), ref64.size()) << what;
    ASSERT_EQ(naive32.size(), ref64.size()) << what;
    double err = 0.0, naive_err = 0.0, scale = 1.0;
    size_t worst = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_TRUE(std::isfinite(got[i])) << what << " element " << i << " is not finite";
        const double e = std::abs(static_cast<double>(got[i]) - ref64[i]);
        if (e > err) {
            err = e;
            worst = i;
        }
        naive_err = std::max(naive_err, std::abs(static_cast<double>(naive32[i]) - ref64[i]));
        scale = std::max(scale, std::abs(ref64[i]));
    }
    EXPECT_LE(err, 2.0 * naive_err + 1e-6 * scale)
        << what << ": worst element " << worst << " got " << got[worst] << " want " << ref64[worst]
        << " (naive fp32 error " << naive_err << ")";
}

template <typename R>
std::vector<R> cast_vec(const FloatVec& v) {
    return std::vector<R>(v.begin(), v.end());
}

double project(const FloatVec& out, const FloatVec& r) {
    double sum = 0.0;
    for (size_t i = 0; i < out.size(); ++i) sum += static_cast<double>(out[i]) * r[i];
    return sum;
}

constexpr double kFdStep = 1e-2;
constexpr double kGradRtol = 2e-3;
constexpr double kGradAtol = 2e-4;

// Central differences of loss() with respect to every element of x (restored afterwards).
void check_grad(const std::string& what, FloatVec& x, const FloatVec& analytic, const std::function<double()>& loss) {
    ASSERT_EQ(x.size(), analytic.size()) << what;
    int failures = 0;
    for (size_t j = 0; j < x.size(); ++j) {
        const float saved = x[j];
        const float plus = static_cast<float>(saved + kFdStep), minus = static_cast<float>(saved - kFdStep);
        x[j] = plus;
        const double loss_plus = loss();
        x[j] = minus;
        const double loss_minus = loss();
        x[j] = saved;
        const double numeric = (loss_plus - loss_minus) / (static_cast<double>(plus) - static_cast<double>(minus));
        const double a = analytic[j];
        const double tol = kGradRtol * std::max(std::abs(a), std::abs(numeric)) + kGradAtol;
        if (!(std::abs(a - numeric) <= tol) && failures++ < 5)
            ADD_FAILURE() << what << "[" << j << "]: analytic " << a << " numeric " << numeric;
    }
    EXPECT_EQ(failures, 0) << what << ": " << failures << " of " << x.size() << " elements out of tolerance";
}

FloatVec minus(const FloatVec& after, const FloatVec& before) {
    FloatVec d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
    return d;
}

// A parameter gradient of a packed run against the separate runs' (each from zero): every run rounds
// its double sum over tokens to fp32 once, so they differ by at most half an ulp of each sum.
void expect_parameter_sum(const std::string& what, const FloatVec& packed, const std::vector<FloatVec>& parts) {
    for (size_t i = 0; i < packed.size(); ++i) {
        double sum = 0.0, magnitude = std::abs(packed[i]);
        for (const FloatVec& p : parts) {
            sum += p[i];
            magnitude += std::abs(p[i]);
        }
        EXPECT_LE(std::abs(packed[i] - sum), 0x1p-23 * magnitude + 1e-30)
            << what << "[" << i << "]: packed " << packed[i] << ", documents alone " << sum;
    }
}

// Whether tokens s <= t (flat indices) share a row of T and a run of one document id.
bool same_segment(const IdVec& doc, int64_t T, int64_t s, int64_t t) {
    if (s / T != t / T) return false;
    for (int64_t r = s + 1; r <= t; ++r)
        if (!doc.empty() && doc[r] != doc[r - 1]) return false;
    return true;
}

// The documents of one packed row: lengths 5, 1, 7 (a one-token document in the middle), arbitrary ids.
const std::vector<int64_t> kDocLengths = {5, 1, 7};
IdVec packed_doc_ids() {
    const int32_t ids[] = {11, 4, 9};
    IdVec doc;
    for (size_t d = 0; d < kDocLengths.size(); ++d) doc.insert(doc.end(), kDocLengths[d], ids[d]);
    return doc;
}

template <typename Fn>
void expect_error(const std::string& what, const std::string& substring, Fn&& call) {
    try {
        call();
        ADD_FAILURE() << what << ": accepted";
    } catch (const mf::Error& e) {
        EXPECT_NE(std::string(e.what()).find(substring), std::string::npos)
            << what << ": message \"" << e.what() << "\" does not say \"" << substring << "\"";
    }
}

// ---------------------------------------------------------------------------------------------
// conv1d_silu

struct ConvCase {
    int64_t B, T, C, K;
    bool bias;
};

struct ConvData {
    FloatVec inp, weight, bias;
    IdVec doc;
};

ConvData make_conv(std::mt19937& rng, const ConvCase& c, IdVec doc) {
    ConvData d{random_vec(rng, c.B * c.T * c.C), random_vec(rng, c.C * c.K), {}, std::move(doc)};
    if (c.bias) d.bias = random_vec(rng, c.C, -0.5f, 0.5f);
    return d;
}

FloatVec conv_forward(const ConvCase& c, ConvData& d) {
    const int64_t N = c.B * c.T;
    FloatVec out(N * c.C, kNaN);
    mf::ops::conv1d_silu_forward(view(out, {N, c.C}), view(d.inp, {N, c.C}), view(d.weight, {c.C, 1, c.K}),
                                 c.bias ? view(d.bias, {c.C}) : Tensor(), doc_view(d.doc), c.T);
    return out;
}

struct ConvGrads {
    FloatVec dinp, dweight, dbias;
};

// dweight, dbias start from `start` (accumulated into).
ConvGrads conv_backward(const ConvCase& c, ConvData& d, FloatVec& dout, const ConvGrads& start) {
    const int64_t N = c.B * c.T;
    ConvGrads g{FloatVec(N * c.C, kNaN), start.dweight, start.dbias};
    mf::ops::conv1d_silu_backward(view(g.dinp, {N, c.C}), view(g.dweight, {c.C, c.K}),
                                  c.bias ? view(g.dbias, {c.C}) : Tensor(), view(dout, {N, c.C}), view(d.inp, {N, c.C}),
                                  view(d.weight, {c.C, c.K}), c.bias ? view(d.bias, {c.C}) : Tensor(), doc_view(d.doc),
                                  c.T);
    return g;
}

ConvGrads conv_zero_grads(const ConvCase& c) {
    return {{}, FloatVec(c.C * c.K, 0.0f), FloatVec(c.bias ? c.C : 0, 0.0f)};
}

template <typename R>
std::vector<R> ref_conv(const ConvCase& c, const ConvData& d) {
    const int64_t N = c.B * c.T;
    std::vector<R> out(N * c.C);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t ch = 0; ch < c.C; ++ch) {
            R acc = c.bias ? R(d.bias[ch]) : R(0);
            for (int64_t j = 0; j < c.K; ++j) {
                const int64_t m = n - (c.K - 1) + j;
                if (m < 0 || !same_segment(d.doc, c.T, m, n)) continue;
                acc += R(d.weight[ch * c.K + j]) * R(d.inp[m * c.C + ch]);
            }
            out[n * c.C + ch] = acc / (R(1) + std::exp(-acc));
        }
    }
    return out;
}

TEST(Conv1dSilu, ForwardMatchesNaiveReference) {
    std::mt19937 rng(10);
    const ConvCase cases[] = {{1, 13, 5, 4, true}, {2, 6, 3, 3, false}, {3, 4, 7, 1, true}, {1, 5, 2, 7, true}};
    for (const ConvCase& c : cases) {
        for (const bool docs : {false, true}) {
            IdVec doc;
            if (docs) {
                for (int64_t n = 0; n < c.B * c.T; ++n) doc.push_back(static_cast<int32_t>(n / 3 + (n % 5 == 4)));
            }
            ConvData d = make_conv(rng, c, doc);
            const std::string what = "conv T=" + std::to_string(c.T) + " C=" + std::to_string(c.C) +
                                     " K=" + std::to_string(c.K) + (docs ? " docs" : "");
            expect_within_rule(what, conv_forward(c, d), ref_conv<double>(c, d), ref_conv<float>(c, d));
        }
    }
}

TEST(Conv1dSilu, GradientsMatchFiniteDifferences) {
    std::mt19937 rng(11);
    const ConvCase cases[] = {{2, 6, 3, 4, true}, {1, 7, 4, 3, false}, {1, 5, 2, 1, true}};
    for (const ConvCase& c : cases) {
        const int64_t N = c.B * c.T;
        IdVec doc(N);
        for (int64_t n = 0; n < N; ++n) doc[n] = static_cast<int32_t>(n >= 2 && n < 4 ? 1 : 0);  // a reset in row 0
        ConvData d = make_conv(rng, c, doc);
        FloatVec r = random_vec(rng, N * c.C);
        const ConvGrads start{{}, random_vec(rng, c.C * c.K), random_vec(rng, c.bias ? c.C : 0)};
        const ConvGrads g = conv_backward(c, d, r, start);
        expect_finite(g.dinp, "dinp");
        auto loss = [&] { return project(conv_forward(c, d), r); };
        const std::string what = "conv K=" + std::to_string(c.K);
        check_grad(what + " dinp", d.inp, g.dinp, loss);
        check_grad(what + " dweight", d.weight, minus(g.dweight, start.dweight), loss);
        if (c.bias) check_grad(what + " dbias", d.bias, minus(g.dbias, start.dbias), loss);
    }
}

// A packed row equals its documents run alone; rows of one id never mix.
TEST(Conv1dSilu, DocumentsAndRowsAreIndependent) {
    std::mt19937 rng(12);
    const ConvCase packed{1, 13, 4, 4, true};
    ConvData d = make_conv(rng, packed, packed_doc_ids());
    FloatVec r = random_vec(rng, 13 * packed.C);
    const FloatVec out = conv_forward(packed, d);
    const ConvGrads g = conv_backward(packed, d, r, conv_zero_grads(packed));
    std::vector<FloatVec> dweights, dbiases;
    int64_t begin = 0;
    for (const int64_t len : kDocLengths) {
        const ConvCase alone{1, len, packed.C, packed.K, true};
        ConvData a{row_range(d.inp, packed.C, begin, begin + len), d.weight, d.bias, {}};
        FloatVec ra = row_range(r, packed.C, begin, begin + len);
        const std::string what = "document of " + std::to_string(len) + " tokens";
        expect_bits(row_range(out, packed.C, begin, begin + len), conv_forward(alone, a), what + ": out");
        const ConvGrads ga = conv_backward(alone, a, ra, conv_zero_grads(alone));
        expect_bits(row_range(g.dinp, packed.C, begin, begin + len), ga.dinp, what + ": dinp");
        dweights.push_back(ga.dweight);
        dbiases.push_back(ga.dbias);
        begin += len;
    }
    expect_parameter_sum("dweight", g.dweight, dweights);
    expect_parameter_sum("dbias", g.dbias, dbiases);
    ConvData leaky = d;
    leaky.doc.clear();
    EXPECT_NE(conv_forward(packed, leaky), out) << "the documents matter (else the test proves nothing)";

    // Three rows, all of one document id: each row is the same computation as that row alone.
    const ConvCase rows{3, 5, 3, 3, true};
    for (const bool with_ids : {false, true}) {
        ConvData rd = make_conv(rng, rows, with_ids ? IdVec(15, 7) : IdVec());
        const FloatVec rout = conv_forward(rows, rd);
        FloatVec rr = random_vec(rng, 15 * rows.C);
        const ConvGrads rg = conv_backward(rows, rd, rr, conv_zero_grads(rows));
        for (int64_t b = 0; b < rows.B; ++b) {
            const ConvCase one{1, rows.T, rows.C, rows.K, true};
            ConvData a{row_range(rd.inp, rows.C, b * 5, b * 5 + 5), rd.weight, rd.bias, {}};
            FloatVec ra = row_range(rr, rows.C, b * 5, b * 5 + 5);
            expect_bits(row_range(rout, rows.C, b * 5, b * 5 + 5), conv_forward(one, a), "row " + std::to_string(b));
            expect_bits(row_range(rg.dinp, rows.C, b * 5, b * 5 + 5),
                        conv_backward(one, a, ra, conv_zero_grads(one)).dinp, "row " + std::to_string(b) + " dinp");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// ssd_scan

struct ScanCase {
    int64_t B, T, H, P, G, S;
    float dt_min, dt_max;
    int64_t N() const { return B * T; }
    int64_t I() const { return H * P; }
    int64_t width() const { return H * P + 2 * G * S; }
    mf::ops::SsdDims dims() const { return {T, H, P, G, S, 4, dt_min, dt_max}; }
};

struct ScanData {
    FloatVec xbc, dt, dt_bias, A_log, D;
    IdVec doc;
};

double softplus64(double u) { return u > 20.0 ? u : std::log1p(std::exp(u)); }

// Moves every raw dt at least `margin` (in softplus output) away from the clamp's kinks.
void keep_off_clamp_kinks(const ScanCase& c, ScanData& d, double margin) {
    for (int64_t n = 0; n < c.N(); ++n) {
        for (int64_t h = 0; h < c.H; ++h) {
            float& dt = d.dt[n * c.H + h];
            for (int guard = 0; guard < 100; ++guard) {
                const double sp = softplus64(static_cast<double>(dt) + d.dt_bias[h]);
                if (std::abs(sp - c.dt_min) > margin && (std::isinf(c.dt_max) || std::abs(sp - c.dt_max) > margin))
                    break;
                dt += 0.125f;
            }
        }
    }
}

ScanData make_scan(std::mt19937& rng, const ScanCase& c, IdVec doc) {
    ScanData d{random_vec(rng, c.N() * c.width()),
               random_vec(rng, c.N() * c.H, -3.0f, 2.0f),
               random_vec(rng, c.H, -0.5f, 0.5f),
               random_vec(rng, c.H, -1.0f, 0.7f),
               random_vec(rng, c.H),
               std::move(doc)};
    keep_off_clamp_kinks(c, d, 0.05);
    return d;
}

FloatVec scan_forward(const ScanCase& c, ScanData& d) {
    const int64_t N = c.N(), H = c.H;
    FloatVec y(N * c.I(), kNaN), states(mf::ops::ssd_chunk_states_numel(N, c.dims()));
    mf::ops::ssd_scan_forward(view(y, {N, c.I()}), view(states, {int64_t(states.size())}), view(d.xbc, {N, c.width()}),
                              view(d.dt, {N, H}), view(d.dt_bias, {H}), view(d.A_log, {H}), view(d.D, {H}),
                              doc_view(d.doc), c.dims());
    return y;
}

struct ScanGrads {
    FloatVec dxbc, ddt, ddt_bias, dA_log, dD;
};

ScanGrads scan_zero_grads(const ScanCase& c) {
    return {{}, {}, FloatVec(c.H, 0.0f), FloatVec(c.H, 0.0f), FloatVec(c.H, 0.0f)};
}

// ddt_bias, dA_log, dD start from `start` (accumulated into).
ScanGrads scan_backward(const ScanCase& c, ScanData& d, FloatVec& dy, const ScanGrads& start) {
    const int64_t N = c.N(), H = c.H;
    ScanGrads g{FloatVec(N * c.width(), kNaN), FloatVec(N * H, kNaN), start.ddt_bias, start.dA_log, start.dD};
    FloatVec states(mf::ops::ssd_chunk_states_numel(N, c.dims()));
    mf::ops::ssd_scan_backward(view(g.dxbc, {N, c.width()}), view(g.ddt, {N, H}), view(g.ddt_bias, {H}),
                               view(g.dA_log, {H}), view(g.dD, {H}), view(dy, {N, c.I()}), view(d.xbc, {N, c.width()}),
                               view(d.dt, {N, H}), view(d.dt_bias, {H}), view(d.A_log, {H}), view(d.D, {H}),
                               view(states, {int64_t(states.size())}), doc_view(d.doc), c.dims());
    return g;
}

// The scan as an explicit sum over the earlier tokens of the segment (no recurrence):
//   y_t[p] = Σ_{s<=t, same segment} (C_t·B_s) · exp(A · Σ_{s<r<=t} δ_r) · δ_s · x_s[p] + D · x_t[p]
template <typename R>
std::vector<R> ref_scan(const ScanCase& c, const ScanData& d) {
    const int64_t N = c.N(), W = c.width(), I = c.I(), heads_per_group = c.H / c.G;
    std::vector<R> y(N * I);
    std::vector<R> delta(N * c.H);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t h = 0; h < c.H; ++h) {
            const R u = R(d.dt[n * c.H + h]) + R(d.dt_bias[h]);
            const R sp = u > R(20) ? u : std::log1p(std::exp(u));
            delta[n * c.H + h] = std::min(std::max(sp, R(c.dt_min)), R(c.dt_max));
        }
    }
    for (int64_t t = 0; t < N; ++t) {
        for (int64_t h = 0; h < c.H; ++h) {
            const int64_t g = h / heads_per_group;
            const R A = -std::exp(R(d.A_log[h]));
            const float* Ct = d.xbc.data() + t * W + I + c.G * c.S + g * c.S;
            for (int64_t p = 0; p < c.P; ++p) {
                R acc = R(0);
                for (int64_t s = t; s >= 0 && same_segment(d.doc, c.T, s, t); --s) {
                    const float* Bs = d.xbc.data() + s * W + I + g * c.S;
                    R cb = R(0);
                    for (int64_t k = 0; k < c.S; ++k) cb += R(Ct[k]) * R(Bs[k]);
                    R decay_sum = R(0);
                    for (int64_t r = s + 1; r <= t; ++r) decay_sum += delta[r * c.H + h];
                    acc += cb * std::exp(A * decay_sum) * delta[s * c.H + h] * R(d.xbc[s * W + h * c.P + p]);
                }
                y[t * I + h * c.P + p] = acc + R(d.D[h]) * R(d.xbc[t * W + h * c.P + p]);
            }
        }
    }
    return y;
}

// The geometries: G = 1 and G > 1, P and S not powers of two, clamps on both sides, one side, none.
const ScanCase kScanCases[] = {
    {1, 9, 2, 3, 1, 5, 0.2f, 1.5f},      // G = 1, both clamps active
    {2, 6, 6, 2, 3, 3, 0.0f, INFINITY},  // G = 3 (two heads a group), no clamp (HF's kernel path)
    {1, 7, 3, 5, 3, 7, 0.1f, INFINITY},  // G = H, lower clamp only (HF's torch path)
    {2, 5, 4, 3, 2, 6, 0.05f, 0.9f},     // B = 2, G = 2
};

IdVec scan_case_docs(const ScanCase& c) {  // a document boundary inside row 0 when T allows
    IdVec doc(c.N(), 0);
    for (int64_t n = 0; n < c.N(); ++n) doc[n] = static_cast<int32_t>(n % c.T >= c.T / 2 + 1 ? 1 : 0);
    return doc;
}

TEST(SsdScan, ForwardMatchesNaiveReference) {
    std::mt19937 rng(20);
    for (const ScanCase& c : kScanCases) {
        for (const bool docs : {false, true}) {
            ScanData d = make_scan(rng, c, docs ? scan_case_docs(c) : IdVec());
            const std::string what = "scan H=" + std::to_string(c.H) + " P=" + std::to_string(c.P) +
                                     " G=" + std::to_string(c.G) + " S=" + std::to_string(c.S) + (docs ? " docs" : "");
            expect_within_rule(what, scan_forward(c, d), ref_scan<double>(c, d), ref_scan<float>(c, d));
        }
    }
}

TEST(SsdScan, GradientsMatchFiniteDifferences) {
    std::mt19937 rng(21);
    for (const ScanCase& c : kScanCases) {
        ScanData d = make_scan(rng, c, scan_case_docs(c));
        int clamped = 0, free = 0;
        for (int64_t n = 0; n < c.N(); ++n) {
            for (int64_t h = 0; h < c.H; ++h) {
                const double sp = softplus64(static_cast<double>(d.dt[n * c.H + h]) + d.dt_bias[h]);
                (sp < c.dt_min || sp > c.dt_max ? clamped : free) += 1;
            }
        }
        if (c.dt_min > 0.0f) {
            ASSERT_GT(clamped, 0) << "the clamp is active on some elements";
        }
        ASSERT_GT(free, 0);
        FloatVec r = random_vec(rng, c.N() * c.I());
        const ScanGrads start{{}, {}, random_vec(rng, c.H), random_vec(rng, c.H), random_vec(rng, c.H)};
        const ScanGrads g = scan_backward(c, d, r, start);
        expect_finite(g.dxbc, "dxbc");
        expect_finite(g.ddt, "ddt");
        int zero_ddt = 0;
        for (const float v : g.ddt) zero_ddt += v == 0.0f;
        EXPECT_EQ(zero_ddt, clamped) << "ddt is zero exactly where the clamp holds";
        auto loss = [&] { return project(scan_forward(c, d), r); };
        const std::string what = "scan H=" + std::to_string(c.H) + " G=" + std::to_string(c.G);
        check_grad(what + " dxbc", d.xbc, g.dxbc, loss);
        check_grad(what + " ddt", d.dt, g.ddt, loss);
        check_grad(what + " ddt_bias", d.dt_bias, minus(g.ddt_bias, start.ddt_bias), loss);
        check_grad(what + " dA_log", d.A_log, minus(g.dA_log, start.dA_log), loss);
        check_grad(what + " dD", d.D, minus(g.dD, start.dD), loss);
    }
}

TEST(SsdScan, DocumentsAndRowsAreIndependent) {
    std::mt19937 rng(22);
    const ScanCase packed{1, 13, 4, 3, 2, 5, 0.1f, 2.0f};
    ScanData d = make_scan(rng, packed, packed_doc_ids());
    FloatVec r = random_vec(rng, 13 * packed.I());
    const FloatVec y = scan_forward(packed, d);
    const ScanGrads g = scan_backward(packed, d, r, scan_zero_grads(packed));
    const int64_t W = packed.width(), I = packed.I(), H = packed.H;
    std::vector<FloatVec> ddt_bias, dA_log, dD;
    int64_t begin = 0;
    for (const int64_t len : kDocLengths) {
        ScanCase alone = packed;
        alone.T = len;
        ScanData a{row_range(d.xbc, W, begin, begin + len),
                   row_range(d.dt, H, begin, begin + len),
                   d.dt_bias,
                   d.A_log,
                   d.D,
                   {}};
        FloatVec ra = row_range(r, I, begin, begin + len);
        const std::string what = "document of " + std::to_string(len) + " tokens";
        expect_bits(row_range(y, I, begin, begin + len), scan_forward(alone, a), what + ": y");
        const ScanGrads ga = scan_backward(alone, a, ra, scan_zero_grads(alone));
        expect_bits(row_range(g.dxbc, W, begin, begin + len), ga.dxbc, what + ": dxbc");
        expect_bits(row_range(g.ddt, H, begin, begin + len), ga.ddt, what + ": ddt");
        ddt_bias.push_back(ga.ddt_bias);
        dA_log.push_back(ga.dA_log);
        dD.push_back(ga.dD);
        begin += len;
    }
    expect_parameter_sum("ddt_bias", g.ddt_bias, ddt_bias);
    expect_parameter_sum("dA_log", g.dA_log, dA_log);
    expect_parameter_sum("dD", g.dD, dD);
    ScanData leaky = d;
    leaky.doc.clear();
    EXPECT_NE(scan_forward(packed, leaky), y) << "the documents matter (else the test proves nothing)";

    // Three rows, all of one document id (and without ids): each row is that row run alone.
    const ScanCase rows{3, 6, 2, 3, 1, 4, 0.0f, INFINITY};
    for (const bool with_ids : {false, true}) {
        ScanData rd = make_scan(rng, rows, with_ids ? IdVec(18, 7) : IdVec());
        const FloatVec ry = scan_forward(rows, rd);
        FloatVec rr = random_vec(rng, 18 * rows.I());
        const ScanGrads rg = scan_backward(rows, rd, rr, scan_zero_grads(rows));
        for (int64_t b = 0; b < rows.B; ++b) {
            ScanCase one = rows;
            one.B = 1;
            ScanData a{row_range(rd.xbc, rows.width(), b * 6, b * 6 + 6),
                       row_range(rd.dt, rows.H, b * 6, b * 6 + 6),
                       rd.dt_bias,
                       rd.A_log,
                       rd.D,
                       {}};
            FloatVec ra = row_range(rr, rows.I(), b * 6, b * 6 + 6);
            const std::string what = "row " + std::to_string(b) + (with_ids ? " (one id)" : "");
            expect_bits(row_range(ry, rows.I(), b * 6, b * 6 + 6), scan_forward(one, a), what + ": y");
            const ScanGrads ga = scan_backward(one, a, ra, scan_zero_grads(one));
            expect_bits(row_range(rg.dxbc, rows.width(), b * 6, b * 6 + 6), ga.dxbc, what + ": dxbc");
            expect_bits(row_range(rg.ddt, rows.H, b * 6, b * 6 + 6), ga.ddt, what + ": ddt");
        }
    }
}

TEST(SsdScan, ChunkStatesNumel) {
    mf::ops::SsdDims d{10, 3, 4, 1, 5, 4, 0.0f, INFINITY};
    EXPECT_EQ(mf::ops::ssd_chunk_states_numel(20, d), 2 * 3 * 3 * 4 * 5) << "B = 2 rows of ceil(10/4) = 3 chunks";
    d.chunk_size = 10;
    EXPECT_EQ(mf::ops::ssd_chunk_states_numel(10, d), 1 * 1 * 3 * 4 * 5);
    expect_error("N not a multiple of T", "does not divide the N = 15 tokens",
                 [&] { mf::ops::ssd_chunk_states_numel(15, d); });
    d.chunk_size = 0;
    expect_error("chunk 0", "chunk_size >= 1", [&] { mf::ops::ssd_chunk_states_numel(10, d); });
}

// ---------------------------------------------------------------------------------------------
// gated_rmsnorm

struct NormCase {
    int64_t N, I, group_size;
};

template <typename R>
std::vector<R> ref_gated_rmsnorm(const NormCase& c, const FloatVec& x, const FloatVec& z, const FloatVec& w,
                                 float eps) {
    std::vector<R> out(c.N * c.I);
    std::vector<R> g(c.group_size);
    for (int64_t n = 0; n < c.N; ++n) {
        for (int64_t k = 0; k < c.I / c.group_size; ++k) {
            R ss = R(0);
            for (int64_t j = 0; j < c.group_size; ++j) {
                const int64_t i = n * c.I + k * c.group_size + j;
                const R zi = R(z[i]);
                g[j] = R(x[i]) * zi / (R(1) + std::exp(-zi));
                ss += g[j] * g[j];
            }
            const R rstd = R(1) / std::sqrt(ss / R(c.group_size) + R(eps));
            for (int64_t j = 0; j < c.group_size; ++j)
                out[n * c.I + k * c.group_size + j] = R(w[k * c.group_size + j]) * (g[j] * rstd);
        }
    }
    return out;
}

FloatVec norm_forward(const NormCase& c, FloatVec& x, FloatVec& z, FloatVec& w, float eps,
                      FloatVec* rstd_out = nullptr) {
    FloatVec out(c.N * c.I, kNaN), rstd(c.N * c.I / c.group_size, kNaN);
    mf::ops::gated_rmsnorm_forward(view(out, {c.N, c.I}), view(rstd, {int64_t(rstd.size())}), view(x, {c.N, c.I}),
                                   view(z, {c.N, c.I}), view(w, {c.I}), c.group_size, eps);
    if (rstd_out != nullptr) *rstd_out = rstd;
    return out;
}

TEST(GatedRmsnorm, ForwardMatchesNaiveReference) {
    std::mt19937 rng(30);
    const float eps = 1e-5f;
    for (const NormCase& c : {NormCase{5, 12, 4}, NormCase{3, 24, 24}, NormCase{4, 30, 10}, NormCase{2, 9, 1}}) {
        FloatVec x = random_vec(rng, c.N * c.I, -2.0f, 2.0f), z = random_vec(rng, c.N * c.I, -3.0f, 3.0f);
        FloatVec w = random_vec(rng, c.I, 0.5f, 1.5f), rstd;
        const FloatVec out = norm_forward(c, x, z, w, eps, &rstd);
        const std::string what = "gated_rmsnorm I=" + std::to_string(c.I) + " group=" + std::to_string(c.group_size);
        expect_within_rule(what, out, ref_gated_rmsnorm<double>(c, x, z, w, eps),
                           ref_gated_rmsnorm<float>(c, x, z, w, eps));
        expect_finite(rstd, what + " rstd");
    }
}

TEST(GatedRmsnorm, GradientsMatchFiniteDifferences) {
    std::mt19937 rng(31);
    const float eps = 1e-5f;
    for (const NormCase& c : {NormCase{3, 12, 4}, NormCase{2, 10, 5}, NormCase{2, 6, 6}}) {
        // |x| in [0.5, 2] keeps every group's RMS of g = x·silu(z) O(1): the norm's curvature grows with
        // rstd, and with rstd ~ 10 the 1e-2 step's truncation error alone exceeds the pass rule.
        FloatVec x = random_vec(rng, c.N * c.I, 0.5f, 2.0f), z = random_vec(rng, c.N * c.I, -3.0f, 3.0f);
        for (size_t i = 0; i < x.size(); i += 2) x[i] = -x[i];
        FloatVec w = random_vec(rng, c.I, 0.5f, 1.5f), r = random_vec(rng, c.N * c.I), rstd;
        norm_forward(c, x, z, w, eps, &rstd);
        for (const float v : rstd) ASSERT_LT(v, 4.0f) << "a group of small g (the test's precondition)";
        FloatVec dx(c.N * c.I, kNaN), dz(c.N * c.I, kNaN), dw0 = random_vec(rng, c.I), dw = dw0;
        mf::ops::gated_rmsnorm_backward(view(dx, {c.N, c.I}), view(dz, {c.N, c.I}), view(dw, {c.I}),
                                        view(r, {c.N, c.I}), view(x, {c.N, c.I}), view(z, {c.N, c.I}), view(w, {c.I}),
                                        view(rstd, {int64_t(rstd.size())}), c.group_size);
        expect_finite(dx, "dx");
        expect_finite(dz, "dz");
        auto loss = [&] { return project(norm_forward(c, x, z, w, eps), r); };
        const std::string what = "gated_rmsnorm group=" + std::to_string(c.group_size);
        check_grad(what + " dx", x, dx, loss);
        check_grad(what + " dz", z, dz, loss);
        check_grad(what + " dweight", w, minus(dw, dw0), loss);
    }
}

// ---------------------------------------------------------------------------------------------
// bad arguments

TEST(Mamba2Ops, BadArgumentsAreRefusedBeforeAnythingIsWritten) {
    std::mt19937 rng(40);
    const ScanCase c{1, 6, 4, 2, 2, 3, 0.0f, INFINITY};
    ScanData d = make_scan(rng, c, IdVec(6, 0));
    const int64_t N = c.N(), H = c.H, W = c.width(), I = c.I();
    FloatVec y(N * I, 0.0f), states(mf::ops::ssd_chunk_states_numel(N, c.dims()), 0.0f);
    auto scan = [&](const mf::ops::SsdDims& dims, Tensor xbc, Tensor dt, Tensor st, Tensor doc) {
        mf::ops::ssd_scan_forward(view(y, {N, I}), st, xbc, dt, view(d.dt_bias, {H}), view(d.A_log, {H}),
                                  view(d.D, {H}), doc, dims);
    };
    const Tensor xbc = view(d.xbc, {N, W}), dt = view(d.dt, {N, H}), st = view(states, {int64_t(states.size())});
    mf::ops::SsdDims dims = c.dims();
    dims.num_groups = 3;
    expect_error("H % G != 0", "num_heads H = 4 is not a multiple of num_groups G = 3",
                 [&] { scan(dims, xbc, dt, st, doc_view(d.doc)); });
    dims = c.dims();
    dims.T = 4;
    expect_error("T does not divide N", "T = 4 tokens per row does not divide the N = 6 tokens",
                 [&] { scan(dims, xbc, dt, st, doc_view(d.doc)); });
    dims = c.dims();
    dims.dt_min = 2.0f;
    dims.dt_max = 1.0f;
    expect_error("empty clamp", "dt clamp", [&] { scan(dims, xbc, dt, st, doc_view(d.doc)); });
    expect_error("xbc width", "does not have rows of I + 2·G·S = 20", [&] {
        scan(c.dims(), view(d.xbc, {N * W / 10, 10}), dt, st, doc_view(d.doc));
    });
    expect_error("dt shape", "dt [6, 2, 2] must be [6, 4]", [&] {
        scan(c.dims(), xbc, view(d.dt, {N, 2, 2}), st, doc_view(d.doc));
    });
    FloatVec short_states(states.size() - 1);
    expect_error("states numel", "states",
                 [&] { scan(c.dims(), xbc, dt, view(short_states, {int64_t(short_states.size())}), doc_view(d.doc)); });
    expect_error("doc_ids size", "doc_ids [5] must be [6]",
                 [&] { scan(c.dims(), xbc, dt, st, Tensor(d.doc.data(), DType::i32, {5})); });
    expect_error("doc_ids dtype", "doc_ids is f32, expected i32",
                 [&] { scan(c.dims(), xbc, dt, st, Tensor(d.dt.data(), DType::f32, {6})); });
    expect_error("bf16 on the CPU", "xbc is bf16, expected f32", [&] {
        scan(c.dims(), Tensor(d.xbc.data(), DType::bf16, {N, W}), dt, st, doc_view(d.doc));
    });
    expect_error("mixed devices", "mixes cpu and cuda", [&] {
        scan(c.dims(), xbc, dt, Tensor(states.data(), DType::f32, {int64_t(states.size())}, Device::cuda),
             doc_view(d.doc));
    });
    expect_bits(y, FloatVec(N * I, 0.0f), "refused scans write nothing");

    const ConvCase cc{1, 6, 3, 4, true};
    ConvData cd = make_conv(rng, cc, {});
    FloatVec out(N * cc.C, 0.0f), empty_weight;
    expect_error("conv K = 0", "and K >= 1", [&] {
        mf::ops::conv1d_silu_forward(view(out, {N, 3}), view(cd.inp, {N, 3}),
                                     Tensor(cd.weight.data(), DType::f32, {3, 0}), Tensor(), Tensor(), 6);
    });
    expect_error("conv weight channels", "must be [C, K] or [C, 1, K] with C = 3", [&] {
        mf::ops::conv1d_silu_forward(view(out, {N, 3}), view(cd.inp, {N, 3}), view(cd.weight, {4, 3}), Tensor(),
                                     Tensor(), 6);
    });
    expect_error("conv bias size", "bias [2] must hold 3 elements", [&] {
        mf::ops::conv1d_silu_forward(view(out, {N, 3}), view(cd.inp, {N, 3}), view(cd.weight, {3, 4}),
                                     Tensor(cd.bias.data(), DType::f32, {2}), Tensor(), 6);
    });
    FloatVec dinp(N * 3), dw(12), db(3), dout = random_vec(rng, N * 3);
    expect_error("conv dbias without bias", "dbias given for a conv without a bias", [&] {
        mf::ops::conv1d_silu_backward(view(dinp, {N, 3}), view(dw, {3, 4}), view(db, {3}), view(dout, {N, 3}),
                                      view(cd.inp, {N, 3}), view(cd.weight, {3, 4}), Tensor(), Tensor(), 6);
    });
    expect_bits(out, FloatVec(N * 3, 0.0f), "refused convs write nothing");

    FloatVec x = random_vec(rng, 2 * 12), z = random_vec(rng, 2 * 12), w = random_vec(rng, 12), nout(24, 0.0f),
             rstd(6, 0.0f);
    expect_error("group_size does not divide I", "group_size 5 does not divide the weight's I = 12", [&] {
        mf::ops::gated_rmsnorm_forward(view(nout, {2, 12}), view(rstd, {6}), view(x, {2, 12}), view(z, {2, 12}),
                                       view(w, {12}), 5, 1e-5f);
    });
    expect_error("rstd size", "rstd [6] must hold 8 elements", [&] {
        mf::ops::gated_rmsnorm_forward(view(nout, {2, 12}), view(rstd, {6}), view(x, {2, 12}), view(z, {2, 12}),
                                       view(w, {12}), 3, 1e-5f);
    });
    expect_error("z shape", "z [2, 6, 2] must be [2, 12]", [&] {
        mf::ops::gated_rmsnorm_forward(view(nout, {2, 12}), view(rstd, {6}), view(x, {2, 12}), view(z, {2, 6, 2}),
                                       view(w, {12}), 4, 1e-5f);
    });
    expect_bits(nout, FloatVec(24, 0.0f), "refused norms write nothing");
}

// ---------------------------------------------------------------------------------------------
// a build without CUDA

TEST(Mamba2Ops, CudaTensorsNeedACudaBuild) {
#ifdef MOEFORGE_WITH_CUDA
    GTEST_SKIP() << "built with CUDA: CUDA tensors are the GPU tests' (tests/gpu)";
#else
    // Views of host memory that claim to live on the GPU (bf16 activations, f32 and bf16 parameters):
    // the checks pass, then the op refuses with the one "built without CUDA" message.
    alignas(256) static unsigned char memory[1 << 16];
    auto t = [](DType dtype, Shape shape) { return Tensor(memory, dtype, std::move(shape), Device::cuda); };
    const mf::ops::SsdDims dims{4, 2, 2, 1, 3, 4, 0.0f, INFINITY};  // I = 4, xbc width 4 + 6 = 10
    const Tensor xbc = t(DType::bf16, {4, 10}), dt = t(DType::bf16, {4, 2}), y = t(DType::bf16, {4, 4});
    const Tensor p32 = t(DType::f32, {2}), p16 = t(DType::bf16, {2}), ids = t(DType::i32, {4});
    const Tensor states = t(DType::f32, {mf::ops::ssd_chunk_states_numel(4, dims)});
    const Tensor w = t(DType::bf16, {10, 1, 4}), b = t(DType::f32, {10}), nw = t(DType::f32, {4});
    const Tensor rstd = t(DType::f32, {8});
    const std::string no_cuda =
        "this moeforge was built without CUDA (MOEFORGE_CUDA=OFF): device tensors are not supported";
    auto refused = [&](const char* op, const std::function<void()>& call) {
        try {
            call();
            ADD_FAILURE() << op << " accepted a CUDA tensor in a build without CUDA";
        } catch (const mf::Error& e) {
            EXPECT_EQ(std::string(e.what()), no_cuda) << op;
        }
    };
    refused("conv1d_silu_forward", [&] { mf::ops::conv1d_silu_forward(xbc, xbc, w, b, ids, 4); });
    refused("conv1d_silu_backward", [&] { mf::ops::conv1d_silu_backward(xbc, w, b, xbc, xbc, w, b, ids, 4); });
    refused("ssd_scan_forward", [&] { mf::ops::ssd_scan_forward(y, states, xbc, dt, p32, p16, p32, ids, dims); });
    refused("ssd_scan_backward", [&] {
        mf::ops::ssd_scan_backward(xbc, dt, p32, p16, p32, y, xbc, dt, p32, p16, p32, states, Tensor(), dims);
    });
    refused("gated_rmsnorm_forward", [&] { mf::ops::gated_rmsnorm_forward(y, rstd, y, y, nw, 2, 1e-5f); });
    refused("gated_rmsnorm_backward", [&] { mf::ops::gated_rmsnorm_backward(y, y, nw, y, y, y, nw, rstd, 2); });
#endif
}

}  // namespace
