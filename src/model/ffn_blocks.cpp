#include "model/ffn_blocks.h"

#include "ops/ops.h"

namespace mf::model {

// --- dense MLP ------------------------------------------------------------------------------------

void MlpActs::alloc(Arena& arena, int64_t N, int64_t I, DType act) {
    h = arena.alloc(act, {N, 2 * I});
    a = arena.alloc(act, {N, I});
}

void MlpScratch::alloc(Arena& arena, int64_t N, int64_t I, DType act) {
    dh = arena.alloc(act, {N, 2 * I});
    da = arena.alloc(act, {N, I});
}

void mlp_block_forward(const Tensor& y, MlpActs& acts, const Tensor& x, const MlpWeights& w) {
    ops::matmul_forward(acts.h, x, w.gate_up);
    ops::swiglu_forward(acts.a, acts.h);
    ops::matmul_forward(y, acts.a, w.down);
}

void mlp_block_backward(const Tensor& dx, const MlpWeights& g, MlpScratch& s, const Tensor& dy, const Tensor& x,
                        const MlpActs& acts, const MlpWeights& w) {
    ops::zero(s.da);
    ops::matmul_backward(s.da, g.down, dy, acts.a, w.down);
    ops::swiglu_backward(s.dh, s.da, acts.h);
    ops::matmul_backward(dx, g.gate_up, s.dh, x, w.gate_up);
}

// --- dropless MoE ---------------------------------------------------------------------------------

void MoeActs::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act) {
    const int64_t P = N * d.top_k;
    logits = arena.alloc(DType::f32, {N, d.num_experts});
    probs = arena.alloc(DType::f32, {N, d.num_experts});
    topk_idx = arena.alloc(DType::i32, {N, d.top_k});
    topk_weight = arena.alloc(DType::f32, {N, d.top_k});
    expert_offsets = arena.alloc(DType::i32, {d.num_experts + 1});
    sorted_pair = arena.alloc(DType::i32, {P});
    pair_row = arena.alloc(DType::i32, {P});
    x_perm = arena.alloc(act, {P, d.hidden});
    h_perm = arena.alloc(act, {P, 2 * d.intermediate});
    a_perm = arena.alloc(act, {P, d.intermediate});
    y_perm = arena.alloc(act, {P, d.hidden});
}

void MoeScratch::alloc(Arena& arena, const MoeDims& d, int64_t N, DType act) {
    const int64_t P = N * d.top_k;
    dy_perm = arena.alloc(act, {P, d.hidden});
    da_perm = arena.alloc(act, {P, d.intermediate});
    dh_perm = arena.alloc(act, {P, 2 * d.intermediate});
    dx_perm = arena.alloc(act, {P, d.hidden});
    dtopk_weight = arena.alloc(DType::f32, {N, d.top_k});
    dlogits = arena.alloc(DType::f32, {N, d.num_experts});
}

void moe_block_forward(const Tensor& y, MoeActs& a, const Tensor& x, const MoeWeights& w, const MoeDims& d) {
    ops::matmul_forward(a.logits, x, w.router);
    ops::router_forward(a.probs, a.topk_idx, a.topk_weight, a.logits, d.norm_topk_prob);
    ops::moe_permute_indices(a.expert_offsets, a.sorted_pair, a.pair_row, a.topk_idx, d.num_experts);
    ops::moe_gather_forward(a.x_perm, x, a.sorted_pair, d.top_k);
    ops::grouped_matmul_forward(a.h_perm, a.x_perm, w.gate_up, a.expert_offsets);
    ops::swiglu_forward(a.a_perm, a.h_perm);
    ops::grouped_matmul_forward(a.y_perm, a.a_perm, w.down, a.expert_offsets);
    ops::moe_unpermute_forward(y, a.y_perm, a.topk_weight, a.pair_row);
}

void moe_block_backward(const Tensor& dx, const MoeWeights& g, MoeScratch& s, const Tensor& dy, const Tensor& dprobs,
                        const Tensor& x, const MoeActs& a, const MoeWeights& w, const MoeDims& d) {
    ops::moe_unpermute_backward(s.dy_perm, s.dtopk_weight, dy, a.y_perm, a.topk_weight, a.pair_row);
    ops::zero(s.da_perm);
    ops::grouped_matmul_backward(s.da_perm, g.down, s.dy_perm, a.a_perm, w.down, a.expert_offsets);
    ops::swiglu_backward(s.dh_perm, s.da_perm, a.h_perm);
    ops::zero(s.dx_perm);
    ops::grouped_matmul_backward(s.dx_perm, g.gate_up, s.dh_perm, a.x_perm, w.gate_up, a.expert_offsets);
    ops::moe_gather_backward(dx, s.dx_perm, a.pair_row, d.top_k);
    ops::router_backward(s.dlogits, s.dtopk_weight, dprobs, a.probs, a.topk_idx, d.norm_topk_prob);
    ops::matmul_backward(dx, g.router, s.dlogits, x, w.router);
}

}  // namespace mf::model
