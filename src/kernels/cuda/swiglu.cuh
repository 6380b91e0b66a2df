// SwiGLU on a fused gate/up row, bf16 storage, fp32 math:
//   out = silu(gate) ⊙ up,  silu(g) = g · σ(g),  inp[N, 2I] holds gate in columns [0, I), up in [I, 2I).
// CPU reference and spec: kernels/cpu/swiglu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out [N, I] bf16 (written) from inp [N, 2I] bf16.
void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream);

// dinp [N, 2I] bf16 (written, not accumulated; may alias inp, in place, but not dout):
//   dgate = dout · up · σ(g) · (1 + g · (1 − σ(g))),  dup = dout · silu(g).
void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream);

}  // namespace mf::cuda
