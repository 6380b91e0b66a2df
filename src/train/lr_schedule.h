// Learning-rate schedules, with the conventions of Hugging Face transformers
// (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup with num_cycles = 0.5,
// get_linear_schedule_with_warmup), so a recipe gives the curve an HF user expects.
//
// For optimizer step s = 0 .. T-1 (T = total_steps, W = optim.warmup_steps) the learning rate is
// lr * multiplier(s), where
//
//   warm-up (s < W):  s / max(1, W)                         (so step 0 runs at lr 0 when W > 0, as in HF)
//   after warm-up:    constant: d = 1
//                     cosine:   p = (s - W) / max(1, T - W),  d = max(0, 0.5 * (1 + cos(pi * p)))
//                     linear:   d = max(0, (T - s) / max(1, T - W))
//                     multiplier = r + (1 - r) * d,          r = optim.min_lr_ratio
//
// min_lr_ratio is our addition: a floor under the decay only (r = 0 gives HF exactly); warm-up
// still starts from 0. Note that HF's curves end above 0 at the last step (linear: lr / (T - W),
// cosine: just above r * lr), because the step that would reach 0 is step T, never taken.
#pragma once

#include <cstdint>

#include "train/recipe.h"

namespace mf::train {

// The multiplier above; requires total_steps >= 1 and 0 <= step <= total_steps. Step T is never
// taken; its value (where the schedule ends: min_lr_ratio for cosine and linear) is what a
// checkpoint at the last step records as its next rate, so extending a finished run is compared
// against it (train/checkpoint.h).
double lr_multiplier(const Recipe::Optim& optim, int64_t step, int64_t total_steps);

// The learning rate used by optimizer step `step`: optim.lr * lr_multiplier(...).
double lr_at(const Recipe::Optim& optim, int64_t step, int64_t total_steps);

}  // namespace mf::train
