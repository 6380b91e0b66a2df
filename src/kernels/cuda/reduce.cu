// Deterministic reductions.
//   sum_squares, sum_values   pass 1: kSumBlocks blocks (a constant, not the SM count) of kSumThreads threads;
//                 thread t of the grid owns the 8-element groups t, t + S, t + 2S, ... (S = grid
//                 threads) and sums their squares (or values) in double in element order; a block combines its
//                 threads by a fixed shuffle tree and a fixed pass over its warps into partial[b].
//                 pass 2: one block adds partial[0..kSumBlocks) by a fixed tree into *out.
//                 The grouping is the same whether 16-byte loads are used or not, so the bits do
//                 not depend on the buffer's alignment either.
//   clip_scale    one thread: norm = sqrt(sumsq), scale = min(1, max_norm / (norm + 1e-6)).
//   scale_inplace elementwise x *= *scale; a scale of exactly 1 (an identity) leaves x unread: every
//                 block reads *scale and returns, so the common case costs a launch, not a pass.
//   reduce_partial_rows   per column, 32 interleaved row groups each summed in ascending row order,
//                 then the groups added in a fixed order.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/cast.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kSumBlocks = 1024;
constexpr int kSumThreads = 256;
constexpr int kThreads = 256;

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ double warp_sum_double(double v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(detail::kFullMask, v, offset);
    return v;
}

// Block-wide double sum in a fixed order; the result is valid in thread 0.
template <int kThreadsPerBlock>
__device__ double block_sum_double(double v) {
    __shared__ double warp_sums[kThreadsPerBlock / 32];
    v = warp_sum_double(v);
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    double total = 0.0;
    if (threadIdx.x == 0) {
        for (int w = 0; w < kThreadsPerBlock / 32; ++w) total += warp_sums[w];
    }
    return total;
}

// kSquare: Σ x² (else Σ x).
template <typename T, bool kVector, bool kSquare>
__global__ void sum_partial_kernel(double* partial, const T* x, int64_t n) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    double acc = 0.0;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g * 8 < n; g += stride) {
        const int64_t base = g * 8;
        if (kVector && base + 8 <= n) {
            float v[8];
            detail::load_f32<8>(v, x + base);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc += kSquare ? static_cast<double>(v[j]) * v[j] : static_cast<double>(v[j]);
        } else {
            for (int64_t i = base; i < base + 8 && i < n; ++i) {
                const double v = detail::to_f32(x[i]);
                acc += kSquare ? v * v : v;
            }
        }
    }
    const double total = block_sum_double<kSumThreads>(acc);
    if (threadIdx.x == 0) partial[blockIdx.x] = total;
}

// sum_partial_kernel's work for up to kMaxSumItems buffers in one grid: blocks [first[i], first[i + 1])
// are buffer i's, partials at partial[i · kSumBlocks + b].
struct SumBatch {
    const void* x[kMaxSumItems];
    int64_t n[kMaxSumItems];
    double* out[kMaxSumItems];
    int first[kMaxSumItems + 1];
    bool vec[kMaxSumItems];
    int count;
};

template <typename T>
__global__ void sum_squares_many_partial_kernel(double* partial, const __grid_constant__ SumBatch batch) {
    int lo = 0, hi = batch.count - 1;  // the item whose block range holds blockIdx.x
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (batch.first[mid] <= static_cast<int>(blockIdx.x))
            lo = mid;
        else
            hi = mid - 1;
    }
    const int b = static_cast<int>(blockIdx.x) - batch.first[lo];
    const int64_t n = batch.n[lo];
    const T* x = static_cast<const T*>(batch.x[lo]);
    const int64_t stride = static_cast<int64_t>(batch.first[lo + 1] - batch.first[lo]) * blockDim.x;
    double acc = 0.0;
    for (int64_t g = static_cast<int64_t>(b) * blockDim.x + threadIdx.x; g * 8 < n; g += stride) {
        const int64_t base = g * 8;
        if (batch.vec[lo] && base + 8 <= n) {
            float v[8];
            detail::load_f32<8>(v, x + base);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc += static_cast<double>(v[j]) * v[j];
        } else {
            for (int64_t i = base; i < base + 8 && i < n; ++i) {
                const double v = detail::to_f32(x[i]);
                acc += v * v;
            }
        }
    }
    const double total = block_sum_double<kSumThreads>(acc);
    if (threadIdx.x == 0) partial[static_cast<int64_t>(lo) * kSumBlocks + b] = total;
}

__global__ void sum_squares_many_final_kernel(const double* partial, const __grid_constant__ SumBatch batch) {
    const int i = static_cast<int>(blockIdx.x);
    const int blocks = batch.first[i + 1] - batch.first[i];
    const double v =
        static_cast<int>(threadIdx.x) < blocks ? partial[static_cast<int64_t>(i) * kSumBlocks + threadIdx.x] : 0.0;
    const double total = block_sum_double<kSumBlocks>(v);
    if (threadIdx.x == 0) *batch.out[i] = total;
}

__global__ void sum_squares_final_kernel(double* out, const double* partial, bool accumulate) {
    const double total = block_sum_double<kSumBlocks>(partial[threadIdx.x]);
    if (threadIdx.x == 0) *out = accumulate ? *out + total : total;
}

__global__ void clip_scale_kernel(float* scale, float* norm, const double* sumsq, float max_norm) {
    const double n = sqrt(*sumsq);
    if (norm != nullptr) *norm = static_cast<float>(n);
    float s = 1.0f;
    if (max_norm > 0.0f) {
        // torch: clip_coef = max_norm / (total_norm + 1e-6), clamped to 1 (total_norm is fp32 there).
        const float coef = max_norm / (static_cast<float>(n) + 1e-6f);
        s = fminf(coef, 1.0f);
    }
    *scale = s;
}

template <int kVec, typename T>
__global__ void scale_kernel(T* x, const float* scale, int64_t n) {
    const float s = *scale;
    if (s == 1.0f) return;  // (x · 1 = x for every x: nothing to do)
    const int64_t num_vec = n / kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vec; i += stride) {
        float v[kVec];
        detail::load_f32<kVec>(v, x + i * kVec);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] *= s;
        detail::store_f32<kVec>(x + i * kVec, v);
    }
    const int64_t tail = num_vec * kVec + threadIdx.x;
    if (blockIdx.x == 0 && tail < n) x[tail] = detail::from_f32<T>(detail::to_f32(x[tail]) * s);
}

// A block takes 32 columns; warp g of its kRowGroups warps sums the rows r ≡ g (mod kRowGroups)
// in ascending order, then the groups are added in order g = 0, 1, ...: a fixed order. Many row
// groups keep the per-thread chains short (the partial buffers are tall and narrow).
constexpr int kRowGroups = 32;

template <typename T>
__global__ void __launch_bounds__(32 * kRowGroups)
    reduce_partial_rows_kernel(T* out, const float* partial, int64_t num_rows, int64_t C, bool accumulate) {
    __shared__ float group_sums[kRowGroups][32];
    const int lane = threadIdx.x % 32;
    const int g = threadIdx.x / 32;
    const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + lane;
    float sum = 0.0f;
    if (c < C) {
#pragma unroll 8
        for (int64_t r = g; r < num_rows; r += kRowGroups) sum += partial[r * C + c];
    }
    group_sums[g][lane] = sum;
    __syncthreads();
    if (g != 0 || c >= C) return;
    float total = 0.0f;
    for (int k = 0; k < kRowGroups; ++k) total += group_sums[k][lane];
    out[c] = detail::from_f32<T>(accumulate ? detail::to_f32(out[c]) + total : total);
}

// ----------------------------------------------------------------------------------------------
// launchers

template <bool kSquare, typename T>
void launch_sum(double* out, const T* x, int64_t n, bool accumulate, double* partial, cudaStream_t stream) {
    if (aligned_to(16, x)) {
        sum_partial_kernel<T, true, kSquare><<<kSumBlocks, kSumThreads, 0, stream>>>(partial, x, n);
    } else {
        sum_partial_kernel<T, false, kSquare><<<kSumBlocks, kSumThreads, 0, stream>>>(partial, x, n);
    }
    MF_CHECK_CUDA(cudaGetLastError());
    sum_squares_final_kernel<<<1, kSumBlocks, 0, stream>>>(out, partial, accumulate);
    MF_CHECK_CUDA(cudaGetLastError());
}

// At most kScaleBlocks blocks (about one resident wave on Hopper) striding over x: the pass streams as
// fast as a block per 256 elements would, and the scale-1 case ends after one wave of reads.
constexpr int64_t kScaleBlocks = 1024;

template <typename T>
void launch_scale(T* x, const float* scale, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = aligned_to(16, x);
    const int64_t work = vec ? n / 8 : n;
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kScaleBlocks));
    if (vec) {
        scale_kernel<8><<<blocks, kThreads, 0, stream>>>(x, scale, n);
    } else {
        scale_kernel<1><<<blocks, kThreads, 0, stream>>>(x, scale, n);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

size_t sum_squares_scratch_bytes() { return kSumBlocks * sizeof(double); }

template <bool kSquare>
void sum_entry(const char* op, double* out, const void* x, DType dtype, int64_t n, bool accumulate, void* scratch,
               cudaStream_t stream) {
    MF_CHECK(n >= 0, op, ": negative element count ", n);
    MF_CHECK(out != nullptr && scratch != nullptr, op, ": null output or scratch");
    MF_CHECK(n == 0 || x != nullptr, op, ": null input with n = ", n);
    MF_CHECK(aligned_to(8, scratch), op, ": scratch must be 8-byte aligned");
    double* partial = static_cast<double*>(scratch);
    switch (dtype) {
        case DType::f32:
            launch_sum<kSquare>(out, static_cast<const float*>(x), n, accumulate, partial, stream);
            break;
        case DType::bf16:
            launch_sum<kSquare>(out, static_cast<const bf16*>(x), n, accumulate, partial, stream);
            break;
        default:
            MF_FAIL(op, ": dtype must be f32 or bf16, got ", dtype_name(dtype));
    }
}

size_t sum_squares_many_scratch_bytes() { return static_cast<size_t>(kMaxSumItems) * kSumBlocks * sizeof(double); }

void sum_squares_many(const SumSquaresItem* items, int64_t count, DType dtype, void* scratch, cudaStream_t stream) {
    MF_CHECK(count >= 0 && (count == 0 || items != nullptr), "sum_squares_many: ", count, " items");
    MF_CHECK(dtype == DType::f32 || dtype == DType::bf16, "sum_squares_many: dtype must be f32 or bf16, got ",
             dtype_name(dtype));
    MF_CHECK(count == 0 || (scratch != nullptr && aligned_to(8, scratch)), "sum_squares_many: bad scratch");
    double* partial = static_cast<double*>(scratch);
    for (int64_t start = 0; start < count; start += kMaxSumItems) {
        SumBatch batch{};
        batch.count = static_cast<int>(std::min<int64_t>(kMaxSumItems, count - start));
        for (int i = 0; i < batch.count; ++i) {
            const SumSquaresItem& it = items[start + i];
            MF_CHECK(it.n >= 0 && it.out != nullptr && (it.n == 0 || it.x != nullptr), "sum_squares_many: item ",
                     start + i, " has n = ", it.n, (it.out == nullptr ? " and no output" : ""));
            const int64_t groups = (it.n + 7) / 8;
            const int64_t blocks = std::min<int64_t>(kSumBlocks, (groups + kSumThreads - 1) / kSumThreads);
            batch.x[i] = it.x;
            batch.n[i] = it.n;
            batch.out[i] = it.out;
            batch.vec[i] = aligned_to(16, it.x);
            batch.first[i + 1] = batch.first[i] + static_cast<int>(blocks);
        }
        if (batch.first[batch.count] > 0) {
            if (dtype == DType::f32)
                sum_squares_many_partial_kernel<float>
                    <<<batch.first[batch.count], kSumThreads, 0, stream>>>(partial, batch);
            else
                sum_squares_many_partial_kernel<bf16>
                    <<<batch.first[batch.count], kSumThreads, 0, stream>>>(partial, batch);
            MF_CHECK_CUDA(cudaGetLastError());
        }
        sum_squares_many_final_kernel<<<batch.count, kSumBlocks, 0, stream>>>(partial, batch);
        MF_CHECK_CUDA(cudaGetLastError());
    }
}

void sum_squares(double* out, const void* x, DType dtype, int64_t n, bool accumulate, void* scratch,
                 cudaStream_t stream) {
    sum_entry<true>("sum_squares", out, x, dtype, n, accumulate, scratch, stream);
}

void sum_values(double* out, const void* x, DType dtype, int64_t n, bool accumulate, void* scratch,
                cudaStream_t stream) {
    sum_entry<false>("sum_values", out, x, dtype, n, accumulate, scratch, stream);
}

void clip_scale(float* scale, float* norm, const double* sumsq, float max_norm, cudaStream_t stream) {
    MF_CHECK(scale != nullptr && sumsq != nullptr, "clip_scale: null scale or sumsq");
    clip_scale_kernel<<<1, 1, 0, stream>>>(scale, norm, sumsq, max_norm);
    MF_CHECK_CUDA(cudaGetLastError());
}

void scale_inplace(void* x, DType dtype, const float* scale, int64_t n, cudaStream_t stream) {
    MF_CHECK(n >= 0, "scale_inplace: negative element count ", n);
    MF_CHECK(scale != nullptr, "scale_inplace: null scale");
    MF_CHECK(n == 0 || x != nullptr, "scale_inplace: null buffer with n = ", n);
    switch (dtype) {
        case DType::f32:
            launch_scale(static_cast<float*>(x), scale, n, stream);
            break;
        case DType::bf16:
            launch_scale(static_cast<bf16*>(x), scale, n, stream);
            break;
        default:
            MF_FAIL("scale_inplace: dtype must be f32 or bf16, got ", dtype_name(dtype));
    }
}

void reduce_partial_rows(void* out, DType out_dtype, const float* partial, int64_t num_rows, int64_t C, bool accumulate,
                         cudaStream_t stream) {
    MF_CHECK(num_rows >= 0 && C >= 0, "reduce_partial_rows: bad shape rows=", num_rows, " C=", C);
    if (C == 0) return;
    MF_CHECK(out != nullptr && (num_rows == 0 || partial != nullptr), "reduce_partial_rows: null buffer");
    MF_CHECK((C + 31) / 32 <= std::numeric_limits<int32_t>::max(), "reduce_partial_rows: C = ", C, " too large");
    const int blocks = static_cast<int>((C + 31) / 32);
    constexpr int threads = 32 * kRowGroups;
    switch (out_dtype) {
        case DType::f32:
            reduce_partial_rows_kernel<<<blocks, threads, 0, stream>>>(static_cast<float*>(out), partial, num_rows, C,
                                                                       accumulate);
            break;
        case DType::bf16:
            reduce_partial_rows_kernel<<<blocks, threads, 0, stream>>>(static_cast<bf16*>(out), partial, num_rows, C,
                                                                       accumulate);
            break;
        default:
            MF_FAIL("reduce_partial_rows: output dtype must be f32 or bf16, got ", dtype_name(out_dtype));
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
