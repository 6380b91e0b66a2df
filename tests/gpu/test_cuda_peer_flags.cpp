// The peer exchange's kernels (kernels/cuda/peer_flags.cuh) on one GPU, against their host
// references: peer_copy against memcpy (16-byte and byte paths: aligned and misaligned pointers, sizes
// around 16, a megabyte and change, zero; one span, and ten disjoint spans of mixed alignment in one
// call: more than one launch holds); peer_signal then peer_wait passes, a wait for a value never
// signalled gives up after its timeout with its code in the error word, and a later wait returns at
// once once the word is set. (Between two GPUs they run in tests/dist/test_nccl_communicator.cpp.)
// MF_BENCH=1: whether the exchange's copies (SM kernels or copy engines) and its one-thread flag
// kernels, issued on a side stream, run beside a persistent sm90 grouped GEMM that holds every SM
// (the EP pipeline's overlap depends on it): each alone, then together, timed from a common start.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <random>
#include <vector>

#include "core/cuda_check.h"
#include "kernels/cuda/grouped_gemm_sm90.cuh"
#include "kernels/cuda/peer_flags.cuh"
#include "test_cuda_common.h"
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
    const Case cases[] = {{0, 0, 0},        {0, 0, 16}, {0, 0, 1 << 20},        {16, 32, 48},
                          {1, 3, 15},       {0, 0, 17}, {5, 0, (1 << 20) + 13}, {0, 7, 1000},
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

TEST_F(CudaPeerFlags, BenchCopiesBesideGroupedGemm) {
    if (!test::bench_enabled()) GTEST_SKIP() << "set MF_BENCH=1";
    // The P2 shape of one expert GEMM (gate_up forward, 64 local experts, 1024 rows each) and one
    // exchange's worth of bytes (~32K token rows of 2048 bf16).
    const int64_t E = 64, M = 65536, C = 2048, OC = 1536;
    const size_t copy_bytes = size_t{32768} * 2048 * 2;
    cuda::bf16 *inp = nullptr, *weight = nullptr, *out = nullptr;
    int32_t* offsets = nullptr;
    unsigned char *src = nullptr, *dst = nullptr;
    uint64_t* flag = nullptr;
    MF_CHECK_CUDA(cudaMalloc(&inp, static_cast<size_t>(M * C) * sizeof(cuda::bf16)));
    MF_CHECK_CUDA(cudaMalloc(&weight, static_cast<size_t>(E * OC * C) * sizeof(cuda::bf16)));
    MF_CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(M * OC) * sizeof(cuda::bf16)));
    MF_CHECK_CUDA(cudaMalloc(&offsets, static_cast<size_t>(E + 1) * sizeof(int32_t)));
    MF_CHECK_CUDA(cudaMalloc(&src, copy_bytes));
    MF_CHECK_CUDA(cudaMalloc(&dst, copy_bytes));
    MF_CHECK_CUDA(cudaMalloc(&flag, sizeof(uint64_t)));
    MF_CHECK_CUDA(cudaMemset(inp, 0x3e, static_cast<size_t>(M * C) * sizeof(cuda::bf16)));
    MF_CHECK_CUDA(cudaMemset(weight, 0x3c, static_cast<size_t>(E * OC * C) * sizeof(cuda::bf16)));
    MF_CHECK_CUDA(cudaMemset(src, 1, copy_bytes));
    std::vector<int32_t> off(static_cast<size_t>(E + 1));
    for (int64_t e = 0; e <= E; ++e) off[static_cast<size_t>(e)] = static_cast<int32_t>(e * (M / E));
    MF_CHECK_CUDA(cudaMemcpy(offsets, off.data(), off.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
    cudaStream_t main_s = nullptr, side = nullptr;
    MF_CHECK_CUDA(cudaStreamCreateWithFlags(&main_s, cudaStreamNonBlocking));
    MF_CHECK_CUDA(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
    cudaEvent_t start, gemm_done, side_done;
    for (cudaEvent_t* ev : {&start, &gemm_done, &side_done}) MF_CHECK_CUDA(cudaEventCreate(ev));
    const cuda::CopySpan span{dst, src, copy_bytes};
    enum class Side { none, sm_copy, ce_copy, flag };
    auto issue_side = [&](Side what) {
        if (what == Side::sm_copy) cuda::peer_copy({&span, 1}, side);
        if (what == Side::ce_copy) MF_CHECK_CUDA(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, side));
        if (what == Side::flag) cuda::peer_signal(flag, 1, side);
    };
    // Median over 7 runs of (gemm end, side end) in ms from the common start.
    auto run = [&](bool gemm, Side what) {
        std::vector<float> g, sd;
        for (int it = 0; it < 8; ++it) {
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            MF_CHECK_CUDA(cudaEventRecord(start, main_s));
            MF_CHECK_CUDA(cudaStreamWaitEvent(side, start, 0));
            if (gemm) cuda::grouped_matmul_forward_sm90(out, inp, weight, offsets, M, E, C, OC, main_s);
            MF_CHECK_CUDA(cudaEventRecord(gemm_done, main_s));
            issue_side(what);
            MF_CHECK_CUDA(cudaEventRecord(side_done, side));
            MF_CHECK_CUDA(cudaDeviceSynchronize());
            if (it == 0) continue;  // warm-up
            float a = 0, b = 0;
            MF_CHECK_CUDA(cudaEventElapsedTime(&a, start, gemm_done));
            MF_CHECK_CUDA(cudaEventElapsedTime(&b, start, side_done));
            g.push_back(a);
            sd.push_back(b);
        }
        std::sort(g.begin(), g.end());
        std::sort(sd.begin(), sd.end());
        return std::pair<float, float>{g[g.size() / 2], sd[sd.size() / 2]};
    };
    const float gemm_alone = run(true, Side::none).first;
    std::printf("BENCH grouped GEMM (sm90, %lld rows, %lld experts, %lldx%lld) alone: %.3f ms\n",
                static_cast<long long>(M), static_cast<long long>(E), static_cast<long long>(OC),
                static_cast<long long>(C), gemm_alone);
    for (const auto& [what, name] :
         {std::pair{Side::sm_copy, "SM-kernel copy"}, std::pair{Side::ce_copy, "copy-engine copy"},
          std::pair{Side::flag, "one-thread flag kernel"}}) {
        const float alone = run(false, what).second;
        const auto [g, sd] = run(true, what);
        std::printf(
            "BENCH %-24s (%.0f MB) alone %.3f ms; beside the GEMM: GEMM ends at %.3f ms, side at %.3f ms "
            "(%s)\n",
            name, what == Side::flag ? 0.0 : copy_bytes / 1e6, alone, g, sd,
            sd < g ? "overlapped" : "waited for the GEMM");
    }
    // Reserving SMs for the side stream: the GEMM alone on fewer SMs, and beside the SM-kernel copy.
    for (const int reserve : {4, 8, 16, 24, 32}) {
        cuda::set_grouped_gemm_sm90_reserved_sms(reserve);
        const float g_alone = run(true, Side::none).first;
        const auto [g, sd] = run(true, Side::sm_copy);
        std::printf(
            "BENCH reserve %2d SMs: GEMM alone %.3f ms (%+.1f%%); beside the SM-kernel copy GEMM ends at %.3f "
            "ms, copy at %.3f ms\n",
            reserve, g_alone, 100.0 * (g_alone / gemm_alone - 1), g, sd);
    }
    cuda::set_grouped_gemm_sm90_reserved_sms(0);
    for (cudaEvent_t ev : {start, gemm_done, side_done}) cudaEventDestroy(ev);
    cudaStreamDestroy(main_s);
    cudaStreamDestroy(side);
    for (void* p :
         {static_cast<void*>(inp), static_cast<void*>(weight), static_cast<void*>(out), static_cast<void*>(offsets),
          static_cast<void*>(src), static_cast<void*>(dst), static_cast<void*>(flag)})
        cudaFree(p);
}

}  // namespace
