// MoE router on the GPU, fp32 throughout: softmax over E expert logits, top-k (ties to the lower
// expert index), optional renormalisation of the k weights (norm_topk_prob); its backward; and the
// statistics of the load-balancing (aux) loss. CPU reference and spec: kernels/cpu/router.h.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mf::cuda {

// logits [N, E] fp32 -> probs [N, E] fp32 (written), topk_idx [N, K] int32 (descending probability),
// topk_weight [N, K] fp32. E <= 1024, K <= min(E, 32).
void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int64_t E,
                    int64_t K, bool norm_topk_prob, cudaStream_t stream);

// dlogits [N, E] fp32 (written) from dtopk_weight [N, K] through the renormalisation and the softmax,
// plus dprobs [N, E] (may be null): a direct gradient on the full probabilities (the aux loss).
// A topk_idx entry outside [0, E) contributes nothing (the CPU reference rejects it).
void router_backward(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                     const int32_t* topk_idx, int64_t N, int64_t E, int64_t K, bool norm_topk_prob,
                     cudaStream_t stream);

// Bytes of scratch router_aux_stats needs.
size_t router_aux_stats_scratch_bytes(int64_t N, int64_t E);

// Aux-loss statistics of one MoE layer, accumulated across layers (+=), over the rows n with
// row_mask[n] != 0 (row_mask [N] fp32 0/1, or null: every row):
//   counts[e]    += number of counted rows whose top-k holds e          counts [E] fp32 (exact integers)
//   prob_sums[e] += Σ_n probs[n, e] over the counted rows                prob_sums [E] fp32
// Deterministic: fixed blocks of rows give partial sums in scratch, added in a fixed order.
// scratch: router_aux_stats_scratch_bytes(N, E) bytes, 16-byte aligned.
void router_aux_stats(float* counts, float* prob_sums, const float* probs, const int32_t* topk_idx,
                      const float* row_mask, int64_t N, int64_t E, int64_t K, void* scratch, size_t scratch_bytes,
                      cudaStream_t stream);

// The aux loss's gradient on the probabilities (HF load_balancing_loss_func, as the CPU model):
//   dprobs[n, e] (written) = float(scale · counts[e]) · row_mask[n]   (row_mask null: 1)
// with scale = coef · E / R² (R = counted rows over all MoE layers), counts from router_aux_stats.
void router_aux_dprobs(float* dprobs, const float* counts, const float* row_mask, double scale, int64_t N, int64_t E,
                       cudaStream_t stream);

}  // namespace mf::cuda
