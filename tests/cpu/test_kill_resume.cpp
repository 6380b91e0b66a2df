// Crash safety: SIGKILL the trainer at random moments (many land inside checkpoint writes, which
// happen every step here), restart it with --resume each time, and require that the final
// metrics and weights equal those of an uninterrupted run, bit for bit (tokens_per_s aside).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "core/json.h"
#include "test_util.h"

extern char** environ;

namespace fs = std::filesystem;
using namespace mf;

namespace {

std::string repo() { return (fs::path(test::fixtures_dir()) / ".." / "..").lexically_normal().string(); }

std::vector<std::string> finetune_args(const fs::path& base, const fs::path& out) {
    return {test::moeforge_binary(),
            "finetune",
            repo() + "/demo/tiny_tokens.yaml",
            "model=" + base.string(),
            "data.train=" + repo() + "/demo/data/tokens.jsonl",
            "out=" + out.string(),
            "train.steps=40",
            "train.seq_len=32",
            "train.micro_batch=2",
            "train.log_every=1000",
            "checkpoint.every=1",
            "checkpoint.keep=2"};
}

// What a restart script does: --resume once a checkpoint exists (without one, --resume is an error).
std::vector<std::string> restart_args(const fs::path& base, const fs::path& out) {
    std::vector<std::string> args = finetune_args(base, out);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(out / "checkpoints", ec))
        if (e.path().filename().string().rfind("step-", 0) == 0 && e.path().filename().string().size() == 13) {
            args.push_back("--resume");
            break;
        }
    return args;
}

pid_t spawn(const std::vector<std::string>& args, const fs::path& log) {
    std::vector<char*> argv;
    for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    posix_spawn_file_actions_adddup2(&actions, 1, 2);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, argv[0], &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    return rc == 0 ? pid : -1;
}

// What waitpid's status says, for the failure messages.
std::string describe(int status) {
    if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
    if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
    return "status " + std::to_string(status);
}

// Metrics without the timing field, one string per step.
std::vector<std::string> metrics(const fs::path& file) {
    std::vector<std::string> out;
    std::istringstream in(test::read_file(file));
    std::string line;
    while (std::getline(in, line)) {
        json::Value v = json::parse(line, file.string());
        auto& obj = v.as_object();
        std::erase_if(obj, [](const auto& kv) { return kv.first == "tokens_per_s"; });
        out.push_back(v.dump());
    }
    return out;
}

TEST(KillResume, SurvivesSigkillAnywhere) {
    const fs::path dir = test::temp_dir("kill");
    std::string out;
    ASSERT_EQ(test::run_command(
                  test::moeforge_binary() + " init --preset tiny --seed 11 --out " + (dir / "base").string(), &out),
              0)
        << out;

    // The reference: one uninterrupted run.
    const fs::path ref = dir / "ref";
    const pid_t ref_pid = spawn(finetune_args(dir / "base", ref), dir / "ref.log");
    ASSERT_GT(ref_pid, 0);
    int status = 0;
    waitpid(ref_pid, &status, 0);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << test::read_file(dir / "ref.log");
    const auto ref_metrics = metrics(ref / "metrics.jsonl");
    ASSERT_EQ(ref_metrics.size(), 40u);
    const std::string ref_weights = test::read_file(ref / "model.safetensors");
    const auto t_start = std::chrono::steady_clock::now();

    std::mt19937 rng(2026);
    int kills = 0, cycles = 0;
    while (kills < 50 || cycles == 0) {
        const fs::path run = dir / ("run" + std::to_string(cycles));
        const fs::path log = dir / ("run" + std::to_string(cycles) + ".log");
        int lives = 0;
        while (true) {
            ASSERT_LT(++lives, 2000) << "no progress";
            const pid_t pid = spawn(restart_args(dir / "base", run), log);
            ASSERT_GT(pid, 0);
            // Most lives are short (inside start-up, steps and checkpoint writes); some run longer.
            // On a slow machine (a sanitizer build sharing two busy cores) start-up alone can outlast
            // every delay, so each 100 lives of one run without finishing double them (up to 16x).
            const int stretch = 1 << std::min(lives / 100, 4);
            const int delay_ms = stretch * std::uniform_int_distribution<int>(5, rng() % 4 == 0 ? 400 : 120)(rng);
            std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
            if (waitpid(pid, &status, WNOHANG) == pid) {
                ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
                    << "life " << lives << " (pid " << pid << ") " << describe(status) << "\n"
                    << test::read_file(log);
                break;  // finished before the kill
            }
            kill(pid, SIGKILL);
            const pid_t waited = waitpid(pid, &status, 0);
            ASSERT_EQ(waited, pid) << "waitpid: " << std::strerror(errno);
            if (WIFSIGNALED(status))
                ++kills;
            else
                ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
                    << "life " << lives << " (pid " << pid << ") " << describe(status) << " before the kill\n"
                    << test::read_file(log);
            if (WIFEXITED(status)) break;
        }
        ++cycles;
        EXPECT_EQ(metrics(run / "metrics.jsonl"), ref_metrics) << "cycle " << cycles;
        EXPECT_TRUE(test::read_file(run / "model.safetensors") == ref_weights)
            << "cycle " << cycles << ": weights differ";
        EXPECT_TRUE(fs::exists(run / "config.json"));
        const auto elapsed = std::chrono::steady_clock::now() - t_start;
        ASSERT_LT(elapsed, std::chrono::minutes(8)) << "kill test too slow";
    }
    std::printf("kill test: %d SIGKILLs survived over %d complete runs, each equal to the uninterrupted run\n", kills,
                cycles);
    RecordProperty("kills", kills);
}

}  // namespace
