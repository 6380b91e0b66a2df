// A row gated by the sigmoid of one logit, on the GPU (bf16 storage, fp32 math):
//   y[n, :] += σ(g[n]) · value[n, :]   (Qwen2-MoE's shared expert behind shared_expert_gate)
// CPU reference and spec: kernels/cpu/sigmoid_gate.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// y [N, H] bf16 (+=: bf16(y + σ(g) · value) in fp32), value [N, H] bf16, gate_logits [N] bf16.
void sigmoid_gate_forward(bf16* y, const bf16* value, const bf16* gate_logits, int64_t N, int64_t H,
                          cudaStream_t stream);

// With s = σ(gate_logits[n]), both written (=), bf16:
//   dvalue [N, H] = s · dy  (may alias dy)
//   dgate_logits [N] = s · (1 − s) · Σ_h dy[n, h] · value[n, h], the row sum in fp32 in a fixed order
//   (lane-strided partials, then a xor butterfly): deterministic.
void sigmoid_gate_backward(bf16* dvalue, bf16* dgate_logits, const bf16* dy, const bf16* value, const bf16* gate_logits,
                           int64_t N, int64_t H, cudaStream_t stream);

}  // namespace mf::cuda
