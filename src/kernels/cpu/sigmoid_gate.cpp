// Sigmoid-gated row, fp32 CPU reference, s = σ(g) = 1 / (1 + exp(−g)) per row:
//   forward   y[n, h] += s · value[n, h]
//   backward  dvalue[n, h] = s · dy[n, h]  (written),  dgate_logits[n] = s · (1 − s) · Σ_h dy·value  (written)
// The row sum is lane_dot (kernels/cpu/lane_dot.h: fixed order, the same bits on every run); it is
// taken before dvalue is written, so dvalue may alias dy. Large |g| is safe: exp(−g) = inf gives
// s = 0, and s = 1 gives s · (1 − s) = 0.
#include "kernels/cpu/sigmoid_gate.h"

#include <cmath>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {
float sigmoid(float g) { return 1.0f / (1.0f + std::exp(-g)); }
}  // namespace

void sigmoid_gate_forward(float* y, const float* value, const float* gate_logits, int64_t N, int64_t H) {
    MF_CHECK(N >= 0 && H >= 0, "sigmoid_gate: negative shape N=", N, " H=", H);
    for (int64_t n = 0; n < N; ++n) {
        const float s = sigmoid(gate_logits[n]);
        const float* v = value + n * H;
        float* out = y + n * H;
        for (int64_t h = 0; h < H; ++h) out[h] += s * v[h];
    }
}

void sigmoid_gate_backward(float* dvalue, float* dgate_logits, const float* dy, const float* value,
                           const float* gate_logits, int64_t N, int64_t H) {
    MF_CHECK(N >= 0 && H >= 0, "sigmoid_gate: negative shape N=", N, " H=", H);
    for (int64_t n = 0; n < N; ++n) {
        const float s = sigmoid(gate_logits[n]);
        const float* dy_row = dy + n * H;
        dgate_logits[n] = s * (1.0f - s) * lane_dot(dy_row, value + n * H, H);
        float* dv = dvalue + n * H;
        for (int64_t h = 0; h < H; ++h) dv[h] = s * dy_row[h];
    }
}

}  // namespace mf::cpu
