// Fused LM head + cross-entropy. Logits for a chunk of tokens are computed, turned into the
// loss and its gradient, and dropped, so [N, V] logits never exist at once.
//   logits[n] = h[n] · wᵀ (w[V, C]); loss[n] = logsumexp(logits[n]) - logits[n][target[n]]
// Targets equal to -100 are ignored (loss 0, no gradient).
#pragma once

#include <cstdint>

namespace mf::cpu {

constexpr int32_t kIgnoreIndex = -100;

// losses[N] (written). When dh/dw are non-null, also the gradients of Σ_n grad_scale · loss[n]:
// dh[N, C] += ...; dw[V, C] += ... . bf16_logits: every logit is rounded to bf16 (nearest even)
// before the softmax, as a bf16 model's logits are (the GPU's bf16 policy; HF's bf16 models too).
void lm_head_cross_entropy(float* losses, float* dh, float* dw, const float* h, const float* w, const int32_t* targets,
                           int64_t N, int64_t C, int64_t V, float grad_scale, bool bf16_logits = false);

}  // namespace mf::cpu
