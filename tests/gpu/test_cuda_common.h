// Shared helpers of the GPU parity tests of the memory-bound CUDA kernels (test_cuda_ops,
// test_cuda_moe, test_cuda_loss_optim): device buffers, bf16 upload/download, the tolerance rule
// and a small benchmark timer.
//
// Tolerance rule (CONVENTIONS.md), against the CPU reference fed the same bf16-rounded inputs:
//   elementwise ops     per-dtype table: bf16 outputs |gpu − ref| <= 1e-2 + 1e-2·|ref|,
//                       fp32 outputs |gpu − ref| <= 1e-5 + 1e-5·|ref|
//   reductions, GEMMs   max |gpu − ref| <= 2 · max |naive − ref| + floor, naive = the same computation
//                       done the way a plain bf16 kernel would store it (given per test; for an fp32
//                       output of an fp32 sum naive = ref), floor = 2^-16 · max(1, max |ref|), which
//                       covers fp32 summation-order differences
//   permutations        exact.
// Outputs are poisoned (NaN bytes) before the GPU call where the op writes (=), so an element that
// is never written fails. MF_BENCH=1 enables the benchmark tests (CUDA events, median of kBenchIters).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "core/bf16.h"
#include "core/cuda_check.h"
#include "test_util.h"

namespace mf::test {

class GpuEnvironment : public ::testing::Environment {
 public:
    void SetUp() override { require_gpu(); }
};

// ---------------------------------------------------------------------------------------------
// device memory

class DeviceBuffer {
 public:
    DeviceBuffer() = default;
    explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
        MF_CHECK_CUDA(cudaMalloc(&ptr_, std::max<size_t>(bytes, 256)));
    }
    ~DeviceBuffer() {
        if (ptr_ != nullptr) cudaFree(ptr_);
    }
    DeviceBuffer(DeviceBuffer&& other) noexcept : ptr_(other.ptr_), bytes_(other.bytes_) { other.ptr_ = nullptr; }
    DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
        std::swap(ptr_, other.ptr_);
        std::swap(bytes_, other.bytes_);
        return *this;
    }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;

    template <typename T>
    T* as(size_t element_offset = 0) const {
        if constexpr (std::is_void_v<T>) {
            return static_cast<char*>(ptr_) + element_offset;
        } else {
            return static_cast<T*>(ptr_) + element_offset;
        }
    }
    size_t bytes() const { return bytes_; }
    // Fills every byte with 0xFF: NaN in fp32 and bf16, -1 in int32.
    void poison() const { MF_CHECK_CUDA(cudaMemset(ptr_, 0xFF, bytes_)); }
    void zero() const { MF_CHECK_CUDA(cudaMemset(ptr_, 0, bytes_)); }

 private:
    void* ptr_ = nullptr;
    size_t bytes_ = 0;
};

inline float round_bf16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

inline std::vector<float> round_bf16(std::vector<float> v) {
    for (float& x : v) x = round_bf16(x);
    return v;
}

// n values uniform in [lo, hi), already rounded to bf16 (so CPU and GPU see the same inputs).
inline std::vector<float> random_bf16(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = round_bf16(dist(rng));
    return v;
}

inline std::vector<float> random_f32(std::mt19937& rng, size_t n, float lo = -1.0f, float hi = 1.0f) {
    std::uniform_real_distribution<float> dist(lo, hi);
    std::vector<float> v(n);
    for (float& x : v) x = dist(rng);
    return v;
}

// bf16 values: `dst` points at device bf16 storage of v.size() elements.
inline void upload_bf16(void* dst, const std::vector<float>& v) {
    std::vector<uint16_t> bits(v.size());
    for (size_t i = 0; i < v.size(); ++i) bits[i] = f32_to_bf16(v[i]);
    MF_CHECK_CUDA(cudaMemcpy(dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}

inline std::vector<float> download_bf16(const void* src, size_t n) {
    std::vector<uint16_t> bits(n);
    MF_CHECK_CUDA(cudaMemcpy(bits.data(), src, n * 2, cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) v[i] = bf16_to_f32(bits[i]);
    return v;
}

template <typename T>
void upload(void* dst, const std::vector<T>& v) {
    MF_CHECK_CUDA(cudaMemcpy(dst, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
}

template <typename T>
std::vector<T> download(const void* src, size_t n) {
    std::vector<T> v(n);
    MF_CHECK_CUDA(cudaMemcpy(v.data(), src, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}

// A device buffer holding v as bf16 (extra_elements of room after it, poisoned).
// A gradient buffer's values in its dtype (f32 as they are, bf16 rounded), and back.
inline void upload_grad(void* dst, const std::vector<float>& v, bool f32) {
    if (f32)
        upload(dst, v);
    else
        upload_bf16(dst, v);
}
inline std::vector<float> download_grad(const void* src, size_t n, bool f32) {
    return f32 ? download<float>(src, n) : download_bf16(src, n);
}

inline DeviceBuffer device_bf16(const std::vector<float>& v, size_t extra_elements = 0) {
    DeviceBuffer b((v.size() + extra_elements) * 2);
    b.poison();
    upload_bf16(b.as<void>(), v);
    return b;
}

template <typename T>
DeviceBuffer device_copy(const std::vector<T>& v) {
    DeviceBuffer b(v.size() * sizeof(T));
    upload(b.as<void>(), v);
    return b;
}

inline void device_sync() { MF_CHECK_CUDA(cudaDeviceSynchronize()); }

// ---------------------------------------------------------------------------------------------
// comparisons

// |gpu − ref| <= abs_tol + rel_tol·|ref| elementwise; NaN anywhere in gpu fails unless ref is NaN.
inline void expect_elementwise(const std::vector<float>& gpu, const std::vector<float>& ref, double abs_tol,
                               double rel_tol, const std::string& what) {
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    size_t bad = 0;
    double worst = 0.0;
    for (size_t i = 0; i < gpu.size(); ++i) {
        const double g = gpu[i], r = ref[i];
        if (std::isnan(r) && std::isnan(g)) continue;
        const double err = std::fabs(g - r);
        const bool ok = err <= abs_tol + rel_tol * std::fabs(r);  // false for NaN
        if (!ok) {
            if (bad < 5) ADD_FAILURE() << what << ": element " << i << " gpu " << g << " ref " << r;
            ++bad;
        }
        if (!std::isnan(err)) worst = std::max(worst, err);
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size() << " elements out of tolerance";
    std::printf("  %-48s n=%-9zu max|err| %.3g\n", what.c_str(), gpu.size(), worst);
}

inline void expect_close_bf16(const std::vector<float>& gpu, const std::vector<float>& ref, const std::string& what) {
    expect_elementwise(gpu, ref, 1e-2, 1e-2, what);
}

inline void expect_close_f32(const std::vector<float>& gpu, const std::vector<float>& ref, const std::string& what) {
    expect_elementwise(gpu, ref, 1e-5, 1e-5, what);
}

// The reduction rule's tolerance: 2·max|naive − ref| + 2^-16·max(1, max|ref|).
inline double reduction_tolerance(const std::vector<float>& ref, const std::vector<float>& naive) {
    double naive_err = 0.0, max_ref = 1.0;
    for (size_t i = 0; i < ref.size(); ++i) {
        naive_err = std::max(naive_err, std::fabs(static_cast<double>(naive[i]) - ref[i]));
        max_ref = std::max(max_ref, std::fabs(static_cast<double>(ref[i])));
    }
    return 2.0 * naive_err + std::ldexp(max_ref, -16);
}

// max|gpu − want| <= tol, elementwise (the first failures named).
inline void expect_within(const std::vector<float>& gpu, const std::vector<float>& want, double tol,
                          const std::string& what) {
    ASSERT_EQ(gpu.size(), want.size()) << what;
    double worst = 0.0;
    size_t bad = 0;
    for (size_t i = 0; i < gpu.size(); ++i) {
        const double err = std::fabs(static_cast<double>(gpu[i]) - want[i]);
        if (!(err <= tol)) {
            if (bad < 5) ADD_FAILURE() << what << ": element " << i << " gpu " << gpu[i] << " want " << want[i];
            ++bad;
        } else {
            worst = std::max(worst, err);
        }
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size() << " elements above tolerance " << tol;
    std::printf("  %-48s n=%-9zu max|err| %.3g (tol %.3g)\n", what.c_str(), gpu.size(), worst, tol);
}

// The reduction rule: max|gpu − ref| <= 2·max|naive − ref| + 2^-16·max(1, max|ref|).
inline void expect_reduction(const std::vector<float>& gpu, const std::vector<float>& ref,
                             const std::vector<float>& naive, const std::string& what) {
    ASSERT_EQ(naive.size(), ref.size()) << what;
    expect_within(gpu, ref, reduction_tolerance(ref, naive), what);
}

// The rule for an output stored as bf16: naive = ref rounded to bf16.
inline void expect_reduction_bf16_out(const std::vector<float>& gpu, const std::vector<float>& ref,
                                      const std::string& what) {
    expect_reduction(gpu, ref, round_bf16(ref), what);
}

template <typename T>
void expect_exact(const std::vector<T>& gpu, const std::vector<T>& ref, const std::string& what) {
    ASSERT_EQ(gpu.size(), ref.size()) << what;
    size_t bad = 0;
    for (size_t i = 0; i < gpu.size(); ++i) {
        if (std::memcmp(&gpu[i], &ref[i], sizeof(T)) != 0) {
            if (bad < 5) ADD_FAILURE() << what << ": element " << i << " gpu " << gpu[i] << " ref " << ref[i];
            ++bad;
        }
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << gpu.size() << " elements differ";
    std::printf("  %-48s n=%-9zu %s\n", what.c_str(), gpu.size(), bad == 0 ? "exact" : "MISMATCH");
}

// ---------------------------------------------------------------------------------------------
// benchmarks

constexpr double kPeakBytesPerSecond = 4.3e12;  // measured device-to-device copy on the H200

// Whether the environment variable `name` is set to 1.
inline bool env_flag(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && std::string(v) == "1";
}

inline bool bench_enabled() { return env_flag("MF_BENCH"); }

// Median time in microseconds of `iters` runs of fn (after 2 warm-ups), each after an untimed
// `setup` (if given) on the same stream; CUDA events around fn alone.
inline double time_us_after(const std::function<void()>& setup, const std::function<void()>& fn, int iters = 10) {
    for (int i = 0; i < 2; ++i) {
        if (setup) setup();
        fn();
    }
    device_sync();
    cudaEvent_t start, stop;
    MF_CHECK_CUDA(cudaEventCreate(&start));
    MF_CHECK_CUDA(cudaEventCreate(&stop));
    std::vector<float> ms(static_cast<size_t>(iters));
    for (int i = 0; i < iters; ++i) {
        if (setup) setup();
        MF_CHECK_CUDA(cudaEventRecord(start));
        fn();
        MF_CHECK_CUDA(cudaEventRecord(stop));
        MF_CHECK_CUDA(cudaEventSynchronize(stop));
        MF_CHECK_CUDA(cudaEventElapsedTime(&ms[static_cast<size_t>(i)], start, stop));
    }
    MF_CHECK_CUDA(cudaEventDestroy(start));
    MF_CHECK_CUDA(cudaEventDestroy(stop));
    std::sort(ms.begin(), ms.end());
    return 1000.0 * ms[ms.size() / 2];
}

// Median time in microseconds of `iters` runs of fn (after 2 warm-ups), timed with CUDA events.
inline double time_us(const std::function<void()>& fn, int iters = 10) { return time_us_after(nullptr, fn, iters); }

inline void report_bandwidth(const char* name, double us, double bytes) {
    const double gbps = bytes / (us * 1e-6) / 1e9;
    std::printf("BENCH %-44s %10.1f us  %8.1f GB/s  %5.1f%% of 4.3 TB/s\n", name, us, gbps,
                100.0 * gbps * 1e9 / kPeakBytesPerSecond);
}

}  // namespace mf::test
