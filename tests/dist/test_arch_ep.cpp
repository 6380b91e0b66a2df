// Expert parallelism for every new family, end to end through the binary on the CPU (TCP) backend:
// the tiny Mixtral, OLMoE and Qwen2-MoE (moeforge init --preset tiny: 8 experts) fine-tuned under
// `moeforge launch --nproc-per-node 2 -- finetune ... dist.ep_size=2` (each rank computes 4 experts
// for both ranks' tokens) against one process on the same rows (micro_batch 2 x grad_accum 2), as
// test_dp_train's ExpertParallelMatchesOneRank does for Qwen3-MoE, and again with train.recompute
// moe and full. Qwen2-MoE's shared expert (and its gate) is replicated beside the sharded experts,
// and its first layer is dense; OLMoE's full-width QK-norm and Mixtral's renamed on-disk module go
// through the EP export gather.
//
// Tolerances: test_dp_train's (the same math in another fp32 summation order): per-step loss, ce,
// aux and grad_norm relative 1e-4; final weights relative L2 1e-5, and training must move the
// weights by far more than that so the bound can fail.
#include <gtest/gtest.h>

#include <string>

#include "io/safetensors.h"
#include "test_util.h"
#include "train_test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

constexpr test::TrainTolerance kTol{1e-4, 1e-5};
constexpr int kSteps = 8;

using test::bin;
using test::repo;

class ArchEp : public ::testing::TestWithParam<std::string> {
 protected:
    void SetUp() override {
        dir_ = test::temp_dir("arch_ep_" + GetParam());
        std::string out;
        ASSERT_EQ(test::run_command(bin() + " init --arch " + GetParam() + " --preset tiny --seed 7 --out " +
                                        (dir_ / "base").string(),
                                    &out),
                  0)
            << out;
    }
    void TearDown() override {
        if (!HasFailure()) fs::remove_all(dir_);
    }
    // The fine-tune on `nproc` processes through the launcher (0: one plain process); its output.
    std::string finetune(const std::string& name, int nproc, const std::string& extra) {
        const std::string prefix =
            nproc > 0 ? bin() + " launch --nproc-per-node " + std::to_string(nproc) + " -- " : bin() + " ";
        const std::string cmd = prefix + "finetune " + repo() +
                                "/demo/tiny_tokens.yaml model=" + (dir_ / "base").string() + " data.train=" + repo() +
                                "/demo/data/tokens.jsonl out=" + (dir_ / name).string() +
                                " train.steps=" + std::to_string(kSteps) +
                                " train.seq_len=64 data.shuffle=true seed=3 device=cpu optim.lr=3e-3 "
                                "train.log_every=3 dist.timeout_s=30 " +
                                extra;
        std::string out;
        EXPECT_EQ(test::run_command(cmd, &out), 0) << cmd << "\n" << out;
        return out;
    }
    fs::path dir_;
};

TEST_P(ArchEp, TwoExpertRanksMatchOneRank) {
    const std::string log = finetune("ep2", 2, "train.micro_batch=2 dist.ep_size=2");
    finetune("one", 0, "train.micro_batch=2 train.grad_accum=2");
    EXPECT_NE(log.find("world 2 (dp 1 x ep 2, tcp)"), std::string::npos) << log;
    test::expect_same_training(dir_ / "ep2", dir_ / "one", kSteps, kTol);
    const double moved = test::rel_l2(test::read_weights(dir_ / "one"), test::read_weights(dir_ / "base"));
    EXPECT_GE(moved, 10 * kTol.weight_rel_l2) << "training should move the weights far more than the tolerance";
    std::printf("%s: training moved the weights by rel L2 %.3g\n", GetParam().c_str(), moved);
    // The MoE blocks (the shared expert's and the QK-norm's backward among them) recomputed in the
    // backward, or whole layers: the EP exchange also runs in the recomputed forward, in lockstep.
    for (const char* mode : {"moe", "full"}) {
        const std::string name = std::string("ep2_recompute_") + mode;
        finetune(name, 2, std::string("train.micro_batch=2 dist.ep_size=2 train.recompute=") + mode);
        test::expect_same_training(dir_ / name, dir_ / "one", kSteps, kTol);
    }
    // The EP export is the whole model in HF's on-disk names, as the one-rank export.
    const io::ModelWeights ep = io::ModelWeights::open(dir_ / "ep2");
    const io::ModelWeights one = io::ModelWeights::open(dir_ / "one");
    EXPECT_EQ(ep.names(), one.names());
    // Each rank holds the replicated parameters (the shared expert among them) and half of the
    // routed experts, counted from the HF files (routed experts: "....experts.E....").
    int64_t replicated = 0, experts = 0, shared = 0;
    for (const std::string& name : one.names()) {
        int64_t n = 1;
        for (const int64_t x : one.find(name)->shape) n *= x;
        (name.find(".experts.") != std::string::npos ? experts : replicated) += n;
        if (name.find(".shared_expert") != std::string::npos) shared += n;
    }
    EXPECT_EQ(shared > 0, GetParam() == "qwen2_moe" || GetParam() == "nemotron_h");
    const std::string held = "this rank holds " + std::to_string(replicated + experts / 2) + " parameters";
    EXPECT_NE(log.find(held), std::string::npos) << "expected \"" << held << "\" in\n" << log;
}

INSTANTIATE_TEST_SUITE_P(Families, ArchEp, ::testing::Values("mixtral", "olmoe", "qwen2_moe", "nemotron_h"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
