// RMSNorm, fp32 CPU reference, computed as Qwen3 (HF) does it:
//   var = mean(x²);  rstd = 1 / sqrt(var + eps);  out = weight ⊙ (x · rstd)
// Backward, with x̂ = x · rstd and g = dout ⊙ weight:
//   dinp  += rstd · (g − x̂ · mean(g ⊙ x̂))
//   dweight += Σ_n dout[n] ⊙ x̂[n]           rows added in order n = 0..N-1
// Row sums (Σx², Σ g·x̂) use lane_dot (kernels/cpu/lane_dot.h: interleaved fp32 partial sums
// combined by a fixed tree), so they vectorise and give the same bits on every run. out may alias
// inp (each element is read before the same element is written, after the row sum is done).
#include "kernels/cpu/rmsnorm.h"

#include <cmath>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
    MF_CHECK(N >= 0 && C > 0, "rmsnorm: bad shape N=", N, " C=", C);
    for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C;
        float* y = out + n * C;
        const float var = lane_dot(x, x, C) / static_cast<float>(C);
        const float r = 1.0f / std::sqrt(var + eps);
        rstd[n] = r;
        for (int64_t c = 0; c < C; ++c) y[c] = weight[c] * (x[c] * r);
    }
}

void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C > 0, "rmsnorm: bad shape N=", N, " C=", C);
    std::vector<float> x_hat(static_cast<size_t>(C));
    std::vector<float> g(static_cast<size_t>(C));
    for (int64_t n = 0; n < N; ++n) {
        const float* x = inp + n * C;
        const float* dy = dout + n * C;
        const float r = rstd[n];
        for (int64_t c = 0; c < C; ++c) {
            x_hat[c] = x[c] * r;
            g[c] = dy[c] * weight[c];
        }
        if (dweight != nullptr) {
            for (int64_t c = 0; c < C; ++c) dweight[c] += dy[c] * x_hat[c];
        }
        if (dinp != nullptr) {
            const float mean_gx = lane_dot(g.data(), x_hat.data(), C) / static_cast<float>(C);
            float* dx = dinp + n * C;
            for (int64_t c = 0; c < C; ++c) dx[c] += r * (g[c] - x_hat[c] * mean_gx);
        }
    }
}

}  // namespace mf::cpu
