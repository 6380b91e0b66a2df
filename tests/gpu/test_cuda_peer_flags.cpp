// The peer exchange's kernels (kernels/cuda/peer_flags.cuh) on one GPU, against their host
// references: peer_copy against memcpy (16-byte and byte paths: aligned and misaligned pointers, sizes
// around 16, a megabyte and change, zero; one span, and ten disjoint spans of mixed alignment in one
// call: more than one launch holds); peer_signal then peer_wait passes, a wait for a value never
// signalled gives up after its timeout with its code in the error word, and a later wait returns at
// once once the word is set. (Between two GPUs they run in tests/dist/test_nccl_communicator.cpp.)
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cuda/peer_flags.cuh"
#include "test_util.h"

using namespace mf;

namespace {

class CudaPeerFlags : public ::testing::Test {
 protected:
    void SetUp() override { test::require_gpu(); }
};

TEST_F(CudaPeerFlags, CopyMatchesMemcpy) {
    const size_t n = (size_t{1} << 20) + 64;
    std::vector<unsigned char> src(n);
    std::mt19937 rng(7);
    for (auto& b : src) b = static_cast<unsigned char>(rng());
    unsigned char *dsrc = nullptr, *ddst = nullptr;
    MF_CHECK_CUDA(cudaMalloc(&dsrc, n));
    MF_CHECK_CUDA(cudaMalloc(&ddst, n));
    MF_CHECK_CUDA(cudaMemcpy(dsrc, src.data(), n, cudaMemcpyHostToDevice));
    struct Case {
        size_t src_off, dst_off, bytes;
    };
    const Case cases[] = {{0, 0, 0},       {0, 0, 16},          {0, 0, 1 << 20},      {16, 32, 48},
                          {1, 3, 15},      {0, 0, 17},          {5, 0, (1 << 20) + 13}, {0, 7, 1000},
                          {32, 48, 1 << 19}};
    for (const Case& c : cases) {
        SCOPED_TRACE("src+" + std::to_string(c.src_off) + " dst+" + std::to_string(c.dst_off) + " bytes " +
                     std::to_string(c.bytes));
        MF_CHECK_CUDA(cudaMemset(ddst, 0xA5, n));
        const cuda::CopySpan span{ddst + c.dst_off, dsrc + c.src_off, c.bytes};
        cuda::peer_copy({&span, 1}, nullptr);
        std::vector<unsigned char> got(n), want(n, 0xA5);
        MF_CHECK_CUDA(cudaMemcpy(got.data(), ddst, n, cudaMemcpyDeviceToHost));
        std::memcpy(want.data() + c.dst_off, src.data() + c.src_off, c.bytes);
        EXPECT_EQ(got, want);
    }
    // Ten disjoint spans in one call (more than one launch's worth), two of them misaligned.
    MF_CHECK_CUDA(cudaMemset(ddst, 0xA5, n));
    std::vector<unsigned char> want(n, 0xA5);
    std::vector<cuda::CopySpan> spans;
    for (size_t k = 0; k < 10; ++k) {
        const size_t dst_off = k * 65536 + (k == 3 ? 5 : 0), src_off = (9 - k) * 65536 + (k == 7 ? 1 : 0);
        const size_t bytes = 16 * (1000 + 37 * k) + (k == 7 ? 3 : 0);
        spans.push_back({ddst + dst_off, dsrc + src_off, bytes});
        std::memcpy(want.data() + dst_off, src.data() + src_off, bytes);
    }
    cuda::peer_copy(spans, nullptr);
    std::vector<unsigned char> got(n);
    MF_CHECK_CUDA(cudaMemcpy(got.data(), ddst, n, cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, want);
    cudaFree(dsrc);
    cudaFree(ddst);
}

TEST_F(CudaPeerFlags, SignalWaitAndTimeout) {
    uint64_t* flag = nullptr;
    MF_CHECK_CUDA(cudaMalloc(&flag, sizeof(uint64_t)));
    MF_CHECK_CUDA(cudaMemset(flag, 0, sizeof(uint64_t)));
    int* error = nullptr;
    MF_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&error), sizeof(int), cudaHostAllocMapped));
    *error = 0;
    int* derror = nullptr;
    MF_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&derror), error, 0));
    const uint64_t second = 1000000000;

    cuda::peer_signal(flag, 5, nullptr);
    cuda::peer_wait(flag, 5, 10 * second, derror, 3, nullptr);  // reached: passes
    cuda::peer_wait(flag, 4, 10 * second, derror, 3, nullptr);  // exceeded: passes
    MF_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(*error, 0);

    const auto t0 = std::chrono::steady_clock::now();
    cuda::peer_wait(flag, 6, second / 5, derror, 7, nullptr);  // never signalled: gives up after 0.2 s
    MF_CHECK_CUDA(cudaDeviceSynchronize());
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(*error, 7);
    EXPECT_GE(waited, 0.19);
    EXPECT_LT(waited, 5.0);

    const auto t1 = std::chrono::steady_clock::now();
    cuda::peer_wait(flag, 6, 60 * second, derror, 9, nullptr);  // the word is set: returns at once, keeps 7
    MF_CHECK_CUDA(cudaDeviceSynchronize());
    EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count(), 5.0);
    EXPECT_EQ(*error, 7);
    cudaFree(flag);
    cudaFreeHost(error);
}

}  // namespace
