// Graceful interruption: SIGINT and SIGTERM (what a terminal's Ctrl-C and SLURM preemption send)
// become a request the training loop polls, instead of killing the process mid-write.
//
//   - install() blocks SIGINT and SIGTERM in the calling thread (so in every thread started after
//     it, which inherit the mask) and starts one watcher thread that takes them with sigwait().
//     Call it first thing, before any other thread exists.
//   - The first signal sets the request: requested_signal() returns it. The loop finishes its step,
//     saves, and exits with 128 + signal (130 for SIGINT, 143 for SIGTERM).
//   - A second signal, arriving at least kRepeatWindowSeconds after the first, exits at once: the
//     watcher runs the abort hook (which removes this process's temporary files, see
//     io::remove_temporaries) and calls _exit(128 + signal). Repeats inside the window count as the
//     same request: under a launcher, SLURM or a terminal one interruption often reaches a process
//     twice (directly and forwarded).
//   - uninstall() (or process exit) stops the watcher and restores the mask; child processes started
//     while installed must unblock the signals themselves (a blocked mask survives execve).
// The watcher is a normal thread, not a signal handler, so the abort hook may take locks and
// call into the file system.
#pragma once

namespace mf::interrupt {

constexpr double kRepeatWindowSeconds = 1.0;

using AbortHook = void (*)();

void install(AbortHook on_abort);
void uninstall();

// install() for the lifetime of a scope (uninstall() on the way out, error or not).
class Scope {
 public:
    explicit Scope(AbortHook on_abort) { install(on_abort); }
    ~Scope() { uninstall(); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;
};

// 0 while no signal arrived, else the first signal's number.
int requested_signal();

// For tests: behave as if `sig` had arrived (first request only; no abort).
void request(int sig);

// "SIGINT" / "SIGTERM" / "signal N".
const char* signal_name(int sig);

}  // namespace mf::interrupt
