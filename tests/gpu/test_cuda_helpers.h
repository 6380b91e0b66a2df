// Shared helpers of the GPU parity tests of the tensor-core kernels (test_cuda_gemm,
// test_cuda_grouped_gemm, test_cuda_attention). Device buffers, bf16 rounding, random inputs and
// host <-> device copies come from test_cuda_common.h; this header adds what those three tests share
// beyond it:
//   expect_parity    the GEMM / attention tolerance rule (CONVENTIONS.md), against an fp32 reference:
//                    max_i |gpu_i − ref_i| <= 2 · max_i |naive_i − ref_i| + 2^-16 · max(1, max_i |ref_i|),
//                    where naive is the same computation stored the way a plain bf16 kernel stores it
//                    (each test says how it builds it); a non-finite gpu element (never written: the
//                    outputs are poisoned with NaN first) or a size mismatch fails;
//   fp32_add, naive_bf16_add   the reference and the naive value of a bf16 "+=" output;
//   fill_random_bf16 large random bf16 device inputs for the benchmarks;
//   median_us        the benchmarks' timer (CUDA events, median of reps runs after 3 warm-ups;
//                    host_lead_us > 0 first holds the stream in a sleeping host function that long,
//                    so the work of fn() is queued before the GPU starts it: the GPU's time, not
//                    the host's issue rate);
//   ScopedEnv        sets an environment variable ("" unsets it) and restores it on scope exit.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "test_cuda_common.h"

namespace mf::test {

class ScopedEnv {
 public:
    ScopedEnv(const char* name, const char* value) : name_(name) {
        if (const char* old = std::getenv(name)) old_ = old;
        set(value);
    }
    ~ScopedEnv() { set(old_ ? old_->c_str() : ""); }
    ScopedEnv(const ScopedEnv&) = delete;
    ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
    void set(const char* value) {
        if (*value == '\0')
            unsetenv(name_.c_str());
        else
            setenv(name_.c_str(), value, 1);
    }
    std::string name_;
    std::optional<std::string> old_;
};

// ref = before + product in fp32; the naive bf16 accumulation stores the product in bf16 first and
// then the sum: bf16(before + bf16(product)), which is what a bf16 "+=" does without a fused epilogue.
inline std::vector<float> fp32_add(const std::vector<float>& before, const std::vector<float>& product) {
    std::vector<float> out(before.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = before[i] + product[i];
    return out;
}
inline std::vector<float> naive_bf16_add(const std::vector<float>& before, const std::vector<float>& product) {
    std::vector<float> out(before.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = round_bf16(before[i] + round_bf16(product[i]));
    return out;
}

// Fills n bf16 values with a random block of at most 2^22 values repeated (fast for big buffers).
inline void fill_random_bf16(const DeviceBuffer& dst, size_t n, std::mt19937& rng) {
    const size_t block = std::min<size_t>(n, size_t{1} << 22);
    DeviceBuffer src(block * 2);
    upload_bf16(src.as<void>(), random_bf16(rng, block));
    for (size_t i = 0; i < n; i += block)
        MF_CHECK_CUDA(
            cudaMemcpy(dst.as<uint16_t>() + i, src.as<void>(), std::min(block, n - i) * 2, cudaMemcpyDeviceToDevice));
}

// The tolerance rule of the file comment; NaN or a size mismatch fails. Prints the max error, the
// tolerance and the relative L2 error.
inline void expect_parity(const std::string& what, const std::vector<float>& gpu, const std::vector<float>& ref,
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

// Median time in microseconds of `reps` runs of fn (after 3 warm-ups), timed with CUDA events.
template <typename Fn>
double median_us(Fn&& fn, int reps = 20, int host_lead_us = 0) {
    cudaEvent_t start, stop;
    MF_CHECK_CUDA(cudaEventCreate(&start));
    MF_CHECK_CUDA(cudaEventCreate(&stop));
    for (int i = 0; i < 3; ++i) fn();
    std::vector<float> times;
    for (int i = 0; i < reps; ++i) {
        if (host_lead_us > 0)
            MF_CHECK_CUDA(cudaLaunchHostFunc(
                nullptr,
                [](void* us) { std::this_thread::sleep_for(std::chrono::microseconds(*static_cast<int*>(us))); },
                &host_lead_us));
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

}  // namespace mf::test
