// The two feed-forward blocks of Qwen3-MoE.
//
// Dense MLP (mlp_only_layers / decoder_sparse_step):  y = (silu(x·Wgᵀ) ⊙ x·Wuᵀ)·Wdᵀ, with Wg and Wu
// adjacent in the parameter buffer so they act as one fused [2I, H] matrix.
//
// Dropless MoE:  router logits = x·Wrᵀ; fp32 softmax; top-k (optionally renormalised); the N·K
// token-expert pairs are grouped by expert (every token kept, no capacity); per expert
// h = x·W_gate_up[e]ᵀ, a = silu(h_gate) ⊙ h_up, y_e = a·W_down[e]ᵀ; y[t] = Σ_k w[t,k]·y_e(t,k).
// The aux loss needs the full router probabilities of every MoE layer, so they are kept in the
// activations and its gradient comes back in as `dprobs`.
// Forward writes y; backward accumulates into dx and the parameter gradients (+=). Activations
// are in the activation dtype; router logits, probabilities and weights are always f32.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mf::model {

struct MlpWeights {
    Tensor gate_up, down;  // [2I, H] (gate rows then up rows), [H, I]
};

struct MlpActs {
    Tensor h, a;  // [N, 2I], [N, I]
    void alloc(Arena& arena, int64_t N, int64_t I, DType act);
};

struct MlpScratch {
    Tensor dh, da;
    void alloc(Arena& arena, int64_t N, int64_t I, DType act);
};

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w);
void mlp_block_backward(const Tensor& dx, const MlpWeights& grads, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w);

struct MoeDims {
    int64_t hidden, intermediate, num_experts, top_k;
    bool norm_topk_prob;
};

struct MoeWeights {
    Tensor router, gate_up, down;  // [E, H], [E, 2I, H], [E, H, I]
};

struct MoeActs {
    Tensor logits, probs;          // [N, E]
    Tensor topk_idx, topk_weight;  // [N, K]
    Tensor expert_offsets;         // [E + 1]
    Tensor sorted_pair, pair_row;  // [N·K]
    Tensor x_perm, h_perm, a_perm, y_perm;  // [N·K, H], [N·K, 2I], [N·K, I], [N·K, H]
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act);
};

struct MoeScratch {
    Tensor dy_perm, da_perm, dh_perm, dx_perm, dtopk_weight, dlogits;
    void alloc(Arena& arena, const MoeDims& d, int64_t N, DType act);
};

void moe_block_forward(const Tensor& y, MoeActs& acts, const Tensor& x, const MoeWeights& w, const MoeDims& d);
// dprobs[N, E] f32 (may be undefined): gradient of the loss with respect to the router probabilities.
void moe_block_backward(const Tensor& dx, const MoeWeights& grads, MoeScratch& s, const Tensor& dy,
                        const Tensor& dprobs, const Tensor& x, const MoeActs& acts, const MoeWeights& w,
                        const MoeDims& d);

}  // namespace mf::model
