// Expert-parallel dispatch and combine (model/ep_exchange.h) between real processes over TCP, with
// rank-coded payloads compared bit for bit (tests/dist/ep_round_trip.h): every routing of the
// harness (including a rank that sends nothing to its peers, ranks that receive nothing and experts
// with no rows), unpipelined and in 2 chunks, on 2 and 3 ranks.
#include <gtest/gtest.h>

#include <cstdio>

#include "dist_test_util.h"
#include "ep_round_trip.h"

namespace mf::test {
namespace {

std::string all_round_trips(parallel::Communicator& comm) {
    std::string out;
    for (int routing = 0; routing < 4; ++routing)
        for (const int64_t chunks : {1, 2}) out += ep_round_trip(comm, Device::cpu, routing, chunks, 5);
    return out;
}

TEST(EpDispatch, TwoRanksRoundTripBitForBit) {
    const auto results = run_ranks(2, 10, all_round_trips);
    for (int r = 0; r < 2; ++r) {
        std::printf("--- rank %d (exit %d)\n%s", r, results[r].exit_code, results[r].output.c_str());
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    }
}

TEST(EpDispatch, ThreeRanksRoundTripBitForBit) {
    const auto results = run_ranks(3, 10, all_round_trips);
    for (int r = 0; r < 3; ++r) {
        std::printf("--- rank %d (exit %d)\n%s", r, results[r].exit_code, results[r].output.c_str());
        EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
    }
}

}  // namespace
}  // namespace mf::test
