// Rotary position embedding, HF "rotate_half" layout: within each head of dim D, element i
// (i < D/2) pairs with element i + D/2, rotated by angle pos · θ^(-2i/D).
#pragma once

#include <cstdint>

namespace mf::cpu {

// In place on x[N, num_heads, D]; positions[N]. inv_freq is computed in fp32 as HF does.
void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta);
// In place on dx[N, num_heads, D]: the inverse (transposed) rotation.
void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta);

}  // namespace mf::cpu
