// MoE router: fp32 softmax over E expert logits, top-k, optional renormalisation of the k
// weights to sum to 1 (norm_topk_prob). Ties in top-k go to the lower expert index.
#pragma once

#include <cstdint>

namespace mf::cpu {

// logits[N, E] -> probs[N, E] (full softmax, kept for the aux loss and backward),
// topk_idx[N, K] (descending probability), topk_weight[N, K].
void router_forward(float* probs, int32_t* topk_idx, float* topk_weight, const float* logits, int64_t N, int64_t E,
                    int64_t K, bool norm_topk_prob);

// dlogits[N, E] (written) from dtopk_weight[N, K] through renormalisation and softmax, plus
// dprobs[N, E] (may be null): a direct gradient on the full probabilities (the aux loss).
void router_backward(float* dlogits, const float* dtopk_weight, const float* dprobs, const float* probs,
                     const int32_t* topk_idx, int64_t N, int64_t E, int64_t K, bool norm_topk_prob);

}  // namespace mf::cpu
