// Row-range copies: the placement of expert parallelism's exchanged rows (model/ffn_blocks.cpp).
// Rows are `row_bytes` bytes each (any dtype: the model moves rows of H bf16 or f32 elements), so
// these are pure copies and bitwise exact; the GPU version is kernels/cuda/rows.cuh.
#pragma once

#include <cstdint>

namespace mf::cpu {

// Copies of row ranges: for each piece p (pieces[3p .. 3p + 2] = src_row, dst_row, rows), dst rows
// [dst_row, dst_row + rows) = src rows [src_row, src_row + rows). Every piece must lie inside both
// buffers (num_src_rows, num_dst_rows; mf::Error otherwise, nothing copied); pieces must not write
// the same dst row twice, and dst and src must not overlap.
void copy_row_pieces(void* dst, const void* src, const int64_t* pieces, int64_t num_pieces, int64_t num_dst_rows,
                     int64_t num_src_rows, int64_t row_bytes);
// The checks of copy_row_pieces (shared with the GPU kernel's entry).
void check_row_pieces(const char* op, const void* dst, const void* src, const int64_t* pieces, int64_t num_pieces,
                      int64_t num_dst_rows, int64_t num_src_rows, int64_t row_bytes);

}  // namespace mf::cpu
