// GPU parity of flash attention (kernels/cuda/attention.cuh) against the fp32 CPU reference
// (kernels/cpu/attention.h), fed the same bf16-rounded inputs; GQA, causal, packed documents.
//
// Tolerance rule (CONVENTIONS.md): max_i |gpu_i − ref_i| <= 2 · max_i |naive_i − ref_i| + floor, where
// ref is the CPU kernel and naive is the same attention computed in fp32 with every stored
// intermediate rounded to bf16 (scores, probabilities, dP, dS, outputs: what an eager bf16
// implementation stores); floor = 2^-16 · max(1, max|ref|). The backward of both sides starts from
// the same bf16 out and fp32 lse. Outputs are poisoned with NaN first, so an element never written
// fails; the backward runs twice and must repeat bit for bit. The cuDNN path (attention_cudnn.cuh,
// plain causal mask) is held to the same rule, in both of its backward algorithms (the deterministic
// one must also repeat bit for bit). MF_BENCH=1 times the Qwen3-30B-A3B shape on both paths.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cpu/attention.h"
#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/attention_cudnn.cuh"
#include "test_cuda_helpers.h"

namespace {

using mf::cuda::bf16;
using namespace mf::test;  // DeviceBuffer, bf16 copies (test_cuda_common.h), expect_parity (test_cuda_helpers.h)

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// the "naive bf16" attention: fp32 math, every stored intermediate rounded to bf16 (scores,
// probabilities, dP, dS and the outputs), as an eager bf16 implementation would store them

float bf(float x) { return round_bf16(x); }

float dot(const float* a, const float* b, int64_t n) {
    float s = 0.0f;
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

struct Shape {
    int64_t B, T, Hq, Hkv, D;
};

bool allowed(const int32_t* doc, int64_t t, int64_t s) { return s <= t && (doc == nullptr || doc[s] == doc[t]); }

void naive_forward(std::vector<float>& out, std::vector<float>& lse, const std::vector<float>& q,
                   const std::vector<float>& k, const std::vector<float>& v, const int32_t* docs, const Shape& s) {
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
    const int64_t group = s.Hq / s.Hkv;
    std::vector<float> sc(s.T), acc(s.D);
    for (int64_t b = 0; b < s.B; ++b)
        for (int64_t h = 0; h < s.Hq; ++h)
            for (int64_t t = 0; t < s.T; ++t) {
                const int32_t* doc = docs != nullptr ? docs + b * s.T : nullptr;
                const float* qt = &q[((b * s.T + t) * s.Hq + h) * s.D];
                float m = -INFINITY;
                for (int64_t j = 0; j <= t; ++j) {
                    if (!allowed(doc, t, j)) continue;
                    sc[j] = bf(scale * dot(qt, &k[((b * s.T + j) * s.Hkv + h / group) * s.D], s.D));
                    m = std::max(m, sc[j]);
                }
                float l = 0.0f;
                for (int64_t j = 0; j <= t; ++j)
                    if (allowed(doc, t, j)) l += std::exp(sc[j] - m);
                std::fill(acc.begin(), acc.end(), 0.0f);
                for (int64_t j = 0; j <= t; ++j) {
                    if (!allowed(doc, t, j)) continue;
                    const float p = bf(std::exp(sc[j] - m) / l);
                    const float* vj = &v[((b * s.T + j) * s.Hkv + h / group) * s.D];
                    for (int64_t d = 0; d < s.D; ++d) acc[d] += p * vj[d];
                }
                for (int64_t d = 0; d < s.D; ++d) out[((b * s.T + t) * s.Hq + h) * s.D + d] = bf(acc[d]);
                lse[(b * s.Hq + h) * s.T + t] = m + std::log(l);
            }
}

void naive_backward(std::vector<float>& dq, std::vector<float>& dk, std::vector<float>& dv,
                    const std::vector<float>& dout, const std::vector<float>& q, const std::vector<float>& k,
                    const std::vector<float>& v, const std::vector<float>& out, const std::vector<float>& lse,
                    const int32_t* docs, const Shape& s) {
    const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(s.D)));
    const int64_t group = s.Hq / s.Hkv;
    std::fill(dq.begin(), dq.end(), 0.0f);
    std::fill(dk.begin(), dk.end(), 0.0f);
    std::fill(dv.begin(), dv.end(), 0.0f);
    for (int64_t b = 0; b < s.B; ++b)
        for (int64_t h = 0; h < s.Hq; ++h)
            for (int64_t t = 0; t < s.T; ++t) {
                const int32_t* doc = docs != nullptr ? docs + b * s.T : nullptr;
                const int64_t qi = ((b * s.T + t) * s.Hq + h) * s.D;
                const float delta = dot(&dout[qi], &out[qi], s.D);
                const float lse_t = lse[(b * s.Hq + h) * s.T + t];
                for (int64_t j = 0; j <= t; ++j) {
                    if (!allowed(doc, t, j)) continue;
                    const int64_t kj = ((b * s.T + j) * s.Hkv + h / group) * s.D;
                    const float sc = bf(scale * dot(&q[qi], &k[kj], s.D));
                    const float p = bf(std::exp(sc - lse_t));
                    const float dp = bf(dot(&dout[qi], &v[kj], s.D));
                    const float ds = bf(p * (dp - delta));
                    for (int64_t d = 0; d < s.D; ++d) {
                        dq[qi + d] += scale * ds * k[kj + d];
                        dk[kj + d] += scale * ds * q[qi + d];
                        dv[kj + d] += p * dout[qi + d];
                    }
                }
            }
    for (auto* g : {&dq, &dk, &dv})
        for (float& x : *g) x = bf(x);
}

// ---------------------------------------------------------------------------------------------
// cases

enum class Docs { none, packed, single };

struct AttnCase {
    Shape shape;
    Docs docs;
    int max_doc_len;
    std::string label() const {
        const char* d = docs == Docs::none ? "causal" : docs == Docs::packed ? "packed docs" : "one doc id";
        return "B=" + std::to_string(shape.B) + " T=" + std::to_string(shape.T) + " Hq=" + std::to_string(shape.Hq) +
               " Hkv=" + std::to_string(shape.Hkv) + " D=" + std::to_string(shape.D) + " " + d;
    }
};

// Packed rows: consecutive documents of random lengths in [1, max_len], ids counting up per row.
std::vector<int32_t> make_docs(std::mt19937& rng, const Shape& s, Docs docs, int max_len) {
    std::vector<int32_t> ids(s.B * s.T, 0);
    if (docs != Docs::packed) return ids;
    for (int64_t b = 0; b < s.B; ++b) {
        int32_t id = 0;
        for (int64_t t = 0; t < s.T;) {
            const int64_t len = 1 + static_cast<int64_t>(rng() % static_cast<unsigned>(max_len));
            for (int64_t i = 0; i < len && t < s.T; ++i, ++t) ids[b * s.T + t] = id;
            ++id;
        }
    }
    return ids;
}

const std::vector<AttnCase> kCases = {
    {{1, 1, 1, 1, 16}, Docs::none, 0},         {{2, 77, 4, 2, 64}, Docs::none, 0},
    {{2, 200, 4, 1, 128}, Docs::packed, 70},   {{1, 300, 8, 2, 16}, Docs::packed, 40},
    {{1, 130, 2, 2, 32}, Docs::single, 0},     {{1, 128, 4, 4, 128}, Docs::packed, 3},
    {{1, 2500, 2, 1, 16}, Docs::packed, 1300},  // runs longer than one 1024-position scan chunk
};

// ---------------------------------------------------------------------------------------------
// parity

struct Run {
    std::vector<float> q, k, v, dout, out_bf16, lse;
    std::vector<int32_t> docs;
};

TEST(CudaAttention, ForwardBackwardParity) {
    std::mt19937 rng(2024);
    for (const AttnCase& c : kCases) {
        const Shape& s = c.shape;
        const mf::cpu::AttentionShape cs{s.B, s.T, s.Hq, s.Hkv, s.D};
        const mf::cuda::AttentionShape gs{s.B, s.T, s.Hq, s.Hkv, s.D};
        const int64_t nq = s.B * s.T * s.Hq * s.D, nkv = s.B * s.T * s.Hkv * s.D, nl = s.B * s.Hq * s.T;
        // Scores of O(1..3) so that the softmax is neither flat nor one-hot.
        const auto q = random_bf16(rng, nq, -1.5f, 1.5f);
        const auto k = random_bf16(rng, nkv, -1.5f, 1.5f);
        const auto v = random_bf16(rng, nkv);
        const auto dout = random_bf16(rng, nq);
        const auto docs = make_docs(rng, s, c.docs, c.max_doc_len);
        const int32_t* cpu_docs = c.docs == Docs::none ? nullptr : docs.data();

        // forward
        std::vector<float> ref_out(nq), ref_lse(nl), naive_out(nq), naive_lse(nl);
        mf::cpu::attention_forward(ref_out.data(), ref_lse.data(), q.data(), k.data(), v.data(), cpu_docs, cs);
        naive_forward(naive_out, naive_lse, q, k, v, cpu_docs, s);

        DeviceBuffer d_q(nq * 2), d_k(nkv * 2), d_v(nkv * 2), d_out(nq * 2), d_lse(nl * 4), d_docs(docs.size() * 4);
        upload_bf16(d_q.as<void>(), q);
        upload_bf16(d_k.as<void>(), k);
        upload_bf16(d_v.as<void>(), v);
        MF_CHECK_CUDA(cudaMemcpy(d_docs.as<void>(), docs.data(), docs.size() * 4, cudaMemcpyHostToDevice));
        const int32_t* gpu_docs = c.docs == Docs::none ? nullptr : d_docs.as<int32_t>();
        d_out.poison();
        d_lse.poison();
        mf::cuda::attention_forward(d_out.as<bf16>(), d_lse.as<float>(), d_q.as<bf16>(), d_k.as<bf16>(), d_v.as<bf16>(),
                                    gpu_docs, gs, nullptr);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        expect_parity("forward out " + c.label(), download_bf16(d_out.as<void>(), nq), ref_out, naive_out);
        expect_parity("forward lse " + c.label(), download<float>(d_lse.as<void>(), nl), ref_lse, naive_lse);

        // backward, from the same bf16 out and fp32 lse on both sides
        const auto out_bf16 = round_bf16(ref_out);
        std::vector<float> ref_dq(nq, 0.0f), ref_dk(nkv, 0.0f), ref_dv(nkv, 0.0f);
        mf::cpu::attention_backward(ref_dq.data(), ref_dk.data(), ref_dv.data(), dout.data(), q.data(), k.data(),
                                    v.data(), out_bf16.data(), ref_lse.data(), cpu_docs, cs);
        std::vector<float> naive_dq(nq), naive_dk(nkv), naive_dv(nkv);
        naive_backward(naive_dq, naive_dk, naive_dv, dout, q, k, v, out_bf16, ref_lse, cpu_docs, s);

        DeviceBuffer d_dout(nq * 2), d_dq(nq * 2), d_dk(nkv * 2), d_dv(nkv * 2);
        upload_bf16(d_dout.as<void>(), dout);
        upload_bf16(d_out.as<void>(), out_bf16);
        upload(d_lse.as<void>(), ref_lse);
        // The dK/dV kernel's own choice of head splits (several for these small grids), then one block
        // per (key tile, KV head) visiting every query head of the group.
        for (const char* splits : {"", "1"}) {
            SCOPED_TRACE(std::string("MOEFORGE_ATTENTION_HEAD_SPLITS=") + splits);
            ScopedEnv env("MOEFORGE_ATTENTION_HEAD_SPLITS", splits);
            DeviceBuffer d_ws(mf::cuda::attention_backward_workspace_bytes(gs));
            std::vector<float> first_dq;
            for (int run = 0; run < 2; ++run) {
                d_dq.poison();
                d_dk.poison();
                d_dv.poison();
                mf::cuda::attention_backward(d_dq.as<bf16>(), d_dk.as<bf16>(), d_dv.as<bf16>(), d_dout.as<bf16>(),
                                             d_q.as<bf16>(), d_k.as<bf16>(), d_v.as<bf16>(), d_out.as<bf16>(),
                                             d_lse.as<float>(), gpu_docs, gs, d_ws.as<void>(), nullptr);
                MF_CHECK_CUDA(cudaDeviceSynchronize());
                const auto dq = download_bf16(d_dq.as<void>(), nq);
                if (run == 1) {
                    EXPECT_EQ(std::memcmp(dq.data(), first_dq.data(), nq * 4), 0) << "dq differs between runs";
                    break;
                }
                first_dq = dq;
                expect_parity("backward dq " + c.label(), dq, ref_dq, naive_dq);
                expect_parity("backward dk " + c.label(), download_bf16(d_dk.as<void>(), nkv), ref_dk, naive_dk);
                expect_parity("backward dv " + c.label(), download_bf16(d_dv.as<void>(), nkv), ref_dv, naive_dv);
            }
        }
    }
}

// cuDNN's fused engines on the plain causal mask: the shapes they serve (T a multiple of 128, D 64
// or 128), MHA and GQA, against the same references; the backward in both algorithms.
TEST(CudnnAttention, ForwardBackwardParity) {
#if !MOEFORGE_WITH_CUDNN
    GTEST_SKIP() << "SKIPPED: built without cuDNN; attention runs on moeforge's kernels only";
#endif
    std::mt19937 rng(77);
    const std::vector<Shape> shapes = {
        {1, 128, 4, 4, 128}, {2, 256, 8, 2, 64}, {1, 384, 4, 1, 128}, {1, 512, 8, 2, 128}};
    for (const Shape& s : shapes) {
        const mf::cpu::AttentionShape cs{s.B, s.T, s.Hq, s.Hkv, s.D};
        const mf::cuda::AttentionShape gs{s.B, s.T, s.Hq, s.Hkv, s.D};
        const std::string label = AttnCase{s, Docs::none, 0}.label() + " (cuDNN)";
        const int64_t nq = s.B * s.T * s.Hq * s.D, nkv = s.B * s.T * s.Hkv * s.D, nl = s.B * s.Hq * s.T;
        const auto q = random_bf16(rng, nq, -1.5f, 1.5f);
        const auto k = random_bf16(rng, nkv, -1.5f, 1.5f);
        const auto v = random_bf16(rng, nkv);
        const auto dout = random_bf16(rng, nq);
        std::vector<float> ref_out(nq), ref_lse(nl), naive_out(nq), naive_lse(nl);
        mf::cpu::attention_forward(ref_out.data(), ref_lse.data(), q.data(), k.data(), v.data(), nullptr, cs);
        naive_forward(naive_out, naive_lse, q, k, v, nullptr, s);
        const auto out_bf16 = round_bf16(ref_out);
        std::vector<float> ref_dq(nq, 0.0f), ref_dk(nkv, 0.0f), ref_dv(nkv, 0.0f);
        mf::cpu::attention_backward(ref_dq.data(), ref_dk.data(), ref_dv.data(), dout.data(), q.data(), k.data(),
                                    v.data(), out_bf16.data(), ref_lse.data(), nullptr, cs);
        std::vector<float> naive_dq(nq), naive_dk(nkv), naive_dv(nkv);
        naive_backward(naive_dq, naive_dk, naive_dv, dout, q, k, v, out_bf16, ref_lse, nullptr, s);

        DeviceBuffer d_q(nq * 2), d_k(nkv * 2), d_v(nkv * 2), d_out(nq * 2), d_lse(nl * 4), d_dout(nq * 2),
            d_dq(nq * 2), d_dk(nkv * 2), d_dv(nkv * 2);
        upload_bf16(d_q.as<void>(), q);
        upload_bf16(d_k.as<void>(), k);
        upload_bf16(d_v.as<void>(), v);
        upload_bf16(d_dout.as<void>(), dout);
        // The deterministic backward whole, and (B = 2) over one-row slices of the batch; then the
        // dQ-accumulating one.
        for (const int variant : {0, 1, 2}) {
            const bool deterministic = variant < 2;
            if (variant == 1 && s.B == 1) continue;
            SCOPED_TRACE(variant == 0   ? "deterministic backward"
                         : variant == 1 ? "deterministic, sliced"
                                        : "dQ-accumulating backward");
            ScopedEnv budget("MOEFORGE_CUDNN_ATTENTION_BUDGET", variant == 1 ? "1" : "");
            mf::cuda::set_cudnn_attention_deterministic(deterministic);
            ASSERT_TRUE(mf::cuda::cudnn_attention_serves(gs)) << label << ": cuDNN refused the shape (see stderr)";
            DeviceBuffer d_fws(mf::cuda::cudnn_attention_forward_workspace_bytes(gs));
            d_out.poison();
            d_lse.poison();
            mf::cuda::cudnn_attention_forward(d_out.as<bf16>(), d_lse.as<float>(), d_q.as<bf16>(), d_k.as<bf16>(),
                                              d_v.as<bf16>(), gs, d_fws.as<void>(), nullptr);
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            expect_parity("forward out " + label, download_bf16(d_out.as<void>(), nq), ref_out, naive_out);
            expect_parity("forward lse " + label, download<float>(d_lse.as<void>(), nl), ref_lse, naive_lse);

            upload_bf16(d_out.as<void>(), out_bf16);
            upload(d_lse.as<void>(), ref_lse);
            DeviceBuffer d_ws(mf::cuda::cudnn_attention_backward_workspace_bytes(gs));
            std::vector<float> first_dq;
            for (int run = 0; run < 2; ++run) {
                d_dq.poison();
                d_dk.poison();
                d_dv.poison();
                mf::cuda::cudnn_attention_backward(d_dq.as<bf16>(), d_dk.as<bf16>(), d_dv.as<bf16>(), d_dout.as<bf16>(),
                                                   d_q.as<bf16>(), d_k.as<bf16>(), d_v.as<bf16>(), d_out.as<bf16>(),
                                                   d_lse.as<float>(), gs, d_ws.as<void>(), nullptr);
                MF_CHECK_CUDA(cudaDeviceSynchronize());
                const auto dq = download_bf16(d_dq.as<void>(), nq);
                expect_parity("backward dq " + label, dq, ref_dq, naive_dq);
                expect_parity("backward dk " + label, download_bf16(d_dk.as<void>(), nkv), ref_dk, naive_dk);
                expect_parity("backward dv " + label, download_bf16(d_dv.as<void>(), nkv), ref_dv, naive_dv);
                if (run == 1 && deterministic) {
                    EXPECT_EQ(std::memcmp(dq.data(), first_dq.data(), nq * 4), 0) << "dq differs between runs";
                }
                first_dq = dq;
            }
        }
        mf::cuda::set_cudnn_attention_deterministic(true);
    }
    // Shapes outside what the fused engines take are declined, not run.
    EXPECT_FALSE(mf::cuda::cudnn_attention_serves({1, 100, 4, 4, 128}));
    EXPECT_FALSE(mf::cuda::cudnn_attention_serves({1, 128, 4, 4, 32}));
}

TEST(CudaAttention, ArgumentErrors) {
    DeviceBuffer buf(1 << 16);
    const mf::cuda::AttentionShape bad_dim{1, 4, 2, 1, 48};
    EXPECT_THROW(mf::cuda::attention_forward(buf.as<bf16>(), buf.as<float>(), buf.as<bf16>(), buf.as<bf16>(),
                                             buf.as<bf16>(), nullptr, bad_dim, nullptr),
                 mf::Error);
    const mf::cuda::AttentionShape bad_group{1, 4, 3, 2, 16};
    EXPECT_THROW(mf::cuda::attention_forward(buf.as<bf16>(), buf.as<float>(), buf.as<bf16>(), buf.as<bf16>(),
                                             buf.as<bf16>(), nullptr, bad_group, nullptr),
                 mf::Error);
    const mf::cuda::AttentionShape ok{1, 4, 2, 1, 16};
    EXPECT_THROW(mf::cuda::attention_forward(buf.as<bf16>() + 1, buf.as<float>(), buf.as<bf16>(), buf.as<bf16>(),
                                             buf.as<bf16>(), nullptr, ok, nullptr),
                 mf::Error);
    // T = 0 is a no-op.
    mf::cuda::attention_forward(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, {2, 0, 2, 1, 16}, nullptr);
    MF_CHECK_CUDA(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// MF_BENCH=1: B=2, T=4096, Hq=32, Hkv=4, D=128 (Qwen3-30B-A3B), causal and packed 1024-token docs.
// FLOPs: forward 4·B·Hq·D·(allowed pairs), backward 2.5x forward (the FlashAttention convention).

TEST(CudaAttention, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 to time";
    const mf::cuda::AttentionShape s{2, 4096, 32, 4, 128};
    const int64_t nq = s.B * s.T * s.Hq * s.D, nkv = s.B * s.T * s.Hkv * s.D;
    std::mt19937 rng(3);
    DeviceBuffer q(nq * 2), k(nkv * 2), v(nkv * 2), out(nq * 2), dout(nq * 2), dq(nq * 2), dk(nkv * 2), dv(nkv * 2),
        lse(s.B * s.Hq * s.T * 4), ws(mf::cuda::attention_backward_workspace_bytes(s)), docs(s.B * s.T * 4);
    fill_random_bf16(q, nq, rng);
    fill_random_bf16(k, nkv, rng);
    fill_random_bf16(v, nkv, rng);
    fill_random_bf16(dout, nq, rng);
    std::vector<int32_t> doc_ids(s.B * s.T);
    for (int64_t i = 0; i < s.B * s.T; ++i) doc_ids[i] = static_cast<int32_t>((i % s.T) / 1024);
    MF_CHECK_CUDA(cudaMemcpy(docs.as<void>(), doc_ids.data(), doc_ids.size() * 4, cudaMemcpyHostToDevice));
    auto report = [](const char* what, double fwd_flops, double fwd, double bwd) {
        std::printf(
            "BENCH attention B=2 T=4096 Hq=32 Hkv=4 D=128 %-20s fwd %8.1f us %6.1f TFLOP/s | bwd %8.1f us "
            "%6.1f | fwd+bwd %8.1f us %6.1f TFLOP/s\n",
            what, fwd, fwd_flops / fwd * 1e-6, bwd, 2.5 * fwd_flops / bwd * 1e-6, fwd + bwd,
            3.5 * fwd_flops / (fwd + bwd) * 1e-6);
    };
    for (int packed = 0; packed < 2; ++packed) {
        const int32_t* d = packed ? docs.as<int32_t>() : nullptr;
        const int64_t span = packed ? 1024 : s.T;
        const double pairs = static_cast<double>(s.T / span) * span * (span + 1) / 2.0;
        const double fwd_flops = 4.0 * s.B * s.Hq * s.D * pairs;
        const double fwd = median_us([&] {
            mf::cuda::attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), d, s,
                                        nullptr);
        });
        const double bwd = median_us([&] {
            mf::cuda::attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(), q.as<bf16>(),
                                         k.as<bf16>(), v.as<bf16>(), out.as<bf16>(), lse.as<float>(), d, s,
                                         ws.as<void>(), nullptr);
        });
        report(packed ? "packed 1024 docs" : "causal", fwd_flops, fwd, bwd);
    }
#if MOEFORGE_WITH_CUDNN
    const double causal_flops = 4.0 * s.B * s.Hq * s.D * s.T * (s.T + 1) / 2.0;
    for (const bool deterministic : {true, false}) {
        mf::cuda::set_cudnn_attention_deterministic(deterministic);
        if (!mf::cuda::cudnn_attention_serves(s)) {
            std::printf("BENCH attention: cuDNN does not serve the shape\n");
            break;
        }
        DeviceBuffer fws(mf::cuda::cudnn_attention_forward_workspace_bytes(s)),
            bws(mf::cuda::cudnn_attention_backward_workspace_bytes(s));
        const double fwd = median_us([&] {
            mf::cuda::cudnn_attention_forward(out.as<bf16>(), lse.as<float>(), q.as<bf16>(), k.as<bf16>(), v.as<bf16>(),
                                              s, fws.as<void>(), nullptr);
        });
        const double bwd = median_us([&] {
            mf::cuda::cudnn_attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(),
                                               q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), out.as<bf16>(),
                                               lse.as<float>(), s, bws.as<void>(), nullptr);
        });
        report(deterministic ? "cuDNN causal, det." : "cuDNN causal, dQ+=", causal_flops, fwd, bwd);
        // Does the backward repeat bit for bit (dQ over 10 runs)?
        auto dq_bits = [&] {
            std::vector<uint16_t> h(static_cast<size_t>(nq));
            MF_CHECK_CUDA(cudaMemcpy(h.data(), dq.as<void>(), nq * 2, cudaMemcpyDeviceToHost));
            return h;
        };
        const auto first = dq_bits();
        int differing = 0;
        for (int run = 0; run < 10; ++run) {
            mf::cuda::cudnn_attention_backward(dq.as<bf16>(), dk.as<bf16>(), dv.as<bf16>(), dout.as<bf16>(),
                                               q.as<bf16>(), k.as<bf16>(), v.as<bf16>(), out.as<bf16>(),
                                               lse.as<float>(), s, bws.as<void>(), nullptr);
            differing += dq_bits() != first;
        }
        std::printf("BENCH attention: %s backward: dq differed from the first run in %d of 10 runs\n",
                    deterministic ? "deterministic" : "dQ-accumulating", differing);
        std::printf("BENCH attention: cuDNN backward workspace %.1f MiB\n", bws.bytes() / 1048576.0);
    }
    mf::cuda::set_cudnn_attention_deterministic(true);
#endif
}

}  // namespace
