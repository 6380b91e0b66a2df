// Scaled dot-product attention with GQA, causal masking and packed documents.
// q[B, T, Hq, D], k/v[B, T, Hkv, D], out[B, T, Hq, D]; query head h reads KV head h / (Hq/Hkv).
// Token t of row b attends token s iff s <= t and doc_ids[b, t] == doc_ids[b, s], so packed
// sequences never attend across documents. scale = 1/sqrt(D).
#pragma once

#include <cstdint>

namespace mf::cpu {

struct AttentionShape {
    int64_t B, T, Hq, Hkv, D;
};

// lse[B, Hq, T] = log-sum-exp of the scaled, masked scores (saved for backward).
void attention_forward(float* out, float* lse, const float* q, const float* k, const float* v, const int32_t* doc_ids,
                       const AttentionShape& s);
// dq, dk, dv are accumulated (+=).
void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                        const float* v, const float* out, const float* lse, const int32_t* doc_ids,
                        const AttentionShape& s);

}  // namespace mf::cpu
