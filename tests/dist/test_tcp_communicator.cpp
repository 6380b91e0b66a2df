// TcpCommunicator between 2 and 4 forked processes on loopback: every collective against a serial
// reference computed independently in each rank, bit for bit; rank-coded all_to_all_v payloads
// with ranks that send or receive nothing, dispatched and combined back; EP x DP sub-groups; and the
// failure paths (a rank that exits, a rank that hangs, mismatched calls), which must end every
// rank within the timeout with a message naming the peer.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "core/bf16.h"
#include "dist_test_util.h"

namespace mf::test {
namespace {

using parallel::Communicator;

// Rank r's input for all_reduce: magnitudes spread over many binades so the summation order
// changes the rounded result (the test checks that it does).
std::vector<float> reduce_input(int rank, size_t count) {
    std::mt19937 gen(1234 + rank);
    std::uniform_real_distribution<float> mant(-1.f, 1.f);
    std::uniform_int_distribution<int> expo(-20, 20);
    std::vector<float> x(count);
    for (auto& v : x) v = std::ldexp(mant(gen), expo(gen));
    return x;
}

std::string expect_all_ok(const std::vector<RankResult>& results) {
    std::string bad;
    for (size_t r = 0; r < results.size(); ++r)
        if (results[r].exit_code != 0)
            bad += "rank " + std::to_string(r) + " exit " + std::to_string(results[r].exit_code) + ": " +
                   results[r].output + "\n";
    return bad;
}

class AllReduce : public ::testing::TestWithParam<int> {};

TEST_P(AllReduce, F32IsTheRankOrderSumOnEveryRank) {
    const int n = GetParam();
    // Over the 4 MiB chunk (1 Mi floats) so that chunking is exercised.
    const size_t count = (1u << 20) + 4099;
    const auto results = run_ranks(n, 20, [&](Communicator& comm) {
        std::vector<float> data = reduce_input(comm.rank(), count);
        comm.all_reduce_sum(data.data(), static_cast<int64_t>(count), DType::f32);
        std::vector<float> ref = reduce_input(0, count), reversed = reduce_input(n - 1, count);
        for (int r = 1; r < n; ++r) {
            const auto x = reduce_input(r, count);
            for (size_t i = 0; i < count; ++i) ref[i] += x[i];
        }
        for (int r = n - 2; r >= 0; --r) {
            const auto x = reduce_input(r, count);
            for (size_t i = 0; i < count; ++i) reversed[i] += x[i];
        }
        size_t order_matters = 0;
        for (size_t i = 0; i < count; ++i) {
            rank_check(std::memcmp(&data[i], &ref[i], 4) == 0, "element " + std::to_string(i) + " differs");
            order_matters += std::memcmp(&ref[i], &reversed[i], 4) != 0;
        }
        if (n > 2) rank_check(order_matters > 0, "test data too benign: the order never matters");
        return std::string("ok");
    });
    EXPECT_EQ(expect_all_ok(results), "");
}

TEST_P(AllReduce, Bf16SumsInF32AndRoundsOnce) {
    const int n = GetParam();
    const size_t count = 5003;
    auto input = [](int rank, size_t count) {
        std::vector<uint16_t> x;
        for (float v : reduce_input(rank, count)) x.push_back(f32_to_bf16(v));
        return x;
    };
    const auto results = run_ranks(n, 20, [&](Communicator& comm) {
        std::vector<uint16_t> data = input(comm.rank(), count);
        comm.all_reduce_sum(data.data(), static_cast<int64_t>(count), DType::bf16);
        std::vector<float> acc(count, 0.f);
        for (int r = 0; r < n; ++r) {
            const auto x = input(r, count);
            for (size_t i = 0; i < count; ++i) acc[i] = r == 0 ? bf16_to_f32(x[i]) : acc[i] + bf16_to_f32(x[i]);
        }
        for (size_t i = 0; i < count; ++i)
            rank_check(data[i] == f32_to_bf16(acc[i]), "bf16 element " + std::to_string(i) + " differs");
        // Integers too (token counts): exact.
        int64_t counts[3] = {comm.rank(), 1, int64_t{1} << 40};
        comm.all_reduce_sum(counts, 3, DType::i64);
        rank_check(counts[0] == n * (n - 1) / 2 && counts[1] == n && counts[2] == n * (int64_t{1} << 40), "i64 sum");
        return std::string("ok");
    });
    EXPECT_EQ(expect_all_ok(results), "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, AllReduce, ::testing::Values(2, 4));

// Elements of rank s's message to rank d: the code (s, d, index), as an i64.
int64_t code(int src, int dst, int64_t idx) { return (int64_t{src} << 40) | (int64_t{dst} << 20) | idx; }

// Tokens rank s sends to rank d; rank 3 sends nothing, nobody sends to rank 2, and self-sends exist.
int64_t route_count(int src, int dst, int n) {
    if (n == 4 && (src == 3 || dst == 2)) return 0;
    return (src * 7 + dst * 3) % 5 + (src == dst ? 1 : 0);
}

TEST(AllToAllV, RankCodedDispatchThenCombineIsBitExact) {
    for (const int n : {2, 4}) {
        const auto results = run_ranks(n, 20, [&](Communicator& comm) {
            const int me = comm.rank();
            std::vector<int64_t> send_counts(n), send_offsets(n), recv_counts(n), recv_offsets(n);
            int64_t send_total = 0, recv_total = 0;
            for (int p = 0; p < n; ++p) {
                // Gaps of 2 elements between segments: offsets are honoured, not assumed contiguous.
                send_counts[p] = route_count(me, p, n);
                send_offsets[p] = send_total;
                send_total += send_counts[p] + 2;
                recv_counts[p] = route_count(p, me, n);
                recv_offsets[p] = recv_total;
                recv_total += recv_counts[p] + 2;
            }
            constexpr int64_t kSentinel = -7;
            std::vector<int64_t> send(send_total, kSentinel), recv(recv_total, kSentinel);
            for (int p = 0; p < n; ++p)
                for (int64_t k = 0; k < send_counts[p]; ++k) send[send_offsets[p] + k] = code(me, p, k);
            comm.all_to_all_v(send.data(), send_counts, send_offsets, recv.data(), recv_counts, recv_offsets,
                              DType::i64);
            for (int p = 0; p < n; ++p) {
                for (int64_t k = 0; k < recv_counts[p]; ++k)
                    rank_check(recv[recv_offsets[p] + k] == code(p, me, k),
                               "element " + std::to_string(k) + " from rank " + std::to_string(p));
                rank_check(recv[recv_offsets[p] + recv_counts[p]] == kSentinel, "gap overwritten");
            }
            // Combine: the reverse all-to-all returns every element to where it came from.
            std::vector<int64_t> back(send_total, kSentinel);
            comm.all_to_all_v(recv.data(), recv_counts, recv_offsets, back.data(), send_counts, send_offsets,
                              DType::i64);
            rank_check(back == send, "combine did not return the dispatched payload");

            // Same routing with 2-byte elements (bf16 bit patterns): offsets scale by the element size.
            std::vector<uint16_t> send16(send_total, 0xFFFF), recv16(recv_total, 0xFFFF);
            for (int p = 0; p < n; ++p)
                for (int64_t k = 0; k < send_counts[p]; ++k)
                    send16[send_offsets[p] + k] = static_cast<uint16_t>((me << 12) | (p << 8) | k);
            comm.all_to_all_v(send16.data(), send_counts, send_offsets, recv16.data(), recv_counts, recv_offsets,
                              DType::bf16);
            for (int p = 0; p < n; ++p)
                for (int64_t k = 0; k < recv_counts[p]; ++k)
                    rank_check(recv16[recv_offsets[p] + k] == static_cast<uint16_t>((p << 12) | (me << 8) | k),
                               "bf16 element");
            return std::string("ok");
        });
        EXPECT_EQ(expect_all_ok(results), "") << "world " << n;
    }
}

TEST(Collectives, BroadcastAllGatherBarrier) {
    const int n = 4;
    const auto results = run_ranks(n, 20, [&](Communicator& comm) {
        const int me = comm.rank();
        rank_check(comm.size() == n && comm.world_rank() == me, "rank/size");
        std::vector<float> b(1000);
        for (size_t i = 0; i < b.size(); ++i) b[i] = me == 2 ? 0.5f * i - 3.f : -1.f;
        comm.broadcast(b.data(), 1000, DType::f32, 2);
        for (size_t i = 0; i < b.size(); ++i) rank_check(b[i] == 0.5f * i - 3.f, "broadcast element");
        comm.broadcast(b.data(), 0, DType::f32, 1);  // empty is fine
        // broadcast_each: uneven pieces (rank 1's empty), each rank's own piece reaches every rank.
        const std::vector<int64_t> pieces = {0, 5, 5, 12, 20};
        std::vector<int32_t> each(20, -1);
        for (int64_t i = pieces[me]; i < pieces[me + 1]; ++i) each[i] = 1000 * me + static_cast<int32_t>(i);
        comm.broadcast_each(each.data(), pieces, DType::i32);
        for (int r = 0; r < n; ++r)
            for (int64_t i = pieces[r]; i < pieces[r + 1]; ++i)
                rank_check(each[i] == 1000 * r + static_cast<int32_t>(i), "broadcast_each element");
        bool threw = false;
        try {
            comm.broadcast_each(each.data(), std::vector<int64_t>{0, 5, 4, 12, 20}, DType::i32);
        } catch (const mf::Error&) {
            threw = true;  // decreasing offsets are refused before any communication, on every rank
        }
        rank_check(threw, "broadcast_each with decreasing offsets must throw");
        std::vector<int32_t> mine(3), all(3 * n, -1);
        for (int i = 0; i < 3; ++i) mine[i] = 100 * me + i;
        comm.all_gather(mine.data(), all.data(), 3, DType::i32);
        for (int r = 0; r < n; ++r)
            for (int i = 0; i < 3; ++i) rank_check(all[3 * r + i] == 100 * r + i, "all_gather element");
        comm.barrier();
        return std::string("ok");
    });
    EXPECT_EQ(expect_all_ok(results), "");
}

TEST(Layout, EpGroupsConsecutiveDpGroupsStrided) {
    const auto layout = parallel::ParallelLayout::make(8, 4, "test");
    EXPECT_EQ(layout.dp_size(), 2);
    EXPECT_EQ(layout.ep_group(5), (std::vector<int>{4, 5, 6, 7}));
    EXPECT_EQ(layout.dp_group(5), (std::vector<int>{1, 5}));
    EXPECT_EQ(layout.ep_rank(5), 1);
    EXPECT_EQ(layout.dp_rank(5), 1);
    EXPECT_THROW(parallel::ParallelLayout::make(6, 4, "recipe.yaml"), Error);
    EXPECT_THROW(parallel::ParallelLayout::make(4, 0, "recipe.yaml"), Error);
}

TEST(SubGroups, EpTwoByDpTwoOnFourRanks) {
    const auto results = run_ranks(4, 20, [&](Communicator& world) {
        const int me = world.rank();
        auto groups = parallel::make_process_groups(world, 2);
        Communicator& ep = *groups.ep;
        Communicator& dp = *groups.dp;
        rank_check(ep.size() == 2 && dp.size() == 2, "group sizes");
        rank_check(ep.rank() == me % 2 && dp.rank() == me / 2, "group ranks");
        // EP group {0,1} / {2,3}; DP group {0,2} / {1,3}: sums of (world rank + 1) tell them apart.
        float v = static_cast<float>(me + 1);
        ep.all_reduce_sum(&v, 1, DType::f32);
        rank_check(v == (me < 2 ? 3.f : 7.f), "EP all_reduce " + std::to_string(v));
        float w = static_cast<float>(me + 1);
        dp.all_reduce_sum(&w, 1, DType::f32);
        rank_check(w == (me % 2 == 0 ? 4.f : 6.f), "DP all_reduce " + std::to_string(w));
        int32_t wr = me, gathered[2] = {-1, -1};
        dp.all_gather(&wr, gathered, 1, DType::i32);
        rank_check(gathered[0] == me % 2 && gathered[1] == me % 2 + 2, "DP members");
        // An all-to-all inside the EP group, interleaved with world collectives.
        const int64_t counts[2] = {1, 1}, offsets[2] = {0, 1};
        int64_t send[2] = {code(me, 0, 0), code(me, 1, 0)}, recv[2] = {0, 0};
        ep.all_to_all_v(send, counts, offsets, recv, counts, offsets, DType::i64);
        world.barrier();
        const int base = me - me % 2;
        rank_check(recv[0] == code(base, me % 2, 0) && recv[1] == code(base + 1, me % 2, 0), "EP all_to_all_v");
        // split: negative color opts out; keys reorder.
        auto odd = world.split(me % 2 == 1 ? 0 : -1, -me);
        if (me % 2 == 1) {
            rank_check(odd != nullptr && odd->size() == 2 && odd->rank() == (me == 3 ? 0 : 1), "split order");
            int32_t x = me, y[2];
            odd->all_gather(&x, y, 1, DType::i32);
            rank_check(y[0] == 3 && y[1] == 1, "split members");
        } else {
            rank_check(odd == nullptr, "negative color got a group");
        }
        world.barrier();
        return std::string("ok");
    });
    EXPECT_EQ(expect_all_ok(results), "");
}

// --- failures -------------------------------------------------------------------------------------

TEST(Failures, RankThatExitsEarlyIsNamedAtOnce) {
    const auto results = run_ranks(4, 10, [&](Communicator& comm) -> std::string {
        if (comm.rank() == 2) ::_exit(0);
        comm.barrier();
        return "barrier passed without rank 2";
    });
    // A survivor waiting on rank 2 names it; one waiting on a survivor that has already failed may
    // name that one instead (e.g. rank 3's barrier goes through rank 0). At least one names rank 2.
    int named_rank2 = 0;
    for (int r : {0, 1, 3}) {
        EXPECT_EQ(results[r].exit_code, 1) << results[r].output;
        const std::string me = "rank " + std::to_string(r) + ": connection to rank ";
        named_rank2 += results[r].output.find(me + "2 lost") != std::string::npos;
        EXPECT_NE(results[r].output.find(me), std::string::npos) << results[r].output;
        EXPECT_NE(results[r].output.find("barrier"), std::string::npos) << results[r].output;
        EXPECT_LT(results[r].seconds, 8.0);  // far below the 10 s timeout: a closed socket is seen at once
    }
    EXPECT_GE(named_rank2, 1);
}

TEST(Failures, HungRankTimesOutEveryOtherRank) {
    constexpr double kTimeout = 1.5;
    const auto results = run_ranks(
        3, kTimeout,
        [&](Communicator& comm) -> std::string {
            if (comm.rank() == 1) std::this_thread::sleep_for(std::chrono::seconds(60));  // killed by the harness
            std::vector<int64_t> counts(3, 1), offsets = {0, 1, 2};
            std::vector<int64_t> send(3, comm.rank()), recv(3);
            comm.all_to_all_v(send.data(), counts, offsets, recv.data(), counts, offsets, DType::i64);
            return "all_to_all_v passed without rank 1";
        },
        /*deadline_s=*/8, /*hung_rank=*/1);
    EXPECT_EQ(results[1].exit_code, -1);  // still hung when the others had exited
    for (int r : {0, 2}) {
        EXPECT_EQ(results[r].exit_code, 1) << results[r].output;
        EXPECT_NE(results[r].output.find("rank " + std::to_string(r) +
                                         ": timed out after 1.5 s waiting for rank 1 in all_to_all_v (tag 1)"),
                  std::string::npos)
            << results[r].output;
        EXPECT_LT(results[r].seconds, kTimeout + 4.0);
    }
}

TEST(Failures, HungRootOfAllReduce) {
    const auto results = run_ranks(
        3, 1.0,
        [&](Communicator& comm) -> std::string {
            float x = 1.f;
            comm.all_reduce_sum(&x, 1, DType::f32);
            if (comm.rank() == 0) std::this_thread::sleep_for(std::chrono::seconds(60));
            comm.all_reduce_sum(&x, 1, DType::f32);
            return "second all_reduce passed without rank 0";
        },
        /*deadline_s=*/8, /*hung_rank=*/0);
    for (int r : {1, 2}) {
        EXPECT_EQ(results[r].exit_code, 1) << results[r].output;
        EXPECT_NE(results[r].output.find("waiting for rank 0 in all_reduce_sum (tag 2)"), std::string::npos)
            << results[r].output;
    }
}

TEST(Failures, MismatchedCollectivesAndCounts) {
    const auto results = run_ranks(2, 10, [&](Communicator& comm) -> std::string {
        float x = 0;
        if (comm.rank() == 0)
            comm.broadcast(&x, 1, DType::f32, 0);
        else
            comm.barrier();
        comm.barrier();  // rank 0's broadcast completes on its own; this barrier then sees rank 1 gone
        return "mismatch not detected";
    });
    EXPECT_EQ(results[1].exit_code, 1);
    EXPECT_NE(results[1].output.find("rank 0 sent broadcast"), std::string::npos) << results[1].output;
    EXPECT_NE(results[1].output.find("different orders"), std::string::npos) << results[1].output;
    EXPECT_NE(results[0].exit_code, 0) << results[0].output;

    const auto counts = run_ranks(2, 10, [&](Communicator& comm) -> std::string {
        const int64_t sc[2] = {1, comm.rank() == 0 ? 3 : 1}, rc[2] = {1, 1}, off[2] = {0, 1};
        int64_t send[4] = {}, recv[4] = {};
        comm.all_to_all_v(send, sc, off, recv, rc, off, DType::i64);
        return "count mismatch not detected";
    });
    EXPECT_EQ(counts[1].exit_code, 1);
    EXPECT_NE(counts[1].output.find("rank 0 sent 24 bytes in all_to_all_v (tag 1), this rank expected 8"),
              std::string::npos)
        << counts[1].output;
}

TEST(Failures, RendezvousNamesMissingRank) {
    const int port = free_port();
    const auto results = run_processes(2, [&](int rank) -> std::string {
        parallel::DistEnv env{rank, 3, rank, "127.0.0.1", port};
        parallel::TcpCommunicator comm(env, 1.0);
        return "joined a world with a missing rank";
    });
    EXPECT_EQ(results[0].exit_code, 1);
    EXPECT_NE(results[0].output.find("rank 0: timed out after 1 s in rendezvous"), std::string::npos)
        << results[0].output;
    EXPECT_NE(results[0].output.find("waiting for rank(s) 2 (1 of 2 joined)"), std::string::npos) << results[0].output;
    EXPECT_EQ(results[1].exit_code, 1);
    EXPECT_NE(results[1].output.find("rank 1: "), std::string::npos) << results[1].output;
    EXPECT_NE(results[1].output.find("rank 0 in rendezvous"), std::string::npos) << results[1].output;
}

TEST(Rendezvous, ShareBlobFromRankZero) {
    const int port = free_port();
    const auto results = run_processes(3, [&](int rank) -> std::string {
        parallel::DistEnv env{rank, 3, rank, "127.0.0.1", port};
        parallel::Rendezvous rdv(env, 10, nullptr);
        std::string blob;
        if (rank == 0)
            for (int i = 0; i < 128; ++i) blob.push_back(static_cast<char>(i * 37 + 11));  // like an NCCL unique id
        rdv.share_blob(blob);
        rank_check(blob.size() == 128, "blob size");
        for (int i = 0; i < 128; ++i) rank_check(blob[i] == static_cast<char>(i * 37 + 11), "blob byte");
        std::string second = rank == 0 ? "" : "ignored";
        rdv.share_blob(second);  // an empty blob from rank 0 clears everyone's
        rank_check(second.empty(), "empty blob");
        return std::string("ok");
    });
    EXPECT_EQ(expect_all_ok(results), "");
}

}  // namespace
}  // namespace mf::test
