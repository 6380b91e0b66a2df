// Mamba-2's causal depthwise conv1d with SiLU on the GPU (bf16 activations, fp32 math). Per channel c
// of token n: pre[n, c] = bias[c] + Σ_{j<K} weight[c, j] · inp[n − (K−1) + j, c], out = silu(pre), a tap
// outside the token's segment (its row of T tokens and its run of one document id,
// kernels/cpu/doc_segments.h) being 0. CPU reference and spec: kernels/cpu/conv1d.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

constexpr int64_t kConv1dMaxTaps = 8;

// out [N, C] bf16 (written), inp [N, C] bf16, weight [C, K] f32, bias [C] f32 or null,
// doc_ids [N] or null (every row one document). K <= kConv1dMaxTaps.
void conv1d_silu_forward(bf16* out, const bf16* inp, const float* weight, const float* bias, const int32_t* doc_ids,
                         int64_t N, int64_t T, int64_t C, int64_t K, cudaStream_t stream);

// Bytes of scratch conv1d_silu_backward needs (per-block partial sums of dweight and dbias).
size_t conv1d_silu_backward_scratch_bytes(int64_t N, int64_t C, int64_t K);

// dinp [N, C] bf16 written; dweight [C, K] += and dbias [C] += (f32 or bf16 each, dbias may be null).
// The pre-activation is recomputed from inp. Deterministic: each block walks a fixed range of rows
// in order per channel and writes its partial sums to scratch; reduce_partial_rows adds the blocks
// in a fixed order (the block count depends on N only). No atomics.
void conv1d_silu_backward(bf16* dinp, void* dweight, DType dweight_dtype, void* dbias, DType dbias_dtype,
                          const bf16* dout, const bf16* inp, const float* weight, const float* bias,
                          const int32_t* doc_ids, int64_t N, int64_t T, int64_t C, int64_t K, void* scratch,
                          size_t scratch_bytes, cudaStream_t stream);

}  // namespace mf::cuda
