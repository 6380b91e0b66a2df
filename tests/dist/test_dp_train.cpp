// Data parallelism end to end through the binary, on the CPU (TCP) backend: the tiny model fine-tuned
// under `moeforge launch --nproc-per-node 2` with micro_batch 2 against one process that sees the
// same rows (micro_batch 2, grad_accum 2: the loader's DP shards, stacked in rank order, are exactly
// those two micro-batches, and the aux loss is a mean over micro-batches in both).
//
// Tolerances (the rule: same math, different fp32 summation order):
//   - per-step loss, ce, aux, grad_norm: relative 1e-4. The DP run sums the two halves' gradients
//     in one fp32 add after each half's backward, the single run accumulates the second half onto
//     the first inside its backward; both are fp32 sums of the same terms (relative error ~1e-7 per
//     add). The runs use optim.lr 3e-3 rather than the demo's 1e-2: at 1e-2 the tiny model hits a
//     gradient spike (norm ~10 at step 8) where the fp32 reordering grows to 5e-5 in grad_norm, a
//     chaotic regime that says nothing about DP; at 3e-3 the largest difference seen is 3e-7.
//   - final weights: relative L2 distance 1e-5 (seen: 1e-7), and the test checks that training
//     moved the weights by far more than that, so the bound can fail.
// The same comparison for EP=2 and EP=2 x DP=2 (dist.ep_size; experts computed by their owners).
// A DP run repeated is bitwise identical (metrics and weights), and so is one with the AdamW state
// whole on every rank instead of sharded (dist.shard_optimizer, ZeRO-1), and one resumed from a DP
// checkpoint. Checkpoints do not depend on the layout: an EP=2 checkpoint equals the one-rank
// run's, resumes in one process, and a one-rank checkpoint resumes at EP=2, each continuing like the
// uninterrupted runs. Under EP a rank holds only its experts. Files come from rank 0 only, a rank killed mid-run makes
// its peer exit non-zero at once (the connection drops), and a rank that stops answering (SIGSTOP) makes its peer exit
// non-zero after dist.timeout_s.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <sstream>
#include <thread>

#include "core/json.h"
#include "dist_test_util.h"
#include "io/safetensors.h"
#include "process_util.h"
#include "test_util.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

constexpr double kMetricRelTol = 1e-4;
constexpr double kWeightRelL2Tol = 1e-5;
constexpr test::TrainTolerance kTol{kMetricRelTol, kWeightRelL2Tol};
constexpr int kSteps = 10;

using test::bin;
using test::close_rel;
using test::read_metrics;
using test::read_weights;
using test::rel_l2;
using test::repo;

class DpTrain : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        dir_ = test::temp_dir("dp_train");
        std::string out;
        ASSERT_EQ(test::run_command(
                      bin() + " init --arch qwen3_moe --preset tiny --seed 7 --out " + (dir_ / "base").string(), &out),
                  0)
            << out;
    }
    static std::string finetune_args(const std::string& name, const std::string& extra) {
        return "finetune " + repo() + "/demo/tiny_tokens.yaml model=" + (dir_ / "base").string() +
               " data.train=" + repo() + "/demo/data/tokens.jsonl out=" + (dir_ / name).string() +
               " train.steps=" + std::to_string(kSteps) +
               " train.seq_len=64 data.shuffle=true seed=3 device=cpu optim.lr=3e-3 train.log_every=5 "
               "dist.timeout_s=30 " +
               extra;
    }
    // Runs the fine-tune on `nproc` processes (0: plainly, without the launcher); returns the output.
    static std::string finetune(const std::string& name, int nproc, const std::string& extra) {
        const std::string prefix =
            nproc > 0 ? bin() + " launch --nproc-per-node " + std::to_string(nproc) + " -- " : bin() + " ";
        const std::string cmd = prefix + finetune_args(name, extra);
        std::string out;
        const int rc = test::run_command(cmd, &out);
        EXPECT_EQ(rc, 0) << cmd << "\n" << out;
        return out;
    }
    static fs::path dir_;
};
fs::path DpTrain::dir_;

TEST_F(DpTrain, TwoRanksMatchOneRankAndRepeatBitwise) {
    const std::string dp_log = finetune("dp2", 2, "train.micro_batch=2");
    finetune("one", 0, "train.micro_batch=2 train.grad_accum=2");
    finetune("big", 0, "train.micro_batch=4");
    const auto dp = read_metrics(dir_ / "dp2" / "metrics.jsonl");
    const auto one = read_metrics(dir_ / "one" / "metrics.jsonl");
    const auto big = read_metrics(dir_ / "big" / "metrics.jsonl");
    ASSERT_EQ(dp.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(one.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(big.size(), static_cast<size_t>(kSteps));
    // Rank 0 alone logs: one start line, not two.
    EXPECT_EQ(dp_log.find("moeforge finetune:"), dp_log.rfind("moeforge finetune:")) << dp_log;
    EXPECT_NE(dp_log.find("world 2 (dp 2 x ep 1, tcp)"), std::string::npos) << dp_log;
    for (size_t i = 0; i < dp.size(); ++i) {
        for (const char* key : {"loss", "ce_loss", "aux_loss", "grad_norm"}) {
            const double a = dp[i].find(key)->as_double(), b = one[i].find(key)->as_double();
            EXPECT_TRUE(close_rel(a, b, kMetricRelTol))
                << "step " << i + 1 << " " << key << ": DP=2 " << a << ", one rank " << b;
        }
        EXPECT_EQ(dp[i].find("lr")->dump(), one[i].find("lr")->dump());
        // The same rows: the same token counts as one rank with micro_batch 4.
        EXPECT_EQ(dp[i].find("tokens")->as_int(), big[i].find("tokens")->as_int()) << "step " << i + 1;
    }
    // Before any update the CE is the one of the whole 4-row batch (the aux loss is not: it is a
    // mean over 2-row micro-batches under DP, over one 4-row batch here).
    EXPECT_TRUE(close_rel(dp[0].find("ce_loss")->as_double(), big[0].find("ce_loss")->as_double(), kMetricRelTol))
        << dp[0].find("ce_loss")->as_double() << " vs " << big[0].find("ce_loss")->as_double();

    const auto w_dp = read_weights(dir_ / "dp2");
    const auto w_one = read_weights(dir_ / "one");
    const auto w_base = read_weights(dir_ / "base");
    const double dist = rel_l2(w_dp, w_one);
    const double moved = rel_l2(w_one, w_base);
    EXPECT_LE(dist, kWeightRelL2Tol) << "final weights, DP=2 vs one rank";
    EXPECT_GE(moved, 10 * kWeightRelL2Tol) << "training should move the weights far more than the tolerance";
    std::printf("DP=2 vs one rank: final weights rel L2 %.3g (training moved them %.3g)\n", dist, moved);

    // Bitwise reproducible: a second DP=2 run gives the same metrics and the same weight file.
    finetune("dp2_again", 2, "train.micro_batch=2");
    const auto again = read_metrics(dir_ / "dp2_again" / "metrics.jsonl");
    ASSERT_EQ(again.size(), dp.size());
    for (size_t i = 0; i < dp.size(); ++i)
        for (const char* key : {"loss", "ce_loss", "aux_loss", "grad_norm", "tokens"})
            EXPECT_EQ(again[i].find(key)->dump(), dp[i].find(key)->dump()) << "step " << i + 1 << " " << key;
    EXPECT_EQ(test::read_file(dir_ / "dp2_again" / "model.safetensors"),
              test::read_file(dir_ / "dp2" / "model.safetensors"));

    // ZeRO-1 only moves where the AdamW state lives: whole on both ranks, the run is the same bits.
    finetune("dp2_whole_state", 2, "train.micro_batch=2 dist.shard_optimizer=false");
    const auto whole = read_metrics(dir_ / "dp2_whole_state" / "metrics.jsonl");
    ASSERT_EQ(whole.size(), dp.size());
    for (size_t i = 0; i < dp.size(); ++i)
        for (const char* key : {"loss", "grad_norm"})
            EXPECT_EQ(whole[i].find(key)->dump(), dp[i].find(key)->dump()) << "step " << i + 1 << " " << key;
    EXPECT_EQ(test::read_file(dir_ / "dp2_whole_state" / "model.safetensors"),
              test::read_file(dir_ / "dp2" / "model.safetensors"));
    // ... and it holds half of it per rank (AdamW m and v: 8 bytes per parameter on the CPU).
    const double sharded_gib = dp.back().find("peak_mem_gib")->as_double();
    const double whole_gib = whole.back().find("peak_mem_gib")->as_double();
    EXPECT_LT(sharded_gib, whole_gib) << "ZeRO-1 should lower the per-rank state";
}

TEST_F(DpTrain, CheckpointRecordsTheWorldSizeAndResumesBitwise) {
    finetune("ckpt", 2, "train.micro_batch=2 checkpoint.every=5");
    const fs::path state = dir_ / "ckpt" / "checkpoints" / "step-00000010" / "state.json";
    ASSERT_TRUE(fs::exists(state)) << state;
    const json::Value s = json::parse(test::read_file(state), state.string());
    EXPECT_EQ(s.find("world_size")->as_int(), 2);
    EXPECT_EQ(s.find("ep_size")->as_int(), 1);
    // Resumed at step 5 by two ranks (into another directory), the run continues bit for bit.
    const fs::path step5 = dir_ / "ckpt" / "checkpoints" / "step-00000005";
    ASSERT_TRUE(fs::exists(step5));
    std::string log;
    const std::string resume_cmd = bin() + " launch --nproc-per-node 2 -- " +
                                   finetune_args("ckpt_resumed", "train.micro_batch=2") + " --resume " + step5.string();
    ASSERT_EQ(test::run_command(resume_cmd, &log), 0) << log;
    const auto full = read_metrics(dir_ / "ckpt" / "metrics.jsonl");
    const auto resumed = read_metrics(dir_ / "ckpt_resumed" / "metrics.jsonl");
    ASSERT_EQ(full.size(), static_cast<size_t>(kSteps));
    ASSERT_EQ(resumed.size(), static_cast<size_t>(kSteps - 5)) << log;
    for (size_t i = 0; i < resumed.size(); ++i)
        for (const char* key : {"step", "loss", "ce_loss", "aux_loss", "grad_norm", "tokens"})
            EXPECT_EQ(resumed[i].find(key)->dump(), full[i + 5].find(key)->dump()) << "step " << i + 6 << " " << key;
    EXPECT_EQ(test::read_file(dir_ / "ckpt_resumed" / "model.safetensors"),
              test::read_file(dir_ / "ckpt" / "model.safetensors"));
}

// SIGTERM to `moeforge launch` (what SLURM preemption sends): every rank finishes the same step,
// together they write one checkpoint (checkpoint.every is 0), the launcher exits 143, and the run
// resumed by two ranks equals the uninterrupted one bit for bit.
TEST_F(DpTrain, SigtermStopsEveryRankAfterTheSameStepAndResumesBitwise) {
    const std::string args = "train.micro_batch=2 train.steps=80 checkpoint.every=0 train.log_every=1";
    finetune("sig_ref", 2, args);
    const fs::path out = dir_ / "sig";
    const fs::path log = dir_ / "sig.log";
    const pid_t pid = test::spawn_shell(bin() + " launch --nproc-per-node 2 -- " + finetune_args("sig", args), log);
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(test::wait_for([&] { return test::count_lines(out / "metrics.jsonl") >= 3; }, 120))
        << test::read_file(log);
    kill(pid, SIGTERM);
    const int code = test::wait_exit(pid, 120);
    const std::string text = test::read_file(log);
    ASSERT_EQ(code, 143) << text;
    const size_t done = test::count_lines(out / "metrics.jsonl");
    ASSERT_LT(done, 80u) << text;
    char name[32];
    std::snprintf(name, sizeof name, "step-%08zu", done);
    const fs::path ckpt = out / "checkpoints" / name;
    EXPECT_TRUE(fs::exists(ckpt / "shard-00000-of-00002.safetensors")) << text;
    EXPECT_TRUE(fs::exists(ckpt / "shard-00001-of-00002.safetensors")) << text;
    EXPECT_EQ(text.find("exited with status"), std::string::npos) << "a stopping rank is not a failure: " << text;
    std::string resumed_log;
    ASSERT_EQ(test::run_command(bin() + " launch --nproc-per-node 2 -- " + finetune_args("sig", args) + " --resume",
                                &resumed_log),
              0)
        << resumed_log;
    const auto ref = read_metrics(dir_ / "sig_ref" / "metrics.jsonl");
    const auto got = read_metrics(out / "metrics.jsonl");
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i)
        for (const char* key : {"step", "loss", "ce_loss", "aux_loss", "grad_norm", "lr", "tokens"})
            EXPECT_EQ(got[i].find(key)->dump(), ref[i].find(key)->dump()) << "step " << i + 1 << " " << key;
    EXPECT_TRUE(test::read_file(out / "model.safetensors") == test::read_file(dir_ / "sig_ref" / "model.safetensors"));
}

// A checkpoint written under EP=2 holds the whole model (both ranks' experts gathered) and equals the
// one-rank run's; it resumes in one process, and the one-rank checkpoint resumes at EP=2.
TEST_F(DpTrain, CheckpointsResumeAtAnotherWorldAndEpSize) {
    finetune("ck_ep2", 2, "train.micro_batch=2 dist.ep_size=2 checkpoint.every=5");
    finetune("ck_one", 0, "train.micro_batch=2 train.grad_accum=2 checkpoint.every=5");
    const fs::path ep5 = dir_ / "ck_ep2" / "checkpoints" / "step-00000005";
    const fs::path one5 = dir_ / "ck_one" / "checkpoints" / "step-00000005";
    ASSERT_TRUE(fs::exists(ep5) && fs::exists(one5));
    const double d = test::checkpoint_rel_l2(ep5, one5);
    EXPECT_LE(d, kWeightRelL2Tol) << "EP=2 checkpoint vs one rank's at step 5";
    const json::Value s = json::parse(test::read_file(ep5 / "state.json"), "state.json");
    EXPECT_EQ(s.find("world_size")->as_int(), 2);
    EXPECT_EQ(s.find("ep_size")->as_int(), 2);
    std::printf("EP=2 vs one-rank checkpoint at step 5: rel L2 %.3g\n", d);

    // EP=2 checkpoint -> one process (the same rows per step: micro_batch 2 x grad_accum 2).
    std::string log;
    std::string cmd = bin() + " " + finetune_args("ck_ep2_to_one", "train.micro_batch=2 train.grad_accum=2") +
                      " --resume " + ep5.string() + " --force-resume";
    ASSERT_EQ(test::run_command(cmd, &log), 0) << log;
    EXPECT_NE(log.find("checkpoint written at world size 2 (EP 2), continuing at world size 1 (EP 1)"),
              std::string::npos)
        << log;
    test::expect_same_tail(dir_ / "ck_ep2_to_one", dir_ / "ck_ep2", kSteps, 5, kTol);
    // One-rank checkpoint -> EP=2 on two processes.
    cmd = bin() + " launch --nproc-per-node 2 -- " +
          finetune_args("ck_one_to_ep2", "train.micro_batch=2 dist.ep_size=2") + " --resume " + one5.string() +
          " --force-resume";
    ASSERT_EQ(test::run_command(cmd, &log), 0) << log;
    test::expect_same_tail(dir_ / "ck_one_to_ep2", dir_ / "ck_one", kSteps, 5, kTol);
}

using test::PeerFailure;
using test::run_and_signal_rank1;

TEST_F(DpTrain, KilledRankMakesThePeerFail) {
    const fs::path dir = dir_ / "killed";
    fs::create_directories(dir);
    const PeerFailure f = run_and_signal_rank1(
        dir, finetune_args("killed/out", "train.micro_batch=2 train.steps=100000 dist.timeout_s=20"), SIGKILL);
    ASSERT_NE(f.status, -1) << "rank 0 still running 30 s after its peer died\n" << f.log;
    EXPECT_TRUE(WIFEXITED(f.status) && WEXITSTATUS(f.status) != 0) << "status " << f.status << "\n" << f.log;
    EXPECT_NE(f.log.find("rank 0: connection to rank 1 lost"), std::string::npos) << f.log;
    EXPECT_LT(f.seconds, 20.0) << "a dead peer is seen at once, not after the timeout\n" << f.log;
    std::printf("killed peer: rank 0 exited after %.2f s\n", f.seconds);
}

TEST_F(DpTrain, StoppedRankMakesThePeerFailAfterTheTimeout) {
    const fs::path dir = dir_ / "stopped";
    fs::create_directories(dir);
    constexpr double kTimeout = 3;
    const PeerFailure f = run_and_signal_rank1(
        dir, finetune_args("stopped/out", "train.micro_batch=2 train.steps=100000 dist.timeout_s=3"), SIGSTOP);
    ASSERT_NE(f.status, -1) << "rank 0 still running 30 s after its peer stopped\n" << f.log;
    EXPECT_TRUE(WIFEXITED(f.status) && WEXITSTATUS(f.status) != 0) << "status " << f.status << "\n" << f.log;
    EXPECT_NE(f.log.find("rank 0: timed out after 3 s waiting for rank 1"), std::string::npos) << f.log;
    EXPECT_GE(f.seconds, kTimeout * 0.9) << f.log;
    EXPECT_LT(f.seconds, kTimeout + 10) << f.log;
    std::printf("stopped peer: rank 0 exited after %.2f s (timeout %.0f s)\n", f.seconds, kTimeout);
}

void expect_same_training(const fs::path& a_dir, const fs::path& b_dir) {
    test::expect_same_training(a_dir, b_dir, kSteps, kTol);
}

// EP=2 (each rank computes 4 of the tiny model's 8 experts for both ranks' tokens) against one
// rank on the same rows; the EP run recomputes the MoE blocks in the backward (train.recompute moe),
// so the dispatch/combine of the recomputation runs in lockstep too.
TEST_F(DpTrain, ExpertParallelMatchesOneRank) {
    const std::string log = finetune("ep2", 2, "train.micro_batch=2 dist.ep_size=2 train.recompute=moe");
    finetune("one_ep_ref", 0, "train.micro_batch=2 train.grad_accum=2");
    expect_same_training(dir_ / "ep2", dir_ / "one_ep_ref");
    // The same with no recomputation and with whole-layer recomputation (the EP exchange runs in the
    // forward, in the recomputed forward and in the backward, in lockstep on both ranks).
    for (const char* mode : {"none", "full"}) {
        const std::string name = std::string("ep2_recompute_") + mode;
        finetune(name, 2, std::string("train.micro_batch=2 dist.ep_size=2 train.recompute=") + mode);
        expect_same_training(dir_ / name, dir_ / "one_ep_ref");
    }
    // Any pipeline depth (dist.ep_chunks: 1 = no pipelining, 3 = uneven chunks of the 4 local
    // experts) computes the same.
    for (const char* chunks : {"1", "3"}) {
        const std::string name = std::string("ep2_chunks_") + chunks;
        finetune(name, 2, std::string("train.micro_batch=2 dist.ep_size=2 dist.ep_chunks=") + chunks);
        expect_same_training(dir_ / name, dir_ / "one_ep_ref");
    }
    const json::Value s = json::parse(test::read_file(dir_ / "ep2" / "recipe.json"), "recipe.json");
    EXPECT_EQ(s.find("dist")->find("ep_size")->as_int(), 2);
    // Each rank holds the replicated parameters and half of the experts (counted from the HF files).
    int64_t replicated = 0, experts = 0;
    const io::ModelWeights w = io::ModelWeights::open(dir_ / "base");
    for (const std::string& name : w.names()) {
        int64_t n = 1;
        for (const int64_t x : w.find(name)->shape) n *= x;
        (name.find(".mlp.experts.") != std::string::npos ? experts : replicated) += n;
    }
    const std::string held = "this rank holds " + std::to_string(replicated + experts / 2) + " parameters";
    EXPECT_NE(log.find(held), std::string::npos) << "expected \"" << held << "\" in\n" << log;
    // ZeRO-1 under EP shards the replicated parameters' state over the world (DP is 1 here): the same
    // bits, less AdamW state per rank.
    const std::string whole = finetune(
        "ep2_whole_state", 2, "train.micro_batch=2 dist.ep_size=2 train.recompute=moe dist.shard_optimizer=false");
    const auto a = read_metrics(dir_ / "ep2" / "metrics.jsonl");
    const auto b = read_metrics(dir_ / "ep2_whole_state" / "metrics.jsonl");
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].find("loss")->dump(), b[i].find("loss")->dump());
    EXPECT_EQ(test::read_file(dir_ / "ep2" / "model.safetensors"),
              test::read_file(dir_ / "ep2_whole_state" / "model.safetensors"));
    auto adam_mib = [](const std::string& text) {
        const size_t at = text.find("AdamW state ");
        return at == std::string::npos ? -1.0 : std::stod(text.substr(at + 12));
    };
    EXPECT_GT(adam_mib(log), 0.0) << log;
    EXPECT_LT(adam_mib(log), adam_mib(whole)) << log << "\n" << whole;
    // `moeforge info` plans the same per-rank figures for this layout.
    std::string info;
    ASSERT_EQ(test::run_command(
                  bin() + " info " + (dir_ / "base").string() + " --world 2 --ep-size 2 --device cpu --json", &info),
              0)
        << info;
    const json::Value plan = *json::parse(info, "info").find("per_rank");
    EXPECT_EQ(plan.find("params")->as_int(), replicated + experts / 2);
    const double planned_mib = static_cast<double>(plan.find("optimizer_bytes")->as_int()) / (1024.0 * 1024.0);
    EXPECT_NEAR(planned_mib, adam_mib(log), 0.051) << info << "\n" << log;
}

// EP=2 x DP=2 on four processes against one rank with 4 micro-batches of the same rows.
TEST_F(DpTrain, ExpertTimesDataParallelMatchesOneRank) {
    finetune("ep2dp2", 4, "train.micro_batch=2 dist.ep_size=2 checkpoint.every=5");
    finetune("one_accum4", 0, "train.micro_batch=2 train.grad_accum=4 checkpoint.every=5");
    expect_same_training(dir_ / "ep2dp2", dir_ / "one_accum4");
    // Four shards (each rank's ZeRO-1 chunk of its experts; the replicated state from EP rank 0's
    // group) tile the same state as the one-rank checkpoint.
    const fs::path a = dir_ / "ep2dp2" / "checkpoints" / "step-00000010";
    const fs::path b = dir_ / "one_accum4" / "checkpoints" / "step-00000010";
    EXPECT_TRUE(fs::exists(a / "shard-00003-of-00004.safetensors"));
    const double d = test::checkpoint_rel_l2(a, b);
    EXPECT_LE(d, kWeightRelL2Tol) << "EP=2 x DP=2 checkpoint vs one rank's";
    EXPECT_EQ(test::read_checkpoint(a).size(), test::read_checkpoint(b).size());
}

// Gradient accumulation under DP: the reduction overlaps only the last micro-batch's backward
// (DistContext::begin_grad_sync), after the earlier ones have accumulated, and still gives the sum.
TEST_F(DpTrain, DataParallelWithAccumulationMatchesOneRank) {
    finetune("dp2_accum2", 2, "train.micro_batch=1 train.grad_accum=2");
    finetune("one_mb1_accum4", 0, "train.micro_batch=1 train.grad_accum=4");
    expect_same_training(dir_ / "dp2_accum2", dir_ / "one_mb1_accum4");
}

// Rank 0 alone logs unless the recipe asks every rank to (dist.log_ranks: all).
TEST_F(DpTrain, EveryRankLogsWhenAsked) {
    const std::string quiet = finetune("log_main", 2, "train.micro_batch=2 train.steps=6");
    EXPECT_EQ(quiet.find("[rank"), std::string::npos) << quiet;
    const std::string all = finetune("log_all", 2, "train.micro_batch=2 train.steps=6 dist.log_ranks=all");
    for (const char* line : {"[rank 0] step    1/6", "[rank 1] step    6/6", "[rank 1] this rank holds"})
        EXPECT_NE(all.find(line), std::string::npos) << line << "\n" << all;
}

TEST_F(DpTrain, BadEpSizeIsRefusedClearly) {
    std::string out;
    const std::string cmd = bin() + " launch --nproc-per-node 3 -- " + finetune_args("ep3", "dist.ep_size=3");
    EXPECT_NE(test::run_command(cmd, &out), 0) << out;
    EXPECT_NE(out.find("dist.ep_size = 3 must divide the model's 8 experts"), std::string::npos) << out;
    const std::string cmd2 = bin() + " launch --nproc-per-node 2 -- " + finetune_args("ep4", "dist.ep_size=4");
    EXPECT_NE(test::run_command(cmd2, &out), 0) << out;
    EXPECT_NE(out.find("dist.ep_size (4) must divide the world size (2)"), std::string::npos) << out;
}

}  // namespace
