// ZeRO-1's layout (train/optimizer.h): the replicated region is cut into one segment per forward
// stage (embedding, each layer, final norm + head), every segment split over the group's ranks, and
// step() broadcasts the segments in the order the forward reads them. Checked against a stand-in
// two-rank group that records what it is asked to broadcast.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "model/causal_lm.h"
#include "ops/ops.h"
#include "qwen3_config.h"
#include "train/optimizer.h"

namespace mf {
namespace {

// Rank `rank` of a group of two: only size/rank and broadcast_each may be used by AdamW.
class RecordingGroup final : public parallel::Communicator {
 public:
    explicit RecordingGroup(int rank) : rank_(rank) {}
    struct Call {
        const void* data;
        std::vector<int64_t> offsets;
    };
    std::vector<Call> calls;

    int rank() const override { return rank_; }
    int size() const override { return 2; }
    int world_rank() const override { return rank_; }
    double timeout_s() const override { return 1; }
    const char* backend() const override { return "recording"; }
    void broadcast_each(void* data, std::span<const int64_t> offsets, DType) override {
        calls.push_back({data, std::vector<int64_t>(offsets.begin(), offsets.end())});
    }
    void all_reduce_sum(void*, int64_t, DType) override { ADD_FAILURE() << "all_reduce_sum"; }
    void broadcast(void*, int64_t, DType, int) override { ADD_FAILURE() << "broadcast"; }
    void all_gather(const void*, void*, int64_t, DType) override { ADD_FAILURE() << "all_gather"; }
    void all_to_all_v(const void*, std::span<const int64_t>, std::span<const int64_t>, void*, std::span<const int64_t>,
                      std::span<const int64_t>, DType) override {
        ADD_FAILURE() << "all_to_all_v";
    }
    void barrier() override { ADD_FAILURE() << "barrier"; }
    std::unique_ptr<Communicator> split(int, int) override {
        ADD_FAILURE() << "split";
        return nullptr;
    }

 private:
    int rank_;
};

// Three layers (the middle one dense), an odd vocabulary so that chunks do not divide evenly.
test::Qwen3Config config() {
    return {.vocab_size = 301,
            .hidden_size = 16,
            .intermediate_size = 12,
            .moe_intermediate_size = 6,
            .num_hidden_layers = 3,
            .num_attention_heads = 4,
            .num_key_value_heads = 2,
            .head_dim = 4,
            .num_experts = 4,
            .num_experts_per_tok = 2,
            .mlp_only_layers = {1},
            .max_position_embeddings = 64};
}

TEST(Zero1Layout, EveryStageIsSplitOverTheRanksAndBroadcastInForwardOrder) {
    model::CausalLM m(config());
    const int64_t split = m.params().expert_offset();
    const model::ParamSpec& embed = m.params().get("model.embed_tokens.weight");
    const model::ParamSpec& head = m.params().get("lm_head.weight");
    ASSERT_EQ(embed.offset, 0);
    train::Recipe::Optim optim;
    std::vector<int> covered(static_cast<size_t>(m.num_params()), 0);
    std::vector<std::vector<int64_t>> starts(2);
    for (int rank = 0; rank < 2; ++rank) {
        RecordingGroup group(rank);
        train::AdamW adam(m, optim, false, &group, nullptr);
        int64_t embed_share = 0;
        for (const auto& r : adam.owned()) {
            for (int64_t i = r.begin; i < r.end; ++i) ++covered[static_cast<size_t>(i)];
            EXPECT_EQ(r.sharded, r.region == 0) << "[" << r.begin << ", " << r.end << ")";
            embed_share += std::max<int64_t>(0, std::min(r.end, embed.numel) - r.begin);
        }
        // Each rank holds (and sends) about half of the first stage, not one rank all of it.
        EXPECT_NEAR(static_cast<double>(embed_share), embed.numel / 2.0, 64.0) << "rank " << rank;

        adam.step(1e-3);
        const char* base = static_cast<const char*>(m.params_tensor().data());
        ASSERT_EQ(group.calls.size(), static_cast<size_t>(m.spec().num_layers() + 2)) << "rank " << rank;
        for (const auto& call : group.calls) {
            ASSERT_EQ(call.offsets.size(), 3u);
            const int64_t start = (static_cast<const char*>(call.data) - base) / static_cast<int64_t>(sizeof(float));
            starts[static_cast<size_t>(rank)].push_back(start);
            // The two pieces: rank 0's chunk, then rank 1's, within 64 elements of an even split.
            const int64_t n = call.offsets[2];
            EXPECT_EQ(call.offsets[0], 0);
            EXPECT_LE(call.offsets[1], n);
            EXPECT_LT(call.offsets[1] - (n - call.offsets[1]), 128) << "segment at " << start;
            EXPECT_LE(start + n, split) << "only the replicated region is broadcast";
        }
        EXPECT_EQ(group.calls.front().offsets[2], embed.numel) << "the embedding is its own, first, stage";
        EXPECT_EQ(starts[static_cast<size_t>(rank)].back() + group.calls.back().offsets[2], head.offset + head.numel)
            << "the head ends the last stage";
        EXPECT_TRUE(std::is_sorted(starts[static_cast<size_t>(rank)].begin(), starts[static_cast<size_t>(rank)].end()));
    }
    EXPECT_EQ(starts[0], starts[1]) << "both ranks broadcast the same segments in the same order";
    // The two ranks' replicated state tiles the replicated region exactly once; the experts are whole
    // on each (no expert group given).
    for (int64_t i = 0; i < m.num_params(); ++i)
        ASSERT_EQ(covered[static_cast<size_t>(i)], i < split ? 1 : 2) << "element " << i;
}

}  // namespace
}  // namespace mf
