// ops::background on the GPU: work issued there starts behind everything the op stream held at the
// call, and the op stream's later work waits for it only through wait_background. Checked with a
// long op-stream fill followed by a background Σ x² (sum_squares_to) and zeroing, whose results
// must be those of the filled values; and with the model's deferred zero_grads (the gradients read
// back after zero_grads are zeros, and a step after it gives the bits of a step on fresh zeros).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "model/causal_lm.h"
#include "ops/ops.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

class GpuBackground : public ::testing::Test {
 protected:
    void SetUp() override { test::require_gpu(); }
};

TEST_F(GpuBackground, StartsBehindTheOpStreamAndIsWaitedFor) {
    const int64_t n = int64_t{1} << 27;  // 256 MiB of bf16: the fill takes long enough to race
    Buffer xb(static_cast<size_t>(n) * 2, Device::cuda), yb(static_cast<size_t>(n) * 2, Device::cuda);
    Buffer sb(2 * sizeof(double), Device::cuda);
    const Tensor x = xb.as(DType::bf16, {n}), y = yb.as(DType::bf16, {n}), sums = sb.as(DType::f64, {2});
    for (int round = 0; round < 3; ++round) {
        ops::fill_normal(x, 100 + static_cast<uint64_t>(round), 0.0f, 1.0f);  // op stream
        ops::fill_normal(y, 200 + static_cast<uint64_t>(round), 0.0f, 1.0f);
        const ops::BackgroundTicket t = ops::background(Device::cuda, [&] {
            ops::sum_squares_to(sums, 0, x);
            ops::zero(y);
            ops::sum_squares_to(sums, 1, y);
        });
        EXPECT_GT(t, 0);
        ops::wait_background(Device::cuda, t);
        double host[2] = {0, 0};
        ops::copy_to_host(host, sums);
        const double expect = ops::sum_squares(x);  // op stream, after the fill
        EXPECT_EQ(host[0], expect) << "round " << round << ": background read x before the fill ended";
        EXPECT_NEAR(host[0], static_cast<double>(n), 0.01 * static_cast<double>(n));
        EXPECT_EQ(host[1], 0.0) << "round " << round;
        EXPECT_EQ(ops::sum_squares(y), 0.0) << "round " << round << ": the op stream did not wait for the zeroing";
    }
    EXPECT_THROW(ops::background(Device::cuda, [] { ops::background(Device::cuda, [] {}); }), Error)
        << "nested background work must be refused";
    // The op stream is usable after the refusal (the guard switched back).
    EXPECT_EQ(ops::sum_squares(y), 0.0);
}

TEST_F(GpuBackground, DeferredZeroGrads) {
    const fs::path dir = fs::path(test::fixtures_dir()) / "hf" / "norm_topk";
    const data::Batch batch = test::load_fixture_batch(dir);
    auto m = train::load_hf_model(dir / "model", nullptr, {Device::cuda, DType::bf16});
    const model::LossScales scales{1.0 / static_cast<double>(batch.num_targets()), 0.001};
    auto host = [&] {
        const Tensor g = m->grads_tensor();
        std::vector<uint16_t> out(static_cast<size_t>(g.numel()));
        ops::copy_to_host(out.data(), g);
        return out;
    };
    m->step(batch, &scales);
    const std::vector<uint16_t> first = host();
    m->zero_grads();
    for (const uint16_t v : host()) ASSERT_EQ(v, 0) << "gradients read after zero_grads are not zero";
    m->step(batch, &scales);
    m->step(batch, &scales);  // accumulates onto the first
    m->zero_grads();
    m->step(batch, &scales);  // must start from zeros again
    EXPECT_EQ(std::memcmp(first.data(), host().data(), first.size() * sizeof(uint16_t)), 0)
        << "a step after a background zero_grads differs from the first step";
}

}  // namespace
