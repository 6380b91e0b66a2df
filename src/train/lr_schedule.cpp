// Learning-rate schedules (formulas and conventions in lr_schedule.h). Computed in double from
// integer step counts, so a resumed run gets bit-identical rates for the same step.
#include "train/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "core/check.h"

namespace mf::train {

double lr_multiplier(const Recipe::Optim& optim, int64_t step, int64_t total_steps) {
    MF_CHECK(total_steps >= 1, "lr schedule: total_steps must be >= 1, got ", total_steps);
    MF_CHECK(step >= 0 && step <= total_steps, "lr schedule: step ", step, " outside [0, ", total_steps, "]");
    MF_CHECK(optim.warmup_steps >= 0, "lr schedule: negative warmup_steps ", optim.warmup_steps);
    const int64_t warmup = optim.warmup_steps;
    if (step < warmup) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));

    double decay = 1.0;
    const double decay_steps = static_cast<double>(std::max<int64_t>(1, total_steps - warmup));
    if (optim.schedule == "constant") {
        decay = 1.0;
    } else if (optim.schedule == "cosine") {
        const double progress = static_cast<double>(step - warmup) / decay_steps;
        decay = std::max(0.0, 0.5 * (1.0 + std::cos(std::numbers::pi * progress)));
    } else if (optim.schedule == "linear") {
        decay = std::max(0.0, static_cast<double>(total_steps - step) / decay_steps);
    } else {
        fail("lr schedule: unknown schedule '", optim.schedule, "' (expected constant, cosine or linear)");
    }
    const double floor = optim.min_lr_ratio;
    return floor + (1.0 - floor) * decay;
}

double lr_at(const Recipe::Optim& optim, int64_t step, int64_t total_steps) {
    return optim.lr * lr_multiplier(optim, step, total_steps);
}

}  // namespace mf::train
