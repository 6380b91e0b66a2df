// gpt-oss's clamped SwiGLU, CUDA: a grid-stride loop over groups of 8 outputs of the [N, I] output,
// each reading the 16 interleaved (gate, up) inputs before it (16-byte bf16 accesses when I % 8 == 0
// and the buffers are 16-byte aligned, else one output at a time). Each thread computes in fp32
// with the CPU reference's formulas (the clamps as comparisons, so NaN passes as in torch; σ with
// IEEE expf, whose overflow gives σ = 0) and rounds once to bf16. Elementwise, hence deterministic;
// a thread reads all its inputs before writing, so dinp may alias inp.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/cuda/clamped_swiglu.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float clamp_max(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float clamp_both(float x, float lo, float hi) { return x > hi ? hi : (x < lo ? lo : x); }
__device__ __forceinline__ float sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

// n consecutive bf16 values as fp32 and back: 16-byte accesses for n a multiple of 8, else one by one.
template <int n>
__device__ __forceinline__ void load_row(float (&x)[n], const bf16* p) {
    if constexpr (n % 8 == 0) {
        detail::load_f32<n>(x, p);
    } else {
#pragma unroll
        for (int i = 0; i < n; ++i) x[i] = detail::to_f32(p[i]);
    }
}
template <int n>
__device__ __forceinline__ void store_row(bf16* p, const float (&x)[n]) {
    if constexpr (n % 8 == 0) {
        detail::store_f32<n>(p, x);
    } else {
#pragma unroll
        for (int i = 0; i < n; ++i) p[i] = detail::from_f32<bf16>(x[i]);
    }
}

template <int kVec>
__global__ void clamped_swiglu_forward_kernel(bf16* out, const bf16* inp, int64_t N, int64_t I, float alpha,
                                              float limit) {
    const int64_t vec_per_row = I / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t i = (idx - n * vec_per_row) * kVec;
        float x[2 * kVec], y[kVec];
        load_row<2 * kVec>(x, inp + n * 2 * I + 2 * i);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            const float g = clamp_max(x[2 * e], limit);
            const float u = clamp_both(x[2 * e + 1], -limit, limit);
            y[e] = (u + 1.0f) * (g * sigmoid(alpha * g));
        }
        store_row<kVec>(out + n * I + i, y);
    }
}

template <int kVec>
__global__ void clamped_swiglu_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I,
                                               float alpha, float limit) {
    const int64_t vec_per_row = I / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t i = (idx - n * vec_per_row) * kVec;
        float x[2 * kVec], dy[kVec], dx[2 * kVec];
        load_row<2 * kVec>(x, inp + n * 2 * I + 2 * i);
        load_row<kVec>(dy, dout + n * I + i);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
            const float gate = x[2 * e], up = x[2 * e + 1];
            const float g = clamp_max(gate, limit);
            const float u = clamp_both(up, -limit, limit);
            const float s = sigmoid(alpha * g);
            const float dg = dy[e] * (u + 1.0f) * (s * (1.0f + alpha * g * (1.0f - s)));
            const float du = dy[e] * (g * s);
            dx[2 * e] = gate <= limit ? dg : 0.0f;
            dx[2 * e + 1] = up >= -limit && up <= limit ? du : 0.0f;
        }
        store_row<2 * kVec>(dinp + n * 2 * I + 2 * i, dx);
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

void clamped_swiglu_forward(bf16* out, const bf16* inp, int64_t N, int64_t I, float alpha, float limit,
                            cudaStream_t stream) {
    MF_CHECK(N >= 0 && I >= 0, "clamped_swiglu_forward: negative shape N=", N, " I=", I);
    if (N == 0 || I == 0) return;
    MF_CHECK(out != nullptr && inp != nullptr, "clamped_swiglu_forward: null buffer");
    if (I % 8 == 0 && aligned_to(16, out, inp)) {
        clamped_swiglu_forward_kernel<8><<<grid_for(N * I / 8), kThreads, 0, stream>>>(out, inp, N, I, alpha, limit);
    } else {
        clamped_swiglu_forward_kernel<1><<<grid_for(N * I), kThreads, 0, stream>>>(out, inp, N, I, alpha, limit);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void clamped_swiglu_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t N, int64_t I, float alpha,
                             float limit, cudaStream_t stream) {
    MF_CHECK(N >= 0 && I >= 0, "clamped_swiglu_backward: negative shape N=", N, " I=", I);
    if (N == 0 || I == 0) return;
    MF_CHECK(dinp != nullptr && dout != nullptr && inp != nullptr, "clamped_swiglu_backward: null buffer");
    if (I % 8 == 0 && aligned_to(16, dinp, dout, inp)) {
        clamped_swiglu_backward_kernel<8>
            <<<grid_for(N * I / 8), kThreads, 0, stream>>>(dinp, dout, inp, N, I, alpha, limit);
    } else {
        clamped_swiglu_backward_kernel<1>
            <<<grid_for(N * I), kThreads, 0, stream>>>(dinp, dout, inp, N, I, alpha, limit);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
