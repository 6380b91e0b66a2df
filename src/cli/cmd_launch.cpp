// moeforge launch: start one process per GPU (or CPU rank) on this node, torchrun-style.
//
//   moeforge launch --nproc-per-node N [--nnodes M --node-rank R --master-addr A --master-port P]
//                   [--program PATH] -- SUBCOMMAND ARGS...
//
// Each child runs this same binary with SUBCOMMAND ARGS (or PATH ARGS with --program, for other
// executables such as test workers), with RANK = R*N + local rank, WORLD_SIZE = M*N, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and NCCL_NVLS_ENABLE=0 set. On one node without
// --master-port (and no MASTER_PORT in the environment) a free loopback port is chosen.
// SIGINT/SIGTERM are forwarded to every child, each time one arrives: the first lets the ranks
// finish their step and save a checkpoint together (core/interrupt.h), so they get
// kInterruptGraceSeconds before SIGKILL, and a rank that exits with 128 + that signal is stopping
// as asked, not failing; a second one makes them exit at once. When a child fails, the others get
// SIGTERM (SIGKILL after kGraceSeconds). The exit status is the first non-zero one (128 + signal for
// a child killed by a signal), else 0. Children also die with the launcher (PR_SET_PDEATHSIG).
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "core/check.h"

extern char** environ;

namespace mf::cli {

namespace {

constexpr double kGraceSeconds = 10.0;
constexpr double kInterruptGraceSeconds = 900.0;  // a step plus a checkpoint of a large model
volatile sig_atomic_t g_signal = 0;
volatile sig_atomic_t g_signal_count = 0;

void on_signal(int sig) {
    g_signal = sig;
    g_signal_count = g_signal_count + 1;
}

int parse_count(const std::string& option, const std::string& value, int lo, int hi) {
    if (value.empty() || value.size() > 9 || value.find_first_not_of("0123456789") != std::string::npos)
        fail("launch: --", option, " '", value, "': expected an integer in [", lo, ", ", hi, "]");
    const int v = std::stoi(value);
    if (v < lo || v > hi) fail("launch: --", option, " ", v, ": expected an integer in [", lo, ", ", hi, "]");
    return v;
}

int free_loopback_port() {
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    MF_CHECK(fd >= 0, "socket: ", std::strerror(errno));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof addr;
    const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    ::close(fd);
    MF_CHECK(ok, "cannot find a free port: ", std::strerror(errno));
    return ntohs(addr.sin_port);
}

int status_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

}  // namespace

int cmd_launch(const Args& args) {
    // Options up to "--"; everything after is the child's command line.
    Args options, child_args;
    bool seen_separator = false;
    for (const std::string& a : args) {
        if (!seen_separator && a == "--") {
            seen_separator = true;
            continue;
        }
        (seen_separator ? child_args : options).push_back(a);
    }
    int nproc = 0, nnodes = 1, node_rank = 0, master_port = 0;
    std::string master_addr = "127.0.0.1", program;
    for (size_t i = 0; i < options.size(); ++i) {
        std::string name = options[i], value;
        if (name.rfind("--", 0) != 0) fail("launch: unexpected argument '", name, "' (the command goes after --)");
        name = name.substr(2);
        const size_t eq = name.find('=');
        if (eq != std::string::npos) {
            value = name.substr(eq + 1);
            name = name.substr(0, eq);
        } else {
            if (i + 1 >= options.size()) fail("launch: option --", name, " needs a value");
            value = options[++i];
        }
        if (name == "nproc-per-node")
            nproc = parse_count(name, value, 1, 1024);
        else if (name == "nnodes")
            nnodes = parse_count(name, value, 1, 65536);
        else if (name == "node-rank")
            node_rank = parse_count(name, value, 0, 65535);
        else if (name == "master-addr")
            master_addr = value;
        else if (name == "master-port")
            master_port = parse_count(name, value, 1, 65535);
        else if (name == "program")
            program = value;
        else
            fail("launch: unknown option --", name);
    }
    if (nproc == 0) fail("launch: missing required option --nproc-per-node");
    if (node_rank >= nnodes) fail("launch: --node-rank ", node_rank, " must be below --nnodes ", nnodes);
    if (!seen_separator || child_args.empty())
        fail("launch: missing the command to run, e.g. `moeforge launch --nproc-per-node 2 -- finetune RECIPE.yaml`");
    if (master_addr.empty()) fail("launch: --master-addr is empty");
    if (master_port == 0) {
        const char* env_port = std::getenv("MASTER_PORT");
        if (env_port != nullptr && env_port[0] != '\0')
            master_port = parse_count("master-port (MASTER_PORT)", env_port, 1, 65535);
        else
            master_port = nnodes == 1 ? free_loopback_port() : 29500;
    }
    if (program.empty()) {
        char self[4096];
        const ssize_t len = ::readlink("/proc/self/exe", self, sizeof self - 1);
        MF_CHECK(len > 0, "launch: cannot find this binary: ", std::strerror(errno));
        self[len] = '\0';
        program = self;
    } else if (::access(program.c_str(), X_OK) != 0) {
        fail("launch: --program '", program, "' is not an executable file");
    }
    const int world_size = nnodes * nproc;

    // Everything the children need is built before fork (no allocation between fork and exec).
    std::vector<std::vector<std::string>> envs(nproc);
    const char* overridden[] = {"RANK=",        "WORLD_SIZE=",  "LOCAL_RANK=",      "LOCAL_WORLD_SIZE=",
                                "MASTER_ADDR=", "MASTER_PORT=", "NCCL_NVLS_ENABLE="};
    for (int local = 0; local < nproc; ++local) {
        for (char** e = environ; *e != nullptr; ++e) {
            bool keep = true;
            for (const char* o : overridden) keep = keep && std::strncmp(*e, o, std::strlen(o)) != 0;
            if (keep) envs[local].push_back(*e);
        }
        envs[local].push_back("RANK=" + std::to_string(node_rank * nproc + local));
        envs[local].push_back("WORLD_SIZE=" + std::to_string(world_size));
        envs[local].push_back("LOCAL_RANK=" + std::to_string(local));
        envs[local].push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
        envs[local].push_back("MASTER_ADDR=" + master_addr);
        envs[local].push_back("MASTER_PORT=" + std::to_string(master_port));
        // NVLink SHARP multicast stays off (it needs fabric-manager support our machines lack).
        envs[local].push_back("NCCL_NVLS_ENABLE=0");
    }
    std::vector<char*> argv;
    argv.push_back(program.data());
    for (std::string& a : child_args) argv.push_back(a.data());
    argv.push_back(nullptr);
    std::vector<std::vector<char*>> envps(nproc);
    for (int local = 0; local < nproc; ++local) {
        for (std::string& e : envs[local]) envps[local].push_back(e.data());
        envps[local].push_back(nullptr);
    }

    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    struct sigaction old_int {
    }, old_term{};
    ::sigaction(SIGINT, &sa, &old_int);
    ::sigaction(SIGTERM, &sa, &old_term);
    const pid_t launcher = ::getpid();
    std::fflush(nullptr);

    std::vector<pid_t> pids(nproc, -1);
    std::vector<bool> running(nproc, false);
    int num_running = 0;
    int result = 0;
    for (int local = 0; local < nproc; ++local) {
        const pid_t pid = ::fork();
        if (pid == 0) {
            ::sigaction(SIGINT, &old_int, nullptr);
            ::sigaction(SIGTERM, &old_term, nullptr);
            ::prctl(PR_SET_PDEATHSIG, SIGTERM);
            if (::getppid() != launcher) ::_exit(1);  // the launcher died before prctl took effect
            ::execve(argv[0], argv.data(), envps[local].data());
            std::fprintf(stderr, "moeforge launch: cannot execute %s: %s\n", argv[0], std::strerror(errno));
            ::_exit(127);
        }
        if (pid < 0) {
            std::fprintf(stderr, "moeforge launch: fork failed: %s\n", std::strerror(errno));
            result = 1;
            for (int started = 0; started < local; ++started) ::kill(pids[started], SIGTERM);
            break;
        }
        pids[local] = pid;
        running[local] = true;
        ++num_running;
    }

    int forwarded = 0;         // how many signals were forwarded
    int interrupt_signal = 0;  // the first forwarded signal (0: none)
    double kill_deadline = 0;  // when to SIGKILL the survivors (0: not yet stopping)
    auto stop_all = [&](int sig, double grace) {
        for (int local = 0; local < nproc; ++local)
            if (running[local]) ::kill(pids[local], sig);
        if (kill_deadline == 0) kill_deadline = now_s() + grace;
    };
    while (num_running > 0) {
        if (g_signal_count != forwarded) {
            forwarded = g_signal_count;
            const int sig = g_signal;
            if (interrupt_signal == 0) interrupt_signal = sig;
            std::fprintf(stderr, "moeforge launch: got signal %d, forwarding it to %d rank(s)%s\n", sig, num_running,
                         forwarded > 1 ? " (again: they stop at once)" : "");
            if (result == 0) result = 128 + sig;
            stop_all(sig, kInterruptGraceSeconds);
        }
        if (kill_deadline != 0 && now_s() > kill_deadline) {
            std::fprintf(stderr, "moeforge launch: %d rank(s) still running after %g s; killing them\n", num_running,
                         kGraceSeconds);
            for (int local = 0; local < nproc; ++local)
                if (running[local]) ::kill(pids[local], SIGKILL);
            kill_deadline = now_s() + 3600;  // SIGKILL once
        }
        int status = 0;
        const pid_t pid = ::waitpid(-1, &status, WNOHANG);
        if (pid <= 0) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            continue;
        }
        for (int local = 0; local < nproc; ++local) {
            if (pids[local] != pid || !running[local]) continue;
            running[local] = false;
            --num_running;
            const int code = status_code(status);
            if (code != 0 && interrupt_signal != 0 && code == 128 + interrupt_signal) continue;  // stopped as asked
            if (code != 0 && result == 0) {
                result = code;
                std::fprintf(
                    stderr,
                    "moeforge launch: rank %d (local %d, pid %d) exited with status %d; stopping the other ranks\n",
                    node_rank * nproc + local, local, static_cast<int>(pid), code);
                stop_all(SIGTERM, kGraceSeconds);
            }
        }
    }
    ::sigaction(SIGINT, &old_int, nullptr);
    ::sigaction(SIGTERM, &old_term, nullptr);
    return result;
}

}  // namespace mf::cli
