// Expert-parallel dispatch and combine (model/ffn_blocks.h) between real processes over TCP, with
// rank-coded payloads compared bit for bit: every row carries (source rank, row index, expert), so
// after dispatch each owner can check that it got exactly the rows routed to its experts, in
// expert-major, then source, then source-order, and after combine every source checks that each row
// came back to its place carrying its owner's mark. Routing includes experts with no rows and a rank
// that sends nothing at all.
#include <gtest/gtest.h>

#include <cstring>

#include "dist_test_util.h"
#include "model/ffn_blocks.h"

namespace mf::test {
namespace {

constexpr int64_t kExperts = 6, kCols = 3;

// Rows rank `r` routes to expert `e` (rank 1 routes nothing; several other experts get none).
int64_t rows_for(int r, int64_t e) { return r == 1 ? 0 : (r * 7 + e * 3) % 4; }

std::string dispatch_round_trip(parallel::Communicator& comm) {
    const int S = comm.size(), me = comm.rank();
    const int64_t El = kExperts / S;
    std::vector<int32_t> offsets(kExperts + 1, 0);
    for (int64_t e = 0; e < kExperts; ++e) offsets[e + 1] = offsets[e] + static_cast<int32_t>(rows_for(me, e));
    const int64_t P = offsets[kExperts];
    std::vector<float> sorted(static_cast<size_t>(std::max<int64_t>(P, 1) * kCols));
    for (int64_t e = 0; e < kExperts; ++e)
        for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i) {
            sorted[i * kCols + 0] = static_cast<float>(me);
            sorted[i * kCols + 1] = static_cast<float>(i);
            sorted[i * kCols + 2] = static_cast<float>(e);
        }
    model::MoeDims d{kCols, 1, kExperts, 1, false, &comm};
    const Tensor offsets_t(offsets.data(), DType::i32, {kExperts + 1});
    const model::EpRouting r = model::ep_plan(d, offsets_t);

    int64_t expected_local = 0;
    for (int s = 0; s < S; ++s)
        for (int64_t j = 0; j < El; ++j) expected_local += rows_for(s, me * El + j);
    rank_check(r.num_local == expected_local, "received row count");
    const int64_t cap = std::max<int64_t>(expected_local, 1);
    std::vector<float> exchange(static_cast<size_t>(cap * kCols)), local(static_cast<size_t>(cap * kCols));
    const Tensor sorted_t(sorted.data(), DType::f32, {P, kCols});
    const Tensor exchange_t(exchange.data(), DType::f32, {cap, kCols});
    const Tensor local_t(local.data(), DType::f32, {r.num_local, kCols});
    model::ep_dispatch(d, r, sorted_t, exchange_t, local_t);

    // Expert-major, then source rank, then the source's order; codes exact.
    int64_t row = 0;
    for (int64_t j = 0; j < El; ++j) {
        rank_check(r.local_offsets[j] == row, "local offset of expert " + std::to_string(j));
        const int64_t e = me * El + j;
        for (int s = 0; s < S; ++s) {
            int64_t src_offset = 0;
            for (int64_t ee = 0; ee < e; ++ee) src_offset += rows_for(s, ee);
            for (int64_t k = 0; k < rows_for(s, e); ++k, ++row) {
                const float* x = &local[row * kCols];
                rank_check(x[0] == static_cast<float>(s) && x[1] == static_cast<float>(src_offset + k) &&
                               x[2] == static_cast<float>(e),
                           "local row " + std::to_string(row) + " holds (" + std::to_string(x[0]) + ", " +
                               std::to_string(x[1]) + ", " + std::to_string(x[2]) + ")");
            }
        }
    }
    rank_check(row == r.num_local && r.local_offsets[El] == row, "local row total");

    // The owner marks each row, combine brings it home.
    for (int64_t i = 0; i < r.num_local; ++i) local[i * kCols + 0] += 1000.0f * static_cast<float>(me + 1);
    std::vector<float> back(sorted.size(), -1.0f);
    const Tensor back_t(back.data(), DType::f32, {P, kCols});
    model::ep_combine(d, r, local_t, exchange_t, back_t);
    for (int64_t e = 0; e < kExperts; ++e) {
        const int owner = static_cast<int>(e / El);
        for (int64_t i = offsets[e]; i < offsets[e + 1]; ++i) {
            float want[kCols] = {static_cast<float>(me) + 1000.0f * static_cast<float>(owner + 1),
                                 static_cast<float>(i), static_cast<float>(e)};
            rank_check(std::memcmp(&back[i * kCols], want, sizeof want) == 0,
                       "combined row " + std::to_string(i) + " differs");
        }
    }
    return "sent " + std::to_string(P) + ", computed " + std::to_string(r.num_local);
}

TEST(EpDispatch, TwoRanksRoundTripBitForBit) {
    const auto results = run_ranks(2, 10, dispatch_round_trip);
    for (int r = 0; r < 2; ++r) EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
}

TEST(EpDispatch, ThreeRanksRoundTripBitForBit) {
    const auto results = run_ranks(3, 10, dispatch_round_trip);
    for (int r = 0; r < 3; ++r) EXPECT_EQ(results[r].exit_code, 0) << "rank " << r << ": " << results[r].output;
}

}  // namespace
}  // namespace mf::test
