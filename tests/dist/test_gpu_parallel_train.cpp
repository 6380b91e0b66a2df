// Expert and data parallelism on 2 GPUs over NCCL, end to end through the binary: the tiny model
// fine-tuned on the cuda device by `moeforge launch --nproc-per-node 2` with dist.ep_size 2 (each GPU
// holds 4 of the 8 experts) and with pure DP, against one GPU seeing the same rows (micro_batch 2 x
// grad_accum 2), a one-GPU checkpoint resumed at EP=2, and a stopped rank named by its peer's
// timeout. Skips visibly (exit 77) without NCCL in the build or with fewer than 2 GPUs.
//
// Tolerances. The runs use precision mixed (fp32 gradients, master weights and AdamW state; bf16
// parameters and activations), so the parallel and single runs differ only by fp32 summation order
// (expert rows grouped differently, micro-batch sums accumulated in another order) and by where the
// bf16 rounding of the updated parameters then lands. One bf16 ulp is 2^-8 ~ 3.9e-3 relative, so:
//   - per-step loss, ce, aux, grad_norm: relative 5e-3;
//   - final weights: relative L2 distance 4e-3 (the test checks that training moved the weights by
//     more than 10x that, so the bound can fail).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>

#include "train_test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

constexpr test::TrainTolerance kTol{5e-3, 4e-3};
constexpr int kSteps = 10;

int gpu_count() {
    std::string out;
    if (test::run_command("nvidia-smi -L 2>/dev/null", &out) != 0) return 0;
    int n = 0;
    for (size_t p = out.find("GPU "); p != std::string::npos; p = out.find("GPU ", p + 4)) ++n;
    return n;
}

class GpuParallelTrain : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
#if !defined(MOEFORGE_WITH_NCCL)
        std::printf("SKIPPED: moeforge built without NCCL (needs MOEFORGE_CUDA and NCCL)\n");
        std::exit(77);
#endif
        if (gpu_count() < 2) {
            std::printf("SKIPPED: fewer than 2 CUDA devices (nvidia-smi -L)\n");
            std::exit(77);
        }
        dir_ = test::temp_dir("gpu_parallel_train");
        std::string out;
        ASSERT_EQ(
            test::run_command(
                test::bin() + " init --arch qwen3_moe --preset tiny --seed 7 --out " + (dir_ / "base").string(), &out),
            0)
            << out;
    }
    static std::string args(const std::string& name, const std::string& extra) {
        return "finetune " + test::repo() + "/demo/tiny_tokens.yaml model=" + (dir_ / "base").string() +
               " data.train=" + test::repo() + "/demo/data/tokens.jsonl out=" + (dir_ / name).string() +
               " train.steps=" + std::to_string(kSteps) +
               " train.seq_len=64 data.shuffle=true seed=3 device=cuda precision=mixed optim.lr=3e-3 "
               "train.log_every=5 dist.timeout_s=120 " +
               extra;
    }
    static std::string run(const std::string& name, int nproc, const std::string& extra, const std::string& tail = "") {
        const std::string cmd = (nproc > 0 ? test::bin() + " launch --nproc-per-node " + std::to_string(nproc) + " -- "
                                           : test::bin() + " ") +
                                args(name, extra) + tail;
        std::string out;
        EXPECT_EQ(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
        return out;
    }
    static fs::path dir_;
};
fs::path GpuParallelTrain::dir_;

TEST_F(GpuParallelTrain, ExpertAndDataParallelMatchOneGpu) {
    run("one", 0, "train.micro_batch=2 train.grad_accum=2 checkpoint.every=5");
    const std::string ep_log = run("ep2", 2, "train.micro_batch=2 dist.ep_size=2");
    run("dp2", 2, "train.micro_batch=2");
    EXPECT_NE(ep_log.find("world 2 (dp 1 x ep 2, nccl)"), std::string::npos) << ep_log;
    test::expect_same_training(dir_ / "ep2", dir_ / "one", kSteps, kTol);
    test::expect_same_training(dir_ / "dp2", dir_ / "one", kSteps, kTol);
    const double moved = test::rel_l2(test::read_weights(dir_ / "one"), test::read_weights(dir_ / "base"));
    EXPECT_GE(moved, 10 * kTol.weight_rel_l2) << "training should move the weights far more than the tolerance";
    std::printf("one GPU: training moved the weights by rel L2 %.3g\n", moved);
    // The one-GPU checkpoint at step 5 resumed by two GPUs under EP=2 continues like the one-GPU run.
    const fs::path step5 = dir_ / "one" / "checkpoints" / "step-00000005";
    ASSERT_TRUE(fs::exists(step5));
    run("one_to_ep2", 2, "train.micro_batch=2 dist.ep_size=2", " --resume " + step5.string() + " --force-resume");
    test::expect_same_tail(dir_ / "one_to_ep2", dir_ / "one", kSteps, 5, kTol);
}

// A rank that stops answering (SIGSTOP) mid-run makes its peer fail after dist.timeout_s with the
// diagnostic, instead of hanging in an NCCL wait (NCCL cannot say which peer is late).
TEST_F(GpuParallelTrain, StoppedRankMakesThePeerFailAfterTheTimeout) {
    const fs::path dir = dir_ / "stopped";
    fs::create_directories(dir);
    constexpr double kTimeout = 5;
    const test::PeerFailure f = test::run_and_signal_rank1(
        dir, args("stopped/out", "train.micro_batch=2 train.steps=100000 dist.ep_size=2 dist.timeout_s=5"), SIGSTOP);
    ASSERT_NE(f.status, -1) << "rank 0 still running 30 s after its peer stopped\n" << f.log;
    EXPECT_TRUE(WIFEXITED(f.status) && WEXITSTATUS(f.status) != 0) << "status " << f.status << "\n" << f.log;
    EXPECT_NE(f.log.find("rank 0: timed out after 5 s"), std::string::npos) << f.log;
    EXPECT_GE(f.seconds, kTimeout * 0.9) << f.log;
    EXPECT_LT(f.seconds, kTimeout + 15) << f.log;
    std::printf("stopped peer on 2 GPUs: rank 0 exited after %.2f s (timeout %.0f s)\n", f.seconds, kTimeout);
}

}  // namespace
