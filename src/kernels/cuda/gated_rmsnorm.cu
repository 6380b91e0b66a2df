// Gated RMSNorm, CUDA. One block of kThreads takes one group of channels and kRowsPerBlock
// consecutive tokens; each thread owns the channels tid, tid + kThreads, ... of the group
// (kMaxPerThread at most) and the block walks its tokens in order.
//   forward   per token: g = x · silu(z) in registers, Σ g² by a fixed-order block sum, rstd, out.
//   backward  per token: the same g, Σ (dout·w)·x̂ by a fixed-order block sum, dx and dz, and each
//             thread adds dout·x̂ into its channels' dweight sums in token order; the sums go to
//             scratch [row blocks, I] and reduce_partial_rows adds the row blocks in a fixed order.
// The block sum is a warp xor butterfly and the warps' sums added in warp order by every thread,
// so every thread holds the same bits. The grid depends on N and I only: bitwise reproducible.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/gated_rmsnorm.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPerThread = static_cast<int>(kGatedRmsnormMaxGroup) / kThreads;
constexpr int64_t kRowsPerBlock = 32;

int64_t row_blocks(int64_t N) { return std::max<int64_t>(1, (N + kRowsPerBlock - 1) / kRowsPerBlock); }

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// Σ v over the block, the same bits in every thread. `slots`: kWarps floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* slots) {
    v = detail::group_sum<32>(v);
    __syncthreads();  // the previous call's readers are done with slots
    if (threadIdx.x % 32 == 0) slots[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += slots[w];
    return total;
}

// grid (groups, row blocks).
__global__ void __launch_bounds__(kThreads)
    gated_rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* x, const bf16* z, const float* weight, int64_t N,
                                 int64_t I, int group_size, float eps) {
    __shared__ float slots[kWarps];
    const int64_t group_idx = blockIdx.x;
    const int64_t num_groups = I / group_size;
    const int64_t c0 = group_idx * group_size;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
    const int64_t r1 = std::min<int64_t>(r0 + kRowsPerBlock, N);
    for (int64_t n = r0; n < r1; ++n) {
        float g[kMaxPerThread];
        float sum_sq = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
            const int i = threadIdx.x + k * kThreads;
            g[k] = 0.0f;
            if (i < group_size) {
                const int64_t at = n * I + c0 + i;
                const float zv = __bfloat162float(z[at]);
                g[k] = __bfloat162float(x[at]) * (zv * sigmoid(zv));
                sum_sq += g[k] * g[k];
            }
        }
        const float r = 1.0f / sqrtf(block_sum(sum_sq, slots) / static_cast<float>(group_size) + eps);
        if (threadIdx.x == 0) rstd[n * num_groups + group_idx] = r;
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
            const int i = threadIdx.x + k * kThreads;
            if (i < group_size) out[n * I + c0 + i] = __float2bfloat16_rn(weight[c0 + i] * (g[k] * r));
        }
    }
}

// grid (groups, row blocks); partial [row blocks, I].
__global__ void __launch_bounds__(kThreads)
    gated_rmsnorm_backward_kernel(bf16* dx, bf16* dz, float* partial, const bf16* dout, const bf16* x, const bf16* z,
                                  const float* weight, const float* rstd, int64_t N, int64_t I, int group_size) {
    __shared__ float slots[kWarps];
    const int64_t group_idx = blockIdx.x;
    const int64_t num_groups = I / group_size;
    const int64_t c0 = group_idx * group_size;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
    const int64_t r1 = std::min<int64_t>(r0 + kRowsPerBlock, N);
    float dw[kMaxPerThread];
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) dw[k] = 0.0f;
    for (int64_t n = r0; n < r1; ++n) {
        const float r = rstd[n * num_groups + group_idx];
        float xv[kMaxPerThread], zv[kMaxPerThread], x_hat[kMaxPerThread], dgw[kMaxPerThread];
        float sum_gx = 0.0f;
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
            const int i = threadIdx.x + k * kThreads;
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
        const float mean_gx = block_sum(sum_gx, slots) / static_cast<float>(group_size);
#pragma unroll
        for (int k = 0; k < kMaxPerThread; ++k) {
            const int i = threadIdx.x + k * kThreads;
            if (i < group_size) {
                const int64_t at = n * I + c0 + i;
                const float dg = r * (dgw[k] - x_hat[k] * mean_gx);
                const float s = sigmoid(zv[k]);
                dx[at] = __float2bfloat16_rn(dg * (zv[k] * s));
                dz[at] = __float2bfloat16_rn(dg * xv[k] * (s * (1.0f + zv[k] * (1.0f - s))));
            }
        }
    }
#pragma unroll
    for (int k = 0; k < kMaxPerThread; ++k) {
        const int i = threadIdx.x + k * kThreads;
        if (i < group_size) partial[static_cast<int64_t>(blockIdx.y) * I + c0 + i] = dw[k];
    }
}

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
    gated_rmsnorm_forward_kernel<<<grid_of(N, I, group_size), kThreads, 0, stream>>>(out, rstd, x, z, weight, N, I,
                                                                                     static_cast<int>(group_size), eps);
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t gated_rmsnorm_backward_scratch_bytes(int64_t N, int64_t I) {
    return static_cast<size_t>(row_blocks(N) * I) * sizeof(float);
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
    gated_rmsnorm_backward_kernel<<<grid_of(N, I, group_size), kThreads, 0, stream>>>(
        dx, dz, partial, dout, x, z, weight, rstd, N, I, static_cast<int>(group_size));
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(dweight, dweight_dtype, partial, row_blocks(N), I, /*accumulate=*/true, stream);
}

}  // namespace mf::cuda
