// Mamba-2 selective scan, fp32 CPU reference: the sequential recurrence, O(N·H·P·S), one (row, head)
// at a time, tokens in order (the chunked SSD of the GPU computes the same sums in another order).
// Forward (ssd_scan.h): a_n = exp(δ_n·A), state_n = a_n·state_{n−1} + δ_n·x_n⊗B_n, y_n = C_n·state_n + D·x_n.
// Backward: the reverse-time adjoint of the state, λ_n = ∂L/∂state_n (zero past a segment's last token):
//   λ_n     = dy_n ⊗ C_n + a_{n+1}·λ_{n+1}          (the second term only inside the segment)
//   dC_n[s] = Σ_p dy_n[p]·state_n[p, s]
//   dx_n[p] = D·dy_n[p] + δ_n·Σ_s λ_n[p, s]·B_n[s]
//   dB_n[s] = δ_n·Σ_p λ_n[p, s]·x_n[p]
//   q_n     = a_n·Σ_{p,s} λ_n[p, s]·state_{n−1}[p, s]           (state_{n−1} = 0 at a segment start)
//   dδ_n    = Σ_p x_n[p]·Σ_s λ_n[p, s]·B_n[s] + A·q_n,   dA = Σ_n δ_n·q_n,   dA_log = A·dA   (A = −exp(A_log))
//   ddt_n   = dδ_n · [dt_min <= softplus(u_n) <= dt_max] · σ(u_n),  u_n = dt_n + dt_bias (σ → 1 above 20)
//   ddt_bias += Σ_n ddt_n,   dD += Σ_n Σ_p dy_n[p]·x_n[p]
// dB and dC add the heads of a group in head order. The state and the per-token sums are fp32; the
// parameter gradients' sums over tokens are double, added once per head. The backward keeps the
// states of one (row, head), T·P·S floats, from a forward pass of its own.
#include "kernels/cpu/ssd_scan.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/check.h"
#include "kernels/cpu/doc_segments.h"
#include "kernels/cpu/lane_dot.h"

namespace mf::cpu {

namespace {

constexpr float kSoftplusThreshold = 20.0f;  // torch's: softplus(u) = u above it

void check_shape(const SsdShape& s) {
    MF_CHECK(s.N >= 0 && s.T >= 1 && s.H >= 1 && s.P >= 1 && s.G >= 1 && s.S >= 1 && s.N % s.T == 0 && s.H % s.G == 0,
             "ssd_scan: bad shape N=", s.N, " T=", s.T, " H=", s.H, " P=", s.P, " G=", s.G, " S=", s.S);
}

float softplus(float u) { return u > kSoftplusThreshold ? u : std::log1p(std::exp(u)); }

// Where one head's operands lie in a token's row of xbc.
struct HeadColumns {
    int64_t x, b, c, width;
};
HeadColumns head_columns(int64_t h, const SsdShape& s) {
    const int64_t I = s.H * s.P, g = h / (s.H / s.G);
    return {h * s.P, I + g * s.S, I + s.G * s.S + g * s.S, I + 2 * s.G * s.S};
}

// δ and its derivative with respect to the raw dt (0 where clamped).
struct Delta {
    float value, grad;
};
Delta delta(float dt_raw, float bias, const SsdShape& s) {
    const float u = dt_raw + bias, sp = softplus(u);
    const bool passes = sp >= s.dt_min && sp <= s.dt_max;
    const float slope = u > kSoftplusThreshold ? 1.0f : 1.0f / (1.0f + std::exp(-u));
    return {std::clamp(sp, s.dt_min, s.dt_max), passes ? slope : 0.0f};
}

// One token's state update: state = a·state + δ·x⊗B (state [P, S]).
void update_state(float* state, float a, float d, const float* x, const float* B, const SsdShape& s) {
    for (int64_t p = 0; p < s.P; ++p) {
        const float xd = d * x[p];
        float* row = state + p * s.S;
        for (int64_t k = 0; k < s.S; ++k) row[k] = a * row[k] + xd * B[k];
    }
}

// The forward over one (row b, head h); with `history` it also keeps state_n of every token.
void scan_head(float* y, std::vector<float>& state, float* history, const float* xbc, const float* dt,
               const float* dt_bias, const float* A_log, const float* D, const int32_t* doc_ids, int64_t b, int64_t h,
               const SsdShape& s) {
    const HeadColumns col = head_columns(h, s);
    const float A = -std::exp(A_log[h]);
    for (int64_t t = 0; t < s.T; ++t) {
        const int64_t n = b * s.T + t;
        if (starts_segment(doc_ids, n, s.T)) std::fill(state.begin(), state.end(), 0.0f);
        const float* row = xbc + n * col.width;
        const float d = delta(dt[n * s.H + h], dt_bias[h], s).value;
        update_state(state.data(), std::exp(d * A), d, row + col.x, row + col.b, s);
        if (history != nullptr) std::copy(state.begin(), state.end(), history + t * s.P * s.S);
        if (y == nullptr) continue;
        float* out = y + n * s.H * s.P + h * s.P;
        for (int64_t p = 0; p < s.P; ++p)
            out[p] = lane_dot(row + col.c, state.data() + p * s.S, s.S) + D[h] * row[col.x + p];
    }
}

// Sums over one (row, head) for the parameter gradients.
struct HeadGrads {
    double dt_bias = 0.0, A = 0.0, D = 0.0;
};

// The adjoint pass over one (row b, head h), tokens in reverse; history from scan_head.
void scan_head_backward(float* dxbc, float* ddt, HeadGrads& grads, std::vector<float>& lambda,
                        std::vector<float>& lambda_b, const float* history, const float* dy, const float* xbc,
                        const float* dt, const float* dt_bias, const float* A_log, const float* D,
                        const int32_t* doc_ids, int64_t b, int64_t h, const SsdShape& s) {
    const HeadColumns col = head_columns(h, s);
    const float A = -std::exp(A_log[h]);
    const int64_t PS = s.P * s.S;
    std::fill(lambda.begin(), lambda.end(), 0.0f);
    for (int64_t t = s.T - 1; t >= 0; --t) {
        const int64_t n = b * s.T + t;
        const bool first = starts_segment(doc_ids, n, s.T);
        const float* row = xbc + n * col.width;
        const float *x = row + col.x, *B = row + col.b, *C = row + col.c;
        const float* g = dy + n * s.H * s.P + h * s.P;
        const float* state = history + t * PS;
        const float* prev = first ? nullptr : history + (t - 1) * PS;
        const Delta d = delta(dt[n * s.H + h], dt_bias[h], s);
        const float a = std::exp(d.value * A);
        float* dx = dxbc + n * col.width + col.x;
        float *dB = dxbc + n * col.width + col.b, *dC = dxbc + n * col.width + col.c;
        float xlb = 0.0f, q = 0.0f, gx = 0.0f;
        for (int64_t p = 0; p < s.P; ++p) {
            float* lam = lambda.data() + p * s.S;
            for (int64_t k = 0; k < s.S; ++k) {
                lam[k] += g[p] * C[k];
                dC[k] += g[p] * state[p * s.S + k];
            }
            lambda_b[p] = lane_dot(lam, B, s.S);
            dx[p] = D[h] * g[p] + d.value * lambda_b[p];
            xlb += x[p] * lambda_b[p];
            gx += g[p] * x[p];
            if (prev != nullptr) q += lane_dot(lam, prev + p * s.S, s.S);
        }
        for (int64_t k = 0; k < s.S; ++k) {
            float acc = 0.0f;
            for (int64_t p = 0; p < s.P; ++p) acc += lambda[p * s.S + k] * x[p];
            dB[k] += d.value * acc;
        }
        q *= a;
        const float ddt_n = (xlb + A * q) * d.grad;
        ddt[n * s.H + h] = ddt_n;
        grads.dt_bias += ddt_n;
        grads.A += static_cast<double>(d.value) * q;
        grads.D += gx;
        // λ_{n−1} = a_n·λ_n inside the segment; nothing flows into the previous segment.
        if (first)
            std::fill(lambda.begin(), lambda.end(), 0.0f);
        else
            for (float& l : lambda) l *= a;
    }
}

}  // namespace

void ssd_scan_forward(float* y, const float* xbc, const float* dt, const float* dt_bias, const float* A_log,
                      const float* D, const int32_t* doc_ids, const SsdShape& s) {
    check_shape(s);
    std::vector<float> state(static_cast<size_t>(s.P * s.S));
    for (int64_t b = 0; b < s.N / s.T; ++b)
        for (int64_t h = 0; h < s.H; ++h) scan_head(y, state, nullptr, xbc, dt, dt_bias, A_log, D, doc_ids, b, h, s);
}

void ssd_scan_backward(float* dxbc, float* ddt, float* ddt_bias, float* dA_log, float* dD, const float* dy,
                       const float* xbc, const float* dt, const float* dt_bias, const float* A_log, const float* D,
                       const int32_t* doc_ids, const SsdShape& s) {
    check_shape(s);
    const int64_t width = s.H * s.P + 2 * s.G * s.S;
    std::memset(dxbc, 0, static_cast<size_t>(s.N * width) * sizeof(float));  // dB, dC add the heads of a group
    std::vector<float> state(static_cast<size_t>(s.P * s.S)), lambda(state.size()), lambda_b(static_cast<size_t>(s.P));
    std::vector<float> history(static_cast<size_t>(s.T * s.P * s.S));
    std::vector<HeadGrads> grads(static_cast<size_t>(s.H));
    for (int64_t b = 0; b < s.N / s.T; ++b) {
        for (int64_t h = 0; h < s.H; ++h) {
            scan_head(nullptr, state, history.data(), xbc, dt, dt_bias, A_log, D, doc_ids, b, h, s);
            scan_head_backward(dxbc, ddt, grads[h], lambda, lambda_b, history.data(), dy, xbc, dt, dt_bias, A_log, D,
                               doc_ids, b, h, s);
        }
    }
    for (int64_t h = 0; h < s.H; ++h) {
        ddt_bias[h] += static_cast<float>(grads[h].dt_bias);
        dA_log[h] += static_cast<float>(-std::exp(static_cast<double>(A_log[h])) * grads[h].A);
        dD[h] += static_cast<float>(grads[h].D);
    }
}

}  // namespace mf::cpu
