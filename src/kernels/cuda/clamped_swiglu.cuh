// gpt-oss's clamped, interleaved SwiGLU on the GPU, bf16 storage, fp32 math:
//   g = min(gate, limit), u = clamp(up, −limit, limit), out = (u + 1) · g · σ(alpha · g),
// gate and up interleaved by column in inp. CPU reference and spec: kernels/cpu/clamped_swiglu.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out [N, I] bf16 (written) from inp [N, 2I] bf16.
void clamped_swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t I, float alpha, float limit,
                            cudaStream_t stream);

// dinp [N, 2I] bf16 (written, interleaved like inp; may alias inp) from dout [N, I] and inp [N, 2I].
void clamped_swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I, float alpha,
                             float limit, cudaStream_t stream);

}  // namespace mf::cuda
