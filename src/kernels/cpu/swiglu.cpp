// SwiGLU on a fused gate/up row, fp32 CPU reference:
//   out = silu(g) ⊙ u,   silu(g) = g · σ(g),  σ(g) = 1 / (1 + exp(−g))
//   dg = dout · u · σ(g) · (1 + g · (1 − σ(g))),   du = dout · silu(g)      (dinp written, not +=)
// Large |g| is safe: exp(−g) overflows to inf for g ≪ 0, which gives σ = 0 and silu = −0.
#include "kernels/cpu/swiglu.h"

#include <cmath>

#include "core/check.h"

namespace mf::cpu {

void swiglu_forward(float* out, const float* inp, int64_t N, int64_t I) {
    MF_CHECK(N >= 0 && I >= 0, "swiglu: negative shape N=", N, " I=", I);
    for (int64_t n = 0; n < N; ++n) {
        const float* gate = inp + n * 2 * I;
        const float* up = gate + I;
        float* y = out + n * I;
        for (int64_t i = 0; i < I; ++i) {
            const float g = gate[i];
            y[i] = g / (1.0f + std::exp(-g)) * up[i];
        }
    }
}

void swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t I) {
    MF_CHECK(N >= 0 && I >= 0, "swiglu: negative shape N=", N, " I=", I);
    for (int64_t n = 0; n < N; ++n) {
        const float* gate = inp + n * 2 * I;
        const float* up = gate + I;
        const float* dy = dout + n * I;
        float* dgate = dinp + n * 2 * I;
        float* dup = dgate + I;
        for (int64_t i = 0; i < I; ++i) {
            const float g = gate[i];
            const float sig = 1.0f / (1.0f + std::exp(-g));
            const float silu = g * sig;
            dgate[i] = dy[i] * up[i] * (sig * (1.0f + g * (1.0f - sig)));
            dup[i] = dy[i] * silu;
        }
    }
}

}  // namespace mf::cpu
