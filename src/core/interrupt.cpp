// core/interrupt.h on POSIX: a sigwait() watcher thread over a blocked SIGINT/SIGTERM mask.
#include "core/interrupt.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

namespace mf::interrupt {

namespace {

std::atomic<int> g_requested{0};
std::atomic<bool> g_installed{false};
std::thread g_watcher;
sigset_t g_old_mask;
AbortHook g_on_abort = nullptr;

// SIGUSR2 is the watcher's private stop signal (sent by uninstall with pthread_kill).
sigset_t watched_set(bool with_stop) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    if (with_stop) sigaddset(&set, SIGUSR2);
    return set;
}

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

void watch() {
    const sigset_t set = watched_set(true);
    double first_at = 0;
    while (true) {
        int sig = 0;
        if (sigwait(&set, &sig) != 0) continue;
        if (sig == SIGUSR2) return;
        int expected = 0;
        if (g_requested.compare_exchange_strong(expected, sig)) {
            first_at = now_s();
            std::fprintf(stderr,
                         "moeforge: got %s: finishing the current step, then saving a checkpoint and stopping "
                         "(send it again to stop at once, without saving)\n",
                         signal_name(sig));
            std::fflush(stderr);
            continue;
        }
        if (now_s() - first_at < kRepeatWindowSeconds) continue;  // the same interruption, delivered twice
        std::fprintf(stderr, "moeforge: got %s again: stopping at once (no checkpoint)\n", signal_name(sig));
        std::fflush(nullptr);
        if (g_on_abort != nullptr) g_on_abort();
        ::_exit(128 + sig);
    }
}

}  // namespace

void install(AbortHook on_abort) {
    if (g_installed.exchange(true)) return;
    g_on_abort = on_abort;
    g_requested = 0;
    const sigset_t set = watched_set(true);
    pthread_sigmask(SIG_BLOCK, &set, &g_old_mask);
    g_watcher = std::thread(watch);
}

void uninstall() {
    if (!g_installed.exchange(false)) return;
    pthread_kill(g_watcher.native_handle(), SIGUSR2);
    g_watcher.join();
    // A repeat that arrived after the request may still be pending; take it rather than die on unblock.
    const sigset_t set = watched_set(true);
    const timespec zero{0, 0};
    while (sigtimedwait(&set, nullptr, &zero) > 0) {
    }
    pthread_sigmask(SIG_SETMASK, &g_old_mask, nullptr);
}

int requested_signal() { return g_requested.load(); }

void request(int sig) {
    int expected = 0;
    g_requested.compare_exchange_strong(expected, sig);
}

const char* signal_name(int sig) {
    if (sig == SIGINT) return "SIGINT";
    if (sig == SIGTERM) return "SIGTERM";
    static thread_local char buf[32];
    std::snprintf(buf, sizeof buf, "signal %d", sig);
    return buf;
}

}  // namespace mf::interrupt
