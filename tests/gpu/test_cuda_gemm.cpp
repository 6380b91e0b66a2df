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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cuda/gemm.cuh"
#include "test_util.h"

namespace {

using mf::cuda::bf16;

class GpuEnvironment : public ::testing::Environment {
 public:
    void SetUp() override { mf::test::require_gpu(); }
};
const auto* const kGpuEnvironment = ::testing::AddGlobalTestEnvironment(new GpuEnvironment);

// ---------------------------------------------------------------------------------------------
// helpers

class DeviceBuffer {
 public:
    explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
        MF_CHECK_CUDA(cudaMalloc(&ptr_, std::max<size_t>(bytes, 16)));
    }
    ~DeviceBuffer() { cudaFree(ptr_); }
    DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) { other.ptr_ = nullptr; }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    template <typename T>
    T* as() const {
        return static_cast<T*>(ptr_);
    }
    size_t bytes() const { return bytes_; }

 private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

std::vector<float> random_bf16_values(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = mf::bf16_to_f32(mf::f32_to_bf16(dist(rng)));
    return v;
}

std::vector<float> round_bf16(std::vector<float> v) {
    for (float& x : v) x = mf::bf16_to_f32(mf::f32_to_bf16(x));
    return v;
}

// ref = before + product in fp32; the naive bf16 accumulation stores the product in bf16 first and
// then the sum: bf16(before + bf16(product)), which is what a bf16 "+=" does without a fused epilogue.
std::vector<float> add(const std::vector<float>& before, const std::vector<float>& product) {
    std::vector<float> out(before.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = before[i] + product[i];
    return out;
}
std::vector<float> naive_bf16_add(const std::vector<float>& before, const std::vector<float>& product) {
    std::vector<float> out(before.size());
    for (size_t i = 0; i < out.size(); ++i)
        out[i] = mf::bf16_to_f32(mf::f32_to_bf16(before[i] + mf::bf16_to_f32(mf::f32_to_bf16(product[i]))));
    return out;
}

void upload_bf16(const DeviceBuffer& dst, const std::vector<float>& v) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = mf::f32_to_bf16(v[i]);
    MF_CHECK_CUDA(cudaMemcpy(dst.as<void>(), bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}
void upload_f32(const DeviceBuffer& dst, const std::vector<float>& v) {
    MF_CHECK_CUDA(cudaMemcpy(dst.as<void>(), v.data(), v.size() * 4, cudaMemcpyHostToDevice));
}
std::vector<float> download_bf16(const DeviceBuffer& src, size_t n) {
    std::vector<uint16_t> bits(n);
    MF_CHECK_CUDA(cudaMemcpy(bits.data(), src.as<void>(), n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = mf::bf16_to_f32(bits[i]);
    return v;
}
std::vector<float> download_f32(const DeviceBuffer& src, size_t n) {
    std::vector<float> v(n);
    MF_CHECK_CUDA(cudaMemcpy(v.data(), src.as<void>(), n * 4, cudaMemcpyDeviceToHost));
    return v;
}
// Fills n bf16 values with a random block of at most 2^22 values repeated (fast for big buffers).
void fill_random_bf16(const DeviceBuffer& dst, size_t n, std::mt19937& rng) {
    const size_t block = std::min<size_t>(n, size_t{1} << 22);
    DeviceBuffer src(block * 2);
    upload_bf16(src, random_bf16_values(rng, block));
    for (size_t i = 0; i < n; i += block)
        MF_CHECK_CUDA(
            cudaMemcpy(dst.as<uint16_t>() + i, src.as<void>(), std::min(block, n - i) * 2, cudaMemcpyDeviceToDevice));
}
void poison(const DeviceBuffer& buf) { MF_CHECK_CUDA(cudaMemset(buf.as<void>(), 0xFF, buf.bytes())); }  // NaN

// The tolerance rule of the file comment; NaN or a size mismatch fails.
void expect_parity(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& ref,
                   const std::vector<float>& naive) {
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    double err = 0.0, naive_err = 0.0, ref_max = 0.0, diff_sq = 0.0, ref_sq = 0.0;
    size_t worst = 0, non_finite = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        if (!std::isfinite(gpu[i])) {
            ++non_finite;
            continue;
        }
        const double e = std::fabs(static_cast<double>(gpu[i]) - ref[i]);
        if (e > err) err = e, worst = i;
        naive_err = std::max(naive_err, std::fabs(static_cast<double>(naive[i]) - ref[i]));
        ref_max = std::max(ref_max, std::fabs(static_cast<double>(ref[i])));
        diff_sq += e * e;
        ref_sq += static_cast<double>(ref[i]) * ref[i];
    }
    const double tol = 2.0 * naive_err + std::ldexp(std::max(1.0, ref_max), -16);
    EXPECT_EQ(non_finite, 0u) << what << ": " << non_finite << " elements are not finite (never written?)";
    EXPECT_LE(err, tol) << what << ": max error " << err << " at " << worst << " (gpu " << gpu[worst] << ", ref "
                        << ref[worst] << "), tolerance " << tol;
    std::printf("  %-48s max err %.3e  tol %.3e  rel-l2 %.3e\n", what.c_str(), err, tol,
                ref_sq > 0 ? std::sqrt(diff_sq / ref_sq) : 0.0);
}

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
        const auto inp = random_bf16_values(rng, s.N * s.C);
        const auto weight = random_bf16_values(rng, s.OC * s.C);
        std::vector<float> ref(s.N * s.OC);
        mf::cpu::matmul_forward(ref.data(), inp.data(), weight.data(), s.N, s.C, s.OC);

        DeviceBuffer d_inp(inp.size() * 2), d_w(weight.size() * 2), d_out(ref.size() * 2), d_out32(ref.size() * 4);
        upload_bf16(d_inp, inp);
        upload_bf16(d_w, weight);
        poison(d_out);
        poison(d_out32);
        mf::cuda::matmul_forward(ctx, d_out.as<bf16>(), d_inp.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC, nullptr);
        mf::cuda::matmul_forward_f32out(ctx, d_out32.as<float>(), d_inp.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC,
                                        nullptr);
        MF_CHECK_CUDA(cudaDeviceSynchronize());
        expect_parity(name("forward", s), download_bf16(d_out, ref.size()), ref, round_bf16(ref));
        expect_parity(name("forward f32 out", s), download_f32(d_out32, ref.size()), ref, ref);
    }
}

TEST(CudaGemm, BackwardInputParity) {
    std::mt19937 rng(99);
    mf::cuda::GemmContext ctx;
    for (const Shape& s : kShapes) {
        for (bool accumulate : {false, true}) {
            const auto dout = random_bf16_values(rng, s.N * s.OC);
            const auto weight = random_bf16_values(rng, s.OC * s.C);
            const auto before = random_bf16_values(rng, s.N * s.C);
            std::vector<float> product(s.N * s.C, 0.0f);
            mf::cpu::matmul_backward(product.data(), nullptr, dout.data(), nullptr, weight.data(), s.N, s.C, s.OC);
            const auto ref = accumulate ? add(before, product) : product;
            const auto naive = accumulate ? naive_bf16_add(before, product) : round_bf16(product);

            DeviceBuffer d_dout(dout.size() * 2), d_w(weight.size() * 2), d_dinp(ref.size() * 2);
            upload_bf16(d_dout, dout);
            upload_bf16(d_w, weight);
            if (accumulate)
                upload_bf16(d_dinp, before);
            else
                poison(d_dinp);
            mf::cuda::matmul_backward_input(ctx, d_dinp.as<bf16>(), d_dout.as<bf16>(), d_w.as<bf16>(), s.N, s.C, s.OC,
                                            accumulate, nullptr);
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            expect_parity(name(accumulate ? "backward input +=" : "backward input =", s),
                          download_bf16(d_dinp, ref.size()), ref, naive);
        }
    }
}

TEST(CudaGemm, BackwardWeightParity) {
    std::mt19937 rng(7);
    mf::cuda::GemmContext ctx;
    for (const Shape& s : kShapes) {
        for (mf::DType dtype : {mf::DType::f32, mf::DType::bf16}) {
            const auto dout = random_bf16_values(rng, s.N * s.OC);
            const auto inp = random_bf16_values(rng, s.N * s.C);
            const auto before = random_bf16_values(rng, s.OC * s.C);  // dweight accumulates
            std::vector<float> product(s.OC * s.C, 0.0f);
            mf::cpu::matmul_backward(nullptr, product.data(), dout.data(), inp.data(), nullptr, s.N, s.C, s.OC);
            const auto ref = add(before, product);

            const bool f32 = dtype == mf::DType::f32;
            DeviceBuffer d_dout(dout.size() * 2), d_inp(inp.size() * 2), d_dw(ref.size() * (f32 ? 4 : 2));
            upload_bf16(d_dout, dout);
            upload_bf16(d_inp, inp);
            if (f32)
                upload_f32(d_dw, before);
            else
                upload_bf16(d_dw, before);
            mf::cuda::matmul_backward_weight(ctx, d_dw.as<void>(), dtype, d_dout.as<bf16>(), d_inp.as<bf16>(), s.N, s.C,
                                             s.OC, nullptr);
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            if (f32)
                expect_parity(name("backward weight f32 +=", s), download_f32(d_dw, ref.size()), ref, ref);
            else
                expect_parity(name("backward weight bf16 +=", s), download_bf16(d_dw, ref.size()), ref,
                              naive_bf16_add(before, product));
        }
    }
}

TEST(CudaGemm, EmptyShapes) {
    mf::cuda::GemmContext ctx;
    // C = 0: the forward output is written as zeros; N = 0 and OC = 0 touch nothing.
    DeviceBuffer out(4 * 8 * 2);
    poison(out);
    mf::cuda::matmul_forward(ctx, out.as<bf16>(), nullptr, nullptr, 4, 0, 8, nullptr);
    MF_CHECK_CUDA(cudaDeviceSynchronize());
    for (float x : download_bf16(out, 32)) EXPECT_EQ(x, 0.0f);
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

template <typename Fn>
double median_us(Fn&& fn, int reps = 20) {
    cudaEvent_t start, stop;
    MF_CHECK_CUDA(cudaEventCreate(&start));
    MF_CHECK_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> times;
    for (int i = 0; i < reps; ++i) {
        MF_CHECK_CUDA(cudaEventRecord(start));
        fn();
        MF_CHECK_CUDA(cudaEventRecord(stop));
        MF_CHECK_CUDA(cudaEventSynchronize(stop));
        float ms = 0.0f;
        MF_CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
        times.push_back(ms * 1000.0f);
    }
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
}

TEST(CudaGemm, Benchmark) {
    const char* bench = std::getenv("MF_BENCH");
    if (bench == nullptr || std::string(bench) != "1") GTEST_SKIP() << "set MF_BENCH=1 to time";
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
