// Multi-process test harness for the dist tests: forks N ranks of the current test process on
// loopback, each running a function, and collects each rank's exit status, its output or error
// message and how long it ran. Checks inside a rank throw (rank_check), since gtest assertions do not
// cross a fork; the parent asserts on the collected results.
#pragma once

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "parallel/tcp_communicator.h"

namespace mf::test {

struct RankResult {
    int exit_code = -1;  // -1: killed by the harness after the deadline
    std::string output;  // what the rank function returned, or the error message
    double seconds = 0;  // from the fork to the exit
};

// A TCP port on 127.0.0.1 that was free a moment ago.
inline int free_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    socklen_t len = sizeof addr;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    return ntohs(addr.sin_port);
}

inline void rank_check(bool ok, const std::string& what) {
    if (!ok) throw Error("check failed: " + what);
}

using RankFn = std::function<std::string(int rank)>;

// Forks `n` processes running fn(rank); a rank that throws exits 1 with the message as output.
// Ranks still running after deadline_s are killed (exit_code -1), and so is `hung_rank` as soon as
// every other rank has exited.
inline std::vector<RankResult> run_processes(int n, const RankFn& fn, double deadline_s = 30, int hung_rank = -1) {
    namespace fs = std::filesystem;
    const fs::path dir =
        fs::temp_directory_path() / ("mf_dist_" + std::to_string(::getpid()) + "_" +
                                     std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    fs::create_directories(dir);
    std::fflush(nullptr);
    const auto start = std::chrono::steady_clock::now();
    std::vector<pid_t> pids(n);
    for (int r = 0; r < n; ++r) {
        pids[r] = ::fork();
        if (pids[r] == 0) {
            int code = 0;
            std::string out;
            try {
                out = fn(r);
            } catch (const std::exception& e) {
                out = e.what();
                code = 1;
            }
            std::ofstream(dir / std::to_string(r)) << out;
            std::fflush(nullptr);
            ::_exit(code);
        }
    }
    std::vector<RankResult> results(n);
    std::vector<bool> done(n, false);
    int remaining = n;
    while (remaining > 0) {
        const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        for (int r = 0; r < n; ++r) {
            if (done[r]) continue;
            int status = 0;
            const pid_t got = ::waitpid(pids[r], &status, WNOHANG);
            if (got == pids[r]) {
                done[r] = true;
                --remaining;
                results[r].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
                results[r].seconds = elapsed;
            } else if (elapsed > deadline_s || (r == hung_rank && remaining == 1)) {
                ::kill(pids[r], SIGKILL);
                ::waitpid(pids[r], &status, 0);
                done[r] = true;
                --remaining;
                results[r].exit_code = -1;
                results[r].seconds = elapsed;
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (int r = 0; r < n; ++r) {
        std::ifstream in(dir / std::to_string(r));
        results[r].output.assign(std::istreambuf_iterator<char>(in), {});
    }
    fs::remove_all(dir);
    return results;
}

// Same, each rank first joining a TcpCommunicator world of n on 127.0.0.1.
using CommFn = std::function<std::string(parallel::Communicator& comm)>;
inline std::vector<RankResult> run_ranks(int n, double timeout_s, const CommFn& fn, double deadline_s = 30,
                                         int hung_rank = -1) {
    const int port = free_port();
    return run_processes(
        n,
        [&](int rank) {
            parallel::DistEnv env;
            env.rank = rank;
            env.world_size = n;
            env.local_rank = rank;
            env.master_addr = "127.0.0.1";
            env.master_port = port;
            parallel::TcpCommunicator comm(env, timeout_s);
            return fn(comm);
        },
        deadline_s, hung_rank);
}

}  // namespace mf::test
