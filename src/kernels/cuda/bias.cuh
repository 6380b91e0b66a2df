// Row bias on the GPU (bf16 storage, fp32 math): out[N, C] += bias[C], and its gradient
// dbias[C] += Σ_n dout[n, :] as deterministic fp32 column sums.
// CPU reference and spec: kernels/cpu/bias.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out [N, C] bf16 (in place, +=), bias [C] bf16: out = bf16(out + bias) with the sum in fp32.
void add_bias(bf16* out, const bf16* bias, int64_t N, int64_t C, cudaStream_t stream);

// Bytes of scratch bias_backward needs (per-row-block column sums).
size_t bias_backward_scratch_bytes(int64_t N, int64_t C);

// dbias [C] (f32 or bf16 per dbias_dtype; +=: old value + sum in fp32, then stored) from
// dout [N, C] bf16. Deterministic: row block b sums its rows in ascending order per column in fp32
// into scratch [blocks, C], then reduce_partial_rows adds the blocks in a fixed order; the block
// count depends on N only. scratch: bias_backward_scratch_bytes(N, C) bytes, 16-byte aligned.
void bias_backward(void* dbias, DType dbias_dtype, const bf16* dout, int64_t N, int64_t C, void* scratch,
                   size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
