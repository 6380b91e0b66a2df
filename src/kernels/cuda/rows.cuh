// Row gather and scatter by an index on the GPU: the reorders of expert parallelism (source-major
// <-> expert-major, model/ffn_blocks.cpp). Rows are `row_bytes` bytes (any dtype; the model moves
// rows of H bf16 elements), so both are pure copies and bitwise equal to the CPU reference.
// CPU reference and spec: kernels/cpu/rows.h.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mf::cuda {

// dst [num_rows, row_bytes] (written): row i = src row index[i]; an index outside [0, num_src_rows)
// gives a zero row. index [num_rows] int32 on the device. dst and src must not overlap.
void gather_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_src_rows,
                 int64_t row_bytes, cudaStream_t stream);

// dst row index[i] (written) = src row i, i < num_rows; an index outside [0, num_dst_rows) writes
// nothing, rows of dst no index names are left as they were. index [num_rows] int32 on the device,
// expected without repeats (a repeated row gets one of its sources). dst and src must not overlap.
void scatter_rows(void* dst, const void* src, const int32_t* index, int64_t num_rows, int64_t num_dst_rows,
                  int64_t row_bytes, cudaStream_t stream);

// kernels/cpu/rows.h's copy_row_pieces on the GPU (same checks, on the host pieces), one launch per
// kMaxRowPieces pieces; the pieces travel as kernel arguments, so nothing is uploaded.
constexpr int64_t kMaxRowPieces = 96;
void copy_row_pieces(void* dst, const void* src, const int64_t* pieces, int64_t num_pieces, int64_t num_dst_rows,
                     int64_t num_src_rows, int64_t row_bytes, cudaStream_t stream);

}  // namespace mf::cuda
