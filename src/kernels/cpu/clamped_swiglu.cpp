// gpt-oss's clamped, interleaved SwiGLU, fp32 CPU reference (spec: clamped_swiglu.h). The clamps are
// written as comparisons so that a NaN passes through them (torch.clamp keeps NaN); σ(z) = 1 / (1 +
// exp(−z)), safe for large |z| (exp overflow gives σ = 0). Each element pair is read before its
// gradients are written, so dinp may alias inp.
#include "kernels/cpu/clamped_swiglu.h"

#include <cmath>

#include "core/check.h"

namespace mf::cpu {

namespace {

float clamp_max(float x, float hi) { return x > hi ? hi : x; }
float clamp_both(float x, float lo, float hi) { return x > hi ? hi : (x < lo ? lo : x); }
float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

void check_shape(const char* op, int64_t N, int64_t I) {
    MF_CHECK(N >= 0 && I >= 0, op, ": negative shape N = ", N, ", I = ", I);
}

}  // namespace

void clamped_swiglu_forward(float* out, const float* inp, int64_t N, int64_t I, float alpha, float limit) {
    check_shape("clamped_swiglu_forward", N, I);
    for (int64_t n = 0; n < N; ++n) {
        const float* row = inp + n * 2 * I;
        for (int64_t i = 0; i < I; ++i) {
            const float g = clamp_max(row[2 * i], limit);
            const float u = clamp_both(row[2 * i + 1], -limit, limit);
            out[n * I + i] = (u + 1.0f) * (g * sigmoid(alpha * g));
        }
    }
}

void clamped_swiglu_backward(float* dinp, const float* dout, const float* inp, int64_t N, int64_t I, float alpha,
                             float limit) {
    check_shape("clamped_swiglu_backward", N, I);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t i = 0; i < I; ++i) {
            const int64_t at = n * 2 * I + 2 * i;
            const float gate = inp[at], up = inp[at + 1], dy = dout[n * I + i];
            const float g = clamp_max(gate, limit);
            const float u = clamp_both(up, -limit, limit);
            const float s = sigmoid(alpha * g);
            const float dg = dy * (u + 1.0f) * (s * (1.0f + alpha * g * (1.0f - s)));
            const float du = dy * (g * s);
            dinp[at] = gate <= limit ? dg : 0.0f;
            dinp[at + 1] = up >= -limit && up <= limit ? du : 0.0f;
        }
    }
}

}  // namespace mf::cpu
