// Rotary position embedding, HF "rotate_half" layout, fp32 CPU reference.
// Of each head of D, the first R = rotary_dim dims rotate (R = D: the whole head). inv_freq[i] =
// 1 / θ^(2i/R), computed in fp32 exactly as HF writes it (1.0 / (base ** (arange(0, R, 2).float() /
// R)), with R = int(D · partial_rotary_factor)); the angle of pair i at position p is the fp32
// product (float)p · inv_freq[i] and its cos/sin are fp32. Element i < R/2 pairs with element
// i + R/2 (both use the same angle):
//   forward   y[i] = x[i]·cos − x[i+R/2]·sin      y[i+R/2] = x[i+R/2]·cos + x[i]·sin
//   backward  the transposed rotation (angle → −angle), applied to the gradient in place.
// Dims [R, D) are not touched (HF concatenates them back unrotated, so their gradient passes too).
// The cos/sin row is computed once per token and shared by all its heads.
#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "core/check.h"

namespace mf::cpu {

namespace {

// One token's heads x[num_heads, D], in place: the first R dims of each rotated by the rows c, s [R]
// (halves that may differ: y[i] = a·c[i] − b·s[i], y[i+R/2] = b·c[i+R/2] + a·s[i+R/2], with
// a = x[i], b = x[i+R/2], in transformers' order x·cos + rotate_half(x)·sin), or `transposed` by the
// transpose of that rotation (the backward).
void rotate_token(float* x, int64_t num_heads, int64_t D, int64_t R, const float* c, const float* s, bool transposed) {
    const int64_t half = R / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        float* lo = x + h * D;
        float* hi = lo + half;
        for (int64_t i = 0; i < half; ++i) {
            const float a = lo[i];
            const float b = hi[i];
            if (transposed) {
                lo[i] = a * c[i] + b * s[half + i];
                hi[i] = b * c[half + i] + a * (-s[i]);
            } else {
                lo[i] = a * c[i] + (-b) * s[i];
                hi[i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

// By positions: each token's row of R angles (both halves the same), transposed for the backward.
void rope_rotate(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, int64_t R, float theta,
                 bool transposed) {
    MF_CHECK(N >= 0 && num_heads >= 0 && D > 0 && R > 0 && R % 2 == 0 && R <= D, "rope: bad shape N=", N,
             " heads=", num_heads, " D=", D, " rotary_dim=", R, " (rotary_dim must be even and in [2, D])");
    MF_CHECK(theta > 0.0f, "rope: theta must be positive, got ", theta);
    const int64_t half = R / 2;
    std::vector<float> inv_freq(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(R));
    }
    std::vector<float> cos_row(static_cast<size_t>(R));
    std::vector<float> sin_row(static_cast<size_t>(R));
    for (int64_t n = 0; n < N; ++n) {
        const float pos = static_cast<float>(positions[n]);
        for (int64_t i = 0; i < half; ++i) {
            const float angle = pos * inv_freq[i];
            cos_row[i] = cos_row[half + i] = std::cos(angle);
            sin_row[i] = sin_row[half + i] = std::sin(angle);
        }
        rotate_token(x + n * num_heads * D, num_heads, D, R, cos_row.data(), sin_row.data(), transposed);
    }
}

// By tables cos, sin [N, D]: the whole head.
void rope_table_rotate(float* x, const float* cos, const float* sin, int64_t N, int64_t num_heads, int64_t D,
                       bool transposed) {
    MF_CHECK(N >= 0 && num_heads >= 0 && D > 0 && D % 2 == 0, "rope: bad shape N=", N, " heads=", num_heads, " D=", D,
             " (D must be even)");
    for (int64_t n = 0; n < N; ++n) {
        rotate_token(x + n * num_heads * D, num_heads, D, D, cos + n * D, sin + n * D, transposed);
    }
}

}  // namespace

void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, int64_t rotary_dim,
                  float theta) {
    rope_rotate(x, positions, N, num_heads, D, rotary_dim, theta, false);
}

void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, int64_t rotary_dim,
                   float theta) {
    rope_rotate(dx, positions, N, num_heads, D, rotary_dim, theta, true);
}

void rope_forward(float* x, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta) {
    rope_rotate(x, positions, N, num_heads, D, D, theta, false);
}

void rope_backward(float* dx, const int32_t* positions, int64_t N, int64_t num_heads, int64_t D, float theta) {
    rope_rotate(dx, positions, N, num_heads, D, D, theta, true);
}

void rope_table_forward(float* x, const float* cos, const float* sin, int64_t N, int64_t num_heads, int64_t D) {
    rope_table_rotate(x, cos, sin, N, num_heads, D, false);
}

void rope_table_backward(float* dx, const float* cos, const float* sin, int64_t N, int64_t num_heads, int64_t D) {
    rope_table_rotate(dx, cos, sin, N, num_heads, D, true);
}

}  // namespace mf::cpu
