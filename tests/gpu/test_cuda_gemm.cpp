// GPU parity of the dense cuBLASLt GEMMs (kernels/cuda/gemm.cuh) against the fp32 CPU reference
// (kernels/cpu/matmul.h), fed the same bf16-rounded inputs.
//
// Tolerance rule (CONVENTIONS.md): max_i |gpu_i − ref_i| <= 2 · max_i |naive_i − ref_i| + floor, where
// ref is the CPU kernel and naive is the same computation stored the way a bf16 kernel stores it
// (the fp32 result rounded to bf16; bf16 "+=" rounds the product, then the sum; for fp32 outputs
// naive = ref). floor = 2^-16 · max(1, max|ref|)
// covers fp32 summation-order differences (observed far below it). Outputs are poisoned with NaN
// before every GPU call, so an element never written fails. MF_BENCH=1 prints timings.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/gemm.cuh"
#include "test_cuda_helpers.h"

namespace {

using mf::cuda::bf16;
using namespace mf::test;  // DeviceBuffer, bf16 copies (test_cuda_common.h), expect_parity (test_cuda_helpers.h)

const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

struct Shape {
    int64_t N, C, OC;
};

std::string name(const char* op, const Shape& s) {
    return std::string(op) + " N=" + std::to_string(s.N) + " C=" + std::to_string(s.C) + " OC=" + std::to_string(s.OC);
}

const std::vector<Shape> kShapes = {{1, 8, 8},       {37, 64, 100}, {128, 256, 384}, {257, 96, 1000},
                                    {300, 1024, 72}, {33, 40, 17},  {64, 2048, 256}, {5, 3, 7}};

// ---------------------------------------------------------------------------------------------
// parity

TEST(CudaGemm, ForwardParity) {
    std::mt19937 rng(1234);
    mf::cuda::GemmContext ctx;
    for (const Shape& s : kShapes) {
        const auto inp = random_bf16(rng, s.N * s.C);
        const auto weight = random_bf16(rng, s.OC * s.C);
        std::vector<float> ref(s.N * s.OC);
        mf::cpu::matmul_forward(ref.data(), inp.data(), weight.data(), s.N, s.C, s.OC);

        DeviceBuffer d_inp(inp.size() * 2), d_w(weight.size() * 2), d_out(ref.size() * 2), d_out32(ref.size() * 4);
        upload_bf16(d_inp.as<void>(), inp);
        upload_bf16(d_w.as<void>(), weight);
        d_out.poison();
        d_out32.poison();
        mf::cuda::matmul_forward(ctx, d_out.as<bf16>(), d_inp.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC, nullptr);
        mf::cuda::matmul_forward_f32out(ctx, d_out32.as<float>(), d_inp.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC,
                                        nullptr);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        expect_parity(name("forward", s), download_bf16(d_out.as<void>(), ref.size()), ref, round_bf16(ref));
        expect_parity(name("forward f32 out", s), download<float>(d_out32.as<void>(), ref.size()), ref, ref);
    }
}

TEST(CudaGemm, BackwardInputParity) {
    std::mt19937 rng(99);
    mf::cuda::GemmContext ctx;
    for (const Shape& s : kShapes) {
        for (bool accumulate : {false, true}) {
            const auto dout = random_bf16(rng, s.N * s.OC);
            const auto weight = random_bf16(rng, s.OC * s.C);
            const auto before = random_bf16(rng, s.N * s.C);
            std::vector<float> product(s.N * s.C, 0.0f);
            mf::cpu::matmul_backward(product.data(), nullptr, dout.data(), nullptr, weight.data(), s.N, s.C, s.OC);
            const auto ref = accumulate ? fp32_add(before, product) : product;
            const auto naive = accumulate ? naive_bf16_add(before, product) : round_bf16(product);

            DeviceBuffer d_dout(dout.size() * 2), d_w(weight.size() * 2), d_dinp(ref.size() * 2);
            upload_bf16(d_dout.as<void>(), dout);
            upload_bf16(d_w.as<void>(), weight);
            if (accumulate)
                upload_bf16(d_dinp.as<void>(), before);
            else
                d_dinp.poison();
            mf::cuda::matmul_backward_input(ctx, d_dinp.as<bf16>(), d_dout.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC,
                                            accumulate, nullptr);
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            expect_parity(name(accumulate ? "backward input +=" : "backward input =", s),
                          download_bf16(d_dinp.as<void>(), ref.size()), ref, naive);
        }
    }
}

TEST(CudaGemm, BackwardWeightParity) {
    std::mt19937 rng(7);
    mf::cuda::GemmContext ctx;
    for (const Shape& s : kShapes) {
        for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16}) {
            const auto dout = random_bf16(rng, s.N * s.OC);
            const auto inp = random_bf16(rng, s.N * s.C);
            const auto before = random_bf16(rng, s.OC * s.C);  // dweight accumulates
            std::vector<float> product(s.OC * s.C, 0.0f);
            mf::cpu::matmul_backward(nullptr, product.data(), dout.data(), inp.data(), nullptr, s.N, s.C, s.OC);
            const auto ref = fp32_add(before, product);

            const bool f32 = dtype == mf::DType::f32;
            DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), d_dw(ref.size() * (f32 ? 4 : 2));
            upload_bf16(d_dout.as<void>(), dout);
            upload_bf16(d_inp.as<void>(), inp);
            upload_grad(d_dw.as<void>(), before, f32);
            mf::cuda::matmul_backward_weight(ctx, d_dw.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(), s.N, s.C,
                                             s.OC, nullptr);
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            if (f32)
                expect_parity(name("backward weight f32 +=", s), download<float>(d_dw.as<void>(), ref.size()), ref,
                              ref);
            else
                expect_parity(name("backward weight bf16 +=", s), download_bf16(d_dw.as<void>(), ref.size()), ref,
                              naive_bf16_add(before, product));
        }
    }
}

TEST(CudaGemm, EmptyShapes) {
    mf::cuda::GemmContext ctx;
    // C = 0: the forward output is written as zeros; N = 0 and OC = 0 touch nothing.
    DeviceBuffer out(4 * 8 * 2);
    out.poison();
    mf::cuda::matmul_forward(ctx, out.as<bf16>(), nullptr, nullptr, 4, 0, 8, nullptr);
    MF_CHECK_CUDA(cudaDeviceSynchronize());
    for (float x : download_bf16(out.as<void>(), 32)) EXPECT_EQ(x, 0.0f);
    mf::cuda::matmul_forward(ctx, nullptr, nullptr, nullptr, 0, 16, 8, nullptr);
    mf::cuda::matmul_backward_weight(ctx, nullptr, mf::DType::f32, nullptr, nullptr, 0, 16, 8, nullptr);
    EXPECT_THROW(mf::cuda::matmul_forward(ctx, out.as<bf16>(), nullptr, nullptr, -1, 4, 4, nullptr), mf::Error);
    EXPECT_THROW(mf::cuda::matmul_backward_weight(ctx, out.as<void>(), mf::DType::i32, out.as<bf16>(), out.as<bf16>(),
                                                  2, 2, 2, nullptr),
                 mf::Error);
    MF_CHECK_CUDA(cudaDeviceSynchronize());
}

// ---------------------------------------------------------------------------------------------
// MF_BENCH=1: µs and TFLOP/s at Qwen3-30B-A3B-like dense shapes (16384 tokens, hidden 2048)

TEST(CudaGemm, Benchmark) {
    if (!bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1 to time";
    mf::cuda::GemmContext ctx;
    std::mt19937 rng(5);
    struct Case {
        const char* label;
        int64_t N, C, OC;
    };
    for (const Case& c : {Case{"qkv proj", 16384, 2048, 5120}, Case{"o proj", 16384, 4096, 2048},
                          Case{"router", 16384, 2048, 128}, Case{"lm head chunk", 4096, 2048, 151936}}) {
        DeviceBuffer inp(c.N * c.C * 2), w(c.OC * c.C * 2), out(c.N * c.OC * 4), dinp(c.N * c.C * 2),
            dw(c.OC * c.C * 4);
        fill_random_bf16(inp, c.N * c.C, rng);
        fill_random_bf16(w, c.OC * c.C, rng);
        fill_random_bf16(out, c.N * c.OC, rng);  // also serves as dout
        MF_CHECK_CUDA(cudaMemset(dw.as<void>(), 0, dw.bytes()));
        const double flops = 2.0 * c.N * c.C * c.OC;
        const double fwd = median_us([&] {
            mf::cuda::matmul_forward(ctx, out.as<bf16>(), inp.as<bf16>(), w.as<bf16>(), c.N, c.C, c.OC, nullptr);
        });
        const double bwd_in = median_us([&] {
            mf::cuda::matmul_backward_input(ctx, dinp.as<bf16>(), out.as<bf16>(), w.as<bf16>(), c.N, c.C, c.OC, false,
                                            nullptr);
        });
        const double bwd_w = median_us([&] {
            mf::cuda::matmul_backward_weight(ctx, dw.as<void>(), mf::DType::f32, out.as<bf16>(), inp.as<bf16>(), c.N,
                                             c.C, c.OC, nullptr);
        });
        std::printf(
            "BENCH gemm %-14s N=%-6lld C=%-5lld OC=%-6lld fwd %8.1f us %6.1f TFLOP/s | bwd-in %8.1f us %6.1f | "
            "bwd-w(f32) %8.1f us %6.1f\n",
            c.label, static_cast<long long>(c.N), static_cast<long long>(c.C), static_cast<long long>(c.OC), fwd,
            flops / fwd * 1e-6, bwd_in, flops / bwd_in * 1e-6, bwd_w, flops / bwd_w * 1e-6);
    }
}

}  // namespace
