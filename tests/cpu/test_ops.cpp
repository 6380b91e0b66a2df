// ops.h on CPU tensors: the argument checks and the dispatch around the reference kernels (the
// kernels themselves are tested in test_kernels.cpp) for the ops of the newer model families (row
// bias, RoPE alone, the sigmoid gate): leading dimensions flatten into rows, out-of-place calls
// leave their inputs alone and equal in-place ones bit for bit, bad shapes are refused with an
// mf::Error before anything is written. Built without CUDA, a CUDA tensor is refused by every op
// with the one "built without CUDA" message (no device memory is touched: the tensors only point).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "kernels/cpu/bias.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sigmoid_gate.h"
#include "ops/ops.h"

namespace {

using mf::Device;
using mf::DType;
using mf::Shape;
using mf::Tensor;

std::vector<float> random_vec(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

Tensor view(std::vector<float>& v, Shape shape) { return Tensor(v.data(), DType::f32, std::move(shape)); }
Tensor view(std::vector<int32_t>& v, Shape shape) { return Tensor(v.data(), DType::i32, std::move(shape)); }

void expect_bits(const std::vector<float>& a, const std::vector<float>& b, const std::string& what) {
    ASSERT_EQ(a.size(), b.size()) << what;
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " differs bit-wise";
}

TEST(Ops, BiasFlattensLeadingDimensions) {
    std::mt19937 rng(1);
    const int64_t B = 2, T = 3, C = 5;
    std::vector<float> x = random_vec(rng, B * T * C), b = random_vec(rng, C), want = x;
    mf::cpu::add_bias(want.data(), b.data(), B * T, C);
    mf::ops::add_bias(view(x, {B, T, C}), view(b, {C}));
    expect_bits(x, want, "add_bias [B, T, C]");

    std::vector<float> db = random_vec(rng, C), db_want = db;
    mf::cpu::bias_backward(db_want.data(), x.data(), B * T, C);
    mf::ops::bias_backward(view(db, {C}), view(x, {B, T, C}));
    expect_bits(db, db_want, "bias_backward [B, T, C]");

    std::vector<float> wrong(4);
    const std::vector<float> before = x;
    EXPECT_THROW(mf::ops::add_bias(view(x, {B, T, C}), view(wrong, {4})), mf::Error);
    EXPECT_THROW(mf::ops::bias_backward(view(wrong, {4}), view(x, {B, T, C})), mf::Error);
    EXPECT_THROW(mf::ops::add_bias(view(x, {B, T, C}), Tensor()), mf::Error) << "an empty bias";
    expect_bits(x, before, "refused calls write nothing");
}

TEST(Ops, RopeOutOfPlaceEqualsInPlace) {
    std::mt19937 rng(2);
    const int64_t N = 6, Hq = 4, Hkv = 2, D = 12, R = 8;
    const float theta = 1e4f;
    std::vector<int32_t> pos = {0, 3, 7, 100, 2, 65};
    const std::vector<float> q0 = random_vec(rng, N * Hq * D), k0 = random_vec(rng, N * Hkv * D);
    for (const bool forward : {true, false}) {
        auto run = [&](std::vector<float>& q, std::vector<float>& k, std::vector<float>& q_in,
                       std::vector<float>& k_in) {
            const Tensor tq = view(q, {N, Hq * D}), tk = view(k, {N, Hkv * D});
            const Tensor tq_in = view(q_in, {N, Hq * D}), tk_in = view(k_in, {N, Hkv * D});
            if (forward)
                mf::ops::rope_forward(tq, tk, tq_in, tk_in, view(pos, {N}), Hq, Hkv, D, R, theta);
            else
                mf::ops::rope_backward(tq, tk, tq_in, tk_in, view(pos, {N}), Hq, Hkv, D, R, theta);
        };
        std::vector<float> q_in = q0, k_in = k0, q(q0.size()), k(k0.size());
        run(q, k, q_in, k_in);
        expect_bits(q_in, q0, "rope leaves q_raw alone");
        expect_bits(k_in, k0, "rope leaves k_raw alone");
        std::vector<float> q_place = q0, k_place = k0;
        run(q_place, k_place, q_place, k_place);
        expect_bits(q_place, q, "rope q in place");
        expect_bits(k_place, k, "rope k in place");
        using RopeKernel = void (*)(float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float);
        const RopeKernel kernel = forward ? RopeKernel(mf::cpu::rope_forward) : RopeKernel(mf::cpu::rope_backward);
        std::vector<float> q_kernel = q0;
        kernel(q_kernel.data(), pos.data(), N, Hq, D, R, theta);
        expect_bits(q, q_kernel, forward ? "rope_forward is the CPU kernel" : "rope_backward is the CPU kernel");
    }
    std::vector<float> q = q0, k = k0, q_out(q0.size()), k_out(k0.size());
    EXPECT_THROW(mf::ops::rope_forward(view(q, {N, Hq * D}), view(k, {N, Hkv * D}), view(q, {N, Hq * D}),
                                       view(k, {N, Hkv * D}), view(pos, {N}), Hq, Hkv + 1, D, R, theta),
                 mf::Error)
        << "k does not hold N·Hkv·D values";
    for (const int64_t bad_rotary : {D + 2, int64_t{7}, int64_t{0}}) {
        EXPECT_THROW(mf::ops::rope_forward(view(q_out, {N, Hq * D}), view(k_out, {N, Hkv * D}), view(q, {N, Hq * D}),
                                           view(k, {N, Hkv * D}), view(pos, {N}), Hq, Hkv, D, bad_rotary, theta),
                     mf::Error)
            << "rotary_dim " << bad_rotary;
    }
    expect_bits(q, q0, "refused calls write nothing");
    expect_bits(q_out, std::vector<float>(q0.size(), 0.0f), "refused calls write nothing (out of place)");
}

// qknorm_rope_table_*: per-head RMSNorm then the table rotation, bit for bit the two CPU kernels in
// turn (forward) and their transposes in turn (backward: dq_raw written, the weight gradients
// accumulated, dq only read); finite differences of the whole pair; bad shapes refused unwritten.
TEST(Ops, QkNormRopeTablesAreNormThenRotation) {
    std::mt19937 rng(4);
    const int64_t N = 3, Hq = 2, Hkv = 1, D = 8;
    const float eps = 1e-6f;
    std::vector<float> q = random_vec(rng, N * Hq * D), k = random_vec(rng, N * Hkv * D);
    std::vector<float> qw = random_vec(rng, D, 0.5f, 1.5f), kw = random_vec(rng, D, 0.5f, 1.5f);
    std::vector<float> cos = random_vec(rng, N * D), sin = random_vec(rng, N * D);
    auto forward = [&](std::vector<float>& q_out, std::vector<float>& k_out, std::vector<float>& q_rstd,
                       std::vector<float>& k_rstd) {
        mf::ops::qknorm_rope_table_forward(view(q_out, {N, Hq, D}), view(k_out, {N, Hkv, D}), view(q_rstd, {N, Hq}),
                                           view(k_rstd, {N, Hkv}), view(q, {N, Hq, D}), view(k, {N, Hkv, D}),
                                           view(qw, {D}), view(kw, {D}), view(cos, {N, D}), view(sin, {N, D}), Hq, Hkv,
                                           eps);
    };
    std::vector<float> q_out(q.size()), k_out(k.size()), q_rstd(N * Hq), k_rstd(N * Hkv);
    forward(q_out, k_out, q_rstd, k_rstd);
    std::vector<float> q_want(q.size()), q_rstd_want(N * Hq);
    mf::cpu::rmsnorm_forward(q_want.data(), q_rstd_want.data(), q.data(), qw.data(), N * Hq, D, eps);
    mf::cpu::rope_table_forward(q_want.data(), cos.data(), sin.data(), N, Hq, D);
    expect_bits(q_out, q_want, "qknorm_rope_table_forward q");
    expect_bits(q_rstd, q_rstd_want, "qknorm_rope_table_forward q_rstd");

    // Backward of L = Σ r_q ⊙ q_out + Σ r_k ⊙ k_out.
    const std::vector<float> r_q = random_vec(rng, q.size()), r_k = random_vec(rng, k.size());
    std::vector<float> dq_out = r_q, dk_out = r_k, dq(q.size(), 7.0f), dk(k.size(), 7.0f);
    std::vector<float> dqw(D, 0.25f), dkw(D, 0.25f);
    mf::ops::qknorm_rope_table_backward(view(dq, {N, Hq, D}), view(dk, {N, Hkv, D}), view(dqw, {D}), view(dkw, {D}),
                                        view(dq_out, {N, Hq, D}), view(dk_out, {N, Hkv, D}), view(q, {N, Hq, D}),
                                        view(k, {N, Hkv, D}), view(qw, {D}), view(kw, {D}), view(q_rstd, {N, Hq}),
                                        view(k_rstd, {N, Hkv}), view(cos, {N, D}), view(sin, {N, D}), Hq, Hkv);
    expect_bits(dq_out, r_q, "the output gradient is only read");
    std::vector<float> dn = r_q, dq_want(q.size(), 0.0f), dqw_want(D, 0.25f);
    mf::cpu::rope_table_backward(dn.data(), cos.data(), sin.data(), N, Hq, D);
    mf::cpu::rmsnorm_backward(dq_want.data(), dqw_want.data(), dn.data(), q.data(), qw.data(), q_rstd.data(), N * Hq,
                              D);
    expect_bits(dq, dq_want, "dq is written: the transposed rotation, then the RMSNorm backward");
    expect_bits(dqw, dqw_want, "dq_weight accumulates");

    // Central differences of L (fp32 forward, accumulated in double), the pass rule of test_kernels.cpp.
    auto loss = [&] {
        std::vector<float> qo(q.size()), ko(k.size()), qr(N * Hq), kr(N * Hkv);
        forward(qo, ko, qr, kr);
        double sum = 0.0;
        for (size_t i = 0; i < qo.size(); ++i) sum += static_cast<double>(qo[i]) * r_q[i];
        for (size_t i = 0; i < ko.size(); ++i) sum += static_cast<double>(ko[i]) * r_k[i];
        return sum;
    };
    auto fd = [&](std::vector<float>& x, const std::vector<float>& analytic, double offset, const char* what) {
        for (size_t j = 0; j < x.size(); ++j) {
            const float saved = x[j], plus = saved + 1e-2f, minus = saved - 1e-2f;
            x[j] = plus;
            const double lp = loss();
            x[j] = minus;
            const double lm = loss();
            x[j] = saved;
            const double numeric = (lp - lm) / (static_cast<double>(plus) - static_cast<double>(minus));
            const double a = analytic[j] - offset;
            EXPECT_LE(std::abs(a - numeric), 2e-3 * std::max(std::abs(a), std::abs(numeric)) + 2e-4)
                << what << "[" << j << "] analytic " << a << " numeric " << numeric;
        }
    };
    fd(q, dq, 0.0, "dq");
    fd(k, dk, 0.0, "dk");
    fd(qw, dqw, 0.25, "dq_weight");
    fd(kw, dkw, 0.25, "dk_weight");

    std::vector<float> short_cos(N * D - D), q_before = q_out;
    EXPECT_THROW(mf::ops::qknorm_rope_table_forward(
                     view(q_out, {N, Hq, D}), view(k_out, {N, Hkv, D}), view(q_rstd, {N, Hq}), view(k_rstd, {N, Hkv}),
                     view(q, {N, Hq, D}), view(k, {N, Hkv, D}), view(qw, {D}), view(kw, {D}),
                     view(short_cos, {N - 1, D}), view(short_cos, {N - 1, D}), Hq, Hkv, eps),
                 mf::Error)
        << "cos with a row short";
    expect_bits(q_out, q_before, "refused calls write nothing");
}

TEST(Ops, SigmoidGateTakesColumnLogits) {
    std::mt19937 rng(3);
    const int64_t N = 5, H = 7;
    const std::vector<float> y0 = random_vec(rng, N * H);
    std::vector<float> value = random_vec(rng, N * H), g = random_vec(rng, N, -3.0f, 3.0f), dy = random_vec(rng, N * H);
    std::vector<float> y_want = y0, dv_want(N * H), dg_want(N);
    mf::cpu::sigmoid_gate_forward(y_want.data(), value.data(), g.data(), N, H);
    mf::cpu::sigmoid_gate_backward(dv_want.data(), dg_want.data(), dy.data(), value.data(), g.data(), N, H);
    for (const Shape& gate_shape : {Shape{N}, Shape{N, 1}}) {
        std::vector<float> y = y0, dv(N * H), dg(N);
        mf::ops::sigmoid_gate_forward(view(y, {N, H}), view(value, {N, H}), view(g, gate_shape));
        expect_bits(y, y_want, "sigmoid_gate_forward");
        mf::ops::sigmoid_gate_backward(view(dv, {N, H}), view(dg, gate_shape), view(dy, {N, H}), view(value, {N, H}),
                                       view(g, gate_shape));
        expect_bits(dv, dv_want, "sigmoid_gate_backward dvalue");
        expect_bits(dg, dg_want, "sigmoid_gate_backward dgate_logits");
    }
    std::vector<float> y = y0;
    EXPECT_THROW(mf::ops::sigmoid_gate_forward(view(y, {N, H}), view(value, {N, H}), view(g, {1, N})), mf::Error)
        << "gate logits [1, N]";
    EXPECT_THROW(mf::ops::sigmoid_gate_forward(view(y, {N, H}), view(value, {N * H}), view(g, {N})), mf::Error)
        << "value [N·H] is one row of N·H, not N rows";
    expect_bits(y, y0, "refused calls write nothing");
}

// ---------------------------------------------------------------------------------------------
// a build without CUDA

#ifndef MOEFORGE_WITH_CUDA
constexpr const char* kNoCuda =
    "this moeforge was built without CUDA (MOEFORGE_CUDA=OFF): device tensors are not supported";

void expect_refused(const char* op, const std::function<void()>& call) {
    try {
        call();
        ADD_FAILURE() << op << " accepted a CUDA tensor in a build without CUDA";
    } catch (const mf::Error& e) {
        EXPECT_STREQ(e.what(), kNoCuda) << op;
    }
}
#endif

TEST(Ops, CudaTensorsNeedACudaBuild) {
#ifdef MOEFORGE_WITH_CUDA
    GTEST_SKIP() << "built with CUDA: CUDA tensors are the GPU tests' (tests/gpu)";
#else
    // Views of host memory that claim to live on the GPU: each op checks the shapes, sees a CUDA
    // tensor and must refuse before touching the memory. Shapes: N = 4 rows of C = 8, E = 2 experts,
    // K = 2, V = 2 destinations.
    alignas(256) static unsigned char memory[1 << 16];
    auto t = [](DType dtype, Shape shape) { return Tensor(memory, dtype, std::move(shape), Device::cuda); };
    const Tensor x = t(DType::bf16, {4, 8}), x2 = t(DType::bf16, {4, 16}), w = t(DType::bf16, {8, 8});
    const Tensor row = t(DType::bf16, {8}), rstd = t(DType::f32, {4}), ids = t(DType::i32, {4});
    const Tensor logits = t(DType::f32, {4, 2}), topk_idx = t(DType::i32, {4, 2}), topk_w = t(DType::f32, {4, 2});
    const Tensor offsets = t(DType::i32, {3}), ew = t(DType::bf16, {2, 8, 8}), gate = t(DType::bf16, {4, 1});
    const Tensor send_pos = t(DType::i32, {2, 4}), counts = t(DType::i32, {2}), dest = t(DType::i32, {2});
    const Tensor meta = t(DType::i32, {4, 4}), pair_row = t(DType::i32, {8}), sums = t(DType::f64, {2});
    const Tensor one_f64 = t(DType::f64, {1}), mask = t(DType::f32, {4});
    std::vector<uint16_t> host(32);

    expect_refused("zero", [&] { mf::ops::zero(x); });
    expect_refused("copy", [&] { mf::ops::copy(x, x); });
    expect_refused("copy_from_host", [&] { mf::ops::copy_from_host(x, host.data()); });
    expect_refused("copy_to_host", [&] { mf::ops::copy_to_host(host.data(), x); });
    expect_refused("fill_normal", [&] { mf::ops::fill_normal(x, 1, 0.0f, 1.0f); });
    expect_refused("add", [&] { mf::ops::add(x, x, x); });
    expect_refused("cast", [&] { mf::ops::cast(x, x); });
    expect_refused("synchronize", [&] { mf::ops::synchronize(Device::cuda); });
    expect_refused("matmul_forward", [&] { mf::ops::matmul_forward(x, x, w); });
    expect_refused("matmul_backward", [&] { mf::ops::matmul_backward(x, w, x, x, w); });
    expect_refused("add_bias", [&] { mf::ops::add_bias(x, row); });
    expect_refused("bias_backward", [&] { mf::ops::bias_backward(row, x); });
    expect_refused("embedding_forward", [&] { mf::ops::embedding_forward(x, ids, w); });
    expect_refused("embedding_backward", [&] { mf::ops::embedding_backward(w, x, ids); });
    expect_refused("rmsnorm_forward", [&] { mf::ops::rmsnorm_forward(x, rstd, x, row, 1e-6f); });
    expect_refused("rmsnorm_backward", [&] { mf::ops::rmsnorm_backward(x, row, x, x, row, rstd); });
    expect_refused("qknorm_rope_forward",
                   [&] { mf::ops::qknorm_rope_forward(x, x, rstd, rstd, x, x, row, row, ids, 1, 1, 1e-6f, 1e4f); });
    expect_refused("qknorm_rope_backward", [&] {
        mf::ops::qknorm_rope_backward(x, x, row, row, x, x, x, x, row, row, rstd, rstd, ids, 1, 1, 1e4f);
    });
    expect_refused("qknorm_rope_table_forward",
                   [&] { mf::ops::qknorm_rope_table_forward(x, x, rstd, rstd, x, x, row, row, x, x, 1, 1, 1e-6f); });
    expect_refused("qknorm_rope_table_backward", [&] {
        mf::ops::qknorm_rope_table_backward(x, x, row, row, x, x, x, x, row, row, rstd, rstd, x, x, 1, 1);
    });
    expect_refused("rope_forward", [&] { mf::ops::rope_forward(x, x, x, x, ids, 1, 1, 8, 4, 1e4f); });
    expect_refused("rope_backward", [&] { mf::ops::rope_backward(x, x, x, x, ids, 1, 1, 8, 4, 1e4f); });
    expect_refused("attention_forward", [&] { mf::ops::attention_forward(x, rstd, x, x, x, Tensor(), 1, 4, 1, 1); });
    expect_refused("attention_backward",
                   [&] { mf::ops::attention_backward(x, x, x, x, x, x, x, x, rstd, Tensor(), 1, 4, 1, 1); });
    expect_refused("swiglu_forward", [&] { mf::ops::swiglu_forward(x, x2); });
    expect_refused("swiglu_backward", [&] { mf::ops::swiglu_backward(x2, x, x2); });
    expect_refused("relu2_forward", [&] { mf::ops::relu2_forward(x, x); });
    expect_refused("relu2_backward", [&] { mf::ops::relu2_backward(x, x, x); });
    expect_refused("sigmoid_gate_forward", [&] { mf::ops::sigmoid_gate_forward(x, x, gate); });
    expect_refused("sigmoid_gate_backward", [&] { mf::ops::sigmoid_gate_backward(x, gate, x, x, gate); });
    expect_refused("router_forward", [&] { mf::ops::router_forward(logits, topk_idx, topk_w, logits, true); });
    expect_refused("router_backward",
                   [&] { mf::ops::router_backward(logits, topk_w, logits, logits, topk_idx, true); });
    expect_refused("router_sigmoid_forward", [&] {
        mf::ops::router_sigmoid_forward(logits, topk_idx, topk_w, logits, Tensor(), 1, 1, true, 2.5f, -INFINITY);
    });
    expect_refused("router_sigmoid_backward",
                   [&] { mf::ops::router_sigmoid_backward(logits, topk_w, logits, topk_idx, true, 2.5f); });
    expect_refused("moe_aux_stats", [&] { mf::ops::moe_aux_stats(rstd, rstd, topk_idx, logits, mask); });
    expect_refused("moe_aux_dprobs", [&] { mf::ops::moe_aux_dprobs(logits, rstd, mask, 1.0f); });
    expect_refused("moe_permute_indices",
                   [&] { mf::ops::moe_permute_indices(offsets, pair_row, pair_row, topk_idx, 2); });
    expect_refused("moe_gather_forward", [&] { mf::ops::moe_gather_forward(x, x, pair_row, 2); });
    expect_refused("moe_gather_backward", [&] { mf::ops::moe_gather_backward(x, x, pair_row, 2); });
    expect_refused("moe_unpermute_forward", [&] { mf::ops::moe_unpermute_forward(x, x, topk_w, pair_row); });
    expect_refused("moe_unpermute_backward",
                   [&] { mf::ops::moe_unpermute_backward(x, topk_w, x, x, topk_w, pair_row); });
    expect_refused("ep_token_positions", [&] { mf::ops::ep_token_positions(send_pos, counts, topk_idx, dest); });
    expect_refused("ep_pack_rows", [&] { mf::ops::ep_pack_rows(x, x, send_pos, counts); });
    expect_refused("ep_pack_meta", [&] {
        mf::ops::ep_pack_meta(meta, send_pos, counts, topk_idx, topk_w, pair_row, offsets, dest, dest);
    });
    expect_refused("ep_scatter_rows", [&] { mf::ops::ep_scatter_rows(x, x, meta); });
    expect_refused("ep_scatter_grad", [&] { mf::ops::ep_scatter_grad(x, topk_w, x, meta, x); });
    expect_refused("ep_reduce_rows", [&] { mf::ops::ep_reduce_rows(x, x, meta, true); });
    expect_refused("ep_sum_blocks", [&] { mf::ops::ep_sum_blocks(x, x, send_pos, counts, false); });
    expect_refused("ep_gather_slots",
                   [&] { mf::ops::ep_gather_slots(topk_w, topk_w, send_pos, counts, topk_idx, dest); });
    expect_refused("grouped_matmul_forward", [&] { mf::ops::grouped_matmul_forward(x, x, ew, offsets); });
    expect_refused("grouped_matmul_backward", [&] { mf::ops::grouped_matmul_backward(x, ew, x, x, ew, offsets); });
    expect_refused("grouped_matmul_backward_weight", [&] {
        mf::ops::grouped_matmul_backward_weight(ew, x, x, std::span<const Tensor>(&offsets, 1), {}, true, one_f64);
    });
    EXPECT_FALSE(mf::ops::grouped_matmul_uses_host_offsets(Device::cuda, 8, 64, 64));
    EXPECT_TRUE(mf::ops::grouped_matmul_uses_host_offsets(Device::cpu, 8, 64, 64));
    expect_refused("lm_head_cross_entropy_scratch_bytes",
                   [&] { mf::ops::lm_head_cross_entropy_scratch_bytes(4, 16, DType::f32, Device::cuda); });
    expect_refused("set_grouped_matmul_reserved_sms",
                   [&] { mf::ops::set_grouped_matmul_reserved_sms(Device::cuda, 4); });
    expect_refused("lm_head_cross_entropy",
                   [&] { mf::ops::lm_head_cross_entropy(rstd, x, w, x, w, ids, 1.0f, DType::f32); });
    expect_refused("adamw_update", [&] {
        mf::ops::adamw_update(x, Tensor(), x, x, x, mf::ops::AdamWHyper{1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1});
    });
    expect_refused("sum", [&] { mf::ops::sum(rstd); });
    expect_refused("sum_squares", [&] { mf::ops::sum_squares(x); });
    expect_refused("sum_squares_to", [&] { mf::ops::sum_squares_to(sums, 0, x); });
    expect_refused("all_finite", [&] { mf::ops::all_finite(x); });
    expect_refused("background", [&] { mf::ops::background(Device::cuda, [] {}); });
    expect_refused("wait_background", [&] { mf::ops::wait_background(Device::cuda, 1); });
    expect_refused("phase_start", [&] { mf::ops::phase_start(Device::cuda); });
#endif
}

// An execution context on the CPU: the default one changes nothing (ops inside run as outside).
TEST(Ops, ExecScopeOnTheCpuChangesNothing) {
    std::vector<float> a{1, 2, 3}, b{4, 5, 6}, out(3);
    Tensor ta(a.data(), DType::f32, {3}, Device::cpu), tb(b.data(), DType::f32, {3}, Device::cpu);
    Tensor to(out.data(), DType::f32, {3}, Device::cpu);
    {
        mf::ops::ExecScope scope(mf::ops::ExecContext{});
        mf::ops::add(to, ta, tb);
    }
    EXPECT_EQ(out, (std::vector<float>{5, 7, 9}));
    EXPECT_EQ(mf::ops::current_stream(Device::cpu), nullptr);
}

// A CUDA stream is refused where there is no CUDA device (a build without CUDA, or no GPU).
TEST(Ops, ExecScopeRefusesAStreamWithoutCuda) {
    if (mf::cuda_available()) GTEST_SKIP() << "a CUDA device is present: the refusal is for machines without one";
    int fake_stream = 0;
    EXPECT_THROW(mf::ops::ExecScope(mf::ops::ExecContext{.stream = &fake_stream}), mf::Error);
}

}  // namespace
