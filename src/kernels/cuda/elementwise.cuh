// Small elementwise and reduction kernels the model needs around the big ones:
//   add_bf16         out = a + b (bf16, fp32 add; out may alias a or b)
//   count_nonfinite  number of NaN/Inf entries of an f32 or bf16 buffer (into a device int)
//   sum_f32          Σ x in a fixed order (one block, strided partials, tree) into a device double
//   aux_dprobs       dprobs[t, e] = scale · counts[e] · mask[t]
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace mf::cuda {

using bf16 = __nv_bfloat16;

void add_bf16(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream);
void count_nonfinite(unsigned long long* count, const void* x, DType dtype, int64_t n, cudaStream_t stream);
void sum_f32(double* out, const float* x, int64_t n, cudaStream_t stream);
// x[i] = mean + std · N(0,1) from a counter-based hash of (seed, i): fast, reproducible, any length.
void fill_normal(void* x, DType dtype, int64_t n, uint64_t seed, float mean, float std, cudaStream_t stream);
void aux_dprobs(float* dprobs, const float* counts, const float* mask, float scale, int64_t N, int64_t E,
                cudaStream_t stream);

}  // namespace mf::cuda
