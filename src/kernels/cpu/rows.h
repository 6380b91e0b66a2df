// Row gather and scatter by an index: the reorders of expert parallelism (source-major <->
// expert-major, model/ffn_blocks.cpp). Rows are `row_bytes` bytes each (any dtype: the model moves
// rows of H bf16 or f32 elements), so both are pure copies and bitwise exact.
//   gather_rows   dst[i] = src[index[i]]   for i < num_rows (dst has num_rows rows)
//   scatter_rows  dst[index[i]] = src[i]   for i < num_rows (src has num_rows rows)
// Out-of-range indices never touch memory outside the buffers: a gather index outside
// [0, num_src_rows) writes a zero row, a scatter index outside [0, num_dst_rows) writes nothing (the
// GPU kernels, kernels/cuda/rows.cuh, do the same). dst and src must not overlap; a scatter index
// should not repeat (a repeated row gets one of its sources).
#pragma once

#include <cstdint>

namespace mf::cpu {

void gather_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_src_rows,
                 int64_t row_bytes);
void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_dst_rows,
                  int64_t row_bytes);

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
