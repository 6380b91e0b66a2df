// Dense matmul (torch.nn.Linear layout), fp32 CPU reference.
//
// Every output element is a plain sequential fp32 sum over its reduction index in ascending order
// (k = 0, 1, ..., K-1), started from 0; the accumulating outputs (dinp, dweight) then add that sum
// to their old value once. An element's bits therefore depend only on its own inputs, never on the
// tile it falls in nor on how many rows the call had: a row computed alone or inside a batch (or on
// another EP/DP shard) is identical bit for bit.
//
// Speed comes from a register tile: kTileRows rows × kTileWidth contiguous columns accumulate
//   acc[r][j] += a(r, k) · b(k, j)            for k = 0..K-1
// where row k of b is contiguous, so the j-loop vectorises without reassociating any sum (each
// SIMD lane is its own sequential sum). The three products map onto it without transposing a whole
// matrix:
//   forward   out[n, o]   = Σ_c inp[n, c] · w[o, c]     b = a kTileWidth-column panel of wᵀ, packed
//   dinp      dinp[n, c] += Σ_o dout[n, o] · w[o, c]    b = rows of w (already contiguous in c)
//   dweight   dw[o, c]   += Σ_n dout[n, o] · inp[n, c]  b = rows of inp; a walks down columns of dout
// Column panels narrower than kTileWidth (the ragged right edge) are copied into a zero-padded
// panel first, so a single tile kernel serves every case.
#include "kernels/cpu/matmul.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/check.h"

namespace mf::cpu {

namespace {

constexpr int kTileRows = 4;
constexpr int kTileWidth = 16;

// ---------------------------------------------------------------------------------------------
// tile kernel

// dst[r, j] (=, or += when accumulate) Σ_k a[r·a_row + k·a_k] · b[k·b_k + j] for r < rows,
// j < width. b must hold kTileWidth readable floats per k (columns >= width may be anything finite).
// NOTE: GCC/Clang vector extensions, because the auto-vectoriser shuffles this loop nest badly.
// Lane-wise vector arithmetic is plain IEEE fp32 per lane, so the bits do not depend on the ISA.
using TileVec = float __attribute__((vector_size(kTileWidth * sizeof(float))));

template <int kRows>
void tile_kernel(float* dst, int64_t dst_stride, int64_t width, bool accumulate, const float* a, int64_t a_row,
                 int64_t a_k, const float* b, int64_t b_k, int64_t K) {
    TileVec acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = TileVec{};
    for (int64_t k = 0; k < K; ++k) {
        TileVec b_vec;
        std::memcpy(&b_vec, b + k * b_k, sizeof(b_vec));
        for (int r = 0; r < kRows; ++r) acc[r] += a[r * a_row + k * a_k] * b_vec;
    }
    for (int r = 0; r < kRows; ++r) {
        float sums[kTileWidth];
        std::memcpy(sums, &acc[r], sizeof(sums));
        float* d = dst + r * dst_stride;
        if (accumulate) {
            for (int64_t j = 0; j < width; ++j) d[j] += sums[j];
        } else {
            for (int64_t j = 0; j < width; ++j) d[j] = sums[j];
        }
    }
}

// One tile of tile_rows (1..kTileRows) rows against a packed kTileWidth-wide panel.
void run_tile(int64_t tile_rows, float* dst, int64_t dst_stride, int64_t width, bool accumulate, const float* a,
              int64_t a_row, int64_t a_k, const float* panel, int64_t K) {
    static_assert(kTileRows == 4, "run_tile dispatches on 1..4 rows");
    switch (tile_rows) {
        case 4:
            tile_kernel<4>(dst, dst_stride, width, accumulate, a, a_row, a_k, panel, kTileWidth, K);
            break;
        case 3:
            tile_kernel<3>(dst, dst_stride, width, accumulate, a, a_row, a_k, panel, kTileWidth, K);
            break;
        case 2:
            tile_kernel<2>(dst, dst_stride, width, accumulate, a, a_row, a_k, panel, kTileWidth, K);
            break;
        default:
            tile_kernel<1>(dst, dst_stride, width, accumulate, a, a_row, a_k, panel, kTileWidth, K);
            break;
    }
}

// Scratch that lives as long as the thread, so repeated calls do not page-fault fresh buffers.
std::vector<float>& scratch(int which) {
    thread_local std::vector<float> buffers[2];
    return buffers[which];
}

// dst[rows, cols] (=, or += when accumulate) A · B over k < K, where
//   A(r, k) = a[r·a_row + k·a_k]   and   B(k, c) = b[k·b_k + c·b_c].
// B is copied kTileWidth columns at a time into a contiguous, zero-padded panel (this also avoids
// cache-set conflicts when b_k is a large power of two). When A walks down columns (a_k != 1) it is
// first repacked so that each row tile reads one contiguous stream.
void gemm(float* dst, int64_t dst_stride, int64_t rows, int64_t cols, bool accumulate, const float* a, int64_t a_row,
          int64_t a_k, const float* b, int64_t b_k, int64_t b_c, int64_t K) {
    if (rows == 0 || cols == 0) return;
    const int64_t num_row_tiles = (rows + kTileRows - 1) / kTileRows;
    const bool pack_a = a_k != 1;
    if (pack_a) {
        // packed_a[tile][k][r] = A(tile·kTileRows + r, k), zero past the last row.
        std::vector<float>& packed_a = scratch(0);
        packed_a.assign(static_cast<size_t>(num_row_tiles * K * kTileRows), 0.0f);
        for (int64_t tile = 0; tile < num_row_tiles; ++tile) {
            const int64_t tile_rows = std::min<int64_t>(kTileRows, rows - tile * kTileRows);
            float* p = packed_a.data() + tile * K * kTileRows;
            for (int64_t k = 0; k < K; ++k) {
                for (int64_t r = 0; r < tile_rows; ++r)
                    p[k * kTileRows + r] = a[(tile * kTileRows + r) * a_row + k * a_k];
            }
        }
    }
    std::vector<float>& panel = scratch(1);
    panel.resize(static_cast<size_t>(K * kTileWidth));
    for (int64_t c0 = 0; c0 < cols; c0 += kTileWidth) {
        const int64_t width = std::min<int64_t>(kTileWidth, cols - c0);
        if (b_c == 1) {
            for (int64_t k = 0; k < K; ++k) {
                float* p = panel.data() + k * kTileWidth;
                std::copy_n(b + k * b_k + c0, width, p);
                std::fill(p + width, p + kTileWidth, 0.0f);
            }
        } else {
            for (int64_t j = 0; j < kTileWidth; ++j) {
                const float* src = b + (c0 + j) * b_c;
                for (int64_t k = 0; k < K; ++k) panel[k * kTileWidth + j] = j < width ? src[k * b_k] : 0.0f;
            }
        }
        for (int64_t tile = 0; tile < num_row_tiles; ++tile) {
            const int64_t r0 = tile * kTileRows;
            float* d = dst + r0 * dst_stride + c0;
            const float* a_tile = pack_a ? scratch(0).data() + tile * K * kTileRows : a + r0 * a_row;
            const int64_t tile_a_row = pack_a ? 1 : a_row;
            const int64_t tile_a_k = pack_a ? kTileRows : a_k;
            const int64_t tile_rows = std::min<int64_t>(kTileRows, rows - r0);
            run_tile(tile_rows, d, dst_stride, width, accumulate, a_tile, tile_a_row, tile_a_k, panel.data(), K);
        }
    }
}

void check_shape(int64_t N, int64_t C, int64_t OC) {
    MF_CHECK(N >= 0 && C >= 0 && OC >= 0, "matmul: negative shape N=", N, " C=", C, " OC=", OC);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// public entry

void matmul_forward(float* out, const float* inp, const float* weight, int64_t N, int64_t C, int64_t OC) {
    check_shape(N, C, OC);
    // out[n, o] = Σ_c inp[n, c] · weight[o, c]:  A = inp, B(c, o) = weight[o·C + c].
    gemm(out, OC, N, OC, /*accumulate=*/false, inp, C, 1, weight, 1, C, C);
}

void matmul_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight, int64_t N,
                     int64_t C, int64_t OC) {
    check_shape(N, C, OC);
    if (dinp != nullptr) {
        // dinp[n, c] += Σ_o dout[n, o] · weight[o, c]:  A = dout, B = weight.
        gemm(dinp, C, N, C, /*accumulate=*/true, dout, OC, 1, weight, C, 1, OC);
    }
    if (dweight != nullptr) {
        // dweight[o, c] += Σ_n dout[n, o] · inp[n, c]:  A(o, n) = dout[n·OC + o], B = inp.
        gemm(dweight, C, OC, C, /*accumulate=*/true, dout, 1, OC, inp, C, 1, N);
    }
}

}  // namespace mf::cpu
