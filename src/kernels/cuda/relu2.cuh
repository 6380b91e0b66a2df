// Squared ReLU on the GPU, bf16 storage, fp32 math: out = max(x, 0)², dinp = dout · 2 · max(x, 0).
// CPU reference and spec: kernels/cpu/relu2.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out [n] bf16 (written; may alias inp) from inp [n] bf16.
void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream);

// dinp [n] bf16 (written, not accumulated; may alias dout or inp) from dout [n] and inp [n] bf16.
void relu2_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t n, cudaStream_t stream);

}  // namespace mf::cuda
