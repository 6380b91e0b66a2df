// Deterministic reductions on the device: the global gradient norm's Σ x², the clipping scale
// computed from it without a host sync, scaling a buffer by a device scalar, and the fixed-order
// column reduction of per-block partial sums that every weight gradient here uses
// (rmsnorm, rope_qknorm).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace mf::cuda {

// Bytes of scratch sum_squares needs (a fixed number of double partial sums).
size_t sum_squares_scratch_bytes();

// *out = (or += when accumulate) Σ_i x[i]² over a flat f32 or bf16 buffer of n elements, each
// square formed in double and summed in double. Two passes: a fixed grid of blocks writes one
// partial each into scratch (grid-stride order, fixed tree inside a block), then one block adds
// the partials in a fixed order; the result does not depend on the device's SM count.
// out: [in/out] one double on the device. scratch: sum_squares_scratch_bytes(), 8-byte aligned.
void sum_squares(double* out, const void* x, DType dtype, int64_t n, bool accumulate, void* scratch,
                 cudaStream_t stream);

// Many sum_squares at once, two launches per kMaxSumItems buffers instead of two per buffer (the
// gradient norm's buffers are mostly small: norms, routers, projections). *items[i].out = Σ x² of
// items[i], bit for bit the value sum_squares gives for that buffer (a buffer of g 8-element groups
// takes min(1024, ⌈g/256⌉) blocks, so every thread owns the groups it owns there and the missing
// blocks' partials are the zeros those blocks would have written). All buffers of one dtype.
// scratch: sum_squares_many_scratch_bytes(), 8-byte aligned.
struct SumSquaresItem {
    const void* x;
    int64_t n;
    double* out;
};
constexpr int kMaxSumItems = 64;
size_t sum_squares_many_scratch_bytes();
void sum_squares_many(const SumSquaresItem* items, int64_t count, DType dtype, void* scratch, cudaStream_t stream);

// *out = (or += when accumulate) Σ_i x[i] in double; same grid, order and scratch as sum_squares.
void sum_values(double* out, const void* x, DType dtype, int64_t n, bool accumulate, void* scratch,
                cudaStream_t stream);

// NOTE: every element of x is finite exactly when its sum_squares result is (a non-finite input
// makes the double sum inf or NaN, while finite fp32 squares cannot overflow a double), so an
// all-finite check is isfinite(sum_squares).

// From a device Σ g²: *norm = sqrt(sumsq) (norm may be null) and
// *scale = min(1, max_norm / (norm + 1e-6)) as torch.nn.utils.clip_grad_norm_ computes it
// (max_norm <= 0 disables clipping: scale = 1). All on the device, no host sync.
void clip_scale(float* scale, float* norm, const double* sumsq, float max_norm, cudaStream_t stream);

// x[i] *= *scale for a flat f32 or bf16 buffer (bf16: product in fp32, rounded to nearest).
// scale: [in] one float on the device. A scale of exactly 1 leaves x untouched (not even read).
void scale_inplace(void* x, DType dtype, const float* scale, int64_t n, cudaStream_t stream);

// out[c] = (or += when accumulate) Σ_{r = 0..num_rows-1} partial[r, c] for c < C, summed in fp32 in a
// fixed order (32 interleaved row groups, each in ascending r, then the groups in order):
// deterministic. out is f32 or bf16 (bf16: old value + sum in fp32, then rounded).
// partial: [num_rows, C] fp32.
void reduce_partial_rows(void* out, DType out_dtype, const float* partial, int64_t num_rows, int64_t C, bool accumulate,
                         cudaStream_t stream);

}  // namespace mf::cuda
