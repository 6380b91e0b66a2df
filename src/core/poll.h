// The pause between two polls of a device or network condition (a stream query, an NCCL state):
// none during the first kPollSpinSeconds of a wait, so a wait that ends soon returns at once,
// then a short sleep. A sleep of a few microseconds lasts ~60-80 µs on Linux (timer slack), which
// the host-side plan of every EP layer paid several times per layer while the GPU sat idle.
#pragma once

#include <chrono>
#include <thread>

namespace mf {

constexpr double kPollSpinSeconds = 2e-3;

inline void poll_pause(double waited_s) {
    if (waited_s < kPollSpinSeconds) return;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
}

}  // namespace mf
