// Squared ReLU, CUDA: a grid-stride loop over 8-element groups (16-byte bf16 accesses when n % 8 == 0
// and the buffers are 16-byte aligned, else single elements). Each thread reads its inputs, computes
// in fp32 with the CPU reference's formulas (r = max(x, 0) keeping NaN; r · r; dout · (2 · r)) and
// rounds once to bf16. Elementwise, so outputs may alias inputs, and deterministic.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/cuda/relu2.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float relu(float x) { return x > 0.0f || isnan(x) ? x : 0.0f; }

template <int kVec>
__global__ void relu2_forward_kernel(bf16* out, const bf16* inp, int64_t n) {
    const int64_t groups = n / kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
        float x[kVec], y[kVec];
        detail::load_f32<kVec>(x, inp + g * kVec);
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
            const float r = relu(x[i]);
            y[i] = r * r;
        }
        detail::store_f32<kVec>(out + g * kVec, y);
    }
}

template <int kVec>
__global__ void relu2_backward_kernel(bf16* dinp, const bf16* dout, const bf16* inp, int64_t n) {
    const int64_t groups = n / kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
        float x[kVec], dy[kVec], dx[kVec];
        detail::load_f32<kVec>(x, inp + g * kVec);
        detail::load_f32<kVec>(dy, dout + g * kVec);
#pragma unroll
        for (int i = 0; i < kVec; ++i) dx[i] = dy[i] * (2.0f * relu(x[i]));
        detail::store_f32<kVec>(dinp + g * kVec, dx);
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

void relu2_forward(bf16* out, const bf16* inp, int64_t n, cudaStream_t stream) {
    MF_CHECK(n >= 0, "relu2_forward: n = ", n, " is negative");
    if (n == 0) return;
    MF_CHECK(out != nullptr && inp != nullptr, "relu2_forward: null buffer");
    if (n % 8 == 0 && aligned_to(16, out, inp)) {
        relu2_forward_kernel<8><<<grid_for(n / 8), kThreads, 0, stream>>>(out, inp, n);
    } else {
        relu2_forward_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(out, inp, n);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void relu2_backward(bf16* dinp, const bf16* dout, const bf16* inp, int64_t n, cudaStream_t stream) {
    MF_CHECK(n >= 0, "relu2_backward: n = ", n, " is negative");
    if (n == 0) return;
    MF_CHECK(dinp != nullptr && dout != nullptr && inp != nullptr, "relu2_backward: null buffer");
    if (n % 8 == 0 && aligned_to(16, dinp, dout, inp)) {
        relu2_backward_kernel<8><<<grid_for(n / 8), kThreads, 0, stream>>>(dinp, dout, inp, n);
    } else {
        relu2_backward_kernel<1><<<grid_for(n), kThreads, 0, stream>>>(dinp, dout, inp, n);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
