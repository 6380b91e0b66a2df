// What a trainer reports (issue 20, parts 3 and 4): the dataset summary before step 1 (records,
// truncation, packing), evaluation during training (val_loss in metrics.jsonl and the log, equal to
// `moeforge eval` of the exported model), checkpoint.keep_best keeping the best evaluation's
// checkpoint through pruning, TensorBoard event files, and `peak_mem_gib` in every metrics line.
// The real binary on the tiny chat model.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <sstream>

#include "core/json.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

std::string repo() { return (fs::path(test::fixtures_dir()) / ".." / "..").lexically_normal().string(); }

class TrainReporting : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        dir_ = test::temp_dir("train_reporting");
        std::string out;
        ASSERT_EQ(test::run_command(test::moeforge_binary() + " init --preset tiny --seed 0 --tokenizer " + repo() +
                                        "/demo/tokenizer --out " + (dir_ / "base").string(),
                                    &out),
                  0)
            << out;
    }
    static std::string finetune(const std::string& out, const std::string& extra) {
        return test::moeforge_binary() + " finetune " + repo() +
               "/demo/tiny_chat.yaml model=" + (dir_ / "base").string() + " data.train=" + repo() +
               "/demo/data/chat.jsonl eval.data=" + heldout() + " out=" + (dir_ / out).string() +
               " train.seq_len=64 optim.warmup_steps=0 train.log_every=100 device=cpu " + extra;
    }
    static std::string heldout() { return repo() + "/demo/data/chat_heldout.jsonl"; }
    static std::vector<json::Value> metrics(const std::string& out) {
        std::vector<json::Value> lines;
        std::istringstream in(test::read_file(dir_ / out / "metrics.jsonl"));
        std::string line;
        while (std::getline(in, line)) lines.push_back(json::parse(line, "metrics.jsonl"));
        return lines;
    }
    static fs::path dir_;
};
fs::path TrainReporting::dir_;

TEST_F(TrainReporting, DatasetSummaryAndEvalDuringTraining) {
    std::string log;
    ASSERT_EQ(test::run_command(finetune("eval", "train.steps=6 eval.every=3"), &log), 0) << log;
    // The summary names the truncation at seq_len 64 (the demo chats run longer) and the packing.
    EXPECT_NE(log.find("300 records"), std::string::npos) << log;
    EXPECT_NE(log.find("truncated at seq_len 64"), std::string::npos) << log;
    EXPECT_NE(log.find("packing"), std::string::npos) << log;
    EXPECT_LT(log.find("truncated at seq_len"), log.find("step    1/6")) << "before step 1: " << log;
    const std::vector<json::Value> m = metrics("eval");
    ASSERT_EQ(m.size(), 6u);
    std::set<int64_t> evaluated;
    for (const json::Value& line : m) {
        ASSERT_NE(line.find("peak_mem_gib"), nullptr);
        EXPECT_GT(line.find("peak_mem_gib")->as_double(), 0.0);
        if (line.find("val_loss") != nullptr) evaluated.insert(line.find("step")->as_int());
    }
    EXPECT_EQ(evaluated, (std::set<int64_t>{3, 6}));
    EXPECT_NE(log.find("eval at step 3"), std::string::npos) << log;
    // The last evaluation saw the exported weights: `moeforge eval` of the export gives the same loss.
    std::string out;
    ASSERT_EQ(
        test::run_command(test::moeforge_binary() + " eval --json --device cpu --seq-len 64 --micro-batch 8 --model " +
                              (dir_ / "eval").string() + " --data " + heldout(),
                          &out),
        0)
        << out;
    const json::Value e = json::parse(out.substr(out.find('{')), "eval output");
    EXPECT_NEAR(e.find("loss")->as_double(), m.back().find("val_loss")->as_double(), 1e-6) << out;
}

TEST_F(TrainReporting, KeepBestSurvivesPruning) {
    // keep 1 with a checkpoint every step: only the newest would stay, and the best evaluation's.
    std::string log;
    ASSERT_EQ(test::run_command(finetune("best",
                                         "train.steps=6 eval.every=2 checkpoint.every=1 checkpoint.keep=1 "
                                         "checkpoint.keep_best=true optim.lr=0.2"),
                                &log),
              0)
        << log;
    int64_t best_step = -1;
    double best = 0;
    for (const json::Value& line : metrics("best")) {
        const json::Value* v = line.find("val_loss");
        if (v == nullptr) continue;
        if (best_step < 0 || v->as_double() < best) {
            best = v->as_double();
            best_step = line.find("step")->as_int();
        }
    }
    ASSERT_GE(best_step, 1);
    std::set<std::string> kept;
    for (const auto& e : fs::directory_iterator(dir_ / "best" / "checkpoints"))
        kept.insert(e.path().filename().string());
    char name[32];
    std::snprintf(name, sizeof name, "step-%08lld", static_cast<long long>(best_step));
    std::set<std::string> want = {"step-00000006", name};
    EXPECT_EQ(kept, want) << log;
    // The best step is recorded in the checkpoints' state.
    EXPECT_NE(test::read_file(dir_ / "best" / "checkpoints" / "step-00000006" / "state.json")
                  .find("\"best_step\": " + std::to_string(best_step)),
              std::string::npos);
}

TEST_F(TrainReporting, TensorBoardEventsAreWritten) {
    std::string log;
    ASSERT_EQ(test::run_command(finetune("tb", "train.steps=4 eval.every=2 log.tensorboard=true"), &log), 0) << log;
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(dir_ / "tb" / "tensorboard")) files.push_back(e.path());
    ASSERT_EQ(files.size(), 1u);
    EXPECT_EQ(files[0].filename().string().rfind("events.out.tfevents.", 0), 0u);
    const std::string bytes = test::read_file(files[0]);
    for (const char* tag : {"brain.Event:2", "train/loss", "train/lr", "train/grad_norm", "val/loss"})
        EXPECT_NE(bytes.find(tag), std::string::npos) << tag;
    // One record per step plus the version record: the tag appears once per logged step (log_every 100
    // here, but every evaluated step and the last are logged): steps 2 and 4.
    size_t count = 0;
    for (size_t at = bytes.find("train/loss"); at != std::string::npos; at = bytes.find("train/loss", at + 1)) ++count;
    EXPECT_EQ(count, 2u);
}

}  // namespace
