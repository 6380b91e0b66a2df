// NcclCommunicator on 2 GPUs (forked ranks, rendezvous on loopback): all_reduce identical on both
// ranks and equal to the fp32 serial sum up to NCCL's order (checked bit for bit between ranks, and
// exactly for integer-valued data), rank-coded all_to_all_v dispatch and combine with zero counts,
// broadcast, broadcast_each, all_gather, split, and all_reduce_sum_async on the side stream (exact on integer
// data, one rounding for bf16 over 2 ranks). Skips (exit 77) without NCCL in the build or with fewer than 2 GPUs.
// NOTE: the parent never touches CUDA, so that the forked ranks can initialise it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/bf16.h"
#include "dist_test_util.h"

#if defined(MOEFORGE_WITH_NCCL)
#include <cuda_runtime.h>

#include "parallel/nccl_communicator.h"
#endif

namespace mf::test {
namespace {

#if !defined(MOEFORGE_WITH_NCCL)

TEST(Nccl, NotBuilt) {
    std::printf("SKIPPED: moeforge built without NCCL (needs MOEFORGE_CUDA and NCCL, cmake/nccl.cmake)\n");
    std::exit(77);
}

#else

template <typename T>
struct DeviceVector {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceVector(const std::vector<T>& host) : n(host.size()) {
        if (cudaMalloc(&ptr, std::max<size_t>(n, 1) * sizeof(T)) != cudaSuccess) throw Error("cudaMalloc failed");
        cudaMemcpy(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice);
    }
    ~DeviceVector() { cudaFree(ptr); }
    std::vector<T> host() const {
        std::vector<T> out(n);
        cudaMemcpy(out.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
        return out;
    }
};

TEST(Nccl, TwoGpuCollectives) {
    const int port = free_port();
    const auto results = run_processes(2, [&](int rank) -> std::string {
        int devices = 0;
        if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) return "skip";
        parallel::DistEnv env{rank, 2, rank, "127.0.0.1", port};
        parallel::Rendezvous rdv(env, 60, nullptr);
        parallel::NcclCommunicator comm(rdv, 60);
        // Integer-valued floats: every summation order gives the same exact result.
        std::vector<float> x(100003);
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7 + rank * 13) % 1000);
        DeviceVector<float> dx(x);
        comm.all_reduce_sum(dx.ptr, static_cast<int64_t>(x.size()), DType::f32);
        comm.synchronize();
        const auto y = dx.host();
        for (size_t i = 0; i < x.size(); ++i)
            rank_check(y[i] == static_cast<float>((i * 7) % 1000 + (i * 7 + 13) % 1000), "f32 all_reduce");
        // Bitwise identical on both ranks for non-exact data: gather the results and compare.
        std::vector<float> z(4099);
        for (size_t i = 0; i < z.size(); ++i) z[i] = 1.f / static_cast<float>(i + 1 + rank * 3);
        DeviceVector<float> dz(z);
        comm.all_reduce_sum(dz.ptr, static_cast<int64_t>(z.size()), DType::f32);
        DeviceVector<float> both(std::vector<float>(2 * z.size()));
        comm.all_gather(dz.ptr, both.ptr, static_cast<int64_t>(z.size()), DType::f32);
        comm.synchronize();
        const auto b = both.host();
        rank_check(std::memcmp(b.data(), b.data() + z.size(), z.size() * 4) == 0, "ranks differ");
        // all_to_all_v: rank 1 sends nothing to rank 0; rank-coded i64 payloads; then combine back.
        const int64_t counts[2][2] = {{3, 5}, {0, 2}};
        std::vector<int64_t> sc = {counts[rank][0], counts[rank][1]}, so = {0, counts[rank][0]};
        std::vector<int64_t> rc = {counts[0][rank], counts[1][rank]}, ro = {0, counts[0][rank]};
        std::vector<int64_t> send;
        for (int p = 0; p < 2; ++p)
            for (int64_t k = 0; k < sc[p]; ++k) send.push_back((int64_t{rank} << 40) | (int64_t{p} << 20) | k);
        DeviceVector<int64_t> dsend(send), drecv(std::vector<int64_t>(rc[0] + rc[1], -1)),
            dback(std::vector<int64_t>(send.size(), -1));
        comm.all_to_all_v(dsend.ptr, sc, so, drecv.ptr, rc, ro, DType::i64);
        comm.all_to_all_v(drecv.ptr, rc, ro, dback.ptr, sc, so, DType::i64);
        comm.synchronize();
        const auto recv = drecv.host();
        for (int p = 0; p < 2; ++p)
            for (int64_t k = 0; k < rc[p]; ++k)
                rank_check(recv[ro[p] + k] == ((int64_t{p} << 40) | (int64_t{rank} << 20) | k), "all_to_all_v code");
        rank_check(dback.host() == send, "combine");
        // all_reduce_sum_async: several reductions started on the side stream behind default-stream
        // work (a kernel-free memcpy that writes the input first), then waited for; f32 integer data
        // gives the exact sums, and a bf16 buffer of 2 ranks equals the one-rounding sum.
        std::vector<float> a(300007), c(1031);
        for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>((i * 3 + rank * 5) % 512);
        for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<float>((i + rank) % 64);
        DeviceVector<float> da(std::vector<float>(a.size(), -1.f)), dc(c);
        cudaMemcpyAsync(da.ptr, a.data(), a.size() * 4, cudaMemcpyHostToDevice, nullptr);
        comm.all_reduce_sum_async(da.ptr, 1000, DType::f32);
        comm.all_reduce_sum_async(da.ptr + 1000, static_cast<int64_t>(a.size()) - 1000, DType::f32);
        comm.all_reduce_sum_async(dc.ptr, static_cast<int64_t>(c.size()), DType::f32);
        comm.wait_async();
        const auto ra = da.host(), rc2 = dc.host();
        for (size_t i = 0; i < a.size(); ++i)
            rank_check(ra[i] == static_cast<float>((i * 3) % 512 + (i * 3 + 5) % 512), "async f32 all_reduce");
        for (size_t i = 0; i < c.size(); ++i)
            rank_check(rc2[i] == static_cast<float>(i % 64 + (i + 1) % 64), "async f32 all_reduce (2nd buffer)");
        std::vector<uint16_t> h(777);
        for (size_t i = 0; i < h.size(); ++i) h[i] = f32_to_bf16(0.1f * static_cast<float>(i) + 0.37f * rank);
        DeviceVector<uint16_t> dh(h);
        comm.all_reduce_sum_async(dh.ptr, static_cast<int64_t>(h.size()), DType::bf16);
        comm.wait_async();
        const auto rh = dh.host();
        for (size_t i = 0; i < h.size(); ++i) {
            const float exact = bf16_to_f32(f32_to_bf16(0.1f * static_cast<float>(i))) +
                                bf16_to_f32(f32_to_bf16(0.1f * static_cast<float>(i) + 0.37f));
            rank_check(rh[i] == f32_to_bf16(exact), "async bf16 all_reduce of 2 ranks: one rounding");
        }
        // broadcast_each (one NCCL group of broadcasts): uneven pieces, the second rank's the larger.
        const std::vector<int64_t> pieces = {0, 1000, 300000};
        std::vector<float> e(300000, -1.f);
        for (int64_t i = pieces[rank]; i < pieces[rank + 1]; ++i) e[i] = static_cast<float>(7 * rank + i % 1024);
        DeviceVector<float> de(e);
        comm.broadcast_each(de.ptr, pieces, DType::f32);
        comm.synchronize();
        const auto re = de.host();
        for (int r = 0; r < 2; ++r)
            for (int64_t i = pieces[r]; i < pieces[r + 1]; ++i)
                rank_check(re[i] == static_cast<float>(7 * r + i % 1024), "broadcast_each element");
        auto solo = comm.split(rank, 0);
        rank_check(solo != nullptr && solo->size() == 1 && solo->rank() == 0, "split");
        comm.barrier();
        return "ok";
    });
    if (results[0].output == "skip") {
        std::printf("SKIPPED: fewer than 2 CUDA devices\n");
        std::exit(77);
    }
    for (int r = 0; r < 2; ++r) EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
}

#endif

}  // namespace
}  // namespace mf::test
