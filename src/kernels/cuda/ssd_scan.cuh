// Mamba-2's selective scan (SSD) on the GPU: bf16 activations, fp32 math and state, computed in
// chunks of Q tokens as the SSD algorithm does, over packed documents (the state resets at every
// segment start: a row start or a change of document id, kernels/cpu/doc_segments.h).
// CPU reference and spec: kernels/cpu/ssd_scan.h. Per row b, head h (group g = h / (H/G)):
//   δ_n = clamp(softplus(dt[n, h] + dt_bias[h]), dt_min, dt_max),  A = −exp(A_log[h]),
//   state_n[P, S] = exp(δ_n·A) · state_{n−1} + δ_n · x_n ⊗ B_n   (0 before a segment),
//   y[n, h·P + p] = C_n · state_n[p, :] + D[h] · x_n[p].
// x, B, C are column ranges of xbc [N, I + 2·G·S] (x | B | C, I = H·P). The memory is O(N·H·P·S / Q):
// `states` holds the state entering each chunk, f32 [B, ceil(T/Q), H, P, S], written by the forward
// and read by the backward.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

constexpr int64_t kSsdMaxChunk = 128;

struct SsdGeometry {
    int64_t num_rows = 0;  // B (N = B·T)
    int64_t T = 0;         // tokens per row
    int64_t H = 0, P = 0, G = 0, S = 0;
    int64_t Q = 0;  // chunk size, 1 .. kSsdMaxChunk
    float dt_min = 0.0f, dt_max = 0.0f;
};

// ceil(T / Q).
int64_t ssd_num_chunks(const SsdGeometry& g);
// Elements of `states`: B · ceil(T/Q) · H · P · S.
int64_t ssd_states_numel(const SsdGeometry& g);

// Parameters (dt_bias, A_log, D [H]) are f32 here; ops converts bf16 parameters first.
struct SsdParams {
    const float* dt_bias;
    const float* A_log;
    const float* D;
};

size_t ssd_scan_forward_scratch_bytes(const SsdGeometry& g);
// y [N, H·P] bf16 and states (f32, ssd_states_numel) written. doc_ids [N] or null (one document per row).
// scratch: ssd_scan_forward_scratch_bytes, 16-byte aligned.
void ssd_scan_forward(bf16* y, float* states, const bf16* xbc, const bf16* dt, const SsdParams& params,
                      const int32_t* doc_ids, const SsdGeometry& g, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream);

// Gradient outputs of the backward. dxbc [N, I + 2GS] and ddt [N, H] (at the raw dt) are written;
// ddt_bias, dA_log, dD [H] are += (each f32 or bf16).
struct SsdGrads {
    bf16* dxbc;
    bf16* ddt;
    void* ddt_bias;
    DType ddt_bias_dtype;
    void* dA_log;
    DType dA_log_dtype;
    void* dD;
    DType dD_dtype;
};

size_t ssd_scan_backward_scratch_bytes(const SsdGeometry& g);
// states: as ssd_scan_forward wrote it. Deterministic: no atomics; the dB/dC sums over a group's
// heads and the parameter-gradient sums over chunks run in a fixed order.
void ssd_scan_backward(const SsdGrads& grads, const bf16* dy, const bf16* xbc, const bf16* dt, const SsdParams& params,
                       const float* states, const int32_t* doc_ids, const SsdGeometry& g, void* scratch,
                       size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
