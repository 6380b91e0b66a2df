// MoE router of the sigmoid kind (DeepSeek-V3, Nemotron-H): scores = σ(logits) in fp32, experts
// chosen on scores + e_score_correction_bias within the topk_group best of n_group expert groups,
// weights = the chosen *scores* (the bias only chooses), optionally renormalised, then scaled.
// Per token row (E experts in n_group groups of G = E / n_group consecutive experts):
//   s[e] = σ(x[e]) = 1 / (1 + exp(−x[e])),  c[e] = s[e] + bias[e]                       (bias null: 0)
//   group score[g] = the sum of the two largest c in group g (HF: topk(2).sum)
//   kept groups = the topk_group largest group scores (ties: lower group index); when
//     topk_group == n_group every group is kept and no group score is needed
//   v[e] = c[e] in a kept group, else masked_score
//   topk_idx = the K largest v, in descending v (ties: lower expert index)
//   w[k] = s[topk_idx[k]];  norm_topk_prob: w[k] /= (Σ_k w[k] + 1e-20);  then w[k] ×= routed_scaling_factor
// masked_score: −inf as HF Nemotron-H (and DeepSeek's own inference code) fills the masked experts,
// so they are never chosen; 0 as HF DeepSeek-V3 fills them, so a masked expert wins over a kept one
// whose c < 0. The two agree whenever the K chosen c are all > 0.
// NOTE: HF takes top-k with sorted=False (slot order unspecified) and leaves ties to torch.topk;
// here the slot order is descending v and ties go to the lower index (as kernels/cpu/router.h).
#pragma once

#include <cmath>
#include <cstdint>

namespace mf::cpu {

struct RouterSigmoidParams {
    int64_t n_group = 1;     // groups of E / n_group consecutive experts
    int64_t topk_group = 1;  // groups kept per token, 1 <= topk_group <= n_group
    bool norm_topk_prob = false;
    float routed_scaling_factor = 1.0f;
    float masked_score = -INFINITY;  // the choice value of an expert in a dropped group (−inf or 0 above)
};

// Refuses (mf::Error) a geometry the router cannot serve: E >= 1, 1 <= K; n_group >= 1 dividing E;
// 1 <= topk_group <= n_group; groups of >= 2 experts when n_group > 1 (the top-2 group score);
// K <= topk_group · E / n_group (the experts of the kept groups); finite routed_scaling_factor;
// masked_score not NaN. `op` names the caller in the message.
void check_router_sigmoid(const char* op, int64_t E, int64_t K, const RouterSigmoidParams& p);

// logits[N, E] -> scores[N, E] (σ, written, kept for backward), topk_idx[N, K], topk_weight[N, K];
// correction_bias[E] (may be null: zeros).
void router_sigmoid_forward(float* scores, int32_t* topk_idx, float* topk_weight, const float* logits,
                            const float* correction_bias, int64_t N, int64_t E, int64_t K,
                            const RouterSigmoidParams& p);

// dlogits[N, E] (written) from dtopk_weight[N, K] through the scaling, the renormalisation and σ,
// the indices held fixed (the choice is piecewise constant; the bias gets no gradient); zero for
// experts not chosen. scores and topk_idx are the forward's. With r = routed_scaling_factor,
// D = Σ_k s_k + 1e-20 and u_k = s_k / D:
//   ds_k = r · (dw_k − Σ_j dw_j · u_j) / D   (norm_topk_prob)      ds_k = r · dw_k   (no norm)
//   dlogits[e] = (Σ_{k: idx_k = e} ds_k) · s_e · (1 − s_e)
void router_sigmoid_backward(float* dlogits, const float* dtopk_weight, const float* scores, const int32_t* topk_idx,
                             int64_t N, int64_t E, int64_t K, bool norm_topk_prob, float routed_scaling_factor);

}  // namespace mf::cpu
