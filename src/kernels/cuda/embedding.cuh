// Token embedding on the GPU: bf16 table, bf16 activations; the backward is deterministic.
// CPU reference and spec: kernels/cpu/embedding.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// out[n, :] = wte[ids[n], :] for n < N.  out [N, C] bf16 (written), wte [V, C] bf16, ids [N] int32.
// NOTE: ids are validated by the caller; an id outside [0, V) gives a zero row (never an
// out-of-bounds read).
void embedding_forward(bf16* out, const int32_t* ids, const bf16* wte, int64_t N, int64_t V, int64_t C,
                       cudaStream_t stream);

// Bytes of scratch embedding_backward needs for N tokens and a vocabulary of V.
size_t embedding_backward_scratch_bytes(int64_t N, int64_t V);

// dwte[ids[n], :] += Σ dout[n, :] over the tokens n carrying that id, summed in fp32 in ascending n
// and added once to dwte (f32, or bf16: old + sum in fp32, rounded). No float atomics: the token
// indices are sorted by id (stable radix sort), then one warp per (id, 256-column slice) adds its
// rows in order, so the result is bitwise reproducible. Ids outside [0, V) are skipped.
// dwte [V, C] (dwte_dtype f32 or bf16), dout [N, C] bf16, ids [N] int32.
// scratch: embedding_backward_scratch_bytes(N, V) bytes, 256-byte aligned (a cudaMalloc'd block).
void embedding_backward(void* dwte, DType dwte_dtype, const bf16* dout, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C, void* scratch, size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
