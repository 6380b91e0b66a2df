// AdamW on the GPU with torch.optim.AdamW semantics, operation for operation as the CPU reference
// (kernels/cpu/adamw.h and adamw.cpp: decoupled decay, torch's lerp form of the first moment,
// bias corrections computed in double on the host and cast to fp32 once). Two storage policies:
//   adamw_update_bf16    bf16 params, grads, m and v (8 bytes per parameter); math in fp32, every
//                        result rounded to nearest even (no stochastic rounding)
//   adamw_update_mixed   fp32 master params, fp32 m and v, bf16 or fp32 grads; also writes the bf16
//                        copy of the updated params that the forward pass reads
// Flat buffers of n elements; the caller calls once per parameter group (its weight decay).
// p.grad_scale (a host value) multiplies every gradient first, as on the CPU; then
// grad_scale (may be null): a device float multiplying every gradient, e.g. the clipping
// scale from reduce.cuh's clip_scale, so clipping needs neither a host sync nor a pass over grads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"
#include "kernels/cpu/adamw.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

using AdamWParams = cpu::AdamWParams;

// param, m, v [n] bf16 (updated in place), grad [n] bf16.
void adamw_update_bf16(bf16* param, bf16* m, bf16* v, const bf16* grad, int64_t n, const AdamWParams& p,
                       const float* grad_scale, cudaStream_t stream);

// master, m, v [n] fp32 (updated in place), grad [n] (grad_dtype f32 or bf16),
// param_bf16 [n] (written with bf16(master) after the update; may be null).
void adamw_update_mixed(float* master, float* m, float* v, const void* grad, DType grad_dtype, bf16* param_bf16,
                        int64_t n, const AdamWParams& p, const float* grad_scale, cudaStream_t stream);

}  // namespace mf::cuda
