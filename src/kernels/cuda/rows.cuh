// Row-range copies on the GPU: the placement of expert parallelism's exchanged rows
// (model/ffn_blocks.cpp). Pure copies, bitwise equal to the CPU reference (spec: kernels/cpu/rows.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace mf::cuda {

// kernels/cpu/rows.h's copy_row_pieces on the GPU (same checks, on the host pieces), one launch per
// kMaxRowPieces pieces; the pieces travel as kernel arguments, so nothing is uploaded.
constexpr int64_t kMaxRowPieces = 96;
void copy_row_pieces(void* dst, const void* src, const int64_t* pieces, int64_t num_pieces, int64_t num_dst_rows,
                     int64_t num_src_rows, int64_t row_bytes, cudaStream_t stream);

}  // namespace mf::cuda
