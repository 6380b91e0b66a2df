// The sigmoid MoE router on the GPU (DeepSeek-V3, Nemotron-H), fp32 throughout: scores = σ(logits),
// group-limited top-k on scores + correction bias, weights from the scores, renormalised and scaled;
// its backward with the indices fixed. CPU reference and spec: kernels/cpu/router_sigmoid.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"
#include "kernels/cpu/router_sigmoid.h"

namespace mf::cuda {

using RouterSigmoidParams = cpu::RouterSigmoidParams;

// logits [N, E] fp32 -> scores [N, E] fp32 (written), topk_idx [N, K] int32 (descending choice value,
// ties to the lower index), topk_weight [N, K] fp32. correction_bias [E] of bias_dtype (f32 or bf16),
// or null (zeros). E <= 1024, K <= 32, and n_group <= 32 when topk_group < n_group; the geometry
// rules of cpu::check_router_sigmoid.
void router_sigmoid_forward(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits,
                            const void* correction_bias, DType bias_dtype, int64_t N, int64_t E, int64_t K,
                            const RouterSigmoidParams& p, cudaStream_t stream);

// dlogits [N, E] fp32 (written) from dtopk_weight [N, K] fp32, scores [N, E] and topk_idx [N, K] of
// the forward. A topk_idx entry outside [0, E) contributes nothing (the CPU reference rejects it).
void router_sigmoid_backward(float* dlogits, const float* dtopk_weight, const float* scores, const int32_t* topk_idx,
                             int64_t N, int64_t E, int64_t K, bool norm_topk_prob, float routed_scaling_factor,
                             cudaStream_t stream);

}  // namespace mf::cuda
