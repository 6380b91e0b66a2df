// Self-attention block: q/k/v projections (optionally with biases), QK-norm (none, per head or over
// the whole projection), RoPE on the leading rotary dims of each head, causal GQA attention inside
// documents, output projection (optionally with a bias).
//
//   q = rope(norm_q(x·Wqᵀ + bq)), k = rope(norm_k(x·Wkᵀ + bk)), v = x·Wvᵀ + bv
//   y = attention(q, k, v)·Woᵀ + bo
//   norm: identity | RMSNorm over each head (weight [D], Qwen3) | RMSNorm over all heads (weight
//   [Hq·D] and [Hkv·D], OLMoE)
// Forward writes y; backward accumulates into dx and into the parameter gradients (+=).
// Activations are in the activation dtype (f32 on the CPU, bf16 on the GPU); the norm statistics
// and the attention log-sum-exp are f32.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/tensor.h"
#include "model/param_table.h"
#include "model/spec.h"

namespace mf::model {

struct AttentionDims {
    int64_t hidden, num_heads, num_kv_heads, head_dim;
    float norm_eps, rope_theta;
    QkNorm qk_norm = QkNorm::per_head;
    bool qkv_bias = false, o_bias = false;
    int64_t rotary_dim = -1;  // the leading dims of each head that rotate; -1: all of them
    int64_t rotary() const { return rotary_dim < 0 ? head_dim : rotary_dim; }
};
// The dims of a spec's attention branch in a model of width `hidden`.
AttentionDims attention_dims(const AttentionBranch& a, int64_t hidden);

struct AttentionWeights {
    Tensor wq, wk, wv, wo, q_norm, k_norm;  // HF shapes: [Hq·D, H], [Hkv·D, H], [Hkv·D, H], [H, Hq·D],
                                            // q/k norm [D] (per head) or [Hq·D]/[Hkv·D] (full width)
    Tensor bq{}, bk{}, bv{}, bo{};          // [Hq·D], [Hkv·D], [Hkv·D], [H] where the dims have them
};

// The branch's parameters under `prefix` ("model.layers.3.self_attn."), in HF v5 names.
void declare_attention_params(ParamTable& table, const std::string& prefix, const AttentionDims& d);
// Views of them (params or grads) through `at(name)`.
AttentionWeights attention_weights(const std::function<Tensor(const std::string&)>& at, const std::string& prefix,
                                   const AttentionDims& d);

// Saved for backward, one set per layer.
struct AttentionActs {
    Tensor q_raw, k_raw;    // projections before QK-norm (with QK-norm only)
    Tensor q_rstd, k_rstd;  // QK-norm statistics (f32): [N·Hq], [N·Hkv] per head; [N], [N] full width
    Tensor q, k, v;         // after norm + rope: attention inputs
    Tensor attn, lse;       // attention output [N, Hq·D] and its log-sum-exp (f32)
    void alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act);
};

// Backward temporaries, shared by all layers.
struct AttentionScratch {
    Tensor dq, dk, dv, dattn, dq_raw, dk_raw;
    void alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act);
};

// The attention inputs from x (what the block and the KV-cache decoder share): q [N, Hq·D], k, v
// [N, Hkv·D] written; q_raw, k_raw, q_rstd, k_rstd as AttentionActs holds them (unused without QK-norm).
void attention_qkv_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_raw, const Tensor& k_raw,
                           const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& x, const AttentionWeights& w,
                           const AttentionDims& d, const Tensor& positions);

void attention_block_forward(const Tensor& y, AttentionActs& acts, const Tensor& x, const AttentionWeights& w,
                             const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                             const Tensor& doc_ids);

void attention_block_backward(const Tensor& dx, const AttentionWeights& grads, AttentionScratch& scratch,
                              const Tensor& dy, const Tensor& x, const AttentionActs& acts, const AttentionWeights& w,
                              const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                              const Tensor& doc_ids);

}  // namespace mf::model
