// Helpers for tests that run the binary in the background and signal it: start a shell command
// with its output in a file, wait (always bounded) for a condition or an exit.
#pragma once

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>

#include "test_util.h"

extern char** environ;

namespace mf::test {

// Starts `/bin/sh -c "exec CMD > LOG 2>&1"`; the pid is CMD's own (exec), so signals reach it.
inline pid_t spawn_shell(const std::string& cmd, const std::filesystem::path& log) {
    const std::string line = "exec " + cmd + " > " + log.string() + " 2>&1";
    const char* argv[] = {"/bin/sh", "-c", line.c_str(), nullptr};
    pid_t pid = -1;
    return posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char* const*>(argv), environ) == 0 ? pid : -1;
}

inline size_t count_lines(const std::filesystem::path& f) {
    const std::string s = read_file(f);
    return static_cast<size_t>(std::count(s.begin(), s.end(), '\n'));
}

// Polls `done` every 20 ms for at most `seconds`; its last value.
inline bool wait_for(const std::function<bool()>& done, double seconds) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    while (std::chrono::steady_clock::now() < until) {
        if (done()) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return done();
}

// Exit status of `pid` (128 + signal when killed), waiting at most `seconds`; after that the
// process is SIGKILLed and -1 returned.
inline int wait_exit(pid_t pid, double seconds) {
    int status = 0;
    if (!wait_for([&] { return waitpid(pid, &status, WNOHANG) == pid; }, seconds)) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return -1;
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace mf::test
