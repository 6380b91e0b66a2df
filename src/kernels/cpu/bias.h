// A bias added to every row of a projection (Qwen2's q/k/v biases, GPT-OSS's attention and expert
// biases): out[N, C] += bias[C], and its gradient dbias[C] += Σ_n dout[n, :].
#pragma once

#include <cstdint>

namespace mf::cpu {

// out[N, C] += bias[C], in place.
void add_bias(float* out, const float* bias, int64_t N, int64_t C);
// dbias[C] += Σ_n dout[n, c]: the column sums in fp32, rows in ascending order, then added once.
void bias_backward(float* dbias, const float* dout, int64_t N, int64_t C);

}  // namespace mf::cpu
