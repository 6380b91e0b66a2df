// Squared ReLU, fp32 CPU reference: r = max(x, 0) (relu(NaN) = NaN, as torch), out = r · r,
// dinp = dout · (2 · r). One read of each input before the write, so outputs may alias inputs.
#include "kernels/cpu/relu2.h"

#include <cmath>

#include "core/check.h"

namespace mf::cpu {

namespace {
float relu(float x) { return x > 0.0f || std::isnan(x) ? x : 0.0f; }
}  // namespace

void relu2_forward(float* out, const float* inp, int64_t n) {
    MF_CHECK(n >= 0, "relu2_forward: n = ", n, " is negative");
    for (int64_t i = 0; i < n; ++i) {
        const float r = relu(inp[i]);
        out[i] = r * r;
    }
}

void relu2_backward(float* dinp, const float* dout, const float* inp, int64_t n) {
    MF_CHECK(n >= 0, "relu2_backward: n = ", n, " is negative");
    for (int64_t i = 0; i < n; ++i) {
        const float r = relu(inp[i]);
        dinp[i] = dout[i] * (2.0f * r);
    }
}

}  // namespace mf::cpu
