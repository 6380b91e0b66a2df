// Reductions used by the optimizer: sum of squares (for the global gradient norm) and scaling.
#pragma once

#include <cstdint>

namespace mf::cpu {

// Σ x² accumulated in double, in index order (deterministic).
double sum_squares(const float* x, int64_t n);
void scale_inplace(float* x, float s, int64_t n);
// True when every element is finite.
bool all_finite(const float* x, int64_t n);

}  // namespace mf::cpu
