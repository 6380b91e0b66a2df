#include "model/ffn_blocks.h"

#include <cstring>

#include "kernels/cpu/grouped_matmul.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/moe_permute.h"
#include "kernels/cpu/router.h"
#include "kernels/cpu/swiglu.h"

namespace mf::model {

namespace {
void zero(const Tensor& t) { std::memset(t.data(), 0, t.nbytes()); }
}  // namespace

// --- dense MLP ------------------------------------------------------------------------------------

void MlpActs::alloc(Arena& arena, int64_t N, int64_t I) {
    h = arena.alloc(DType::f32, {N, 2 * I});
    a = arena.alloc(DType::f32, {N, I});
}

void MlpScratch::alloc(Arena& arena, int64_t N, int64_t I) {
    dh = arena.alloc(DType::f32, {N, 2 * I});
    da = arena.alloc(DType::f32, {N, I});
}

void mlp_block_forward(float* y, MlpActs& acts, const float* x, const MlpWeights& w, int64_t N, int64_t H, int64_t I) {
    cpu::matmul_forward(acts.h.ptr<float>(), x, w.gate_up, N, H, 2 * I);
    cpu::swiglu_forward(acts.a.ptr<float>(), acts.h.ptr<float>(), N, I);
    cpu::matmul_forward(y, acts.a.ptr<float>(), w.down, N, I, H);
}

void mlp_block_backward(float* dx, const MlpWeights& g, MlpScratch& s, const float* dy, const float* x,
                        const MlpActs& acts, const MlpWeights& w, int64_t N, int64_t H, int64_t I) {
    zero(s.da);
    cpu::matmul_backward(s.da.ptr<float>(), g.down, dy, acts.a.ptr<float>(), w.down, N, I, H);
    cpu::swiglu_backward(s.dh.ptr<float>(), s.da.ptr<float>(), acts.h.ptr<float>(), N, I);
    cpu::matmul_backward(dx, g.gate_up, s.dh.ptr<float>(), x, w.gate_up, N, H, 2 * I);
}

// --- dropless MoE ---------------------------------------------------------------------------------

void MoeActs::alloc(Arena& arena, const MoeDims& d, int64_t N) {
    const int64_t P = N * d.top_k;
    logits = arena.alloc(DType::f32, {N, d.num_experts});
    probs = arena.alloc(DType::f32, {N, d.num_experts});
    topk_idx = arena.alloc(DType::i32, {N, d.top_k});
    topk_weight = arena.alloc(DType::f32, {N, d.top_k});
    expert_offsets = arena.alloc(DType::i32, {d.num_experts + 1});
    sorted_pair = arena.alloc(DType::i32, {P});
    pair_row = arena.alloc(DType::i32, {P});
    x_perm = arena.alloc(DType::f32, {P, d.hidden});
    h_perm = arena.alloc(DType::f32, {P, 2 * d.intermediate});
    a_perm = arena.alloc(DType::f32, {P, d.intermediate});
    y_perm = arena.alloc(DType::f32, {P, d.hidden});
}

void MoeScratch::alloc(Arena& arena, const MoeDims& d, int64_t N) {
    const int64_t P = N * d.top_k;
    dy_perm = arena.alloc(DType::f32, {P, d.hidden});
    da_perm = arena.alloc(DType::f32, {P, d.intermediate});
    dh_perm = arena.alloc(DType::f32, {P, 2 * d.intermediate});
    dx_perm = arena.alloc(DType::f32, {P, d.hidden});
    dtopk_weight = arena.alloc(DType::f32, {N, d.top_k});
    dlogits = arena.alloc(DType::f32, {N, d.num_experts});
}

void moe_block_forward(float* y, MoeActs& a, const float* x, const MoeWeights& w, const MoeDims& d, int64_t N) {
    const int64_t E = d.num_experts, K = d.top_k, H = d.hidden, I = d.intermediate;
    cpu::matmul_forward(a.logits.ptr<float>(), x, w.router, N, H, E);
    cpu::router_forward(a.probs.ptr<float>(), a.topk_idx.ptr<int32_t>(), a.topk_weight.ptr<float>(),
                        a.logits.ptr<float>(), N, E, K, d.norm_topk_prob);
    cpu::moe_permute_indices(a.expert_offsets.ptr<int32_t>(), a.sorted_pair.ptr<int32_t>(), a.pair_row.ptr<int32_t>(),
                             a.topk_idx.ptr<int32_t>(), N, K, E);
    cpu::moe_gather_forward(a.x_perm.ptr<float>(), x, a.sorted_pair.ptr<int32_t>(), N, K, H);
    cpu::grouped_matmul_forward(a.h_perm.ptr<float>(), a.x_perm.ptr<float>(), w.gate_up,
                                a.expert_offsets.ptr<int32_t>(), E, H, 2 * I);
    cpu::swiglu_forward(a.a_perm.ptr<float>(), a.h_perm.ptr<float>(), N * K, I);
    cpu::grouped_matmul_forward(a.y_perm.ptr<float>(), a.a_perm.ptr<float>(), w.down, a.expert_offsets.ptr<int32_t>(),
                                E, I, H);
    cpu::moe_unpermute_forward(y, a.y_perm.ptr<float>(), a.topk_weight.ptr<float>(), a.pair_row.ptr<int32_t>(), N, K, H);
}

void moe_block_backward(float* dx, const MoeWeights& g, MoeScratch& s, const float* dy, const float* dprobs,
                        const float* x, const MoeActs& a, const MoeWeights& w, const MoeDims& d, int64_t N) {
    const int64_t E = d.num_experts, K = d.top_k, H = d.hidden, I = d.intermediate;
    const int32_t* offsets = a.expert_offsets.ptr<int32_t>();
    cpu::moe_unpermute_backward(s.dy_perm.ptr<float>(), s.dtopk_weight.ptr<float>(), dy, a.y_perm.ptr<float>(),
                                a.topk_weight.ptr<float>(), a.pair_row.ptr<int32_t>(), N, K, H);
    zero(s.da_perm);
    cpu::grouped_matmul_backward(s.da_perm.ptr<float>(), g.down, s.dy_perm.ptr<float>(), a.a_perm.ptr<float>(), w.down,
                                 offsets, E, I, H);
    cpu::swiglu_backward(s.dh_perm.ptr<float>(), s.da_perm.ptr<float>(), a.h_perm.ptr<float>(), N * K, I);
    zero(s.dx_perm);
    cpu::grouped_matmul_backward(s.dx_perm.ptr<float>(), g.gate_up, s.dh_perm.ptr<float>(), a.x_perm.ptr<float>(),
                                 w.gate_up, offsets, E, H, 2 * I);
    cpu::moe_gather_backward(dx, s.dx_perm.ptr<float>(), a.pair_row.ptr<int32_t>(), N, K, H);
    cpu::router_backward(s.dlogits.ptr<float>(), s.dtopk_weight.ptr<float>(), dprobs, a.probs.ptr<float>(),
                         a.topk_idx.ptr<int32_t>(), N, E, K, d.norm_topk_prob);
    cpu::matmul_backward(dx, g.router, s.dlogits.ptr<float>(), x, w.router, N, H, E);
}

}  // namespace mf::model
