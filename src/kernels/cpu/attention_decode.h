// Attention of new tokens over a KV cache (generation): n queries at positions first .. first+n-1
// attend the cached keys and values of positions 0 .. their own (causal, GQA, one document).
// q[n, Hq, D], out[n, Hq, D]; k/v[first + n, Hkv, D] (token-major, the cache's first rows, the new
// tokens' own rows included); query head h reads KV head h / (Hq/Hkv); scale = 1/sqrt(D).
// The arithmetic is attention_forward's (kernels/cpu/attention.h) for the same row, in the same
// order, so a query's output is bit for bit the one a full causal attention over the prefix gives.
#pragma once

#include <cstdint>

namespace mf::cpu {

struct AttentionDecodeShape {
    int64_t n, first, Hq, Hkv, D;
};

void attention_decode_forward(float* out, const float* q, const float* k, const float* v,
                              const AttentionDecodeShape& s);

}  // namespace mf::cpu
