// Row-range copies, CUDA. One launch per kMaxRowPieces pieces, which travel as a kernel argument:
// blockIdx.y picks the piece, one warp copies one row in units of the widest access the row length
// and the pointers allow (16 bytes: 8 bf16; else 4, 2 or 1 byte), kUnroll loads in flight per lane
// before the stores. Pure copies: every output byte has one writer (pieces do not overlap in dst),
// the result is bitwise the CPU reference's.
#include <algorithm>
#include <limits>

#include "core/check.h"
#include "core/cuda_check.h"
#include "kernels/cpu/rows.h"
#include "kernels/cuda/rows.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kRowsPerBlock = kThreads / 32;
constexpr int kUnroll = 4;

// ----------------------------------------------------------------------------------------------
// kernels

// One row copied by a warp: kUnroll loads in flight per lane before the stores.
template <typename Unit>
__device__ __forceinline__ void copy_row(Unit* __restrict__ out, const Unit* __restrict__ in, int64_t units_per_row,
                                         int lane) {
    for (int64_t u0 = lane; u0 < units_per_row; u0 += 32 * kUnroll) {
        Unit v[kUnroll];
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t u = u0 + k * 32;
            if (u < units_per_row) v[k] = in[u];
        }
#pragma unroll
        for (int k = 0; k < kUnroll; ++k) {
            const int64_t u = u0 + k * 32;
            if (u < units_per_row) out[u] = v[k];
        }
    }
}

// Pieces of rows, by value: piece p copies rows[p] rows from src_row[p] to dst_row[p].
struct PieceTable {
    int64_t src_row[kMaxRowPieces], dst_row[kMaxRowPieces], rows[kMaxRowPieces];
};

// blockIdx.y: the piece; blockIdx.x strides over its rows, one warp per row.
template <typename Unit>
__global__ void __launch_bounds__(kThreads)
    copy_pieces_kernel(Unit* __restrict__ dst, const Unit* __restrict__ src, const __grid_constant__ PieceTable t,
                       int64_t units_per_row) {
    const int lane = threadIdx.x % 32;
    const int p = blockIdx.y;
    const int64_t n = t.rows[p];
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32; i < n;
         i += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
        const Unit* in = src + (t.src_row[p] + i) * units_per_row;
        Unit* out = dst + (t.dst_row[p] + i) * units_per_row;
        copy_row(out, in, units_per_row, lane);
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

// The widest unit that divides the row and the alignment of both buffers.
bool fits(int64_t bytes, int64_t row_bytes, const void* a, const void* b) {
    const auto aligned = [bytes](const void* p) {
        return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
    };
    return row_bytes % bytes == 0 && aligned(a) && aligned(b);
}

template <typename Unit>
void launch_pieces(void* dst, const void* src, const PieceTable& t, int num_pieces, int64_t max_rows, int64_t row_bytes,
                   cudaStream_t stream) {
    // Enough blocks for the largest piece, at most ~8 waves of the machine over all pieces.
    const int64_t want = (max_rows + kRowsPerBlock - 1) / kRowsPerBlock;
    const dim3 grid(static_cast<unsigned>(std::clamp<int64_t>(want, 1, std::max<int64_t>(1, 8192 / num_pieces))),
                    static_cast<unsigned>(num_pieces));
    copy_pieces_kernel<Unit><<<grid, kThreads, 0, stream>>>(static_cast<Unit*>(dst), static_cast<const Unit*>(src), t,
                                                            row_bytes / static_cast<int64_t>(sizeof(Unit)));
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void copy_row_pieces(void* dst, const void* src, const int64_t* pieces, int64_t num_pieces, int64_t num_dst_rows,
                     int64_t num_src_rows, int64_t row_bytes, cudaStream_t stream) {
    cpu::check_row_pieces("copy_row_pieces", dst, src, pieces, num_pieces, num_dst_rows, num_src_rows, row_bytes);
    MF_CHECK(num_dst_rows <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(row_bytes, 1) &&
                 num_src_rows <= std::numeric_limits<int64_t>::max() / std::max<int64_t>(row_bytes, 1),
             "copy_row_pieces: buffers of ", row_bytes, "-byte rows overflow");
    if (row_bytes == 0) return;
    for (int64_t first = 0; first < num_pieces;) {
        PieceTable t{};
        int n = 0;
        int64_t max_rows = 0;
        for (; first < num_pieces && n < kMaxRowPieces; ++first) {
            if (pieces[3 * first + 2] == 0) continue;
            t.src_row[n] = pieces[3 * first];
            t.dst_row[n] = pieces[3 * first + 1];
            t.rows[n] = pieces[3 * first + 2];
            max_rows = std::max(max_rows, t.rows[n]);
            ++n;
        }
        if (n == 0) continue;
        if (fits(16, row_bytes, dst, src)) launch_pieces<uint4>(dst, src, t, n, max_rows, row_bytes, stream);
        else if (fits(4, row_bytes, dst, src)) launch_pieces<uint32_t>(dst, src, t, n, max_rows, row_bytes, stream);
        else if (fits(2, row_bytes, dst, src)) launch_pieces<uint16_t>(dst, src, t, n, max_rows, row_bytes, stream);
        else launch_pieces<uint8_t>(dst, src, t, n, max_rows, row_bytes, stream);
    }
}

}  // namespace mf::cuda
