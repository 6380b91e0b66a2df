// Rotary position embedding, HF "rotate_half" layout: within each head of dim D, the first
// rotary_dim dims (R, even, <= D) rotate, element i (i < R/2) pairing with element i + R/2 at angle
// pos · θ^(-2i/R); dims [R, D) pass through unchanged (HF's partial_rotary_factor = R / D).
#pragma once

#include <cstdint>

namespace mf::cpu {

// In place on x[N, num_heads, D]; positions[N]. inv_freq is computed in fp32 as HF does.
void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, int64_t rotary_dim,
                  float theta);
// In place on dx[N, num_heads, D]: the inverse (transposed) rotation; pass-through dims unchanged.
void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, int64_t rotary_dim,
                   float theta);

// The whole head rotates (rotary_dim = D).
void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta);
void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta);

// The rotation given by tables cos, sin [N, D] (transformers' position_embeddings: any rope type),
// in place on x[N, num_heads, D], the whole head, as transformers' q·cos + rotate_half(q)·sin:
//   y[i] = x[i]·cos[i] − x[i+D/2]·sin[i]      y[i+D/2] = x[i+D/2]·cos[i+D/2] + x[i]·sin[i+D/2]
void rope_table_forward(float* x, const float* cos, const float* sin, int64_t N, int64_t num_heads, int64_t D);
// Its transpose, in place on dx[N, num_heads, D]:
//   d[i] = dy[i]·cos[i] + dy[i+D/2]·sin[i+D/2]      d[i+D/2] = dy[i+D/2]·cos[i+D/2] − dy[i]·sin[i]
void rope_table_backward(float* dx, const float* cos, const float* sin, int64_t N, int64_t num_heads, int64_t D);

}  // namespace mf::cpu
