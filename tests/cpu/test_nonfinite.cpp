// A NaN in the weights makes the loss non-finite in the first step: with train.on_nonfinite:
// stop the run ends naming the step and the first layer where it appeared; with skip it goes on,
// dropping those updates and marking them in metrics.jsonl. Resume refuses changed recipes.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "model/causal_lm.h"
#include "test_util.h"
#include "train/hf_checkpoint.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

std::string repo() { return (fs::path(test::fixtures_dir()) / ".." / "..").lexically_normal().string(); }

TEST(NonFinite, StopNamesStepAndLayerSkipContinues) {
    const fs::path dir = test::temp_dir("nonfinite");
    std::string out;
    ASSERT_EQ(test::run_command(
                  test::moeforge_binary() + " init --preset tiny --seed 1 --out " + (dir / "base").string(), &out),
              0);
    {
        json::Value raw;
        auto m = train::load_hf_model(dir / "base", &raw);
        m->param("model.layers.2.self_attn.v_proj.weight").ptr<float>()[5] = std::numeric_limits<float>::quiet_NaN();
        fs::create_directories(dir / "nan");
        train::save_hf_model(dir / "nan", *m, &raw, {});
    }
    const std::string cmd = test::moeforge_binary() + " finetune " + repo() +
                            "/demo/tiny_tokens.yaml model=" + (dir / "nan").string() + " data.train=" + repo() +
                            "/demo/data/tokens.jsonl train.steps=6 " + "train.seq_len=32 out=";
    EXPECT_NE(test::run_command(cmd + (dir / "stop").string(), &out), 0);
    EXPECT_NE(out.find("step 1: non-finite loss"), std::string::npos) << out;
    EXPECT_NE(out.find("layer 2 (self-attention output)"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(test::run_command(cmd + (dir / "skip").string() + " train.on_nonfinite=skip", &out), 0) << out;
    EXPECT_NE(out.find("update skipped"), std::string::npos) << out;
    const std::string metrics = test::read_file(dir / "skip" / "metrics.jsonl");
    EXPECT_NE(metrics.find("\"skipped\":true"), std::string::npos) << metrics;
    EXPECT_NE(metrics.find("\"loss\":null"), std::string::npos) << metrics;
}

TEST(Resume, RefusesAChangedRecipeUnlessForced) {
    const fs::path dir = test::temp_dir("resume_refuse");
    std::string out;
    ASSERT_EQ(test::run_command(
                  test::moeforge_binary() + " init --preset tiny --seed 1 --out " + (dir / "base").string(), &out),
              0);
    const std::string cmd = test::moeforge_binary() + " finetune " + repo() +
                            "/demo/tiny_tokens.yaml model=" + (dir / "base").string() + " data.train=" + repo() +
                            "/demo/data/tokens.jsonl train.steps=6 " +
                            "train.seq_len=32 checkpoint.every=3 out=" + (dir / "run").string();
    ASSERT_EQ(test::run_command(cmd, &out), 0) << out;
    out.clear();
    EXPECT_NE(test::run_command(cmd + " train.seq_len=48 --resume", &out), 0);
    EXPECT_NE(out.find("train.seq_len was 32, now 48"), std::string::npos) << out;
    out.clear();
    EXPECT_EQ(test::run_command(cmd + " train.seq_len=48 --resume --force-resume", &out), 0) << out;
    EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
    out.clear();
    // A damaged checkpoint is refused with the file named.
    test::write_file(dir / "run" / "checkpoints" / "step-00000006" / "state.json", "{\"magic\": \"something else\"}");
    EXPECT_NE(test::run_command(cmd + " --resume", &out), 0);
    EXPECT_NE(out.find("not a moeforge training checkpoint"), std::string::npos) << out;
}

}  // namespace
