// GPU parity of the dense memory-bound kernels against their CPU references (kernels/cpu), fed the
// same bf16-rounded inputs: casts, embedding, RMSNorm, fused QK-norm + RoPE, RoPE alone (partial
// rotary), row bias, SwiGLU, gpt-oss's clamped SwiGLU, the sigmoid gate. Shapes cover the 16-byte vector paths, the
// element paths (sizes that are not multiples of 8, odd sizes, misaligned pointers), single rows, rows longer than the
// register cache, and in-place use; the ops with reductions run twice and must give the same bits. Tolerances:
// test_cuda_common.h. MF_BENCH=1 adds bandwidth figures at Qwen3-30B-A3B shapes (16384 tokens, hidden 2048, heads 32/4
// of dim 128, expert dim 768).
#include <gtest/gtest.h>

#include <numeric>

#include "kernels/cpu/bias.h"
#include "kernels/cpu/clamped_swiglu.h"
#include "kernels/cpu/embedding.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"
#include "kernels/cpu/sigmoid_gate.h"
#include "kernels/cpu/swiglu.h"
#include "kernels/cuda/bias.cuh"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/clamped_swiglu.cuh"
#include "kernels/cuda/embedding.cuh"
#include "kernels/cuda/rmsnorm.cuh"
#include "kernels/cuda/rope_qknorm.cuh"
#include "kernels/cuda/sigmoid_gate.cuh"
#include "kernels/cuda/swiglu.cuh"
#include "test_cuda_common.h"

namespace {

using mf::DType;
using mf::cuda::bf16;
using namespace mf::test;

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// casts

TEST(CudaCast, RoundTripsBitExactlyIncludingSpecialValues) {
    std::mt19937 rng(1);
    for (const int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{8}, int64_t{1000003}}) {
        for (const int64_t offset : {int64_t{0}, int64_t{1}}) {  // 1: misaligned, element path
            std::vector<float> x = random_f32(rng, static_cast<size_t>(n), -1e3f, 1e3f);
            const float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, 3.0e38f, 1e-40f, 1.00390625f};
            for (size_t i = 0; i < x.size() && i < 8; ++i) x[i] = specials[i];
            DeviceBuffer src((static_cast<size_t>(n) + 1) * 4), dst((static_cast<size_t>(n) + 1) * 2);
            upload(src.as<float>(offset), x);
            dst.poison();
            mf::cuda::cast_f32_to_bf16(dst.as<bf16>(offset), src.as<float>(offset), n, nullptr);
            device_sync();
            const std::vector<uint16_t> got = download<uint16_t>(dst.as<bf16>(offset), static_cast<size_t>(n));
            std::vector<uint16_t> want(static_cast<size_t>(n));
            for (size_t i = 0; i < want.size(); ++i) want[i] = mf::f32_to_bf16(x[i]);
            // NaN payloads may differ; compare NaN-ness for those, bits otherwise.
            for (size_t i = 0; i < want.size(); ++i) {
                if (std::isnan(x[i])) {
                    EXPECT_TRUE(std::isnan(mf::bf16_to_f32(got[i])));
                    want[i] = got[i];
                }
            }
            expect_exact(got, want, "cast f32->bf16 n=" + std::to_string(n) + " offset=" + std::to_string(offset));

            DeviceBuffer back((static_cast<size_t>(n) + 1) * 4);
            back.poison();
            mf::cuda::cast_bf16_to_f32(back.as<float>(offset), dst.as<bf16>(offset), n, nullptr);
            device_sync();
            const std::vector<float> round = download<float>(back.as<float>(offset), static_cast<size_t>(n));
            std::vector<float> want_f(static_cast<size_t>(n));
            for (size_t i = 0; i < want_f.size(); ++i) want_f[i] = mf::bf16_to_f32(got[i]);
            expect_exact(round, want_f, "cast bf16->f32 n=" + std::to_string(n) + " offset=" + std::to_string(offset));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// embedding

struct EmbeddingCase {
    int64_t N, V, C, offset;
};

TEST(CudaEmbedding, ForwardCopiesRowsExactly) {
    std::mt19937 rng(2);
    for (const EmbeddingCase& s : {EmbeddingCase{37, 50, 64, 0}, EmbeddingCase{5, 7, 13, 0},
                                   EmbeddingCase{64, 1000, 2048, 0}, EmbeddingCase{9, 11, 64, 1}}) {
        const std::vector<float> wte = random_bf16(rng, static_cast<size_t>(s.V * s.C));
        std::vector<int32_t> ids(static_cast<size_t>(s.N));
        for (auto& id : ids) id = static_cast<int32_t>(rng() % s.V);
        std::vector<float> ref(static_cast<size_t>(s.N * s.C));
        mf::cpu::embedding_forward(ref.data(), ids.data(), wte.data(), s.N, s.C);

        DeviceBuffer d_wte((wte.size() + 1) * 2), d_out((ref.size() + 1) * 2);
        upload_bf16(d_wte.as<bf16>(s.offset), wte);
        DeviceBuffer d_ids = device_copy(ids);
        d_out.poison();
        mf::cuda::embedding_forward(d_out.as<bf16>(s.offset), d_ids.as<int32_t>(), d_wte.as<bf16>(s.offset), s.N, s.V,
                                    s.C, nullptr);
        device_sync();
        expect_exact(download_bf16(d_out.as<bf16>(s.offset), ref.size()), ref,
                     "embedding fwd N=" + std::to_string(s.N) + " C=" + std::to_string(s.C));
    }
}

TEST(CudaEmbedding, ForwardGivesZeroRowsForInvalidIds) {
    std::mt19937 rng(3);
    const int64_t N = 4, V = 6, C = 16;
    const std::vector<float> wte = random_bf16(rng, static_cast<size_t>(V * C));
    const std::vector<int32_t> ids = {2, -1, 6, 5};
    DeviceBuffer d_wte = device_bf16(wte), d_ids = device_copy(ids), d_out(static_cast<size_t>(N * C) * 2);
    d_out.poison();
    mf::cuda::embedding_forward(d_out.as<bf16>(), d_ids.as<int32_t>(), d_wte.as<bf16>(), N, V, C, nullptr);
    device_sync();
    std::vector<float> want(static_cast<size_t>(N * C), 0.0f);
    std::copy_n(wte.begin() + 2 * C, C, want.begin());
    std::copy_n(wte.begin() + 5 * C, C, want.begin() + 3 * C);
    expect_exact(download_bf16(d_out.as<bf16>(), want.size()), want, "embedding fwd invalid ids");
}

TEST(CudaEmbedding, BackwardMatchesCpuAndIsDeterministic) {
    std::mt19937 rng(4);
    for (const EmbeddingCase& s : {EmbeddingCase{37, 50, 64, 0}, EmbeddingCase{300, 7, 13, 0},
                                   EmbeddingCase{2000, 500, 2048, 0}, EmbeddingCase{64, 9, 72, 1}}) {
        for (const DType dtype : {DType::f32, DType::bf16}) {
            const std::string name = std::string("embedding bwd ") + mf::dtype_name(dtype) +
                                     " N=" + std::to_string(s.N) + " C=" + std::to_string(s.C);
            std::vector<int32_t> ids(static_cast<size_t>(s.N));
            // A third of the tokens share one hot id; the rest are spread (some ids never appear).
            for (size_t n = 0; n < ids.size(); ++n) ids[n] = static_cast<int32_t>(n % 3 == 0 ? 3 % s.V : rng() % s.V);
            const std::vector<float> dout = random_bf16(rng, static_cast<size_t>(s.N * s.C));
            std::vector<float> dwte0 = random_f32(rng, static_cast<size_t>(s.V * s.C));
            if (dtype == DType::bf16) dwte0 = round_bf16(dwte0);
            std::vector<float> ref = dwte0;
            mf::cpu::embedding_backward(ref.data(), dout.data(), ids.data(), s.N, s.C);

            const size_t esize = mf::dtype_size(dtype);
            DeviceBuffer d_ids = device_copy(ids);
            DeviceBuffer d_dwte((dwte0.size() + 1) * esize);
            const size_t scratch_bytes = mf::cuda::embedding_backward_scratch_bytes(s.N, s.V);
            DeviceBuffer scratch(scratch_bytes);
            std::vector<float> results[2];
            for (auto& result : results) {
                void* dwte = static_cast<char*>(d_dwte.as<void>()) + s.offset * esize;
                if (dtype == DType::f32) {
                    upload(dwte, dwte0);
                } else {
                    upload_bf16(dwte, dwte0);
                }
                scratch.poison();
                // offset 1 misaligns dwte and dout together (element path).
                DeviceBuffer d_dout_shifted((dout.size() + 1) * 2);
                upload_bf16(d_dout_shifted.as<bf16>(s.offset), dout);
                mf::cuda::embedding_backward(dwte, dtype, d_dout_shifted.as<bf16>(s.offset), d_ids.as<int32_t>(), s.N,
                                             s.V, s.C, scratch.as<void>(), scratch_bytes, nullptr);
                device_sync();
                result = dtype == DType::f32 ? download<float>(dwte, dwte0.size()) : download_bf16(dwte, dwte0.size());
            }
            if (dtype == DType::f32) {
                expect_reduction(results[0], ref, ref, name);
            } else {
                expect_reduction_bf16_out(results[0], ref, name);
            }
            expect_exact(results[1], results[0], name + " rerun");
        }
    }
}

TEST(CudaEmbedding, BackwardSkipsInvalidIds) {
    std::mt19937 rng(5);
    const int64_t N = 6, V = 4, C = 16;
    const std::vector<int32_t> ids = {1, -5, 4, 1, 3, 100};
    const std::vector<float> dout = random_bf16(rng, static_cast<size_t>(N * C));
    std::vector<float> ref(static_cast<size_t>(V * C), 0.0f);
    for (int64_t n = 0; n < N; ++n) {
        if (ids[n] < 0 || ids[n] >= V) continue;
        for (int64_t c = 0; c < C; ++c) ref[ids[n] * C + c] += dout[n * C + c];
    }
    DeviceBuffer d_dout = device_bf16(dout), d_ids = device_copy(ids), d_dwte(ref.size() * 4);
    d_dwte.zero();
    const size_t scratch_bytes = mf::cuda::embedding_backward_scratch_bytes(N, V);
    DeviceBuffer scratch(scratch_bytes);
    mf::cuda::embedding_backward(d_dwte.as<void>(), DType::f32, d_dout.as<bf16>(), d_ids.as<int32_t>(), N, V, C,
                                 scratch.as<void>(), scratch_bytes, nullptr);
    device_sync();
    expect_reduction(download<float>(d_dwte.as<void>(), ref.size()), ref, ref, "embedding bwd invalid ids");
}

TEST(CudaEmbedding, RejectsBadArguments) {
    DeviceBuffer scratch(1024);
    EXPECT_THROW(mf::cuda::embedding_backward(scratch.as<void>(), DType::f32, scratch.as<bf16>(), scratch.as<int32_t>(),
                                              4, 10, 8, scratch.as<void>(), 1, nullptr),
                 mf::Error);
    EXPECT_THROW(mf::cuda::embedding_forward(nullptr, nullptr, nullptr, -1, 10, 8, nullptr), mf::Error);
}

// ---------------------------------------------------------------------------------------------
// RMSNorm

struct RowsCase {
    int64_t N, C;
};

TEST(CudaRmsnorm, ForwardMatchesCpu) {
    std::mt19937 rng(6);
    const float eps = 1e-6f;
    for (const RowsCase& s :
         {RowsCase{33, 2048}, RowsCase{7, 100}, RowsCase{3, 4104}, RowsCase{1, 8}, RowsCase{300, 72}}) {
        for (const bool in_place : {false, true}) {
            const std::string name = std::string("rmsnorm fwd") + (in_place ? " in-place" : "") +
                                     " N=" + std::to_string(s.N) + " C=" + std::to_string(s.C);
            const std::vector<float> x = random_bf16(rng, static_cast<size_t>(s.N * s.C), -2.0f, 2.0f);
            const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.C), 0.5f, 1.5f);
            std::vector<float> ref(x.size()), rstd_ref(static_cast<size_t>(s.N));
            mf::cpu::rmsnorm_forward(ref.data(), rstd_ref.data(), x.data(), w.data(), s.N, s.C, eps);

            DeviceBuffer d_x = device_bf16(x), d_w = device_bf16(w), d_out(x.size() * 2), d_rstd(rstd_ref.size() * 4);
            d_out.poison();
            d_rstd.poison();
            bf16* out = in_place ? d_x.as<bf16>() : d_out.as<bf16>();
            mf::cuda::rmsnorm_forward(out, d_rstd.as<float>(), d_x.as<bf16>(), d_w.as<bf16>(), s.N, s.C, eps, nullptr);
            device_sync();
            expect_close_bf16(download_bf16(out, ref.size()), ref, name);
            const std::vector<float> rstd = download<float>(d_rstd.as<void>(), rstd_ref.size());
            expect_reduction(rstd, rstd_ref, rstd_ref, name + " rstd");
        }
    }
}

TEST(CudaRmsnorm, BackwardMatchesCpu) {
    std::mt19937 rng(7);
    const float eps = 1e-6f;
    for (const RowsCase& s : {RowsCase{33, 2048}, RowsCase{5, 100}, RowsCase{5000, 24}, RowsCase{3, 4104}}) {
        for (const bool accumulate : {false, true}) {
            for (const DType dtype : {DType::f32, DType::bf16}) {
                const std::string name = std::string("rmsnorm bwd ") + mf::dtype_name(dtype) +
                                         (accumulate ? " += " : " = ") + "N=" + std::to_string(s.N) +
                                         " C=" + std::to_string(s.C);
                const size_t n = static_cast<size_t>(s.N * s.C);
                const std::vector<float> x = random_bf16(rng, n, -2.0f, 2.0f);
                const std::vector<float> w = random_bf16(rng, static_cast<size_t>(s.C), 0.5f, 1.5f);
                const std::vector<float> dout = random_bf16(rng, n);
                std::vector<float> y(n), rstd(static_cast<size_t>(s.N));
                mf::cpu::rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), s.N, s.C, eps);
                const std::vector<float> dinp0 = accumulate ? random_bf16(rng, n) : std::vector<float>(n, 0.0f);
                std::vector<float> dw0 = random_f32(rng, static_cast<size_t>(s.C));
                if (dtype == DType::bf16) dw0 = round_bf16(dw0);
                std::vector<float> dinp_ref = dinp0, dw_ref = dw0;
                mf::cpu::rmsnorm_backward(dinp_ref.data(), dw_ref.data(), dout.data(), x.data(), w.data(), rstd.data(),
                                          s.N, s.C);

                DeviceBuffer d_x = device_bf16(x), d_w = device_bf16(w), d_dout = device_bf16(dout);
                DeviceBuffer d_rstd = device_copy(rstd), d_dinp = device_bf16(dinp0);
                if (!accumulate) d_dinp.poison();
                DeviceBuffer d_dw(dw0.size() * 4);
                if (dtype == DType::f32) {
                    upload(d_dw.as<void>(), dw0);
                } else {
                    upload_bf16(d_dw.as<void>(), dw0);
                }
                const size_t scratch_bytes = mf::cuda::rmsnorm_backward_scratch_bytes(s.N, s.C);
                DeviceBuffer scratch(scratch_bytes);
                scratch.poison();
                mf::cuda::rmsnorm_backward(d_dinp.as<bf16>(), accumulate, d_dw.as<void>(), dtype, d_dout.as<bf16>(),
                                           d_x.as<bf16>(), d_w.as<bf16>(), d_rstd.as<float>(), s.N, s.C,
                                           scratch.as<void>(), scratch_bytes, nullptr);
                device_sync();
                expect_close_bf16(download_bf16(d_dinp.as<void>(), n), dinp_ref, name + " dinp");
                if (dtype == DType::f32) {
                    expect_reduction(download<float>(d_dw.as<void>(), dw0.size()), dw_ref, dw_ref, name + " dweight");
                } else {
                    expect_reduction_bf16_out(download_bf16(d_dw.as<void>(), dw0.size()), dw_ref, name + " dweight");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// QK-norm + RoPE

struct RopeCase {
    int64_t N, Hq, Hkv, D;
    float theta;
};

struct RopeReference {
    std::vector<float> q_out, k_out, q_rstd, k_rstd;
};

RopeReference rope_reference(const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& qw,
                             const std::vector<float>& kw, const std::vector<int32_t>& pos, const RopeCase& s,
                             float eps) {
    RopeReference r;
    r.q_out.resize(q.size());
    r.k_out.resize(k.size());
    r.q_rstd.resize(static_cast<size_t>(s.N * s.Hq));
    r.k_rstd.resize(static_cast<size_t>(s.N * s.Hkv));
    mf::cpu::rmsnorm_forward(r.q_out.data(), r.q_rstd.data(), q.data(), qw.data(), s.N * s.Hq, s.D, eps);
    mf::cpu::rmsnorm_forward(r.k_out.data(), r.k_rstd.data(), k.data(), kw.data(), s.N * s.Hkv, s.D, eps);
    mf::cpu::rope_forward(r.q_out.data(), pos.data(), s.N, s.Hq, s.D, s.theta);
    mf::cpu::rope_forward(r.k_out.data(), pos.data(), s.N, s.Hkv, s.D, s.theta);
    return r;
}

// The last two: 72 heads of 8 lanes need two passes of a 512-thread block per token; 2500 tokens
// give backward blocks several tokens each.
const RopeCase kRopeCases[] = {{19, 4, 2, 128, 1e6f}, {7, 3, 1, 36, 1e4f},   {5, 2, 2, 256, 1e6f},
                               {3, 5, 0, 64, 1e4f},   {9, 64, 8, 128, 1e6f}, {2500, 8, 2, 128, 1e6f}};

TEST(CudaRopeQknorm, ForwardMatchesCpu) {
    std::mt19937 rng(8);
    const float eps = 1e-6f;
    for (const RopeCase& s : kRopeCases) {
        for (const bool in_place : {false, true}) {
            const std::string name = std::string("rope_qknorm fwd") + (in_place ? " in-place" : "") +
                                     " N=" + std::to_string(s.N) + " H=" + std::to_string(s.Hq) + "/" +
                                     std::to_string(s.Hkv) + " D=" + std::to_string(s.D);
            const std::vector<float> q = random_bf16(rng, static_cast<size_t>(s.N * s.Hq * s.D), -3.0f, 3.0f);
            const std::vector<float> k = random_bf16(rng, static_cast<size_t>(s.N * s.Hkv * s.D), -3.0f, 3.0f);
            const std::vector<float> qw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
            const std::vector<float> kw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
            std::vector<int32_t> pos(static_cast<size_t>(s.N));
            for (auto& p : pos) p = static_cast<int32_t>(rng() % 4096);
            const RopeReference ref = rope_reference(q, k, qw, kw, pos, s, eps);

            DeviceBuffer d_q = device_bf16(q), d_k = device_bf16(k), d_qw = device_bf16(qw), d_kw = device_bf16(kw);
            DeviceBuffer d_pos = device_copy(pos), d_qo(q.size() * 2), d_ko(k.size() * 2);
            DeviceBuffer d_qr(ref.q_rstd.size() * 4), d_kr(ref.k_rstd.size() * 4);
            d_qo.poison();
            d_ko.poison();
            d_qr.poison();
            d_kr.poison();
            bf16* qo = in_place ? d_q.as<bf16>() : d_qo.as<bf16>();
            bf16* ko = in_place ? d_k.as<bf16>() : d_ko.as<bf16>();
            mf::cuda::rope_qknorm_forward(qo, ko, d_qr.as<float>(), d_kr.as<float>(), d_q.as<bf16>(), d_k.as<bf16>(),
                                          d_qw.as<bf16>(), d_kw.as<bf16>(), d_pos.as<int32_t>(), s.N, s.Hq, s.Hkv, s.D,
                                          s.theta, eps, nullptr);
            device_sync();
            expect_close_bf16(download_bf16(qo, q.size()), ref.q_out, name + " q");
            expect_close_bf16(download_bf16(ko, k.size()), ref.k_out, name + " k");
            const std::vector<float> q_rstd = download<float>(d_qr.as<void>(), ref.q_rstd.size());
            const std::vector<float> k_rstd = download<float>(d_kr.as<void>(), ref.k_rstd.size());
            expect_reduction(q_rstd, ref.q_rstd, ref.q_rstd, name + " q rstd");
            expect_reduction(k_rstd, ref.k_rstd, ref.k_rstd, name + " k rstd");
        }
    }
}

TEST(CudaRopeQknorm, BackwardMatchesCpu) {
    std::mt19937 rng(9);
    const float eps = 1e-6f;
    for (const RopeCase& s : kRopeCases) {
        for (const DType dtype : {DType::f32, DType::bf16}) {
            const std::string name = std::string("rope_qknorm bwd ") + mf::dtype_name(dtype) +
                                     " N=" + std::to_string(s.N) + " H=" + std::to_string(s.Hq) + "/" +
                                     std::to_string(s.Hkv) + " D=" + std::to_string(s.D);
            const size_t nq = static_cast<size_t>(s.N * s.Hq * s.D), nk = static_cast<size_t>(s.N * s.Hkv * s.D);
            const std::vector<float> q = random_bf16(rng, nq, -3.0f, 3.0f), k = random_bf16(rng, nk, -3.0f, 3.0f);
            const std::vector<float> qw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
            const std::vector<float> kw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
            const std::vector<float> dyq = random_bf16(rng, nq), dyk = random_bf16(rng, nk);
            std::vector<int32_t> pos(static_cast<size_t>(s.N));
            for (auto& p : pos) p = static_cast<int32_t>(rng() % 4096);
            const RopeReference fwd = rope_reference(q, k, qw, kw, pos, s, eps);

            // CPU: inverse rotation, then the RMSNorm backward with C = D over N·H rows.
            std::vector<float> dnq = dyq, dnk = dyk;
            mf::cpu::rope_backward(dnq.data(), pos.data(), s.N, s.Hq, s.D, s.theta);
            mf::cpu::rope_backward(dnk.data(), pos.data(), s.N, s.Hkv, s.D, s.theta);
            std::vector<float> dq_ref(nq, 0.0f), dk_ref(nk, 0.0f);
            std::vector<float> dqw0 = random_f32(rng, static_cast<size_t>(s.D));
            std::vector<float> dkw0 = random_f32(rng, static_cast<size_t>(s.D));
            if (dtype == DType::bf16) {
                dqw0 = round_bf16(dqw0);
                dkw0 = round_bf16(dkw0);
            }
            std::vector<float> dqw_ref = dqw0, dkw_ref = dkw0;
            mf::cpu::rmsnorm_backward(dq_ref.data(), dqw_ref.data(), dnq.data(), q.data(), qw.data(), fwd.q_rstd.data(),
                                      s.N * s.Hq, s.D);
            mf::cpu::rmsnorm_backward(dk_ref.data(), dkw_ref.data(), dnk.data(), k.data(), kw.data(), fwd.k_rstd.data(),
                                      s.N * s.Hkv, s.D);

            DeviceBuffer d_q = device_bf16(q), d_k = device_bf16(k), d_qw = device_bf16(qw), d_kw = device_bf16(kw);
            DeviceBuffer d_dyq = device_bf16(dyq), d_dyk = device_bf16(dyk), d_pos = device_copy(pos);
            DeviceBuffer d_qr = device_copy(fwd.q_rstd), d_kr = device_copy(fwd.k_rstd);
            DeviceBuffer d_dq(nq * 2), d_dk(nk * 2), d_dqw(static_cast<size_t>(s.D) * 4),
                d_dkw(static_cast<size_t>(s.D) * 4);
            d_dq.poison();
            d_dk.poison();
            if (dtype == DType::f32) {
                upload(d_dqw.as<void>(), dqw0);
                upload(d_dkw.as<void>(), dkw0);
            } else {
                upload_bf16(d_dqw.as<void>(), dqw0);
                upload_bf16(d_dkw.as<void>(), dkw0);
            }
            const size_t scratch_bytes = mf::cuda::rope_qknorm_backward_scratch_bytes(s.N, s.D);
            DeviceBuffer scratch(scratch_bytes);
            scratch.poison();
            mf::cuda::rope_qknorm_backward(d_dq.as<bf16>(), d_dk.as<bf16>(), d_dqw.as<void>(), d_dkw.as<void>(), dtype,
                                           d_dyq.as<bf16>(), d_dyk.as<bf16>(), d_q.as<bf16>(), d_k.as<bf16>(),
                                           d_qw.as<bf16>(), d_kw.as<bf16>(), d_qr.as<float>(), d_kr.as<float>(),
                                           d_pos.as<int32_t>(), s.N, s.Hq, s.Hkv, s.D, s.theta, scratch.as<void>(),
                                           scratch_bytes, nullptr);
            device_sync();
            expect_close_bf16(download_bf16(d_dq.as<void>(), nq), dq_ref, name + " dq");
            expect_close_bf16(download_bf16(d_dk.as<void>(), nk), dk_ref, name + " dk");
            if (dtype == DType::f32) {
                expect_reduction(download<float>(d_dqw.as<void>(), dqw0.size()), dqw_ref, dqw_ref, name + " dq_weight");
                expect_reduction(download<float>(d_dkw.as<void>(), dkw0.size()), dkw_ref, dkw_ref, name + " dk_weight");
            } else {
                expect_reduction_bf16_out(download_bf16(d_dqw.as<void>(), dqw0.size()), dqw_ref, name + " dq_weight");
                expect_reduction_bf16_out(download_bf16(d_dkw.as<void>(), dkw0.size()), dkw_ref, name + " dk_weight");
            }
        }
    }
}

// The rotation given by bf16 tables cos, sin [N, D] (transformers' position_embeddings) with halves
// that differ, forward and backward, against the CPU's norm + table rotation (f32 weight grads).
TEST(CudaRopeQknorm, TablesMatchCpu) {
    std::mt19937 rng(10);
    const float eps = 1e-6f;
    for (const RopeCase& s : kRopeCases) {
        const std::string name = "rope_qknorm tables N=" + std::to_string(s.N) + " H=" + std::to_string(s.Hq) + "/" +
                                 std::to_string(s.Hkv) + " D=" + std::to_string(s.D);
        const size_t nq = static_cast<size_t>(s.N * s.Hq * s.D), nk = static_cast<size_t>(s.N * s.Hkv * s.D);
        const size_t nt = static_cast<size_t>(s.N * s.D);
        const std::vector<float> q = random_bf16(rng, nq, -3.0f, 3.0f), k = random_bf16(rng, nk, -3.0f, 3.0f);
        const std::vector<float> qw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
        const std::vector<float> kw = random_bf16(rng, static_cast<size_t>(s.D), 0.5f, 1.5f);
        const std::vector<float> cos = random_bf16(rng, nt), sin = random_bf16(rng, nt);
        const std::vector<float> dyq = random_bf16(rng, nq), dyk = random_bf16(rng, nk);

        std::vector<float> q_ref(nq), k_ref(nk), qr_ref(static_cast<size_t>(s.N * s.Hq));
        std::vector<float> kr_ref(static_cast<size_t>(s.N * s.Hkv));
        mf::cpu::rmsnorm_forward(q_ref.data(), qr_ref.data(), q.data(), qw.data(), s.N * s.Hq, s.D, eps);
        mf::cpu::rmsnorm_forward(k_ref.data(), kr_ref.data(), k.data(), kw.data(), s.N * s.Hkv, s.D, eps);
        mf::cpu::rope_table_forward(q_ref.data(), cos.data(), sin.data(), s.N, s.Hq, s.D);
        mf::cpu::rope_table_forward(k_ref.data(), cos.data(), sin.data(), s.N, s.Hkv, s.D);
        std::vector<float> dnq = dyq, dnk = dyk, dq_ref(nq, 0.0f), dk_ref(nk, 0.0f);
        std::vector<float> dqw_ref(static_cast<size_t>(s.D), 0.0f), dkw_ref(static_cast<size_t>(s.D), 0.0f);
        mf::cpu::rope_table_backward(dnq.data(), cos.data(), sin.data(), s.N, s.Hq, s.D);
        mf::cpu::rope_table_backward(dnk.data(), cos.data(), sin.data(), s.N, s.Hkv, s.D);
        mf::cpu::rmsnorm_backward(dq_ref.data(), dqw_ref.data(), dnq.data(), q.data(), qw.data(), qr_ref.data(),
                                  s.N * s.Hq, s.D);
        mf::cpu::rmsnorm_backward(dk_ref.data(), dkw_ref.data(), dnk.data(), k.data(), kw.data(), kr_ref.data(),
                                  s.N * s.Hkv, s.D);

        DeviceBuffer d_q = device_bf16(q), d_k = device_bf16(k), d_qw = device_bf16(qw), d_kw = device_bf16(kw);
        DeviceBuffer d_cos = device_bf16(cos), d_sin = device_bf16(sin), d_qo(nq * 2), d_ko(nk * 2);
        DeviceBuffer d_qr(qr_ref.size() * 4), d_kr(kr_ref.size() * 4);
        d_qo.poison();
        d_ko.poison();
        mf::cuda::rope_qknorm_table_forward(d_qo.as<bf16>(), d_ko.as<bf16>(), d_qr.as<float>(), d_kr.as<float>(),
                                            d_q.as<bf16>(), d_k.as<bf16>(), d_qw.as<bf16>(), d_kw.as<bf16>(),
                                            d_cos.as<bf16>(), d_sin.as<bf16>(), s.N, s.Hq, s.Hkv, s.D, eps, nullptr);
        device_sync();
        expect_close_bf16(download_bf16(d_qo.as<void>(), nq), q_ref, name + " q");
        expect_close_bf16(download_bf16(d_ko.as<void>(), nk), k_ref, name + " k");

        DeviceBuffer d_dyq = device_bf16(dyq), d_dyk = device_bf16(dyk), d_dq(nq * 2), d_dk(nk * 2);
        DeviceBuffer d_dqw = device_copy(std::vector<float>(static_cast<size_t>(s.D), 0.0f));
        DeviceBuffer d_dkw = device_copy(std::vector<float>(static_cast<size_t>(s.D), 0.0f));
        DeviceBuffer d_qr_ref = device_copy(qr_ref), d_kr_ref = device_copy(kr_ref);
        d_dq.poison();
        d_dk.poison();
        const size_t scratch_bytes = mf::cuda::rope_qknorm_backward_scratch_bytes(s.N, s.D);
        DeviceBuffer scratch(scratch_bytes);
        scratch.poison();
        mf::cuda::rope_qknorm_table_backward(d_dq.as<bf16>(), d_dk.as<bf16>(), d_dqw.as<void>(), d_dkw.as<void>(),
                                             DType::f32, d_dyq.as<bf16>(), d_dyk.as<bf16>(), d_q.as<bf16>(),
                                             d_k.as<bf16>(), d_qw.as<bf16>(), d_kw.as<bf16>(), d_qr_ref.as<float>(),
                                             d_kr_ref.as<float>(), d_cos.as<bf16>(), d_sin.as<bf16>(), s.N, s.Hq, s.Hkv,
                                             s.D, scratch.as<void>(), scratch_bytes, nullptr);
        device_sync();
        expect_close_bf16(download_bf16(d_dq.as<void>(), nq), dq_ref, name + " dq");
        expect_close_bf16(download_bf16(d_dk.as<void>(), nk), dk_ref, name + " dk");
        if (s.Hq > 0) {
            expect_reduction(download<float>(d_dqw.as<void>(), dqw_ref.size()), dqw_ref, dqw_ref, name + " dq_weight");
        }
        if (s.Hkv > 0) {
            expect_reduction(download<float>(d_dkw.as<void>(), dkw_ref.size()), dkw_ref, dkw_ref, name + " dk_weight");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RoPE alone (partial rotary)

struct PartialRopeCase {
    int64_t N, Hq, Hkv, D, R;
    float theta;
};

// 16-byte vectors where R/2 and D − R are multiples of 8 (the first three, the 2500-token one and
// the last), single elements otherwise (R/2 = 18, 10, 12; D odd); no key heads; one token.
const PartialRopeCase kPartialRopeCases[] = {
    {19, 4, 2, 128, 64, 1e6f},   {9, 64, 8, 128, 128, 1e6f}, {4, 2, 1, 96, 48, 1e4f}, {7, 3, 1, 36, 36, 1e4f},
    {1, 1, 1, 80, 20, 1e4f},     {6, 3, 2, 72, 24, 1e6f},    {5, 2, 1, 9, 4, 1e4f},   {3, 5, 0, 64, 32, 1e4f},
    {2500, 8, 2, 128, 32, 1e6f}, {11, 4, 4, 256, 256, 1e6f}};

std::string rope_name(const char* what, const PartialRopeCase& s) {
    return std::string(what) + " N=" + std::to_string(s.N) + " H=" + std::to_string(s.Hq) + "/" +
           std::to_string(s.Hkv) + " D=" + std::to_string(s.D) + " R=" + std::to_string(s.R);
}

// The dims [R, D) of every head of x [rows, D].
std::vector<float> pass_through(const std::vector<float>& x, int64_t D, int64_t R) {
    std::vector<float> out;
    for (size_t row = 0; row < x.size() / static_cast<size_t>(D); ++row)
        out.insert(out.end(), x.begin() + static_cast<int64_t>(row) * D + R,
                   x.begin() + static_cast<int64_t>(row + 1) * D);
    return out;
}

// Forward (sign +1) or backward (sign −1) of RoPE alone on the GPU against the CPU kernel, out of
// place and in place; pass-through dims exact; a second run gives the same bits.
void check_rope_alone(const PartialRopeCase& s, bool forward, std::mt19937& rng) {
    const size_t nq = static_cast<size_t>(s.N * s.Hq * s.D), nk = static_cast<size_t>(s.N * s.Hkv * s.D);
    const std::vector<float> q = random_bf16(rng, nq, -3.0f, 3.0f), k = random_bf16(rng, nk, -3.0f, 3.0f);
    std::vector<int32_t> pos(static_cast<size_t>(s.N));
    for (auto& p : pos) p = static_cast<int32_t>(rng() % 8192);
    std::vector<float> q_ref = q, k_ref = k;
    auto cpu = forward ? static_cast<void (*)(float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float)>(
                             mf::cpu::rope_forward)
                       : static_cast<void (*)(float*, const int32_t*, int64_t, int64_t, int64_t, int64_t, float)>(
                             mf::cpu::rope_backward);
    cpu(q_ref.data(), pos.data(), s.N, s.Hq, s.D, s.R, s.theta);
    cpu(k_ref.data(), pos.data(), s.N, s.Hkv, s.D, s.R, s.theta);
    auto gpu = forward ? mf::cuda::rope_forward : mf::cuda::rope_backward;

    DeviceBuffer d_pos = device_copy(pos);
    for (const bool in_place : {false, true}) {
        const std::string name = rope_name(forward ? "rope fwd" : "rope bwd", s) + (in_place ? " in-place" : "");
        std::vector<float> runs[2][2];  // [run][q, k]
        for (auto& run : runs) {
            DeviceBuffer d_q = device_bf16(q), d_k = device_bf16(k), d_qo(nq * 2), d_ko(nk * 2);
            d_qo.poison();
            d_ko.poison();
            bf16* qo = in_place ? d_q.as<bf16>() : d_qo.as<bf16>();
            bf16* ko = in_place ? d_k.as<bf16>() : d_ko.as<bf16>();
            gpu(qo, ko, d_q.as<bf16>(), d_k.as<bf16>(), d_pos.as<int32_t>(), s.N, s.Hq, s.Hkv, s.D, s.R, s.theta,
                nullptr);
            device_sync();
            run[0] = download_bf16(qo, nq);
            run[1] = download_bf16(ko, nk);
        }
        expect_close_bf16(runs[0][0], q_ref, name + " q");
        expect_close_bf16(runs[0][1], k_ref, name + " k");
        expect_exact(pass_through(runs[0][0], s.D, s.R), pass_through(q, s.D, s.R), name + " q pass-through");
        expect_exact(pass_through(runs[0][1], s.D, s.R), pass_through(k, s.D, s.R), name + " k pass-through");
        expect_exact(runs[1][0], runs[0][0], name + " q rerun");
        expect_exact(runs[1][1], runs[0][1], name + " k rerun");
    }
}

TEST(CudaRope, ForwardMatchesCpu) {
    std::mt19937 rng(12);
    for (const PartialRopeCase& s : kPartialRopeCases) check_rope_alone(s, true, rng);
}

TEST(CudaRope, BackwardMatchesCpu) {
    std::mt19937 rng(13);
    for (const PartialRopeCase& s : kPartialRopeCases) check_rope_alone(s, false, rng);
}

TEST(CudaRope, FullRotaryEqualsTheQknormKernelsRotation) {
    // With unit norm weights and inputs already of unit RMS per head, QK-norm + RoPE is a rotation
    // of (almost) the input: the whole-head RoPE alone must agree with it to the bf16 rule.
    std::mt19937 rng(14);
    const int64_t N = 13, Hq = 4, Hkv = 2, D = 128;
    const float theta = 1e6f;
    const size_t nq = static_cast<size_t>(N * Hq * D), nk = static_cast<size_t>(N * Hkv * D);
    const std::vector<float> q = random_bf16(rng, nq, -2.0f, 2.0f), k = random_bf16(rng, nk, -2.0f, 2.0f);
    std::vector<int32_t> pos(static_cast<size_t>(N));
    for (auto& p : pos) p = static_cast<int32_t>(rng() % 4096);
    std::vector<float> qn(nq), kn(nk), q_rstd(static_cast<size_t>(N * Hq)), k_rstd(static_cast<size_t>(N * Hkv));
    const std::vector<float> ones(static_cast<size_t>(D), 1.0f);
    mf::cpu::rmsnorm_forward(qn.data(), q_rstd.data(), q.data(), ones.data(), N * Hq, D, 0.0f);
    mf::cpu::rmsnorm_forward(kn.data(), k_rstd.data(), k.data(), ones.data(), N * Hkv, D, 0.0f);
    qn = round_bf16(qn);
    kn = round_bf16(kn);
    DeviceBuffer d_q = device_bf16(qn), d_k = device_bf16(kn), d_w = device_bf16(ones), d_pos = device_copy(pos);
    DeviceBuffer d_q1(nq * 2), d_k1(nk * 2), d_q2(nq * 2), d_k2(nk * 2), d_qr(q_rstd.size() * 4),
        d_kr(k_rstd.size() * 4);
    mf::cuda::rope_forward(d_q1.as<bf16>(), d_k1.as<bf16>(), d_q.as<bf16>(), d_k.as<bf16>(), d_pos.as<int32_t>(), N, Hq,
                           Hkv, D, D, theta, nullptr);
    mf::cuda::rope_qknorm_forward(d_q2.as<bf16>(), d_k2.as<bf16>(), d_qr.as<float>(), d_kr.as<float>(), d_q.as<bf16>(),
                                  d_k.as<bf16>(), d_w.as<bf16>(), d_w.as<bf16>(), d_pos.as<int32_t>(), N, Hq, Hkv, D,
                                  theta, 0.0f, nullptr);
    device_sync();
    expect_close_bf16(download_bf16(d_q1.as<void>(), nq), download_bf16(d_q2.as<void>(), nq), "rope vs qknorm q");
    expect_close_bf16(download_bf16(d_k1.as<void>(), nk), download_bf16(d_k2.as<void>(), nk), "rope vs qknorm k");
}

TEST(CudaRope, RejectsBadRotaryDim) {
    DeviceBuffer buf(4096), pos(64);
    for (const int64_t R : {int64_t{0}, int64_t{3}, int64_t{66}, int64_t{-2}})
        EXPECT_THROW(mf::cuda::rope_forward(buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(),
                                            pos.as<int32_t>(), 2, 1, 1, 64, R, 1e4f, nullptr),
                     mf::Error)
            << "rotary_dim " << R;
    EXPECT_THROW(mf::cuda::rope_backward(buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(), buf.as<bf16>(),
                                         pos.as<int32_t>(), 2, 1, 1, 512, 512, 1e4f, nullptr),
                 mf::Error)
        << "rotary_dim above 256";
}

// ---------------------------------------------------------------------------------------------
// bias

struct BiasCase {
    int64_t N, C, offset;
};

// Vector paths (C % 8 == 0, aligned), element paths (C odd or not a multiple of 8, or offset 1:
// misaligned), single rows, many row blocks (5000 rows; 4097: the last row block is empty).
const BiasCase kBiasCases[] = {{33, 2048, 0}, {7, 100, 0}, {1, 8, 0},     {1, 1, 0},    {300, 72, 0},
                               {5000, 24, 0}, {17, 64, 1}, {4097, 40, 0}, {9, 4099, 0}, {64, 7, 0}};

TEST(CudaBias, ForwardIsTheRoundedFp32Sum) {
    std::mt19937 rng(15);
    for (const BiasCase& s : kBiasCases) {
        const std::string name =
            "add_bias N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " offset=" + std::to_string(s.offset);
        const size_t n = static_cast<size_t>(s.N * s.C);
        const std::vector<float> x = random_bf16(rng, n, -4.0f, 4.0f), b = random_bf16(rng, static_cast<size_t>(s.C));
        std::vector<float> ref = x;
        mf::cpu::add_bias(ref.data(), b.data(), s.N, s.C);
        DeviceBuffer d_x((n + 1) * 2), d_b((b.size() + 1) * 2);
        upload_bf16(d_x.as<bf16>(s.offset), x);
        upload_bf16(d_b.as<bf16>(s.offset), b);
        mf::cuda::add_bias(d_x.as<bf16>(s.offset), d_b.as<bf16>(s.offset), s.N, s.C, nullptr);
        device_sync();
        // One fp32 addition of two bf16 values, rounded once: exactly the CPU sum rounded to bf16.
        expect_exact(download_bf16(d_x.as<bf16>(s.offset), n), round_bf16(ref), name);
    }
}

TEST(CudaBias, BackwardMatchesCpuAndIsDeterministic) {
    std::mt19937 rng(16);
    for (const BiasCase& s : kBiasCases) {
        for (const DType dtype : {DType::f32, DType::bf16}) {
            const bool f32 = dtype == DType::f32;
            const std::string name = std::string("bias_backward ") + mf::dtype_name(dtype) +
                                     " N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) +
                                     " offset=" + std::to_string(s.offset);
            const size_t n = static_cast<size_t>(s.N * s.C);
            const std::vector<float> dout = random_bf16(rng, n);
            std::vector<float> db0 = random_f32(rng, static_cast<size_t>(s.C));
            if (!f32) db0 = round_bf16(db0);
            std::vector<float> ref = db0;
            mf::cpu::bias_backward(ref.data(), dout.data(), s.N, s.C);

            DeviceBuffer d_dout((n + 1) * 2), d_db((db0.size() + 1) * 4);
            upload_bf16(d_dout.as<bf16>(s.offset), dout);
            const size_t scratch_bytes = mf::cuda::bias_backward_scratch_bytes(s.N, s.C);
            DeviceBuffer scratch(scratch_bytes);
            void* db = static_cast<char*>(d_db.as<void>()) + s.offset * mf::dtype_size(dtype);
            std::vector<float> results[2];
            for (auto& result : results) {
                upload_grad(db, db0, f32);
                scratch.poison();
                mf::cuda::bias_backward(db, dtype, d_dout.as<bf16>(s.offset), s.N, s.C, scratch.as<void>(),
                                        scratch_bytes, nullptr);
                device_sync();
                result = download_grad(db, db0.size(), f32);
            }
            if (f32)
                expect_reduction(results[0], ref, ref, name);
            else
                expect_reduction_bf16_out(results[0], ref, name);
            expect_exact(results[1], results[0], name + " rerun");
        }
    }
}

TEST(CudaBias, RejectsBadArguments) {
    DeviceBuffer buf(4096);
    EXPECT_THROW(mf::cuda::add_bias(buf.as<bf16>(), buf.as<bf16>(), -1, 8, nullptr), mf::Error);
    EXPECT_THROW(
        mf::cuda::bias_backward(buf.as<void>(), DType::f32, buf.as<bf16>(), 100, 8, buf.as<void>(), 16, nullptr),
        mf::Error)
        << "scratch too small";
    EXPECT_THROW(
        mf::cuda::bias_backward(buf.as<void>(), DType::i32, buf.as<bf16>(), 4, 8, buf.as<void>(), 4096, nullptr),
        mf::Error)
        << "integer dbias";
}

// ---------------------------------------------------------------------------------------------
// SwiGLU

TEST(CudaSwiglu, ForwardAndBackwardMatchCpu) {
    std::mt19937 rng(10);
    for (const RowsCase& s : {RowsCase{17, 768}, RowsCase{3, 13}, RowsCase{64, 8}}) {
        for (const bool in_place : {false, true}) {
            const std::string name = std::string("swiglu") + " N=" + std::to_string(s.N) + " I=" + std::to_string(s.C);
            const size_t n_in = static_cast<size_t>(s.N * 2 * s.C), n_out = static_cast<size_t>(s.N * s.C);
            std::vector<float> inp = random_bf16(rng, n_in, -8.0f, 8.0f);
            inp[0] = -100.0f;  // exp overflow: σ = 0
            inp[1] = 100.0f;
            const std::vector<float> dout = random_bf16(rng, n_out);
            std::vector<float> out_ref(n_out), dinp_ref(n_in);
            mf::cpu::swiglu_forward(out_ref.data(), inp.data(), s.N, s.C);
            mf::cpu::swiglu_backward(dinp_ref.data(), dout.data(), inp.data(), s.N, s.C);

            DeviceBuffer d_inp = device_bf16(inp), d_dout = device_bf16(dout), d_out(n_out * 2), d_dinp(n_in * 2);
            d_out.poison();
            d_dinp.poison();
            mf::cuda::swiglu_forward(d_out.as<bf16>(), d_inp.as<bf16>(), s.N, s.C, nullptr);
            bf16* dinp = in_place ? d_inp.as<bf16>() : d_dinp.as<bf16>();
            mf::cuda::swiglu_backward(dinp, d_dout.as<bf16>(), d_inp.as<bf16>(), s.N, s.C, nullptr);
            device_sync();
            if (!in_place) expect_close_bf16(download_bf16(d_out.as<void>(), n_out), out_ref, name + " fwd");
            expect_close_bf16(download_bf16(dinp, n_in), dinp_ref, name + (in_place ? " bwd in-place" : " bwd"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// gpt-oss's clamped, interleaved SwiGLU

TEST(CudaClampedSwiglu, ForwardAndBackwardMatchCpu) {
    std::mt19937 rng(11);
    const float alpha = 1.702f, limit = 7.0f;
    for (const RowsCase& s : {RowsCase{17, 768}, RowsCase{3, 13}, RowsCase{64, 8}, RowsCase{1, 1}}) {
        for (const bool in_place : {false, true}) {
            const std::string name = "clamped_swiglu N=" + std::to_string(s.N) + " I=" + std::to_string(s.C);
            const size_t n_in = static_cast<size_t>(s.N * 2 * s.C), n_out = static_cast<size_t>(s.N * s.C);
            std::vector<float> inp = random_bf16(rng, n_in, -10.0f, 10.0f);  // beyond the clamps at ±7
            inp[0] = -100.0f;                                                // exp overflow: σ = 0
            if (n_in > 2) inp[2] = limit;                                    // on the edge: the gradient passes
            const std::vector<float> dout = random_bf16(rng, n_out);
            std::vector<float> out_ref(n_out), dinp_ref(n_in);
            mf::cpu::clamped_swiglu_forward(out_ref.data(), inp.data(), s.N, s.C, alpha, limit);
            mf::cpu::clamped_swiglu_backward(dinp_ref.data(), dout.data(), inp.data(), s.N, s.C, alpha, limit);

            DeviceBuffer d_inp = device_bf16(inp), d_dout = device_bf16(dout), d_out(n_out * 2), d_dinp(n_in * 2);
            d_out.poison();
            d_dinp.poison();
            mf::cuda::clamped_swiglu_forward(d_out.as<bf16>(), d_inp.as<bf16>(), s.N, s.C, alpha, limit, nullptr);
            bf16* dinp = in_place ? d_inp.as<bf16>() : d_dinp.as<bf16>();
            mf::cuda::clamped_swiglu_backward(dinp, d_dout.as<bf16>(), d_inp.as<bf16>(), s.N, s.C, alpha, limit,
                                              nullptr);
            device_sync();
            if (!in_place) expect_close_bf16(download_bf16(d_out.as<void>(), n_out), out_ref, name + " fwd");
            expect_close_bf16(download_bf16(dinp, n_in), dinp_ref, name + (in_place ? " bwd in-place" : " bwd"));
        }
    }
}

// ---------------------------------------------------------------------------------------------
// sigmoid gate

TEST(CudaSigmoidGate, ForwardAndBackwardMatchCpu) {
    std::mt19937 rng(17);
    for (const BiasCase& s : kBiasCases) {  // the same ragged rows: N × H
        const std::string shape =
            " N=" + std::to_string(s.N) + " H=" + std::to_string(s.C) + " offset=" + std::to_string(s.offset);
        const size_t n = static_cast<size_t>(s.N * s.C), rows = static_cast<size_t>(s.N);
        const std::vector<float> y0 = random_bf16(rng, n), value = random_bf16(rng, n, -2.0f, 2.0f);
        const std::vector<float> dy = random_bf16(rng, n);
        std::vector<float> g = random_bf16(rng, rows, -6.0f, 6.0f);
        if (rows > 2) {
            g[0] = -100.0f;  // expf(100) = inf: s = 0
            g[1] = 100.0f;   // s = 1: s · (1 − s) = 0
        }
        std::vector<float> y_ref = y0, dvalue_ref(n), dg_ref(rows);
        mf::cpu::sigmoid_gate_forward(y_ref.data(), value.data(), g.data(), s.N, s.C);
        mf::cpu::sigmoid_gate_backward(dvalue_ref.data(), dg_ref.data(), dy.data(), value.data(), g.data(), s.N, s.C);

        DeviceBuffer d_y((n + 1) * 2), d_value((n + 1) * 2), d_dy((n + 1) * 2), d_dvalue((n + 1) * 2);
        DeviceBuffer d_g = device_bf16(g), d_dg(rows * 2);
        upload_bf16(d_y.as<bf16>(s.offset), y0);
        upload_bf16(d_value.as<bf16>(s.offset), value);
        mf::cuda::sigmoid_gate_forward(d_y.as<bf16>(s.offset), d_value.as<bf16>(s.offset), d_g.as<bf16>(), s.N, s.C,
                                       nullptr);
        device_sync();
        expect_close_bf16(download_bf16(d_y.as<bf16>(s.offset), n), y_ref, "sigmoid gate fwd" + shape);

        for (const bool in_place : {false, true}) {  // in place: dvalue aliases dy
            const std::string name = std::string("sigmoid gate bwd") + (in_place ? " in-place" : "") + shape;
            std::vector<float> dvalue[2], dg[2];
            for (int run = 0; run < 2; ++run) {
                upload_bf16(d_dy.as<bf16>(s.offset), dy);
                d_dvalue.poison();
                d_dg.poison();
                bf16* dv = in_place ? d_dy.as<bf16>(s.offset) : d_dvalue.as<bf16>(s.offset);
                mf::cuda::sigmoid_gate_backward(dv, d_dg.as<bf16>(), d_dy.as<bf16>(s.offset),
                                                d_value.as<bf16>(s.offset), d_g.as<bf16>(), s.N, s.C, nullptr);
                device_sync();
                dvalue[run] = download_bf16(dv, n);
                dg[run] = download_bf16(d_dg.as<void>(), rows);
            }
            expect_close_bf16(dvalue[0], dvalue_ref, name + " dvalue");
            expect_reduction_bf16_out(dg[0], dg_ref, name + " dgate_logits");
            expect_exact(dvalue[1], dvalue[0], name + " dvalue rerun");
            expect_exact(dg[1], dg[0], name + " dgate_logits rerun");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// benchmarks (MF_BENCH=1)

TEST(CudaOpsBench, Qwen3MoeShapes) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 for the benchmark";
    std::mt19937 rng(11);
    const int64_t N = 16384, H = 2048, V = 151936, Hq = 32, Hkv = 4, D = 128, I = 768, K = 8;
    const double act = static_cast<double>(N * H) * 2;  // one bf16 activation of [N, H]

    // embedding
    {
        DeviceBuffer wte(static_cast<size_t>(V * H) * 2), out(static_cast<size_t>(N * H) * 2);
        wte.zero();
        std::vector<int32_t> ids(static_cast<size_t>(N));
        for (auto& id : ids) id = static_cast<int32_t>(rng() % V);
        DeviceBuffer d_ids = device_copy(ids);
        const double us = time_us([&] {
            mf::cuda::embedding_forward(out.as<bf16>(), d_ids.as<int32_t>(), wte.as<bf16>(), N, V, H, nullptr);
        });
        report_bandwidth("embedding_forward N=16384 H=2048", us, 2 * act);
        DeviceBuffer dwte(static_cast<size_t>(V * H) * 4);
        dwte.zero();
        const size_t sb = mf::cuda::embedding_backward_scratch_bytes(N, V);
        DeviceBuffer scratch(sb);
        const double us_b = time_us([&] {
            mf::cuda::embedding_backward(dwte.as<void>(), DType::f32, out.as<bf16>(), d_ids.as<int32_t>(), N, V, H,
                                         scratch.as<void>(), sb, nullptr);
        });
        // dout read, and each touched fp32 dwte row read and written (ids nearly all distinct here).
        report_bandwidth("embedding_backward f32 (sort + sum)", us_b, act + 2.0 * N * H * 4);
    }
    // rmsnorm
    {
        DeviceBuffer x(static_cast<size_t>(N * H) * 2), y(static_cast<size_t>(N * H) * 2), w(H * 2),
            rstd(static_cast<size_t>(N) * 4), dx(static_cast<size_t>(N * H) * 2), dw(H * 4);
        upload_bf16(x.as<void>(), random_bf16(rng, static_cast<size_t>(N * H)));
        upload_bf16(w.as<void>(), random_bf16(rng, H));
        dw.zero();
        const double us = time_us([&] {
            mf::cuda::rmsnorm_forward(y.as<bf16>(), rstd.as<float>(), x.as<bf16>(), w.as<bf16>(), N, H, 1e-6f, nullptr);
        });
        report_bandwidth("rmsnorm_forward N=16384 C=2048", us, 2 * act);
        const size_t sb = mf::cuda::rmsnorm_backward_scratch_bytes(N, H);
        DeviceBuffer scratch(sb);
        const double us_b = time_us([&] {
            mf::cuda::rmsnorm_backward(dx.as<bf16>(), false, dw.as<void>(), DType::f32, y.as<bf16>(), x.as<bf16>(),
                                       w.as<bf16>(), rstd.as<float>(), N, H, scratch.as<void>(), sb, nullptr);
        });
        report_bandwidth("rmsnorm_backward (dinp =, dweight f32)", us_b, 3 * act);
    }
    // QK-norm + RoPE
    {
        const size_t nq = static_cast<size_t>(N * Hq * D), nk = static_cast<size_t>(N * Hkv * D);
        DeviceBuffer q(nq * 2), k(nk * 2), qo(nq * 2), ko(nk * 2), qw(D * 2), kw(D * 2), qr(N * Hq * 4),
            kr(N * Hkv * 4), dqw(D * 4), dkw(D * 4);
        upload_bf16(q.as<void>(), random_bf16(rng, nq));
        upload_bf16(k.as<void>(), random_bf16(rng, nk));
        upload_bf16(qw.as<void>(), random_bf16(rng, D, 0.5f, 1.5f));
        upload_bf16(kw.as<void>(), random_bf16(rng, D, 0.5f, 1.5f));
        std::vector<int32_t> pos(static_cast<size_t>(N));
        for (size_t n = 0; n < pos.size(); ++n) pos[n] = static_cast<int32_t>(n % 4096);
        DeviceBuffer d_pos = device_copy(pos);
        dqw.zero();
        dkw.zero();
        const double bytes = static_cast<double>(nq + nk) * 2;
        const double us = time_us([&] {
            mf::cuda::rope_qknorm_forward(qo.as<bf16>(), ko.as<bf16>(), qr.as<float>(), kr.as<float>(), q.as<bf16>(),
                                          k.as<bf16>(), qw.as<bf16>(), kw.as<bf16>(), d_pos.as<int32_t>(), N, Hq, Hkv,
                                          D, 1e6f, 1e-6f, nullptr);
        });
        report_bandwidth("rope_qknorm_forward N=16384 H=32/4 D=128", us, 2 * bytes);
        const size_t sb = mf::cuda::rope_qknorm_backward_scratch_bytes(N, D);
        DeviceBuffer scratch(sb);
        const double us_b = time_us([&] {
            mf::cuda::rope_qknorm_backward(qo.as<bf16>(), ko.as<bf16>(), dqw.as<void>(), dkw.as<void>(), DType::f32,
                                           qo.as<bf16>(), ko.as<bf16>(), q.as<bf16>(), k.as<bf16>(), qw.as<bf16>(),
                                           kw.as<bf16>(), qr.as<float>(), kr.as<float>(), d_pos.as<int32_t>(), N, Hq,
                                           Hkv, D, 1e6f, scratch.as<void>(), sb, nullptr);
        });
        report_bandwidth("rope_qknorm_backward (in place, dweight f32)", us_b, 3 * bytes);
    }
    // SwiGLU over the N·K expert rows
    {
        const int64_t rows = N * K;
        DeviceBuffer inp(static_cast<size_t>(rows * 2 * I) * 2), out(static_cast<size_t>(rows * I) * 2),
            dinp(static_cast<size_t>(rows * 2 * I) * 2);
        upload_bf16(inp.as<void>(), random_bf16(rng, static_cast<size_t>(rows * 2 * I), -4.0f, 4.0f));
        const double row_bytes = static_cast<double>(rows * I) * 2;
        const double us = time_us([&] { mf::cuda::swiglu_forward(out.as<bf16>(), inp.as<bf16>(), rows, I, nullptr); });
        report_bandwidth("swiglu_forward rows=131072 I=768", us, 3 * row_bytes);
        const double us_b = time_us(
            [&] { mf::cuda::swiglu_backward(dinp.as<bf16>(), out.as<bf16>(), inp.as<bf16>(), rows, I, nullptr); });
        report_bandwidth("swiglu_backward", us_b, 5 * row_bytes);
    }
    // casts
    {
        const int64_t n = int64_t{1} << 28;
        DeviceBuffer f(static_cast<size_t>(n) * 4), b(static_cast<size_t>(n) * 2);
        f.zero();
        const double us = time_us([&] { mf::cuda::cast_f32_to_bf16(b.as<bf16>(), f.as<float>(), n, nullptr); });
        report_bandwidth("cast_f32_to_bf16 n=2^28", us, 6.0 * n);
        const double us_b = time_us([&] { mf::cuda::cast_bf16_to_f32(f.as<float>(), b.as<bf16>(), n, nullptr); });
        report_bandwidth("cast_bf16_to_f32 n=2^28", us_b, 6.0 * n);
    }
}

}  // namespace
