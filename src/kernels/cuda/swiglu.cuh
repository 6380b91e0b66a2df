// SwiGLU on a fused gate/up row, bf16 storage, fp32 math:
//   out = silu(gate) ⊙ up,  silu(g) = g · σ(g),  inp[N, 2I] holds gate in columns [0, I), up in [I, 2I).
// CPU reference and spec: kernels/cpu/swiglu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

#ifdef __CUDACC__
// The formulas, shared by these kernels and the grouped products' fused epilogues
// (grouped_gemm_sm90.cu), so that a fused pass gives the separate passes' bits.
__device__ __forceinline__ float swiglu_value(float g, float u) { return g / (1.0f + expf(-g)) * u; }
__device__ __forceinline__ void swiglu_grad(float g, float u, float dy, float& dg, float& du) {
    const float sig = 1.0f / (1.0f + expf(-g));
    const float silu = g * sig;
    dg = dy * u * (sig * (1.0f + g * (1.0f - sig)));
    du = dy * silu;
}
#endif

// out [N, I] bf16 (written) from inp [N, 2I] bf16.
void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream);

// dinp [N, 2I] bf16 (written, not accumulated; may alias inp, in place, but not dout):
//   dgate = dout · up · σ(g) · (1 + g · (1 − σ(g))),  dup = dout · silu(g).
void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream);

}  // namespace mf::cuda
