// Qwen3 self-attention block: q/k/v projections, per-head RMSNorm on q and k (QK-norm), RoPE,
// causal GQA attention inside documents, output projection.
//
//   q = rope(rmsnorm_D(x·Wqᵀ)), k = rope(rmsnorm_D(x·Wkᵀ)), v = x·Wvᵀ
//   y = attention(q, k, v)·Woᵀ
// Forward writes y; backward accumulates into dx and into the parameter gradients (+=).
// Activations are in the activation dtype (f32 on the CPU, bf16 on the GPU); the norm statistics
// and the attention log-sum-exp are f32.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mf::model {

struct AttentionDims {
    int64_t hidden, num_heads, num_kv_heads, head_dim;
    float norm_eps, rope_theta;
};

struct AttentionWeights {
    Tensor wq, wk, wv, wo, q_norm, k_norm;  // HF shapes: [Hq·D, H], [Hkv·D, H], [Hkv·D, H], [H, Hq·D], [D], [D]
};

// Saved for backward, one set per layer.
struct AttentionActs {
    Tensor q_raw, k_raw;    // projections before QK-norm
    Tensor q_rstd, k_rstd;  // QK-norm statistics (f32)
    Tensor q, k, v;         // after norm + rope: attention inputs
    Tensor attn, lse;       // attention output [N, Hq·D] and its log-sum-exp (f32)
    void alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act);
};

// Backward temporaries, shared by all layers.
struct AttentionScratch {
    Tensor dq, dk, dv, dattn, dq_raw, dk_raw;
    void alloc(Arena& arena, const AttentionDims& d, int64_t B, int64_t T, DType act);
};

void attention_block_forward(const Tensor& y, AttentionActs& acts, const Tensor& x, const AttentionWeights& w,
                             const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                             const Tensor& doc_ids);

void attention_block_backward(const Tensor& dx, const AttentionWeights& grads, AttentionScratch& scratch,
                              const Tensor& dy, const Tensor& x, const AttentionActs& acts, const AttentionWeights& w,
                              const AttentionDims& d, int64_t B, int64_t T, const Tensor& positions,
                              const Tensor& doc_ids);

}  // namespace mf::model
