// Gated RMSNorm, CUDA. A block of kThreads takes one group of channels and a run of consecutive tokens
// (at most kMaxRowBlocks runs over the tokens); each of its warps takes every kWarps-th token of the
// run, whole: lane l holds the group's channels l, l + 32, ... in registers.
//   forward   per token: g = x · silu(z), Σ g² by a warp xor butterfly (every lane the same bits),
//             rstd, out.
//   backward  per token: the same g, Σ (dout·w)·x̂ by the butterfly, dx and dz, and each lane adds
//             dout·x̂ into its channels' dweight sums in token order; the warps' sums go to scratch
//             [row blocks · kWarps, I] and reduce_partial_rows adds them in a fixed order.
// No block synchronisation; the grid depends on N and I only: bitwise reproducible.
#include <algorithm>
#include <limits>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/cuda/gated_rmsnorm.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxRowBlocks = 256;  // bounds the backward's partial sums: kMaxRowBlocks · kWarps rows of I
constexpr int64_t kMinRowsPerBlock = 8;

// Tokens per block: at least kMinRowsPerBlock, and no more than kMaxRowBlocks blocks over the tokens.
int64_t rows_per_block(int64_t N) {
    return std::max<int64_t>(kMinRowsPerBlock, (N + kMaxRowBlocks - 1) / kMaxRowBlocks);
}
int64_t row_blocks(int64_t N) { return std::max<int64_t>(1, (N + rows_per_block(N) - 1) / rows_per_block(N)); }

// ----------------------------------------------------------------------------------------------
// kernels: a warp per (token, group), lane l holding channels l, l + 32, ... (kPerLane slots, a
// power of two with 32·kPerLane >= group_size), the token's sums by a warp butterfly (no block sync).

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// grid (groups, row blocks); warp w of a block takes tokens r0 + w, r0 + w + kWarps, ...
template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    gated_rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* x, const bf16* z, const float* weight, int64_t N,
                                 int64_t I, int group_size, int64_t rows, float eps) {
    const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
    const int64_t group_idx = blockIdx.x;
    const int64_t num_groups = I / group_size;
    const int64_t c0 = group_idx * group_size;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows;
    const int64_t r1 = std::min<int64_t>(r0 + rows, N);
    for (int64_t n = r0 + warp; n < r1; n += kWarps) {
        float g[kPerLane];
        float sum_sq = 0.0f;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int i = lane + 32 * k;
            g[k] = 0.0f;
            if (i < group_size) {
                const int64_t at = n * I + c0 + i;
                const float zv = __bfloat162float(z[at]);
                g[k] = __bfloat162float(x[at]) * (zv * sigmoid(zv));
                sum_sq += g[k] * g[k];
            }
        }
        const float r = 1.0f / sqrtf(detail::group_sum<32>(sum_sq) / static_cast<float>(group_size) + eps);
        if (lane == 0) rstd[n * num_groups + group_idx] = r;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int i = lane + 32 * k;
            if (i < group_size) out[n * I + c0 + i] = __float2bfloat16_rn(weight[c0 + i] * (g[k] * r));
        }
    }
}

// grid (groups, row blocks); partial [row blocks · kWarps, I]: warp w of block b sums its tokens' dout·x̂
// into row b·kWarps + w (zeros where it had no token).
template <int kPerLane>
__global__ void __launch_bounds__(kThreads)
    gated_rmsnorm_backward_kernel(bf16* dx, bf16* dz, float* partial, const bf16* dout, const bf16* x, const bf16* z,
                                  const float* weight, const float* rstd, int64_t N, int64_t I, int group_size,
                                  int64_t rows) {
    const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
    const int64_t group_idx = blockIdx.x;
    const int64_t num_groups = I / group_size;
    const int64_t c0 = group_idx * group_size;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows;
    const int64_t r1 = std::min<int64_t>(r0 + rows, N);
    float dw[kPerLane];
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) dw[k] = 0.0f;
    for (int64_t n = r0 + warp; n < r1; n += kWarps) {
        const float r = rstd[n * num_groups + group_idx];
        float xv[kPerLane], zv[kPerLane], x_hat[kPerLane], dgw[kPerLane];
        float sum_gx = 0.0f;
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int i = lane + 32 * k;
            xv[k] = zv[k] = x_hat[k] = dgw[k] = 0.0f;
            if (i < group_size) {
                const int64_t at = n * I + c0 + i;
                xv[k] = __bfloat162float(x[at]);
                zv[k] = __bfloat162float(z[at]);
                x_hat[k] = xv[k] * (zv[k] * sigmoid(zv[k])) * r;
                const float dy = __bfloat162float(dout[at]);
                dgw[k] = dy * weight[c0 + i];
                sum_gx += dgw[k] * x_hat[k];
                dw[k] += dy * x_hat[k];
            }
        }
        const float mean_gx = detail::group_sum<32>(sum_gx) / static_cast<float>(group_size);
#pragma unroll
        for (int k = 0; k < kPerLane; ++k) {
            const int i = lane + 32 * k;
            if (i < group_size) {
                const int64_t at = n * I + c0 + i;
                const float dg = r * (dgw[k] - x_hat[k] * mean_gx);
                const float s = sigmoid(zv[k]);
                dx[at] = __float2bfloat16_rn(dg * (zv[k] * s));
                dz[at] = __float2bfloat16_rn(dg * xv[k] * (s * (1.0f + zv[k] * (1.0f - s))));
            }
        }
    }
    const int64_t row = static_cast<int64_t>(blockIdx.y) * kWarps + warp;
#pragma unroll
    for (int k = 0; k < kPerLane; ++k) {
        const int i = lane + 32 * k;
        if (i < group_size) partial[row * I + c0 + i] = dw[k];
    }
}

// Calls f(std::integral_constant<int, kPerLane>{}) with the slots per lane the group needs.
template <typename F>
void with_lanes(int64_t group_size, F&& f) {
    if (group_size <= 32 * 4) return f(std::integral_constant<int, 4>{});
    if (group_size <= 32 * 16) return f(std::integral_constant<int, 16>{});
    return f(std::integral_constant<int, 64>{});
}
static_assert(kGatedRmsnormMaxGroup <= 32 * 64, "with_lanes covers groups up to 2048 channels");

void check_shape(const char* op, int64_t N, int64_t I, int64_t group_size) {
    MF_CHECK(N >= 0 && I > 0 && group_size > 0 && I % group_size == 0, op, ": bad shape N=", N, " I=", I,
             " group_size=", group_size);
    MF_CHECK(group_size <= kGatedRmsnormMaxGroup, op, ": group_size = ", group_size, " is wider than supported (",
             kGatedRmsnormMaxGroup, ")");
    MF_CHECK(I / group_size < std::numeric_limits<int32_t>::max() && row_blocks(N) < 65536, op, ": N = ", N,
             " is too large");
}

dim3 grid_of(int64_t N, int64_t I, int64_t group_size) {
    return dim3(static_cast<unsigned>(I / group_size), static_cast<unsigned>(row_blocks(N)));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void gated_rmsnorm_forward(bf16* out, float* rstd, const bf16* x, const bf16* z, const float* weight, int64_t N,
                           int64_t I, int64_t group_size, float eps, cudaStream_t stream) {
    check_shape("gated_rmsnorm_forward", N, I, group_size);
    MF_CHECK(eps >= 0.0f, "gated_rmsnorm_forward: eps must be >= 0, got ", eps);
    if (N == 0) return;
    MF_CHECK(out != nullptr && rstd != nullptr && x != nullptr && z != nullptr && weight != nullptr,
             "gated_rmsnorm_forward: null buffer");
    with_lanes(group_size, [&](auto lanes) {
        gated_rmsnorm_forward_kernel<lanes.value><<<grid_of(N, I, group_size), kThreads, 0, stream>>>(
            out, rstd, x, z, weight, N, I, static_cast<int>(group_size), rows_per_block(N), eps);
    });
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t gated_rmsnorm_backward_scratch_bytes(int64_t N, int64_t I) {
    return static_cast<size_t>(row_blocks(N) * kWarps * I) * sizeof(float);
}

void gated_rmsnorm_backward(bf16* dx, bf16* dz, void* dweight, DType dweight_dtype, const bf16* dout, const bf16* x,
                            const bf16* z, const float* weight, const float* rstd, int64_t N, int64_t I,
                            int64_t group_size, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    check_shape("gated_rmsnorm_backward", N, I, group_size);
    if (N == 0) return;
    MF_CHECK(dx != nullptr && dz != nullptr && dweight != nullptr && dout != nullptr && x != nullptr && z != nullptr &&
                 weight != nullptr && rstd != nullptr,
             "gated_rmsnorm_backward: null buffer");
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16,
             "gated_rmsnorm_backward: dweight dtype must be f32 or bf16, got ", dtype_name(dweight_dtype));
    const size_t needed = gated_rmsnorm_backward_scratch_bytes(N, I);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed && aligned_to(16, scratch),
             "gated_rmsnorm_backward: scratch has ", scratch_bytes, " bytes, needs ", needed, " (16-byte aligned)");
    float* partial = static_cast<float*>(scratch);
    with_lanes(group_size, [&](auto lanes) {
        gated_rmsnorm_backward_kernel<lanes.value><<<grid_of(N, I, group_size), kThreads, 0, stream>>>(
            dx, dz, partial, dout, x, z, weight, rstd, N, I, static_cast<int>(group_size), rows_per_block(N));
    });
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(dweight, dweight_dtype, partial, row_blocks(N) * kWarps, I, /*accumulate=*/true, stream);
}

}  // namespace mf::cuda
