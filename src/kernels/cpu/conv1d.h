// Mamba-2's causal depthwise conv1d with SiLU (HF nn.Conv1d(groups=C, padding=K−1) cut to the first
// T outputs, then silu), over packed documents: per channel c of token n,
//   pre[n, c] = bias[c] + Σ_{j<K} weight[c, j] · inp[n − (K−1) + j, c],   out = silu(pre),
// where a tap outside the token's segment (kernels/cpu/doc_segments.h: its row and document) is 0.
#pragma once

#include <cstdint>

namespace mf::cpu {

struct Conv1dShape {
    int64_t N;  // tokens (B rows of T)
    int64_t T;  // tokens per row
    int64_t C;  // channels
    int64_t K;  // taps
};

// out[N, C] (written); weight [C, K]; bias [C] or null; doc_ids [N] or null.
void conv1d_silu_forward(float* out, const float* inp, const float* weight, const float* bias, const int32_t* doc_ids,
                         const Conv1dShape& s);
// dinp[N, C] written; dweight[C, K] +=; dbias[C] += (may be null). The pre-activation is recomputed.
void conv1d_silu_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                          const float* weight, const float* bias, const int32_t* doc_ids, const Conv1dShape& s);

}  // namespace mf::cpu
