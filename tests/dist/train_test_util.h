// Helpers for the dist tests that train through the binary: read a run's metrics.jsonl, an HF
// directory's weights or a training checkpoint's tensors, and compare two runs within stated
// tolerances (per-step metrics relative, final weights by relative L2 distance over all tensors).
#pragma once

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/json.h"
#include "dist_test_util.h"
#include "io/safetensors.h"
#include "test_util.h"

namespace mf::test {

inline std::string bin() { return moeforge_binary(); }
inline std::string repo() { return (std::filesystem::path(fixtures_dir()) / ".." / "..").lexically_normal().string(); }

inline std::vector<json::Value> read_metrics(const std::filesystem::path& file) {
    std::vector<json::Value> out;
    std::istringstream in(test::read_file(file));
    std::string line;
    while (std::getline(in, line)) out.push_back(json::parse(line, file.string()));
    return out;
}

// All weights of an HF directory, by name, as f32.
inline std::map<std::string, std::vector<float>> read_weights(const std::filesystem::path& dir) {
    const io::ModelWeights w = io::ModelWeights::open(dir);
    std::map<std::string, std::vector<float>> out;
    for (const std::string& name : w.names()) {
        const io::StTensor* t = w.find(name);
        int64_t n = 1;
        for (const int64_t d : t->shape) n *= d;
        std::vector<float> v(static_cast<size_t>(n));
        w.read_f32(name, t->shape, v.data());
        out[name] = std::move(v);
    }
    return out;
}

// ||a - b|| / ||b|| over all tensors together.
inline double rel_l2(const std::map<std::string, std::vector<float>>& a,
                     const std::map<std::string, std::vector<float>>& b) {
    double diff = 0, norm = 0;
    for (const auto& [name, vb] : b) {
        const auto it = a.find(name);
        if (it == a.end() || it->second.size() != vb.size()) return INFINITY;
        for (size_t i = 0; i < vb.size(); ++i) {
            const double d = static_cast<double>(it->second[i]) - vb[i];
            diff += d * d;
            norm += static_cast<double>(vb[i]) * vb[i];
        }
    }
    return std::sqrt(diff / norm);
}

inline bool close_rel(double a, double b, double tol) { return std::fabs(a - b) <= tol * std::max(std::fabs(b), 1e-6); }
// A training checkpoint's state, whole: every shard's "KIND/NAME@OFFSET" pieces put back into
// "KIND/NAME" tensors (flattened).
inline std::map<std::string, std::vector<float>> read_checkpoint(const std::filesystem::path& dir) {
    std::map<std::string, std::vector<float>> out;
    for (const auto& entry : std::filesystem::directory_iterator(dir)) {
        if (entry.path().extension() != ".safetensors") continue;
        const io::SafetensorsFile f = io::SafetensorsFile::open(entry.path());
        for (const io::StTensor& t : f.tensors()) {
            const size_t at = t.name.rfind('@');
            const std::string name = t.name.substr(0, at);
            const size_t offset = std::stoull(t.name.substr(at + 1));
            std::vector<float>& v = out[name];
            const size_t n = t.nbytes / sizeof(float);
            if (v.size() < offset + n) v.resize(offset + n);
            if (n > 0) std::memcpy(v.data() + offset, t.data, t.nbytes);
        }
    }
    return out;
}

// The state of two training checkpoints: relative L2 distance over all.
inline double checkpoint_rel_l2(const std::filesystem::path& a, const std::filesystem::path& b) {
    return rel_l2(read_checkpoint(a), read_checkpoint(b));
}

struct TrainTolerance {
    double metric_rel;     // per-step loss, ce_loss, aux_loss, grad_norm
    double weight_rel_l2;  // final weights
};

// Per-step metrics and final weights of run `a` against run `b`.
inline void expect_same_training(const std::filesystem::path& a_dir, const std::filesystem::path& b_dir, int steps,
                                 TrainTolerance tol) {
    const auto a = read_metrics(a_dir / "metrics.jsonl");
    const auto b = read_metrics(b_dir / "metrics.jsonl");
    ASSERT_EQ(a.size(), static_cast<size_t>(steps));
    ASSERT_EQ(b.size(), static_cast<size_t>(steps));
    for (size_t i = 0; i < a.size(); ++i) {
        for (const char* key : {"loss", "ce_loss", "aux_loss", "grad_norm"}) {
            const double x = a[i].find(key)->as_double(), y = b[i].find(key)->as_double();
            EXPECT_TRUE(close_rel(x, y, tol.metric_rel)) << a_dir.filename() << " vs " << b_dir.filename() << " step "
                                                         << i + 1 << " " << key << ": " << x << " vs " << y;
        }
        EXPECT_EQ(a[i].find("tokens")->as_int(), b[i].find("tokens")->as_int()) << "step " << i + 1;
    }
    const double dist = rel_l2(read_weights(a_dir), read_weights(b_dir));
    EXPECT_LE(dist, tol.weight_rel_l2) << a_dir.filename() << " vs " << b_dir.filename();
    std::printf("%s vs %s: final weights rel L2 %.3g\n", a_dir.filename().c_str(), b_dir.filename().c_str(), dist);
}

// Metrics of steps from+1..steps of `resumed` (resumed at step `from`) against the same steps of
// `full`, and the final weights.
inline void expect_same_tail(const std::filesystem::path& resumed_dir, const std::filesystem::path& full_dir, int steps,
                             int from, TrainTolerance tol) {
    const auto full = read_metrics(full_dir / "metrics.jsonl");
    const auto resumed = read_metrics(resumed_dir / "metrics.jsonl");
    ASSERT_EQ(full.size(), static_cast<size_t>(steps));
    ASSERT_EQ(resumed.size(), static_cast<size_t>(steps - from));
    for (size_t i = 0; i < resumed.size(); ++i) {
        const size_t j = i + static_cast<size_t>(from);
        EXPECT_EQ(resumed[i].find("step")->as_int(), full[j].find("step")->as_int());
        for (const char* key : {"loss", "ce_loss", "grad_norm"}) {
            const double x = resumed[i].find(key)->as_double(), y = full[j].find(key)->as_double();
            EXPECT_TRUE(close_rel(x, y, tol.metric_rel)) << resumed_dir.filename() << " vs " << full_dir.filename()
                                                         << " step " << j + 1 << " " << key << ": " << x << " vs " << y;
        }
    }
    EXPECT_LE(rel_l2(read_weights(resumed_dir), read_weights(full_dir)), tol.weight_rel_l2);
}

// Two ranks started by hand (no launcher, which would stop the survivor itself); once rank 0 has
// logged steps, rank 1 gets `sig`. Returns rank 0's exit status and the seconds it took to exit.
struct PeerFailure {
    int status = -1;
    double seconds = 0;
    std::string log;
};
inline PeerFailure run_and_signal_rank1(const std::filesystem::path& dir, const std::string& args, int sig) {
    const int port = free_port();
    pid_t pids[2];
    for (int r = 0; r < 2; ++r) {
        const std::string cmd = "RANK=" + std::to_string(r) + " WORLD_SIZE=2 LOCAL_RANK=" + std::to_string(r) +
                                " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " exec " + bin() + " " +
                                args + " >" + (dir / ("rank" + std::to_string(r) + ".log")).string() + " 2>&1";
        pids[r] = ::fork();
        if (pids[r] == 0) {
            ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
            ::_exit(127);
        }
    }
    PeerFailure result;
    const auto started = std::chrono::steady_clock::now();
    bool training = false;
    while (!training && std::chrono::steady_clock::now() - started < std::chrono::seconds(30)) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const std::filesystem::path metrics = dir / "out" / "metrics.jsonl";
        try {
            training = std::filesystem::exists(metrics) && read_metrics(metrics).size() >= 2;
        } catch (const Error&) {  // a line being written
        }
    }
    ::kill(pids[1], training ? sig : SIGKILL);
    const auto signalled_at = std::chrono::steady_clock::now();
    pid_t done = 0;
    while ((done = ::waitpid(pids[0], &result.status, WNOHANG)) == 0 &&
           std::chrono::steady_clock::now() - signalled_at < std::chrono::seconds(30))
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
    result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled_at).count();
    if (done == 0) {
        ::kill(pids[0], SIGKILL);
        ::waitpid(pids[0], nullptr, 0);
        result.status = -1;
    }
    ::kill(pids[1], SIGKILL);
    ::waitpid(pids[1], nullptr, 0);
    result.log = read_file(dir / "rank0.log");
    if (!training) result.log = "rank 0 never logged 2 steps:\n" + result.log;
    return result;
}

}  // namespace mf::test
