// The sigmoid MoE router and the squared ReLU of ops.h on CUDA tensors against the same ops on CPU
// tensors (the reference kernels, kernels/cpu/router_sigmoid.h and relu2.h), through the dispatch
// and the glue of cuda_ops.cu. Geometries: Nemotron 3 Nano (E 128, K 6, one group), DeepSeek-V3
// (E 256, K 8, 8 groups, keep 4), small odd E, E = 1024 with 32 groups; correction bias absent, f32
// or bf16; masked_score −inf and 0.
// Tolerances (test_cuda_common.h): topk_idx exact (the rows are drawn so that no choice is within
// 1e-4 of flipping: σ may differ by an ulp of expf between the devices, nothing else does); scores
// elementwise fp32; topk_weight and dlogits the reduction rule with naive = ref (fp32 outputs of
// fp32 sums); relu2 the elementwise bf16 table. Exact ties (equal logits) must break the same way.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/tensor.h"
#include "ops/ops.h"
#include "test_cuda_common.h"

namespace {

using mf::Buffer;
using mf::Device;
using mf::DType;
using mf::Shape;
using mf::Tensor;
using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// One tensor's values on both devices: f32 on the CPU, gpu_dtype on the GPU.
struct Pair {
    Buffer host, device;
    Tensor cpu, gpu;
};

Pair both_devices(const std::vector<float>& v, const Shape& shape, DType gpu_dtype) {
    Pair p{Buffer(v.size() * 4, Device::cpu), Buffer(v.size() * mf::dtype_size(gpu_dtype), Device::cuda), {}, {}};
    p.cpu = p.host.as(DType::f32, shape);
    p.gpu = p.device.as(gpu_dtype, shape);
    std::memcpy(p.host.data(), v.data(), v.size() * 4);
    if (gpu_dtype == DType::bf16) {
        std::vector<uint16_t> bits(v.size());
        for (size_t i = 0; i < v.size(); ++i) bits[i] = mf::f32_to_bf16(v[i]);
        mf::ops::copy_from_host(p.gpu, bits.data());
    } else {
        mf::ops::copy_from_host(p.gpu, v.data());
    }
    return p;
}

// An output on both devices, each filled with NaN bytes (0xFF: -1 as i32), so a missed write shows.
Pair poisoned(size_t n, const Shape& shape, DType cpu_dtype, DType gpu_dtype) {
    Pair p{Buffer(n * mf::dtype_size(cpu_dtype), Device::cpu),
           Buffer(n * mf::dtype_size(gpu_dtype), Device::cuda),
           {},
           {}};
    p.cpu = p.host.as(cpu_dtype, shape);
    p.gpu = p.device.as(gpu_dtype, shape);
    std::memset(p.host.data(), 0xFF, p.host.nbytes());
    MF_CHECK_CUDA(cudaMemset(p.device.data(), 0xFF, p.device.nbytes()));
    return p;
}

std::vector<float> values(const Tensor& t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    if (t.dtype() == DType::bf16) {
        std::vector<uint16_t> bits(v.size());
        mf::ops::copy_to_host(bits.data(), t);
        for (size_t i = 0; i < v.size(); ++i) v[i] = mf::bf16_to_f32(bits[i]);
    } else {
        mf::ops::copy_to_host(v.data(), t);
    }
    return v;
}

std::vector<int32_t> indices(const Tensor& t) {
    std::vector<int32_t> v(static_cast<size_t>(t.numel()));
    mf::ops::copy_to_host(v.data(), t);
    return v;
}

// ---------------------------------------------------------------------------------------------
// router inputs without near-ties

struct Case {
    const char* what;
    int64_t N, E, K, n_group, topk_group;
    bool norm;
    float scale, masked;
    float bias_lo, bias_hi;
};

// True when, computed in fp64, the row's choice has a margin of at least `margin` everywhere it
// matters: between the topk_group-th and the next group score, and between neighbours among the
// K + 1 largest choice values (two masked experts tie exactly on both devices and may).
bool well_separated(const float* x, const std::vector<float>& bias, const Case& c, double margin) {
    const int64_t G = c.E / c.n_group;
    std::vector<double> v(static_cast<size_t>(c.E));
    for (int64_t e = 0; e < c.E; ++e) v[e] = 1.0 / (1.0 + std::exp(-static_cast<double>(x[e]))) + bias[e];
    std::vector<bool> masked(static_cast<size_t>(c.E), false);
    if (c.topk_group < c.n_group) {
        std::vector<double> score(static_cast<size_t>(c.n_group));
        for (int64_t g = 0; g < c.n_group; ++g) {
            std::vector<double> m(v.begin() + g * G, v.begin() + (g + 1) * G);
            std::partial_sort(m.begin(), m.begin() + 2, m.end(), std::greater<double>());
            score[g] = m[0] + m[1];
        }
        std::vector<int64_t> order(static_cast<size_t>(c.n_group));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
        if (score[order[c.topk_group - 1]] - score[order[c.topk_group]] < margin) return false;
        for (int64_t i = c.topk_group; i < c.n_group; ++i)
            for (int64_t e = order[i] * G; e < (order[i] + 1) * G; ++e) {
                masked[e] = true;
                v[e] = c.masked;
            }
    }
    std::vector<int64_t> order(static_cast<size_t>(c.E));
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
    for (int64_t k = 0; k < std::min(c.K, c.E - 1); ++k) {
        const int64_t a = order[k], b = order[k + 1];
        if (masked[a] && masked[b]) continue;
        if (v[a] - v[b] < margin) return false;
    }
    return true;
}

std::vector<float> separated_logits(std::mt19937& rng, const std::vector<float>& bias, const Case& c) {
    std::vector<float> logits(static_cast<size_t>(c.N * c.E));
    std::uniform_real_distribution<float> dist(-3.0f, 3.0f);
    for (int64_t n = 0; n < c.N; ++n) {
        float* x = logits.data() + n * c.E;
        int tries = 0;
        do {
            for (int64_t e = 0; e < c.E; ++e) x[e] = dist(rng);
            MF_CHECK(++tries < 1000, "no well-separated row found for ", c.what);
        } while (!well_separated(x, bias, c, 1e-4));
    }
    return logits;
}

const Case kCases[] = {
    {"nemotron-3-nano", 2000, 128, 6, 1, 1, true, 2.5f, -INFINITY, -0.05f, 0.05f},
    {"deepseek-v3", 1000, 256, 8, 8, 4, true, 2.5f, -INFINITY, -0.05f, 0.05f},
    {"deepseek-v3 masked=0", 300, 256, 8, 8, 4, true, 2.5f, 0.0f, -1.0f, 0.0f},
    {"odd E=15 groups 2/3", 37, 15, 4, 3, 2, false, 1.0f, -INFINITY, -0.3f, 0.3f},
    {"odd E=7", 29, 7, 3, 1, 1, true, 1.0f, -INFINITY, -0.3f, 0.3f},
    {"E=72 groups 2/4 masked=0", 45, 72, 8, 4, 2, false, 1.5f, 0.0f, -0.8f, 0.1f},
    {"E=1024 groups 8/32 K=32", 50, 1024, 32, 32, 8, true, 1.0f, -INFINITY, -0.05f, 0.05f},
};

struct Routed {
    Pair scores, idx, weight;
};

Routed route_both(const Case& c, Pair& logits, const Pair* bias) {
    Routed r{poisoned(c.N * c.E, {c.N, c.E}, DType::f32, DType::f32),
             poisoned(c.N * c.K, {c.N, c.K}, DType::i32, DType::i32),
             poisoned(c.N * c.K, {c.N, c.K}, DType::f32, DType::f32)};
    mf::ops::router_sigmoid_forward(r.scores.cpu, r.idx.cpu, r.weight.cpu, logits.cpu, bias ? bias->cpu : Tensor(),
                                    c.n_group, c.topk_group, c.norm, c.scale, c.masked);
    mf::ops::router_sigmoid_forward(r.scores.gpu, r.idx.gpu, r.weight.gpu, logits.gpu, bias ? bias->gpu : Tensor(),
                                    c.n_group, c.topk_group, c.norm, c.scale, c.masked);
    mf::ops::synchronize(Device::cuda);
    return r;
}

// ---------------------------------------------------------------------------------------------
// router

TEST(CudaRouterSigmoid, ForwardAndBackwardMatchCpu) {
    std::mt19937 rng(31);
    for (const Case& c : kCases) {
        for (const int bias_kind : {0, 1, 2}) {  // none, f32, bf16 (the CPU sees the same values in f32)
            const std::string name = std::string(c.what) + (bias_kind == 0   ? ""
                                                            : bias_kind == 1 ? " bias f32"
                                                                             : " bias bf16");
            const std::vector<float> bias_values = random_bf16(rng, static_cast<size_t>(c.E), c.bias_lo, c.bias_hi);
            const std::vector<float> zeros(static_cast<size_t>(c.E), 0.0f);
            const std::vector<float>& chosen_bias = bias_kind == 0 ? zeros : bias_values;
            Pair logits = both_devices(separated_logits(rng, chosen_bias, c), {c.N, c.E}, DType::f32);
            Pair bias = both_devices(bias_values, {c.E}, bias_kind == 2 ? DType::bf16 : DType::f32);
            Routed r = route_both(c, logits, bias_kind == 0 ? nullptr : &bias);
            expect_exact(indices(r.idx.gpu), indices(r.idx.cpu), name + " topk_idx");
            expect_close_f32(values(r.scores.gpu), values(r.scores.cpu), name + " scores");
            const std::vector<float> w_ref = values(r.weight.cpu);
            expect_reduction(values(r.weight.gpu), w_ref, w_ref, name + " topk_weight");

            // Backward from the CPU's forward on both devices.
            const std::vector<float> dw = random_f32(rng, static_cast<size_t>(c.N * c.K));
            Pair dtopk = both_devices(dw, {c.N, c.K}, DType::f32);
            Pair scores = both_devices(values(r.scores.cpu), {c.N, c.E}, DType::f32);
            Pair idx{Buffer(), Buffer(c.N * c.K * 4, Device::cuda), r.idx.cpu, {}};
            idx.gpu = idx.device.as(DType::i32, {c.N, c.K});
            mf::ops::copy_from_host(idx.gpu, r.idx.cpu.data());
            Pair dlogits = poisoned(c.N * c.E, {c.N, c.E}, DType::f32, DType::f32);
            mf::ops::router_sigmoid_backward(dlogits.cpu, dtopk.cpu, scores.cpu, idx.cpu, c.norm, c.scale);
            mf::ops::router_sigmoid_backward(dlogits.gpu, dtopk.gpu, scores.gpu, idx.gpu, c.norm, c.scale);
            const std::vector<float> d_ref = values(dlogits.cpu);
            expect_reduction(values(dlogits.gpu), d_ref, d_ref, name + " dlogits");
        }
    }
}

TEST(CudaRouterSigmoid, ExactTiesBreakAsOnTheCpu) {
    // Logits from {0, 0.5, 1}: most rows hold exact ties of experts and of groups, and no near-ties.
    std::mt19937 rng(32);
    for (const Case& c : {kCases[0], kCases[1], kCases[3]}) {
        std::vector<float> x(static_cast<size_t>(c.N * c.E));
        for (float& v : x) v = 0.5f * static_cast<float>(rng() % 3);
        Pair logits = both_devices(x, {c.N, c.E}, DType::f32);
        Routed r = route_both(c, logits, nullptr);
        expect_exact(indices(r.idx.gpu), indices(r.idx.cpu), std::string(c.what) + " ties topk_idx");
        const std::vector<float> w_ref = values(r.weight.cpu);
        expect_reduction(values(r.weight.gpu), w_ref, w_ref, std::string(c.what) + " ties topk_weight");
    }
}

// ---------------------------------------------------------------------------------------------
// relu2

TEST(CudaRelu2, MatchesCpuAlignedUnalignedAndInPlace) {
    std::mt19937 rng(33);
    struct Shape2 {
        int64_t rows, cols, offset;  // offset: elements into the device buffer (1: not 16-byte aligned)
    };
    for (const Shape2& s : {Shape2{64, 1856, 0}, Shape2{7, 13, 0}, Shape2{16, 64, 1}, Shape2{1, 1, 0}}) {
        const int64_t n = s.rows * s.cols;
        const std::string name =
            "relu2 [" + std::to_string(s.rows) + ", " + std::to_string(s.cols) + "]" + (s.offset ? " unaligned" : "");
        std::vector<float> x = random_bf16(rng, static_cast<size_t>(n), -4.0f, 4.0f);
        x[0] = 0.0f;
        const std::vector<float> dy = random_bf16(rng, static_cast<size_t>(n), -2.0f, 2.0f);
        // CPU reference.
        std::vector<float> y_ref(x.size()), dx_ref(x.size()), xc = x, dyc = dy;
        const Shape shape{s.rows, s.cols};
        mf::ops::relu2_forward(Tensor(y_ref.data(), DType::f32, shape), Tensor(xc.data(), DType::f32, shape));
        mf::ops::relu2_backward(Tensor(dx_ref.data(), DType::f32, shape), Tensor(dyc.data(), DType::f32, shape),
                                Tensor(xc.data(), DType::f32, shape));
        // GPU: four bf16 tensors at the same element offset of their buffers.
        const size_t bytes = static_cast<size_t>(n + s.offset) * 2, off = static_cast<size_t>(s.offset) * 2;
        Buffer bx(bytes, Device::cuda), by(bytes, Device::cuda), bdy(bytes, Device::cuda), bdx(bytes, Device::cuda);
        const Tensor tx = bx.as(DType::bf16, shape, off), ty = by.as(DType::bf16, shape, off);
        const Tensor tdy = bdy.as(DType::bf16, shape, off), tdx = bdx.as(DType::bf16, shape, off);
        upload_bf16(tx.data(), x);
        upload_bf16(tdy.data(), dy);
        MF_CHECK_CUDA(cudaMemset(by.data(), 0xFF, bytes));
        MF_CHECK_CUDA(cudaMemset(bdx.data(), 0xFF, bytes));
        mf::ops::relu2_forward(ty, tx);
        mf::ops::relu2_backward(tdx, tdy, tx);
        const std::vector<float> y = values(ty), dx = values(tdx);
        expect_close_bf16(y, y_ref, name + " forward");
        expect_close_bf16(dx, dx_ref, name + " backward");
        // In place: out = inp, then dinp = dout, both equal to the out-of-place results bit for bit.
        Buffer bz(bytes, Device::cuda), bdz(bytes, Device::cuda);
        const Tensor tz = bz.as(DType::bf16, shape, off), tdz = bdz.as(DType::bf16, shape, off);
        upload_bf16(tz.data(), x);
        upload_bf16(tdz.data(), dy);
        mf::ops::relu2_backward(tdz, tdz, tx);
        mf::ops::relu2_forward(tz, tz);
        expect_exact(values(tz), y, name + " in place forward");
        expect_exact(values(tdz), dx, name + " in place backward");
    }
}

}  // namespace
