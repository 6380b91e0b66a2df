// No run loses a user's work (issue 20, part 1): the export writes only its own files into OUT;
// OUT that overlaps the model or the data, `.`, or holds foreign weights is refused before step 1;
// float16 models export as float16; `--resume` without a checkpoint is an error that writes
// nothing; OUT is locked; SIGINT/SIGTERM finish the step, save and exit 130/143, and a resume then
// equals an uninterrupted run bit for bit; a second signal exits at once without temporaries; a
// resume that would bend the learning-rate schedule is refused; checkpoints carry checksums.
// Every case runs the real binary on the tiny model; every wait is bounded.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <sstream>
#include <thread>

#include "core/bf16.h"
#include "core/json.h"
#include "io/crc32c.h"
#include "io/file.h"
#include "io/safetensors.h"
#include "process_util.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace mf;

namespace {

std::string repo() { return (fs::path(test::fixtures_dir()) / ".." / "..").lexically_normal().string(); }

class NoLostWork : public ::testing::Test {
 protected:
    static void SetUpTestSuite() {
        dir_ = test::temp_dir("no_lost_work");
        std::string out;
        ASSERT_EQ(
            test::run_command(test::moeforge_binary() + " init --preset tiny --seed 3 --out " + base().string(), &out),
            0)
            << out;
    }
    static fs::path base() { return dir_ / "base"; }
    static std::string data() { return repo() + "/demo/data/tokens.jsonl"; }
    static std::string finetune(const fs::path& model, const std::string& out, const std::string& extra) {
        return test::moeforge_binary() + " finetune " + repo() + "/demo/tiny_tokens.yaml model=" + model.string() +
               " data.train=" + data() + " out=" + out +
               " train.seq_len=32 train.micro_batch=2 train.log_every=1000 optim.warmup_steps=0 "
               "device=cpu " +
               extra;
    }
    static int run(const std::string& cmd, std::string* out) {
        out->clear();
        return test::run_command(cmd, out);
    }
    // Names under `d` (recursively), sorted: to show nothing else changed.
    static std::vector<std::string> tree(const fs::path& d) {
        std::vector<std::string> names;
        for (const auto& e : fs::recursive_directory_iterator(d)) names.push_back(fs::relative(e.path(), d).string());
        std::sort(names.begin(), names.end());
        return names;
    }
    static bool has_temporaries(const fs::path& d) {
        for (const auto& e : fs::recursive_directory_iterator(d)) {
            const std::string n = e.path().filename().string();
            if (n.find(".tmp-") != std::string::npos || n.rfind(".moeforge-staging", 0) == 0) return true;
        }
        return false;
    }
    static fs::path dir_;
};
fs::path NoLostWork::dir_;

TEST_F(NoLostWork, ExportKeepsWhatItDidNotWrite) {
    const fs::path out = dir_ / "keep";
    fs::create_directories(out / "sub");
    test::write_file(out / "NOTES.txt", "mine\n");
    test::write_file(out / "sub" / "data.bin", "also mine\n");
    std::string log;
    ASSERT_EQ(run(finetune(base(), out.string(), "train.steps=2"), &log), 0) << log;
    EXPECT_EQ(test::read_file(out / "NOTES.txt"), "mine\n");
    EXPECT_EQ(test::read_file(out / "sub" / "data.bin"), "also mine\n");
    for (const char* f : {"config.json", "model.safetensors", "metrics.jsonl", "recipe.json", ".moeforge-export.json"})
        EXPECT_TRUE(fs::exists(out / f)) << f;
    EXPECT_FALSE(fs::exists(out / io::DirLock::kFileName)) << "the lock is released at the end";
    EXPECT_FALSE(has_temporaries(out));
    // A second run into the same OUT replaces its own files and still keeps the user's.
    ASSERT_EQ(run(finetune(base(), out.string(), "train.steps=1"), &log), 0) << log;
    EXPECT_EQ(test::read_file(out / "NOTES.txt"), "mine\n");
    EXPECT_TRUE(fs::exists(out / "sub" / "data.bin"));
}

TEST_F(NoLostWork, BatchBeyondTheMachinesMemoryIsNamed) {
    // Under the recipe's token cap, but beyond this machine's memory: ~100 GiB of activations.
    const double host_gib = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE)) /
                            (1024.0 * 1024.0 * 1024.0);
    if (host_gib > 90) GTEST_SKIP() << "this machine has " << host_gib << " GiB: the 100 GiB batch would fit";
    std::string log;
    EXPECT_NE(
        run(finetune(base(), (dir_ / "huge").string(), "train.steps=1") + " train.micro_batch=1024 train.seq_len=4096",
            &log),
        0);
    EXPECT_NE(log.find("a micro-batch of 1024 x 4096 tokens needs"), std::string::npos) << log;
    EXPECT_NE(log.find("train.micro_batch"), std::string::npos) << log;
    EXPECT_EQ(log.find("out of host memory"), std::string::npos) << log;
}

TEST_F(NoLostWork, InitWritesOnlyItsOwnFiles) {
    const fs::path out = dir_ / "init_out";
    fs::create_directories(out / "sub");
    test::write_file(out / "NOTES.txt", "mine\n");
    std::string log;
    const std::string init = test::moeforge_binary() + " init --preset tiny --seed 4 --out ";
    ASSERT_EQ(run(init + out.string(), &log), 0) << log;
    EXPECT_EQ(test::read_file(out / "NOTES.txt"), "mine\n");
    EXPECT_TRUE(fs::is_directory(out / "sub"));
    EXPECT_TRUE(fs::exists(out / "model.safetensors"));
    // Again into the same directory (its own earlier files are replaced), and never over a tokenizer it reads.
    ASSERT_EQ(run(init + out.string(), &log), 0) << log;
    EXPECT_EQ(test::read_file(out / "NOTES.txt"), "mine\n");
    fs::copy(repo() + "/demo/tokenizer", dir_ / "tok", fs::copy_options::recursive);
    const std::vector<std::string> tok_files = tree(dir_ / "tok");
    EXPECT_NE(run(init + (dir_ / "tok").string() + " --tokenizer " + (dir_ / "tok").string(), &log), 0);
    EXPECT_NE(log.find("contains the input"), std::string::npos) << log;
    EXPECT_EQ(tree(dir_ / "tok"), tok_files);
    EXPECT_NE(run("cd " + out.string() + " && " + init + ".", &log), 0);
    EXPECT_NE(log.find("current directory"), std::string::npos) << log;
}

TEST_F(NoLostWork, OutputOverlappingModelOrDataIsRefusedBeforeTraining) {
    std::string log;
    const std::vector<std::string> before = tree(base());
    // OUT = the model directory, OUT = its parent.
    EXPECT_NE(run(finetune(base(), base().string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("the model directory"), std::string::npos) << log;
    EXPECT_NE(run(finetune(base(), dir_.string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("contains the model directory"), std::string::npos) << log;
    EXPECT_EQ(log.find("step "), std::string::npos) << "refused before step 1: " << log;
    // A symlink that resolves to the model directory.
    fs::create_directory_symlink(base(), dir_ / "link_to_base");
    EXPECT_NE(run(finetune(base(), (dir_ / "link_to_base").string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("resolves to"), std::string::npos) << log;
    EXPECT_EQ(tree(base()), before) << "the model directory is untouched";
    // OUT containing the training data.
    const fs::path with_data = dir_ / "with_data";
    fs::create_directories(with_data);
    fs::copy_file(data(), with_data / "train.jsonl");
    EXPECT_NE(run(test::moeforge_binary() + " finetune " + repo() + "/demo/tiny_tokens.yaml model=" + base().string() +
                      " data.train=" + (with_data / "train.jsonl").string() + " out=" + with_data.string() +
                      " train.steps=1 train.seq_len=32 optim.warmup_steps=0 device=cpu",
                  &log),
              0);
    EXPECT_NE(log.find("contains the input"), std::string::npos) << log;
    EXPECT_EQ(tree(with_data), std::vector<std::string>{"train.jsonl"});
    // `.`: the current directory.
    EXPECT_NE(run("cd " + with_data.string() + " && " + finetune(base(), ".", "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("current directory"), std::string::npos) << log;
    // OUT that is a file.
    test::write_file(dir_ / "a_file", "x");
    EXPECT_NE(run(finetune(base(), (dir_ / "a_file").string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("not a directory"), std::string::npos) << log;
    EXPECT_EQ(test::read_file(dir_ / "a_file"), "x");
}

TEST_F(NoLostWork, SymlinkedOutputWritesIntoItsTarget) {
    const fs::path target = dir_ / "link_target";
    fs::create_directories(target);
    test::write_file(target / "NOTES.txt", "kept\n");
    fs::create_directory_symlink(target, dir_ / "out_link");
    std::string log;
    ASSERT_EQ(run(finetune(base(), (dir_ / "out_link").string(), "train.steps=1"), &log), 0) << log;
    EXPECT_TRUE(fs::is_symlink(dir_ / "out_link"));
    EXPECT_TRUE(fs::exists(target / "model.safetensors"));
    EXPECT_EQ(test::read_file(target / "NOTES.txt"), "kept\n");
}

TEST_F(NoLostWork, DirectoryInThePlaceOfAnExportFileIsRefusedBeforeTraining) {
    const fs::path out = dir_ / "dir_in_the_way";
    fs::create_directories(out / "config.json");
    std::string log;
    EXPECT_NE(run(finetune(base(), out.string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("a directory named config.json"), std::string::npos) << log;
    EXPECT_EQ(log.find("step "), std::string::npos) << "refused before step 1: " << log;
    EXPECT_TRUE(fs::is_directory(out / "config.json"));
}

TEST_F(NoLostWork, ForeignWeightsInOutputAreRefused) {
    const fs::path out = dir_ / "foreign";
    fs::create_directories(out);
    fs::copy_file(base() / "model.safetensors", out / "model.safetensors");
    std::string log;
    EXPECT_NE(run(finetune(base(), out.string(), "train.steps=1"), &log), 0);
    EXPECT_NE(log.find("no moeforge export wrote"), std::string::npos) << log;
    EXPECT_EQ(tree(out), std::vector<std::string>{"model.safetensors"});
}

TEST_F(NoLostWork, Float16ModelTrainsAndExportsAsFloat16) {
    // A float16 copy of the base model: config dtype float16 and F16 weights.
    const fs::path f16 = dir_ / "base_f16";
    fs::create_directories(f16);
    json::Value cfg = json::parse(test::read_file(base() / "config.json"), "config.json");
    cfg.set("torch_dtype", "float16");
    if (cfg.find("dtype") != nullptr) cfg.set("dtype", "float16");
    test::write_file(f16 / "config.json", cfg.dump(2));
    const io::ModelWeights src = io::ModelWeights::open(base());
    std::vector<std::vector<uint16_t>> halves;
    std::vector<io::StWriteTensor> tensors;
    for (const io::StTensor& t : src.files().at(0).tensors()) {
        std::vector<float> v(static_cast<size_t>(shape_numel(t.shape)));
        src.read_f32(t.name, t.shape, v.data());
        halves.emplace_back(v.size());
        for (size_t i = 0; i < v.size(); ++i) halves.back()[i] = f32_to_f16(v[i]);
        tensors.push_back({t.name, io::StDType::F16, t.shape, halves.back().data()});
    }
    io::write_safetensors(f16 / "model.safetensors", tensors, {});
    std::string log;
    const fs::path out = dir_ / "out_f16";
    ASSERT_EQ(run(finetune(f16, out.string(), "train.steps=2"), &log), 0) << log;
    const io::SafetensorsFile written = io::SafetensorsFile::open(out / "model.safetensors");
    for (const io::StTensor& t : written.tensors()) EXPECT_EQ(t.dtype, io::StDType::F16) << t.name;
    EXPECT_NE(test::read_file(out / "config.json").find("float16"), std::string::npos);
}

TEST_F(NoLostWork, ResumeWithoutCheckpointIsAnErrorAndWritesNothing) {
    std::string log;
    const fs::path fresh = dir_ / "never_ran";
    EXPECT_NE(run(finetune(base(), fresh.string(), "train.steps=2") + " --resume", &log), 0);
    EXPECT_NE(log.find("no checkpoint"), std::string::npos) << log;
    EXPECT_FALSE(fs::exists(fresh));
    // A finished run without checkpoints: --resume must not train again and replace its model.
    const fs::path done = dir_ / "finished";
    ASSERT_EQ(run(finetune(base(), done.string(), "train.steps=2"), &log), 0) << log;
    const std::vector<std::string> before = tree(done);
    const std::string weights = test::read_file(done / "model.safetensors");
    const std::string metrics = test::read_file(done / "metrics.jsonl");
    EXPECT_NE(run(finetune(base(), done.string(), "train.steps=2") + " --resume", &log), 0);
    EXPECT_NE(log.find("no checkpoint"), std::string::npos) << log;
    EXPECT_EQ(tree(done), before);
    EXPECT_TRUE(test::read_file(done / "model.safetensors") == weights);
    EXPECT_EQ(test::read_file(done / "metrics.jsonl"), metrics);
    EXPECT_NE(run(finetune(base(), done.string(), "train.steps=2") + " --resume=", &log), 0);
    EXPECT_NE(log.find("--resume= needs a value"), std::string::npos) << log;
    EXPECT_NE(run(finetune(base(), done.string(), "train.steps=2") + " --resume " + (dir_ / "nowhere").string(), &log),
              0);
    EXPECT_NE(log.find("not a training checkpoint directory"), std::string::npos) << log;
}

TEST_F(NoLostWork, OutputIsLockedWhileARunHoldsIt) {
    const fs::path out = dir_ / "locked";
    fs::create_directories(out);
    std::string log;
    {
        const io::DirLock held(out);  // what a running moeforge holds
        EXPECT_NE(run(finetune(base(), out.string(), "train.steps=1"), &log), 0);
        EXPECT_NE(log.find("in use by another moeforge run"), std::string::npos) << log;
        EXPECT_NE(log.find("pid " + std::to_string(::getpid())), std::string::npos) << "names the holder: " << log;
        EXPECT_FALSE(fs::exists(out / "recipe.json")) << "nothing written";
    }
    // A lock file left by a process that died (no flock on it) is taken over with a warning.
    test::write_file(out / io::DirLock::kFileName, "pid 999999 host elsewhere since 0\n");
    ASSERT_EQ(run(finetune(base(), out.string(), "train.steps=1"), &log), 0) << log;
    EXPECT_NE(log.find("taking it over"), std::string::npos) << log;
    EXPECT_NE(log.find("pid 999999"), std::string::npos) << log;
}

TEST(DirLock, SecondLockFailsAtOnceAndReleaseFreesIt) {
    const fs::path d = test::temp_dir("dirlock");
    {
        const io::DirLock a(d);
        EXPECT_TRUE(a.stale_holder().empty());
        try {
            const io::DirLock b(d);
            ADD_FAILURE() << "a second lock succeeded";
        } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("in use"), std::string::npos) << e.what();
        }
    }
    EXPECT_FALSE(fs::exists(d / io::DirLock::kFileName));
    const io::DirLock again(d);
    EXPECT_TRUE(again.stale_holder().empty());
}

TEST(StagedFiles, ReplacesItsOwnFilesRemovesItsStaleOnesAndNothingElse) {
    const fs::path d = test::temp_dir("staged");
    test::write_file(d / "user.txt", "user");
    {
        io::StagedFiles s(d, ".record.json");
        test::write_file(s.staging() / "a.bin", "a1");
        test::write_file(s.staging() / "b.bin", "b1");
        test::write_file(s.staging() / "config.json", "{}");
        s.commit({"config.json"});
    }
    EXPECT_EQ(io::StagedFiles::recorded(d, ".record.json"),
              (std::vector<std::string>{"a.bin", "b.bin", "config.json"}));
    {
        io::StagedFiles s(d, ".record.json");
        test::write_file(s.staging() / "a.bin", "a2");
        test::write_file(s.staging() / "config.json", "{}");
        s.commit({"config.json"});
    }
    EXPECT_EQ(test::read_file(d / "a.bin"), "a2");
    EXPECT_FALSE(fs::exists(d / "b.bin")) << "written by the first commit, absent from the second";
    EXPECT_EQ(test::read_file(d / "user.txt"), "user");
    {
        io::StagedFiles s(d, ".record.json");
        test::write_file(s.staging() / "a.bin", "a3");
    }  // no commit
    EXPECT_EQ(test::read_file(d / "a.bin"), "a2");
    for (const auto& e : fs::directory_iterator(d))
        EXPECT_EQ(e.path().filename().string().find("staging"), std::string::npos) << e.path();
}

// A commit cut short after some renames (here a directory in the way of the second name; a SIGKILL
// there is the same) leaves the files it moved listed in the record: a later export replaces them
// rather than refusing them as someone else's (the kill test once hit this).
TEST(StagedFiles, ACommitCutShortLeavesWhatItMovedRecorded) {
    const fs::path d = test::temp_dir("staged_cut");
    fs::create_directories(d / "b.bin");
    {
        io::StagedFiles s(d, ".record.json");
        test::write_file(s.staging() / "a.bin", "a1");
        test::write_file(s.staging() / "b.bin", "b1");
        EXPECT_THROW(s.commit(), Error);
    }
    ASSERT_EQ(test::read_file(d / "a.bin"), "a1") << "a.bin is renamed before b.bin fails";
    const auto listed = io::StagedFiles::recorded(d, ".record.json");
    EXPECT_NE(std::find(listed.begin(), listed.end(), "a.bin"), listed.end()) << "a.bin moved but unrecorded";
    fs::remove(d / "b.bin");
    io::StagedFiles again(d, ".record.json");
    test::write_file(again.staging() / "a.bin", "a2");
    again.commit();
    EXPECT_EQ(test::read_file(d / "a.bin"), "a2");
    EXPECT_EQ(io::StagedFiles::recorded(d, ".record.json"), std::vector<std::string>{"a.bin"});
}

TEST(Crc32c, KnownValuesAndRunningSums) {
    EXPECT_EQ(io::crc32c(0, "123456789", 9), 0xE3069283u);
    EXPECT_EQ(io::crc32c(0, "", 0), 0u);
    std::string big(100003, '\0');
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<char>(i * 131 + 7);
    const uint32_t whole = io::crc32c(0, big.data(), big.size());
    uint32_t parts = 0;
    for (size_t at = 0; at < big.size(); at += 977)
        parts = io::crc32c(parts, big.data() + at, std::min<size_t>(977, big.size() - at));
    EXPECT_EQ(parts, whole);
    std::string flipped = big;
    flipped[5000] ^= 1;
    EXPECT_NE(io::crc32c(0, flipped.data(), flipped.size()), whole);
}

// --- signals ---------------------------------------------------------------------------------------

using test::count_lines;
using test::spawn_shell;
using test::wait_exit;
using test::wait_for;

std::vector<std::string> metrics_without_timing(const fs::path& file) {
    std::vector<std::string> out;
    std::istringstream in(test::read_file(file));
    std::string line;
    while (std::getline(in, line)) {
        json::Value v = json::parse(line, file.string());
        std::erase_if(v.as_object(),
                      [](const auto& kv) { return kv.first == "tokens_per_s" || kv.first == "peak_mem_gib"; });
        out.push_back(v.dump());
    }
    return out;
}

TEST_F(NoLostWork, SignalFinishesTheStepSavesAndResumesBitwise) {
    const std::string args = "train.steps=30 checkpoint.every=0";
    std::string log;
    const fs::path ref = dir_ / "sig_ref";
    ASSERT_EQ(run(finetune(base(), ref.string(), args), &log), 0) << log;

    for (const int sig : {SIGTERM, SIGINT}) {
        const fs::path out = dir_ / ("sig_" + std::to_string(sig));
        const fs::path log_file = dir_ / ("sig_" + std::to_string(sig) + ".log");
        const pid_t pid = spawn_shell(finetune(base(), out.string(), args), log_file);
        ASSERT_GT(pid, 0);
        ASSERT_TRUE(wait_for([&] { return count_lines(out / "metrics.jsonl") >= 3; }, 60)) << test::read_file(log_file);
        kill(pid, sig);
        const int code = wait_exit(pid, 60);
        const std::string text = test::read_file(log_file);
        ASSERT_EQ(code, 128 + sig) << text;
        EXPECT_NE(text.find("checkpoint saved"), std::string::npos) << text;
        EXPECT_NE(text.find("stopped by"), std::string::npos) << text;
        const size_t steps_done = count_lines(out / "metrics.jsonl");
        ASSERT_LT(steps_done, 30u) << "the signal must stop the run early";
        EXPECT_TRUE(fs::exists(out / "checkpoints")) << "a checkpoint although checkpoint.every is 0";
        EXPECT_FALSE(fs::exists(out / "model.safetensors")) << "an interrupted run does not export";
        EXPECT_FALSE(fs::exists(out / io::DirLock::kFileName));
        EXPECT_FALSE(has_temporaries(out));
        // The log reached the redirected file line by line (flushed), not lost in a buffer.
        EXPECT_NE(text.find("moeforge finetune:"), std::string::npos) << text;

        ASSERT_EQ(run(finetune(base(), out.string(), args) + " --resume", &log), 0) << log;
        EXPECT_EQ(metrics_without_timing(out / "metrics.jsonl"), metrics_without_timing(ref / "metrics.jsonl"));
        EXPECT_TRUE(test::read_file(out / "model.safetensors") == test::read_file(ref / "model.safetensors"))
            << "the resumed run's weights differ from the uninterrupted run's";
    }
}

TEST_F(NoLostWork, SecondSignalStopsAtOnceWithoutTemporaries) {
    // Long steps (a large batch on the CPU) so that the second signal lands inside one.
    const fs::path out = dir_ / "sig_twice";
    const fs::path log_file = dir_ / "sig_twice.log";
    const std::string cmd = finetune(base(), out.string(), "train.steps=1000 checkpoint.every=0") +
                            " train.seq_len=256 train.micro_batch=16 train.grad_accum=4";
    const pid_t pid = spawn_shell(cmd, log_file);
    ASSERT_GT(pid, 0);
    // Bounded generously: a sanitizer build on two busy cores runs these steps many times slower.
    ASSERT_TRUE(wait_for([&] { return count_lines(out / "metrics.jsonl") >= 1; }, 400)) << test::read_file(log_file);
    kill(pid, SIGTERM);
    std::this_thread::sleep_for(std::chrono::milliseconds(1300));  // past the repeat window
    const auto t0 = std::chrono::steady_clock::now();
    kill(pid, SIGTERM);
    const int code = wait_exit(pid, 30);
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string text = test::read_file(log_file);
    EXPECT_EQ(code, 143) << text;
    EXPECT_LT(took, 5.0) << "the second signal must not wait for the step";
    EXPECT_FALSE(has_temporaries(out)) << text;
    // Whatever checkpoint exists is complete.
    if (fs::exists(out / "checkpoints")) {
        for (const auto& e : fs::directory_iterator(out / "checkpoints"))
            EXPECT_TRUE(fs::exists(e.path() / "state.json")) << e.path();
    }
}

// --- schedule and checksums -------------------------------------------------------------------------

TEST_F(NoLostWork, ResumeThatWouldBendTheScheduleIsRefused) {
    const fs::path out = dir_ / "schedule";
    std::string log;
    ASSERT_EQ(run(finetune(base(), out.string(), "train.steps=4 checkpoint.every=2 optim.schedule=cosine"), &log), 0)
        << log;
    EXPECT_NE(run(finetune(base(), out.string(), "train.steps=8 optim.schedule=cosine") + " --resume", &log), 0);
    EXPECT_NE(log.find("would change the learning rate"), std::string::npos) << log;
    EXPECT_NE(log.find("train.steps 4 -> 8"), std::string::npos) << log;
    // A constant schedule does not depend on train.steps: more steps continue smoothly.
    const fs::path c = dir_ / "schedule_constant";
    ASSERT_EQ(run(finetune(base(), c.string(),
                           "train.steps=4 checkpoint.every=2 optim.schedule=constant optim.warmup_steps=0"),
                  &log),
              0)
        << log;
    EXPECT_EQ(
        run(finetune(base(), c.string(), "train.steps=6 optim.schedule=constant optim.warmup_steps=0") + " --resume",
            &log),
        0)
        << log;
    EXPECT_EQ(count_lines(c / "metrics.jsonl"), 6u);
}

TEST_F(NoLostWork, DamagedCheckpointFilesAreNoticedByTheirChecksum) {
    const fs::path out = dir_ / "checksums";
    std::string log;
    const std::string args = "train.steps=4 checkpoint.every=2 optim.schedule=constant";
    ASSERT_EQ(run(finetune(base(), out.string(), args), &log), 0) << log;
    const fs::path ckpt = out / "checkpoints" / "step-00000004";
    const fs::path shard = ckpt / "shard-00000-of-00001.safetensors";
    ASSERT_TRUE(fs::exists(shard));
    // One flipped bit deep inside the data (a value that stays finite), then one in state.json.
    std::string bytes = test::read_file(shard);
    const size_t at = bytes.size() - 4 * 1000 - 2;
    bytes[at] = static_cast<char>(bytes[at] ^ 0x01);
    const std::string original = test::read_file(shard);
    test::write_file(shard, bytes);
    EXPECT_NE(run(finetune(base(), out.string(), "train.steps=6 optim.schedule=constant") + " --resume", &log), 0);
    EXPECT_NE(log.find("checksum mismatch"), std::string::npos) << log;
    EXPECT_NE(log.find("shard-00000-of-00001.safetensors"), std::string::npos) << log;
    test::write_file(shard, original);
    std::string state = test::read_file(ckpt / "state.json");
    const size_t pos = state.find("\"adam_step\": 4");
    ASSERT_NE(pos, std::string::npos) << state;
    state.replace(pos, 14, "\"adam_step\": 5");
    test::write_file(ckpt / "state.json", state);
    EXPECT_NE(run(finetune(base(), out.string(), "train.steps=6 optim.schedule=constant") + " --resume", &log), 0);
    EXPECT_NE(log.find("state.json: checksum mismatch"), std::string::npos) << log;
}

}  // namespace
