// The cached-KV attention op of generation (model/generate.h), backend-neutral like ops.h.
//
//   out[n, Hq·D] = causal GQA attention of q[n, Hq·D], the queries of positions first .. first+n-1,
//                  over k/v[first + n, Hkv·D] (token-major: a KV cache's first rows, the queries'
//                  own tokens included)
// On the CPU the result of each query is bit for bit attention_forward's row over the whole prefix
// (kernels/cpu/attention_decode.h). NOTE: there is no CUDA kernel yet; attention_decode_supported
// says so, and the generator then runs ops::attention_forward over the prefix instead.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace mf::ops {

bool attention_decode_supported(Device device);
void attention_decode_forward(const Tensor& out, const Tensor& q, const Tensor& k, const Tensor& v, int64_t first,
                              int64_t num_heads, int64_t num_kv_heads);

}  // namespace mf::ops
