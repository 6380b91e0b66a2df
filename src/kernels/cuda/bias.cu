// Row bias, CUDA.
//   add_bias       a grid-stride loop over kVec-element column groups of out [N, C] (16-byte bf16
//                  accesses when C % 8 == 0 and the buffers are 16-byte aligned, else single
//                  elements): out = bf16(float(out) + float(bias)). Elementwise, hence deterministic.
//   bias_backward  a grid of (column tiles) x (row blocks): thread t of a tile owns kVec adjacent
//                  columns and sums them over its row block's rows in ascending order in fp32
//                  registers (the warp reads a contiguous stretch of each row), writing one row of
//                  scratch [row_blocks, C]; reduce_partial_rows then adds the row blocks in a fixed
//                  order into dbias (+=). The row blocks are a function of N only, so the result is
//                  bitwise reproducible across runs and devices. No atomics.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/bias.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;
// Row blocks of the backward: at least kMinRowsPerBlock rows each, at most kMaxRowBlocks of them
// (with a few column tiles, two or more waves on an H200; the partial sums stay small).
constexpr int64_t kMaxRowBlocks = 256;
constexpr int64_t kMinRowsPerBlock = 16;

int64_t row_blocks(int64_t N) {
    return std::clamp<int64_t>((N + kMinRowsPerBlock - 1) / kMinRowsPerBlock, 1, kMaxRowBlocks);
}

// ----------------------------------------------------------------------------------------------
// kernels

template <int kVec>
__global__ void add_bias_kernel(bf16* out, const bf16* bias, int64_t N, int64_t C) {
    const int64_t vec_per_row = C / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t c = (idx - n * vec_per_row) * kVec;
        float y[kVec], b[kVec];
        detail::load_f32<kVec>(y, out + n * C + c);
        detail::load_f32<kVec>(b, bias + c);
#pragma unroll
        for (int e = 0; e < kVec; ++e) y[e] += b[e];
        detail::store_f32<kVec>(out + n * C + c, y);
    }
}

// partial [gridDim.y, C]: row block blockIdx.y covers rows [y · rows_per_block, + rows_per_block) ∩ [0, N).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    bias_backward_kernel(float* partial, const bf16* dout, int64_t N, int64_t C, int64_t rows_per_block) {
    const int64_t c = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
    if (c >= C) return;
    const int64_t row_begin = static_cast<int64_t>(blockIdx.y) * rows_per_block;
    const int64_t row_end = row_begin + rows_per_block < N ? row_begin + rows_per_block : N;
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0.0f;
    for (int64_t r = row_begin; r < row_end; ++r) {
        float v[kVec];
        detail::load_f32<kVec>(v, dout + r * C + c);
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[e] += v[e];
    }
    detail::store_f32<kVec>(partial + static_cast<int64_t>(blockIdx.y) * C + c, acc);
}

// ----------------------------------------------------------------------------------------------
// launchers

int grid_for(int64_t work) {
    return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

void check_shape(const char* op, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C >= 0, op, ": negative shape N=", N, " C=", C);
    MF_CHECK((C + kThreads - 1) / kThreads <= std::numeric_limits<int32_t>::max(), op, ": C = ", C, " is too large");
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void add_bias(bf16* out, const bf16* bias, int64_t N, int64_t C, cudaStream_t stream) {
    check_shape("add_bias", N, C);
    if (N == 0 || C == 0) return;
    MF_CHECK(out != nullptr && bias != nullptr, "add_bias: null buffer");
    if (C % 8 == 0 && aligned_to(16, out, bias)) {
        add_bias_kernel<8><<<grid_for(N * C / 8), kThreads, 0, stream>>>(out, bias, N, C);
    } else {
        add_bias_kernel<1><<<grid_for(N * C), kThreads, 0, stream>>>(out, bias, N, C);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t bias_backward_scratch_bytes(int64_t N, int64_t C) {
    check_shape("bias_backward", N, C);
    return static_cast<size_t>(row_blocks(N) * C) * sizeof(float);
}

void bias_backward(void* dbias, DType dbias_dtype, const bf16* dout, int64_t N, int64_t C, void* scratch,
                   size_t scratch_bytes, cudaStream_t stream) {
    check_shape("bias_backward", N, C);
    MF_CHECK(dbias_dtype == DType::f32 || dbias_dtype == DType::bf16,
             "bias_backward: dbias dtype must be f32 or bf16, got ", dtype_name(dbias_dtype));
    if (N == 0 || C == 0) return;
    MF_CHECK(dbias != nullptr && dout != nullptr, "bias_backward: null buffer");
    const size_t needed = bias_backward_scratch_bytes(N, C);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed, "bias_backward: scratch has ", scratch_bytes,
             " bytes, needs ", needed);
    MF_CHECK(aligned_to(16, scratch), "bias_backward: scratch must be 16-byte aligned");
    float* partial = static_cast<float*>(scratch);
    const int64_t blocks_y = row_blocks(N);
    const int64_t rows_per_block = (N + blocks_y - 1) / blocks_y;
    if (C % 8 == 0 && aligned_to(16, dout)) {
        const dim3 grid(static_cast<unsigned>((C / 8 + kThreads - 1) / kThreads), static_cast<unsigned>(blocks_y));
        bias_backward_kernel<8><<<grid, kThreads, 0, stream>>>(partial, dout, N, C, rows_per_block);
    } else {
        const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(blocks_y));
        bias_backward_kernel<1><<<grid, kThreads, 0, stream>>>(partial, dout, N, C, rows_per_block);
    }
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(dbias, dbias_dtype, partial, blocks_y, C, /*accumulate=*/true, stream);
}

}  // namespace mf::cuda
