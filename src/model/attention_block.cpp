#include "model/attention_block.h"

#include "ops/ops.h"

namespace mf::model {

AttentionDims attention_dims(const AttentionBranch& a, int64_t hidden) {
    AttentionDims d{hidden,
                    a.num_heads,
                    a.num_kv_heads,
                    a.head_dim,
                    static_cast<float>(a.qk_norm_eps),
                    static_cast<float>(a.rope_theta)};
    d.qk_norm = a.qk_norm;
    d.qkv_bias = a.qkv_bias;
    d.o_bias = a.o_bias;
    d.rotary_dim = a.rotary_dim == a.head_dim ? -1 : a.rotary_dim;
    return d;
}

void declare_attention_params(ParamTable& table, const std::string& p, const AttentionDims& d) {
    const int64_t H = d.hidden, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    table.add(p + "q_proj.weight", {Dq, H}, ParamRole::weight);
    if (d.qkv_bias) table.add(p + "q_proj.bias", {Dq}, ParamRole::bias);
    table.add(p + "k_proj.weight", {Dkv, H}, ParamRole::weight);
    if (d.qkv_bias) table.add(p + "k_proj.bias", {Dkv}, ParamRole::bias);
    table.add(p + "v_proj.weight", {Dkv, H}, ParamRole::weight);
    if (d.qkv_bias) table.add(p + "v_proj.bias", {Dkv}, ParamRole::bias);
    table.add(p + "o_proj.weight", {H, Dq}, ParamRole::weight);
    if (d.o_bias) table.add(p + "o_proj.bias", {H}, ParamRole::bias);
    if (d.qk_norm == QkNorm::per_head) {
        table.add(p + "q_norm.weight", {d.head_dim}, ParamRole::norm);
        table.add(p + "k_norm.weight", {d.head_dim}, ParamRole::norm);
    } else if (d.qk_norm == QkNorm::full_width) {
        table.add(p + "q_norm.weight", {Dq}, ParamRole::norm);
        table.add(p + "k_norm.weight", {Dkv}, ParamRole::norm);
    }
}

AttentionWeights attention_weights(const std::function<Tensor(const std::string&)>& at, const std::string& p,
                                   const AttentionDims& d) {
    AttentionWeights w;
    w.wq = at(p + "q_proj.weight");
    w.wk = at(p + "k_proj.weight");
    w.wv = at(p + "v_proj.weight");
    w.wo = at(p + "o_proj.weight");
    if (d.qk_norm != QkNorm::none) {
        w.q_norm = at(p + "q_norm.weight");
        w.k_norm = at(p + "k_norm.weight");
    }
    if (d.qkv_bias) {
        w.bq = at(p + "q_proj.bias");
        w.bk = at(p + "k_proj.bias");
        w.bv = at(p + "v_proj.bias");
    }
    if (d.o_bias) w.bo = at(p + "o_proj.bias");
    return w;
}

void AttentionActs::alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act) {
    const int64_t N = B * T, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    if (d.qk_norm != QkNorm::none) {
        const bool per_head = d.qk_norm == QkNorm::per_head;
        q_raw = arena.alloc(act, {N, Dq});
        k_raw = arena.alloc(act, {N, Dkv});
        q_rstd = arena.alloc(DType::f32, {N * (per_head ? d.num_heads : 1)});
        k_rstd = arena.alloc(DType::f32, {N * (per_head ? d.num_kv_heads : 1)});
    }
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
    if (d.qk_norm != QkNorm::none) {
        dq_raw = arena.alloc(act, {N, Dq});
        dk_raw = arena.alloc(act, {N, Dkv});
    }
}

void attention_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_raw, const Tensor& k_raw,
                           const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& x, const AttentionWeights& w,
                           const AttentionDims& d, const Tensor& positions) {
    // Without QK-norm the projections go straight into q and k, which RoPE then rotates in place.
    const bool normed = d.qk_norm != QkNorm::none;
    const Tensor& qp = normed ? q_raw : q;
    const Tensor& kp = normed ? k_raw : k;
    ops::matmul_forward(qp, x, w.wq);
    ops::matmul_forward(kp, x, w.wk);
    ops::matmul_forward(v, x, w.wv);
    if (d.qkv_bias) {
        ops::add_bias(qp, w.bq);
        ops::add_bias(kp, w.bk);
        ops::add_bias(v, w.bv);
    }
    switch (d.qk_norm) {
        case QkNorm::per_head:
            ops::qknorm_rope_forward(q, k, q_rstd, k_rstd, q_raw, k_raw, w.q_norm, w.k_norm, positions, d.num_heads,
                                     d.num_kv_heads, d.norm_eps, d.rope_theta);
            return;
        case QkNorm::full_width:
            ops::rmsnorm_forward(q, q_rstd, q_raw, w.q_norm, d.norm_eps);
            ops::rmsnorm_forward(k, k_rstd, k_raw, w.k_norm, d.norm_eps);
            break;
        case QkNorm::none:
            break;
    }
    if (d.rotary() > 0)
        ops::rope_forward(q, k, q, k, positions, d.num_heads, d.num_kv_heads, d.head_dim, d.rotary(), d.rope_theta);
}

void attention_block_forward(const Tensor& y, AttentionActs& a, const Tensor& x, const AttentionWeights& w,
                             const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                             const Tensor& doc_ids) {
    attention_qkv_forward(a.q, a.k, a.v, a.q_raw, a.k_raw, a.q_rstd, a.k_rstd, x, w, d, positions);
    ops::attention_forward(a.attn, a.lse, a.q, a.k, a.v, doc_ids, B, T, d.num_heads, d.num_kv_heads);
    ops::matmul_forward(y, a.attn, w.wo);
    if (d.o_bias) ops::add_bias(y, w.bo);
}

void attention_block_backward(const Tensor& dx, const AttentionWeights& g, AttentionScratch& s, const Tensor& dy,
                              const Tensor& x, const AttentionActs& a, const AttentionWeights& w,
                              const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                              const Tensor& doc_ids) {
    // Every scratch gradient below is written, not added to.
    if (d.o_bias) ops::bias_backward(g.bo, dy);
    ops::matmul_backward(s.dattn, g.wo, dy, a.attn, w.wo, false);
    ops::attention_backward(s.dq, s.dk, s.dv, s.dattn, a.q, a.k, a.v, a.attn, a.lse, doc_ids, B, T, d.num_heads,
                            d.num_kv_heads);
    // The gradients of the projections (before norm and rope): dq_raw, dk_raw with QK-norm, else dq, dk
    // rotated back in place.
    const bool normed = d.qk_norm != QkNorm::none;
    const Tensor& dqp = normed ? s.dq_raw : s.dq;
    const Tensor& dkp = normed ? s.dk_raw : s.dk;
    if (d.qk_norm == QkNorm::per_head) {
        ops::qknorm_rope_backward(s.dq_raw, s.dk_raw, g.q_norm, g.k_norm, s.dq, s.dk, a.q_raw, a.k_raw, w.q_norm,
                                  w.k_norm, a.q_rstd, a.k_rstd, positions, d.num_heads, d.num_kv_heads, d.rope_theta);
    } else {
        if (d.rotary() > 0)
            ops::rope_backward(s.dq, s.dk, s.dq, s.dk, positions, d.num_heads, d.num_kv_heads, d.head_dim, d.rotary(),
                               d.rope_theta);
        if (d.qk_norm == QkNorm::full_width) {
            ops::zero(s.dq_raw);  // rmsnorm_backward adds into its input gradient
            ops::zero(s.dk_raw);
            ops::rmsnorm_backward(s.dq_raw, g.q_norm, s.dq, a.q_raw, w.q_norm, a.q_rstd);
            ops::rmsnorm_backward(s.dk_raw, g.k_norm, s.dk, a.k_raw, w.k_norm, a.k_rstd);
        }
    }
    if (d.qkv_bias) {
        ops::bias_backward(g.bq, dqp);
        ops::bias_backward(g.bk, dkp);
        ops::bias_backward(g.bv, s.dv);
    }
    ops::matmul_backward(dx, g.wq, dqp, x, w.wq);
    ops::matmul_backward(dx, g.wk, dkp, x, w.wk);
    ops::matmul_backward(dx, g.wv, s.dv, x, w.wv);
}

}  // namespace mf::model
