#include "model/attention_block.h"

#include "ops/ops.h"

namespace mf::model {

void AttentionActs::alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act) {
    const int64_t N = B * T, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    q_raw = arena.alloc(act, {N, Dq});
    k_raw = arena.alloc(act, {N, Dkv});
    q_rstd = arena.alloc(DType::f32, {N * d.num_heads});
    k_rstd = arena.alloc(DType::f32, {N * d.num_kv_heads});
    q = arena.alloc(act, {N, Dq});
    k = arena.alloc(act, {N, Dkv});
    v = arena.alloc(act, {N, Dkv});
    attn = arena.alloc(act, {N, Dq});
    lse = arena.alloc(DType::f32, {B, d.num_heads, T});
}

void AttentionScratch::alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act) {
    const int64_t N = B * T, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    dq = arena.alloc(act, {N, Dq});
    dk = arena.alloc(act, {N, Dkv});
    dv = arena.alloc(act, {N, Dkv});
    dattn = arena.alloc(act, {N, Dq});
    dq_raw = arena.alloc(act, {N, Dq});
    dk_raw = arena.alloc(act, {N, Dkv});
}

void attention_block_forward(const Tensor& y, AttentionActs& a, const Tensor& x, const AttentionWeights& w,
                             const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                             const Tensor& doc_ids) {
    ops::matmul_forward(a.q_raw, x, w.wq);
    ops::matmul_forward(a.k_raw, x, w.wk);
    ops::matmul_forward(a.v, x, w.wv);
    ops::qknorm_rope_forward(a.q, a.k, a.q_rstd, a.k_rstd, a.q_raw, a.k_raw, w.q_norm, w.k_norm, positions, d.num_heads,
                             d.num_kv_heads, d.norm_eps, d.rope_theta);
    ops::attention_forward(a.attn, a.lse, a.q, a.k, a.v, doc_ids, B, T, d.num_heads, d.num_kv_heads);
    ops::matmul_forward(y, a.attn, w.wo);
}

void attention_block_backward(const Tensor& dx, const AttentionWeights& g, AttentionScratch& s, const Tensor& dy,
                              const Tensor& x, const AttentionActs& a, const AttentionWeights& w,
                              const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                              const Tensor& doc_ids) {
    // Every scratch gradient below is written, not added to.
    ops::matmul_backward(s.dattn, g.wo, dy, a.attn, w.wo, false);
    ops::attention_backward(s.dq, s.dk, s.dv, s.dattn, a.q, a.k, a.v, a.attn, a.lse, doc_ids, B, T, d.num_heads,
                            d.num_kv_heads);
    ops::qknorm_rope_backward(s.dq_raw, s.dk_raw, g.q_norm, g.k_norm, s.dq, s.dk, a.q_raw, a.k_raw, w.q_norm, w.k_norm,
                              a.q_rstd, a.k_rstd, positions, d.num_heads, d.num_kv_heads, d.rope_theta);
    ops::matmul_backward(dx, g.wq, s.dq_raw, x, w.wq);
    ops::matmul_backward(dx, g.wk, s.dk_raw, x, w.wk);
    ops::matmul_backward(dx, g.wv, s.dv, x, w.wv);
}

}  // namespace mf::model
