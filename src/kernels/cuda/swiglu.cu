// SwiGLU, CUDA: a grid-stride loop over 8-element column groups of the [N, I] output (16-byte
// bf16 accesses when I % 8 == 0 and the buffers are 16-byte aligned, else single elements).
// Each thread reads its gate and up values, computes in fp32 with the same formulas (and the same
// σ = 1 / (1 + exp(−g)) with IEEE expf) as the CPU reference, and rounds once to bf16.
// Elementwise, hence deterministic. Large |g| is safe: expf(−g) = inf gives σ = 0.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/cuda/swiglu.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// ----------------------------------------------------------------------------------------------
// kernels

template <int kVec>
__global__ void swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int64_t I) {
    const int64_t vec_per_row = I / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t i = (idx - n * vec_per_row) * kVec;
        float g[kVec], u[kVec], y[kVec];
        detail::load_f32<kVec>(g, inp + n * 2 * I + i);
        detail::load_f32<kVec>(u, inp + n * 2 * I + I + i);
#pragma unroll
        for (int e = 0; e < kVec; ++e) y[e] = swiglu_value(g[e], u[e]);
        detail::store_f32<kVec>(out + n * I + i, y);
    }
}

template <int kVec>
__global__ void swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I) {
    const int64_t vec_per_row = I / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t i = (idx - n * vec_per_row) * kVec;
        float g[kVec], u[kVec], dy[kVec], dg[kVec], du[kVec];
        detail::load_f32<kVec>(g, inp + n * 2 * I + i);
        detail::load_f32<kVec>(u, inp + n * 2 * I + I + i);
        detail::load_f32<kVec>(dy, dout + n * I + i);
#pragma unroll
        for (int e = 0; e < kVec; ++e) swiglu_grad(g[e], u[e], dy[e], dg[e], du[e]);
        detail::store_f32<kVec>(dinp + n * 2 * I + i, dg);
        detail::store_f32<kVec>(dinp + n * 2 * I + I + i, du);
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

int grid_for(int64_t work) {
    return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream) {
    MF_CHECK(N >= 0 && I >= 0, "swiglu_forward: negative shape N=", N, " I=", I);
    if (N == 0 || I == 0) return;
    MF_CHECK(out != nullptr && inp != nullptr, "swiglu_forward: null buffer");
    if (I % 8 == 0 && aligned_to(16, out, inp)) {
        swiglu_forward_kernel<8><<<grid_for(N * I / 8), kThreads, 0, stream>>>(out, inp, N, I);
    } else {
        swiglu_forward_kernel<1><<<grid_for(N * I), kThreads, 0, stream>>>(out, inp, N, I);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I, cudaStream_t stream) {
    MF_CHECK(N >= 0 && I >= 0, "swiglu_backward: negative shape N=", N, " I=", I);
    if (N == 0 || I == 0) return;
    MF_CHECK(dinp != nullptr && dout != nullptr && inp != nullptr, "swiglu_backward: null buffer");
    if (I % 8 == 0 && aligned_to(16, dinp, dout, inp)) {
        swiglu_backward_kernel<8><<<grid_for(N * I / 8), kThreads, 0, stream>>>(dinp, dout, inp, N, I);
    } else {
        swiglu_backward_kernel<1><<<grid_for(N * I), kThreads, 0, stream>>>(dinp, dout, inp, N, I);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
