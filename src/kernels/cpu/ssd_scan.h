// Mamba-2's selective scan (SSD), per row b and head h of H, over packed documents
// (kernels/cpu/doc_segments.h). x, B, C are the columns of xbc[N, I + 2·G·S] (the conv's output):
// x[n, h] = xbc[n, h·P .. h·P+P), B[n, g] = xbc[n, I + g·S ..), C[n, g] = xbc[n, I + G·S + g·S ..),
// I = H·P, head h reading group g = h / (H/G). With dt the raw [N, H] input,
//   δ_n = clamp(softplus(dt[n, h] + dt_bias[h]), dt_min, dt_max),  A = −exp(A_log[h]),
//   state_n[P, S] = exp(δ_n·A) · state_{n−1} + δ_n · x_n ⊗ B_n    (state = 0 before a segment's first token)
//   y[n, h·P + p] = Σ_s C_n[s] · state_n[p, s] + D[h] · x_n[p]
#pragma once

#include <cstdint>

namespace mf::cpu {

struct SsdShape {
    int64_t N;             // tokens (B rows of T)
    int64_t T;             // tokens per row
    int64_t H;             // heads
    int64_t P;             // head dim
    int64_t G;             // B/C groups (H % G == 0)
    int64_t S;             // state size
    float dt_min, dt_max;  // the clamp after softplus
};

// y[N, H·P] (written). doc_ids [N] or null.
void ssd_scan_forward(float* y, const float* xbc, const float* dt, const float* dt_bias, const float* A_log,
                      const float* D, const int32_t* doc_ids, const SsdShape& s);
// dxbc[N, I + 2GS] and ddt[N, H] (the gradient at the raw dt) written; ddt_bias, dA_log, dD [H] +=.
void ssd_scan_backward(float* dxbc, float* ddt, float* ddt_bias, float* dA_log, float* dD, const float* dy,
                       const float* xbc, const float* dt, const float* dt_bias, const float* A_log, const float* D,
                       const int32_t* doc_ids, const SsdShape& s);

}  // namespace mf::cpu
