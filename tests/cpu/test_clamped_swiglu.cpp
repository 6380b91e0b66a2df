// gpt-oss's clamped, interleaved SwiGLU (ops::clamped_swiglu_*) on the CPU:
//   forward   against transformers' GptOssExperts formula evaluated here in fp64, on values inside
//             and beyond the clamps (gate above limit, up below −limit and above limit), with the
//             default alpha/limit and others; NaN propagates as through torch.clamp
//   backward  against central finite differences of Σ dout · out through the op's own fp32 forward
//             (points within 2h of a clamp's edge skipped: the difference would straddle the kink);
//             clamped inputs get exactly zero gradient; dinp aliasing inp equals out of place
//   refusals  a [N, 2I] input that is not twice the output's width, non-finite alpha or limit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/tensor.h"
#include "ops/ops.h"

namespace {

using mf::DType;
using mf::Shape;
using mf::Tensor;

Tensor view(std::vector<float>& v, Shape shape) { return Tensor(v.data(), DType::f32, std::move(shape)); }

double reference(double gate, double up, double alpha, double limit) {
    const double g = std::min(gate, limit);
    const double u = std::max(-limit, std::min(up, limit));
    return (u + 1.0) * g / (1.0 + std::exp(-alpha * g));
}

struct Case {
    int64_t N, I;
    float alpha, limit;
};

std::vector<float> inputs(std::mt19937& rng, const Case& c) {
    std::uniform_real_distribution<float> dist(-1.6f * c.limit, 1.6f * c.limit);
    std::vector<float> x(static_cast<size_t>(c.N * 2 * c.I));
    for (float& v : x) v = dist(rng);
    return x;
}

TEST(ClampedSwiglu, ForwardMatchesTheGptOssFormulaInFp64) {
    std::mt19937 rng(3);
    for (const Case& c : {Case{5, 7, 1.702f, 7.0f}, Case{1, 1, 1.702f, 7.0f}, Case{3, 16, 0.5f, 2.0f}}) {
        std::vector<float> x = inputs(rng, c), y(static_cast<size_t>(c.N * c.I), -1.0f);
        mf::ops::clamped_swiglu_forward(view(y, {c.N, c.I}), view(x, {c.N, 2 * c.I}), c.alpha, c.limit);
        for (int64_t n = 0; n < c.N; ++n)
            for (int64_t i = 0; i < c.I; ++i) {
                const size_t at = static_cast<size_t>(n * 2 * c.I + 2 * i);
                const double want = reference(x[at], x[at + 1], c.alpha, c.limit);
                EXPECT_NEAR(y[static_cast<size_t>(n * c.I + i)], want, 4e-6 * (1.0 + std::fabs(want)))
                    << "N=" << c.N << " I=" << c.I << " row " << n << " column " << i;
            }
    }
    // The defaults are gpt-oss's: alpha 1.702, limit 7; gate 9 clamps to 7, up -8 to -7.
    std::vector<float> x = {9.0f, -8.0f, 1.0f, 0.5f}, y(2);
    mf::ops::clamped_swiglu_forward(view(y, {1, 2}), view(x, {1, 4}));
    EXPECT_NEAR(y[0], reference(7.0, -7.0, 1.702, 7.0), 1e-5);
    EXPECT_NEAR(y[1], reference(1.0, 0.5, 1.702, 7.0), 1e-6);
    std::vector<float> nan_in = {NAN, 0.5f, 1.0f, NAN}, nan_out(2);
    mf::ops::clamped_swiglu_forward(view(nan_out, {1, 2}), view(nan_in, {1, 4}));
    EXPECT_TRUE(std::isnan(nan_out[0]) && std::isnan(nan_out[1])) << "NaN passes the clamps, as torch.clamp";
}

TEST(ClampedSwiglu, BackwardMatchesFiniteDifferences) {
    std::mt19937 rng(4);
    const double h = 1e-2;
    for (const Case& c : {Case{4, 9, 1.702f, 7.0f}, Case{2, 8, 0.8f, 1.5f}}) {
        std::vector<float> x = inputs(rng, c);
        std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
        std::vector<float> dy(static_cast<size_t>(c.N * c.I)), dx(x.size(), -7.0f);
        for (float& v : dy) v = unit(rng);
        mf::ops::clamped_swiglu_backward(view(dx, {c.N, 2 * c.I}), view(dy, {c.N, c.I}), view(x, {c.N, 2 * c.I}),
                                         c.alpha, c.limit);
        auto objective = [&](std::vector<float>& at) {
            std::vector<float> y(dy.size());
            mf::ops::clamped_swiglu_forward(view(y, {c.N, c.I}), view(at, {c.N, 2 * c.I}), c.alpha, c.limit);
            double s = 0;
            for (size_t k = 0; k < y.size(); ++k) s += static_cast<double>(dy[k]) * y[k];
            return s;
        };
        int checked = 0, clamped = 0;
        for (size_t k = 0; k < x.size(); ++k) {
            const bool is_gate = k % 2 == 0;
            const double v = x[k];
            const bool outside = is_gate ? v > c.limit : std::fabs(v) > c.limit;
            if (outside) {
                EXPECT_EQ(dx[k], 0.0f) << "a clamped " << (is_gate ? "gate" : "up") << " gets no gradient";
                ++clamped;
                continue;
            }
            if (std::fabs(std::fabs(v) - c.limit) < 2 * h) continue;
            std::vector<float> plus = x, minus = x;
            plus[k] = static_cast<float>(v + h);
            minus[k] = static_cast<float>(v - h);
            const double fd = (objective(plus) - objective(minus)) / (plus[k] - minus[k]);
            EXPECT_NEAR(dx[k], fd, 2e-3 * (1.0 + std::fabs(fd))) << "element " << k << " = " << v;
            ++checked;
        }
        EXPECT_GT(checked, 10);
        EXPECT_GT(clamped, 0) << "the inputs reach beyond the clamps";
        std::vector<float> in_place = x;
        mf::ops::clamped_swiglu_backward(view(in_place, {c.N, 2 * c.I}), view(dy, {c.N, c.I}),
                                         view(in_place, {c.N, 2 * c.I}), c.alpha, c.limit);
        EXPECT_EQ(std::memcmp(in_place.data(), dx.data(), dx.size() * 4), 0) << "dinp aliasing inp";
    }
}

TEST(ClampedSwiglu, RefusesBadShapesAndParameters) {
    std::vector<float> x(12), y(4);
    auto refused = [](const std::function<void()>& f, const std::string& words) {
        try {
            f();
            ADD_FAILURE() << "accepted; expected a refusal naming " << words;
        } catch (const mf::Error& e) {
            EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
        }
    };
    refused([&] { mf::ops::clamped_swiglu_forward(view(y, {2, 2}), view(x, {2, 6})); }, "must be [N, 2I]");
    refused([&] { mf::ops::clamped_swiglu_forward(view(y, {2, 2}), view(x, {3, 4}), 1.0f, NAN); }, "must be finite");
    refused(
        [&] {
            mf::ops::clamped_swiglu_backward(view(x, {3, 4}), view(y, {2, 2}), view(x, {2, 6}));
        },
        "clamped_swiglu_backward");
}

}  // namespace
