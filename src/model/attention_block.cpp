#include "model/attention_block.h"

#include <cstring>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/matmul.h"
#include "kernels/cpu/rmsnorm.h"
#include "kernels/cpu/rope.h"

namespace mf::model {

void AttentionActs::alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T) {
    const int64_t N = B * T;
    q_raw = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    k_raw = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
    q_rstd = arena.alloc(DType::f32, {N * d.num_heads});
    k_rstd = arena.alloc(DType::f32, {N * d.num_kv_heads});
    q = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    k = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
    v = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
    attn = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    lse = arena.alloc(DType::f32, {B, d.num_heads, T});
}

void AttentionScratch::alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T) {
    const int64_t N = B * T;
    dq = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    dk = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
    dv = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
    dattn = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    dq_raw = arena.alloc(DType::f32, {N, d.num_heads * d.head_dim});
    dk_raw = arena.alloc(DType::f32, {N, d.num_kv_heads * d.head_dim});
}

void attention_block_forward(float* y, AttentionActs& a, const float* x, const AttentionWeights& w,
                             const AttentionDims& d, int64_t B, int64_t T, const int32_t* positions,
                             const int32_t* doc_ids) {
    const int64_t N = B * T, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    cpu::matmul_forward(a.q_raw.ptr<float>(), x, w.wq, N, d.hidden, Dq);
    cpu::matmul_forward(a.k_raw.ptr<float>(), x, w.wk, N, d.hidden, Dkv);
    cpu::matmul_forward(a.v.ptr<float>(), x, w.wv, N, d.hidden, Dkv);
    cpu::rmsnorm_forward(a.q.ptr<float>(), a.q_rstd.ptr<float>(), a.q_raw.ptr<float>(), w.q_norm, N * d.num_heads,
                         d.head_dim, d.norm_eps);
    cpu::rmsnorm_forward(a.k.ptr<float>(), a.k_rstd.ptr<float>(), a.k_raw.ptr<float>(), w.k_norm, N * d.num_kv_heads,
                         d.head_dim, d.norm_eps);
    cpu::rope_forward(a.q.ptr<float>(), positions, N, d.num_heads, d.head_dim, d.rope_theta);
    cpu::rope_forward(a.k.ptr<float>(), positions, N, d.num_kv_heads, d.head_dim, d.rope_theta);
    const cpu::AttentionShape s{B, T, d.num_heads, d.num_kv_heads, d.head_dim};
    cpu::attention_forward(a.attn.ptr<float>(), a.lse.ptr<float>(), a.q.ptr<float>(), a.k.ptr<float>(),
                           a.v.ptr<float>(), doc_ids, s);
    cpu::matmul_forward(y, a.attn.ptr<float>(), w.wo, N, Dq, d.hidden);
}

void attention_block_backward(float* dx, const AttentionWeights& g, AttentionScratch& s, const float* dy,
                              const float* x, const AttentionActs& a, const AttentionWeights& w,
                              const AttentionDims& d, int64_t B, int64_t T, const int32_t* positions,
                              const int32_t* doc_ids) {
    const int64_t N = B * T, Dq = d.num_heads * d.head_dim, Dkv = d.num_kv_heads * d.head_dim;
    for (Tensor* t : {&s.dq, &s.dk, &s.dv, &s.dattn, &s.dq_raw, &s.dk_raw}) std::memset(t->data(), 0, t->nbytes());
    cpu::matmul_backward(s.dattn.ptr<float>(), g.wo, dy, a.attn.ptr<float>(), w.wo, N, Dq, d.hidden);
    const cpu::AttentionShape shape{B, T, d.num_heads, d.num_kv_heads, d.head_dim};
    cpu::attention_backward(s.dq.ptr<float>(), s.dk.ptr<float>(), s.dv.ptr<float>(), s.dattn.ptr<float>(),
                            a.q.ptr<float>(), a.k.ptr<float>(), a.v.ptr<float>(), a.attn.ptr<float>(),
                            a.lse.ptr<float>(), doc_ids, shape);
    cpu::rope_backward(s.dq.ptr<float>(), positions, N, d.num_heads, d.head_dim, d.rope_theta);
    cpu::rope_backward(s.dk.ptr<float>(), positions, N, d.num_kv_heads, d.head_dim, d.rope_theta);
    cpu::rmsnorm_backward(s.dq_raw.ptr<float>(), g.q_norm, s.dq.ptr<float>(), a.q_raw.ptr<float>(), w.q_norm,
                          a.q_rstd.ptr<float>(), N * d.num_heads, d.head_dim);
    cpu::rmsnorm_backward(s.dk_raw.ptr<float>(), g.k_norm, s.dk.ptr<float>(), a.k_raw.ptr<float>(), w.k_norm,
                          a.k_rstd.ptr<float>(), N * d.num_kv_heads, d.head_dim);
    cpu::matmul_backward(dx, g.wq, s.dq_raw.ptr<float>(), x, w.wq, N, d.hidden, Dq);
    cpu::matmul_backward(dx, g.wk, s.dk_raw.ptr<float>(), x, w.wk, N, d.hidden, Dkv);
    cpu::matmul_backward(dx, g.wv, s.dv.ptr<float>(), x, w.wv, N, d.hidden, Dkv);
}

}  // namespace mf::model
