// Gated RMSNorm, fp32 CPU reference. Per token and group (size M = group_size), with σ the sigmoid:
//   forward   g = x · z·σ(z),  rstd = 1 / sqrt(Σ g² / M + eps),  ĝ = g · rstd,  out = weight · ĝ
//   backward  e = dout · weight,  dg = rstd · (e − ĝ · Σ(e · ĝ) / M)
//             dx = dg · z·σ(z),   dz = dg · x · σ(z) · (1 + z · (1 − σ(z))),   dweight += Σ_n dout · ĝ
// Group sums are lane_dot (kernels/cpu/lane_dot.h: fixed order); dweight's sum over tokens runs in
// double, n ascending, and is added once.
#include "kernels/cpu/gated_rmsnorm.h"

#include <cmath>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {

void check_shape(int64_t N, int64_t I, int64_t group_size) {
    MF_CHECK(N >= 0 && I >= 1 && group_size >= 1 && I % group_size == 0, "gated_rmsnorm: bad shape N=", N, " I=", I,
             " group_size=", group_size);
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// g = x · silu(z) over one group.
void gate(float* g, const float* x, const float* z, int64_t M) {
    for (int64_t c = 0; c < M; ++c) g[c] = x[c] * (z[c] * sigmoid(z[c]));
}

}  // namespace

void gated_rmsnorm_forward(float* out, float* rstd, const float* x, const float* z, const float* weight, int64_t N,
                           int64_t I, int64_t group_size, float eps) {
    check_shape(N, I, group_size);
    const int64_t M = group_size, groups = I / M;
    std::vector<float> g(static_cast<size_t>(M));
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t k = 0; k < groups; ++k) {
            const int64_t off = n * I + k * M;
            gate(g.data(), x + off, z + off, M);
            const float r = 1.0f / std::sqrt(lane_dot(g.data(), g.data(), M) / static_cast<float>(M) + eps);
            rstd[n * groups + k] = r;
            for (int64_t c = 0; c < M; ++c) out[off + c] = weight[k * M + c] * (g[c] * r);
        }
    }
}

void gated_rmsnorm_backward(float* dx, float* dz, float* dweight, const float* dout, const float* x, const float* z,
                            const float* weight, const float* rstd, int64_t N, int64_t I, int64_t group_size) {
    check_shape(N, I, group_size);
    const int64_t M = group_size, groups = I / M;
    std::vector<float> g_hat(static_cast<size_t>(M)), e(static_cast<size_t>(M));
    std::vector<double> dw(static_cast<size_t>(I), 0.0);
    for (int64_t n = 0; n < N; ++n) {
        for (int64_t k = 0; k < groups; ++k) {
            const int64_t off = n * I + k * M;
            const float r = rstd[n * groups + k];
            gate(g_hat.data(), x + off, z + off, M);
            for (int64_t c = 0; c < M; ++c) {
                g_hat[c] *= r;
                e[c] = dout[off + c] * weight[k * M + c];
                dw[k * M + c] += static_cast<double>(dout[off + c]) * g_hat[c];
            }
            const float mean_eg = lane_dot(e.data(), g_hat.data(), M) / static_cast<float>(M);
            for (int64_t c = 0; c < M; ++c) {
                const float dg = r * (e[c] - g_hat[c] * mean_eg);
                const float zc = z[off + c], sig = sigmoid(zc);
                dx[off + c] = dg * (zc * sig);
                dz[off + c] = dg * x[off + c] * sig * (1.0f + zc * (1.0f - sig));
            }
        }
    }
    for (int64_t c = 0; c < I; ++c) dweight[c] += static_cast<float>(dw[c]);
}

}  // namespace mf::cpu
