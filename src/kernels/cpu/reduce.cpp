// Reductions for the optimizer, CPU reference:
//   sum_squares   Σ x² with each square formed in double and added in index order
//   scale_inplace x ← x · s
//   all_finite    no NaN and no ±inf
// A single sequential pass each, so results are deterministic.
#include "kernels/cpu/reduce.h"

#include <cmath>

#include "core/check.h"

namespace mf::cpu {

double sum_squares(const float* x, int64_t n) {
    MF_CHECK(n >= 0, "sum_squares: negative element count ", n);
    double sum = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        const double value = x[i];
        sum += value * value;
    }
    return sum;
}

void scale_inplace(float* x, float s, int64_t n) {
    MF_CHECK(n >= 0, "scale_inplace: negative element count ", n);
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

bool all_finite(const float* x, int64_t n) {
    MF_CHECK(n >= 0, "all_finite: negative element count ", n);
    bool finite = true;
    for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(x[i]);
    return finite;
}

}  // namespace mf::cpu
