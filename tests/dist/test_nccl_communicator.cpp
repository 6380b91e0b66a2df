// NcclCommunicator on 2 GPUs (forked ranks, rendezvous on loopback): all_reduce identical on both
// ranks and equal to the fp32 serial sum up to NCCL's order (checked bit for bit between ranks, and
// exactly for integer-valued data), rank-coded all_to_all_v dispatch and combine with zero counts,
// broadcast, broadcast_each, all_gather, split, and all_reduce_sum_async on the side stream (exact on integer
// data, one rounding for bf16 over 2 ranks); the peer exchange that carries all_to_all_v between GPUs
// of one host (parallel/peer_exchange.h): rank-coded bytes through 1000-byte slots (many rounds, odd
// sizes, zero sizes, two streams interleaved), the same through NCCL with it switched off, and a
// peer that never sends making the waiting rank exit with its rank named. Skips (exit 77) without
// NCCL in the build or with fewer than 2 GPUs.
// NOTE: the parent never touches CUDA, so that the forked ranks can initialise it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "core/bf16.h"
#include "dist_test_util.h"

#if defined(MOEFORGE_WITH_NCCL)
#include <cuda_runtime.h>
#include <unistd.h>

#include "parallel/nccl_communicator.h"
#include "parallel/peer_exchange.h"
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

// The parent's view of a two-GPU test: skipped (exit 77, said on stdout) when a rank found fewer
// than 2 GPUs.
void skip_without_two_gpus(const std::vector<RankResult>& results) {
    if (results[0].output == "skip") {
        std::printf("SKIPPED: fewer than 2 CUDA devices\n");
        std::exit(77);
    }
}

bool fewer_than_two_gpus() {
    int devices = 0;
    return cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2;
}

// One forked rank's NCCL world of 2 on loopback.
struct TwoGpuRank {
    parallel::Rendezvous rdv;
    parallel::NcclCommunicator comm;
    TwoGpuRank(int rank, int port, double timeout_s)
        : rdv(parallel::DistEnv{rank, 2, rank, "127.0.0.1", port}, 60, nullptr), comm(rdv, timeout_s) {}
};

TEST(Nccl, TwoGpuCollectives) {
    const int port = free_port();
    const auto results = run_processes(2, [&](int rank) -> std::string {
        if (fewer_than_two_gpus()) return "skip";
        TwoGpuRank world(rank, port, 60);
        auto& comm = world.comm;
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
        rank_check(comm.uses_peer_exchange(), "2 GPUs of one host: all_to_all_v should take the peer exchange");
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
        // broadcast_each (one NCCL group of point-to-point sends) and broadcast_each_async (side
        // stream), uneven pieces: each rank's own coded piece must reach the other. The async result
        // is read back on the default stream after join_async alone (no host wait): the device-side
        // ordering must suffice, as for the forward that reads ZeRO-1's broadcast parameters.
        auto check_broadcast = [&](const std::vector<int64_t>& pieces, int code, bool async) {
            std::vector<float> e(static_cast<size_t>(pieces.back()), -1.f);
            for (int64_t i = pieces[rank]; i < pieces[rank + 1]; ++i) e[i] = static_cast<float>(code * rank + i % 1021);
            DeviceVector<float> de(e);
            std::vector<float> re;
            if (async) {
                const uint64_t ticket = comm.broadcast_each_async(de.ptr, pieces, DType::f32);
                rank_check(ticket != 0, "broadcast_each_async returns a ticket");
                comm.join_async(ticket);
                re = de.host();
                comm.wait_async();
            } else {
                comm.broadcast_each(de.ptr, pieces, DType::f32);
                comm.synchronize();
                re = de.host();
            }
            for (int r = 0; r < 2; ++r)
                for (int64_t i = pieces[r]; i < pieces[r + 1]; ++i)
                    rank_check(re[i] == static_cast<float>(code * r + i % 1021),
                               async ? "broadcast_each_async element" : "broadcast_each element");
        };
        check_broadcast({0, 1000, 300000}, 7, false);
        check_broadcast({0, 20000000, 20000003}, 11, true);  // rank 0's piece 80 MB, rank 1's 3 floats
        auto solo = comm.split(rank, 0);
        rank_check(solo != nullptr && solo->size() == 1 && solo->rank() == 0, "split");
        comm.barrier();
        return "ok";
    });
    skip_without_two_gpus(results);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
}

// Rank-coded bytes: byte k of the piece `from` sends `to` in exchange `round`.
uint8_t code(int from, int to, int round, size_t k) {
    return static_cast<uint8_t>(from * 97 + to * 31 + round * 7 + k * 13 + (k >> 8));
}

// One all_to_all_v of bytes between 2 ranks, piece sizes sizes[from][to], with gaps between the
// pieces on both sides (even, so that the NCCL variant can count bf16 elements).
constexpr size_t kSendGap = 4, kRecvGap = 6;
struct BytePlan {
    std::vector<size_t> sb, so, rb, ro;
    std::vector<uint8_t> send;
    size_t recv_total = 0;
};

BytePlan byte_plan(int rank, const size_t (&sizes)[2][2], int round) {
    BytePlan b;
    for (int p = 0; p < 2; ++p) {
        b.sb.push_back(sizes[rank][p]);
        b.so.push_back(b.send.size());
        for (size_t k = 0; k < sizes[rank][p]; ++k) b.send.push_back(code(rank, p, round, k));
        b.send.resize(b.send.size() + kSendGap, 0xEE);
    }
    for (int p = 0; p < 2; ++p) {
        b.rb.push_back(sizes[p][rank]);
        b.ro.push_back(b.recv_total);
        b.recv_total += sizes[p][rank] + kRecvGap;
    }
    return b;
}

void check_bytes(const BytePlan& b, const std::vector<uint8_t>& recv, int rank, int round) {
    const std::string where = "exchange " + std::to_string(round) + ": ";
    for (int p = 0; p < 2; ++p) {
        for (size_t k = 0; k < b.rb[p]; ++k)
            rank_check(recv[b.ro[p] + k] == code(p, rank, round, k),
                       where + "byte " + std::to_string(k) + " from rank " + std::to_string(p));
        for (size_t k = b.rb[p]; k < b.rb[p] + kRecvGap; ++k)
            rank_check(recv[b.ro[p] + k] == 0x55, where + "a gap was written");
    }
}

TEST(Nccl, PeerExchangeRoundsAndFallback) {
    const int port = free_port();
    const auto results = run_processes(
        2,
        [&](int rank) -> std::string {
            if (fewer_than_two_gpus()) return "skip";
            TwoGpuRank world(rank, port, 60);
            auto& comm = world.comm;
            const size_t sizes[4][2][2] = {
                {{10, 4322}, {3000, 8}},  // uneven rounds both ways
                {{0, 1000}, {0, 0}},      // one direction only, exactly one slot
                {{2, 0}, {1002, 64}},     // nothing from rank 0 to rank 1, 2 rounds back
                {{50000, 12346}, {4, 65536}},
            };
            // 1000-byte slots: every piece above 1000 bytes travels in several rounds. Both copy kinds.
            using Copies = parallel::PeerExchange::Copies;
            for (const Copies copies : {Copies::engines, Copies::kernels}) {
                auto x = parallel::PeerExchange::create(comm, 1000, copies);
                rank_check(x != nullptr, "2 GPUs of one host: the peer exchange should be possible");
                cudaStream_t other = nullptr;
                rank_check(cudaStreamCreateWithFlags(&other, cudaStreamNonBlocking) == cudaSuccess, "stream");
                std::vector<BytePlan> plans;
                std::vector<std::unique_ptr<DeviceVector<uint8_t> > > sends, recvs;
                for (int round = 0; round < 8; ++round) {  // each shape twice, alternating streams, no wait between
                    plans.push_back(byte_plan(rank, sizes[round % 4], round));
                    const BytePlan& b = plans.back();
                    sends.push_back(std::make_unique<DeviceVector<uint8_t> >(b.send));
                    recvs.push_back(std::make_unique<DeviceVector<uint8_t> >(std::vector<uint8_t>(b.recv_total, 0x55)));
                    x->all_to_all_v(reinterpret_cast<const char*>(sends.back()->ptr), b.sb, b.so,
                                    reinterpret_cast<char*>(recvs.back()->ptr), b.rb, b.ro,
                                    round % 2 ? other : nullptr);
                }
                rank_check(cudaDeviceSynchronize() == cudaSuccess, "device");
                rank_check(x->late_peer() == -1, "no wait gave up");
                for (int round = 0; round < 8; ++round) check_bytes(plans[round], recvs[round]->host(), rank, round);
                x.reset();
                cudaStreamDestroy(other);
            }

            // The communicator's all_to_all_v with the peer exchange switched off goes through NCCL and
            // gives the same bytes (as bf16 elements).
            ::setenv("MOEFORGE_PEER_EXCHANGE", "0", 1);
            auto child = comm.split(0, rank);
            auto& nccl = static_cast<parallel::NcclCommunicator&>(*child);
            const BytePlan b = byte_plan(rank, sizes[3], 9);
            DeviceVector<uint8_t> ds(b.send), dr(std::vector<uint8_t>(b.recv_total, 0x55));
            auto elems = [](const std::vector<size_t>& v) {
                std::vector<int64_t> out;
                for (const size_t x : v) out.push_back(static_cast<int64_t>(x / 2));
                return out;
            };
            nccl.all_to_all_v(ds.ptr, elems(b.sb), elems(b.so), dr.ptr, elems(b.rb), elems(b.ro), DType::bf16);
            nccl.synchronize();
            rank_check(!nccl.uses_peer_exchange(), "MOEFORGE_PEER_EXCHANGE=0 should keep NCCL");
            check_bytes(b, dr.host(), rank, 9);
            return "ok";
        },
        120);
    skip_without_two_gpus(results);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
}

// A peer that never sends: the rank waiting for it ends with status 1 within the timeout, naming
// the late rank; the silent rank (which does get its piece through) is killed by the harness.
TEST(Nccl, PeerExchangeLatePeerNamed) {
    const int port = free_port();
    // The communicator reports on stderr and ends the process: rank 0's stderr goes to a file.
    const std::string err_path = "/tmp/mf_peer_late_" + std::to_string(::getpid()) + ".err";
    const auto results = run_processes(
        2,
        [&](int rank) -> std::string {
            if (fewer_than_two_gpus()) return "skip";
            if (rank == 0 && std::freopen(err_path.c_str(), "w", stderr) == nullptr) return "no stderr file";
            TwoGpuRank world(rank, port, 3);
            auto& comm = world.comm;
            std::vector<int64_t> one = {1, 1}, offs = {0, 1};
            DeviceVector<int32_t> s(std::vector<int32_t>{rank, rank}), r(std::vector<int32_t>{-1, -1});
            comm.all_to_all_v(s.ptr, one, offs, r.ptr, one, offs, DType::i32);  // makes the exchange; both take part
            comm.synchronize();
            rank_check(comm.uses_peer_exchange(), "2 GPUs of one host: the peer exchange should be taken");
            if (rank == 1) {
                ::sleep(30);  // never answers the second exchange
                return "rank 1 slept";
            }
            comm.all_to_all_v(s.ptr, one, offs, r.ptr, one, offs, DType::i32);
            comm.synchronize();  // must not return
            return "rank 0 returned from a wait for a silent peer";
        },
        20, 1);
    skip_without_two_gpus(results);
    std::ifstream in(err_path);
    const std::string err((std::istreambuf_iterator<char>(in)), {});
    std::remove(err_path.c_str());
    EXPECT_EQ(results[0].exit_code, 1) << results[0].output << err;
    EXPECT_NE(err.find("rank 0: timed out after 3 s waiting for rank 1 of this group"), std::string::npos) << err;
    EXPECT_LT(results[0].seconds, 15.0);
}

#endif

}  // namespace
}  // namespace mf::test
