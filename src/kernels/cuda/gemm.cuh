// Dense GEMMs of the nn.Linear layout on the GPU, through cuBLASLt: bf16 storage, fp32 accumulation.
//
//   forward          out[N, OC]      = inp[N, C] · weight[OC, C]ᵀ              (written)
//   backward input   dinp[N, C]     (=|+=) dout[N, OC] · weight[OC, C]         (accumulate flag)
//   backward weight  dweight[OC, C]  += dout[N, OC]ᵀ · inp[N, C]               (always accumulates)
//
// All matrices are row-major and contiguous. The CPU reference is kernels/cpu/matmul.h (same
// formulas; its backward always accumulates). Products of zero size are no-ops, except that a
// written output with an empty reduction (C = 0 forward, OC = 0 backward input) is set to zero.
// Every call runs on the given stream and never synchronises the host.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace mf::cuda {

using bf16 = __nv_bfloat16;

// The cuBLASLt handle and one workspace (32 MiB). Create one per stream that issues GEMMs
// (kernels queued on two streams at once must not share a workspace), once, and reuse it.
struct GemmContext {
    static constexpr size_t kWorkspaceBytes = size_t{32} << 20;

    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;

    GemmContext();  // creates the handle and allocates the workspace on the current device
    ~GemmContext();
    GemmContext(const GemmContext&) = delete;
    GemmContext& operator=(const GemmContext&) = delete;
};

// out[N, OC] = inp[N, C] · weight[OC, C]ᵀ, out in bf16 (written).
void matmul_forward(GemmContext& ctx, bf16* out, const bf16* inp, const bf16* weight, int64_t N, int64_t C, int64_t OC,
                    cudaStream_t stream);

// The same product with an fp32 out[N, OC] (written), e.g. for logits that feed the loss.
void matmul_forward_f32out(GemmContext& ctx, float* out, const bf16* inp, const bf16* weight, int64_t N, int64_t C,
                           int64_t OC, cudaStream_t stream);

// dinp[N, C] = dout[N, OC] · weight[OC, C], or += when accumulate.
void matmul_backward_input(GemmContext& ctx, bf16* dinp, const bf16* dout, const bf16* weight, int64_t N, int64_t C,
                           int64_t OC, bool accumulate, cudaStream_t stream);

// dweight[OC, C] += dout[N, OC]ᵀ · inp[N, C]; dweight is fp32 (DType::f32) or bf16 (DType::bf16).
// The sum over N runs in fp32 and is added to the existing dweight values (beta = 1).
void matmul_backward_weight(GemmContext& ctx, void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                            int64_t N, int64_t C, int64_t OC, cudaStream_t stream);

}  // namespace mf::cuda
