// Grouped GEMMs over per-expert row groups (the expert GEMMs of a dropless MoE), bf16 storage,
// fp32 accumulation, tensor cores. The CPU reference is kernels/cpu/grouped_matmul.h.
//
// inp/out/dout/dinp hold M rows; group e owns rows [offsets[e], offsets[e + 1]) and uses the slice
// weight[e] of the stacked weight [E, OC, C]:
//   forward          out[r, :]  = inp[r, :] · weight[e]ᵀ                       (written)
//   backward input   dinp[r, :] (=|+=) dout[r, :] · weight[e]                   (accumulate flag)
//   backward weight  dweight[e] += Σ_{r in group e} dout[r, :]ᵀ · inp[r, :]     (always accumulates)
// Rows outside [offsets[0], offsets[E]) are neither read nor written; an empty group leaves its
// dweight[e] unchanged. offsets is int32 [E + 1] in DEVICE memory and is never copied to the host:
// every call is asynchronous on its stream. The kernels cannot report bad offsets without a sync,
// so they make them safe instead: each offset is clamped to [0, M] and to the running maximum of
// the offsets before it (non-decreasing offsets within [0, M], the contract, are unchanged), so no
// access ever leaves the M-row buffers.
//
// Requirements (checked, mf::Error otherwise): C and OC multiples of 8, every pointer 16-byte
// aligned, 0 <= E <= kMaxExperts, M < 2^31. Results are deterministic: each output tile is owned
// by one block that sums its K range in a fixed order; no atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace mf::cuda {

using bf16 = __nv_bfloat16;

constexpr int64_t kMaxGroupedExperts = 1024;

// The requirements above for a call named `what` on the three tensors x, y, z (mf::Error otherwise);
// shared by this kernel and the cuBLAS path (grouped_gemm_cublas.cuh).
void check_grouped_args(const char* what, const void* x, const void* y, const void* z, const int32_t* offsets,
                        int64_t M, int64_t E, int64_t C, int64_t OC);

// out[M, OC]: out[r] = inp[r] · weight[e]ᵀ for the rows r of every group e (written).
void grouped_matmul_forward(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                            int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

// dinp[M, C]: dinp[r] = dout[r] · weight[e] (or += when accumulate) for the rows r of every group e.
void grouped_matmul_backward_input(bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets, int64_t M,
                                   int64_t E, int64_t C, int64_t OC, bool accumulate, cudaStream_t stream);

// dweight[E, OC, C] (fp32 or bf16): dweight[e] += Σ_{r in group e} dout[r]ᵀ · inp[r], summed in fp32 in a
// fixed order (row blocks ascending) and added once to the stored value.
void grouped_matmul_backward_weight(void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                                    const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                    cudaStream_t stream);

}  // namespace mf::cuda
