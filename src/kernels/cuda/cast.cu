// fp32 <-> bf16 buffer casts. A grid-stride loop over pairs of 8-element vectors (16-byte bf16 accesses,
// two 16-byte fp32 accesses) when both buffers are 16-byte aligned, else over single elements;
// the n % 8 tail is done element by element. fp32 -> bf16 rounds to nearest even; bf16 -> fp32
// is exact. Purely elementwise, so deterministic.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

// ----------------------------------------------------------------------------------------------
// kernels

// Two vectors per thread and iteration (i and i + stride), both loads issued before the stores,
// to keep more bytes in flight.
template <int kVec, typename Src, typename Dst>
__global__ void cast_kernel(Dst* dst, const Src* src, int64_t n) {
    const int64_t num_vec = n / kVec;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vec; i += 2 * stride) {
        const bool second = i + stride < num_vec;
        float v0[kVec], v1[kVec];
        detail::load_f32<kVec>(v0, src + i * kVec);
        if (second) detail::load_f32<kVec>(v1, src + (i + stride) * kVec);
        detail::store_f32<kVec>(dst + i * kVec, v0);
        if (second) detail::store_f32<kVec>(dst + (i + stride) * kVec, v1);
    }
    // Tail (kVec > 1 only): the last n % kVec elements, one per thread of the first block.
    const int64_t tail_begin = num_vec * kVec;
    if (blockIdx.x == 0 && tail_begin + threadIdx.x < n) {
        const int64_t i = tail_begin + threadIdx.x;
        dst[i] = detail::from_f32<Dst>(detail::to_f32(src[i]));
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

template <typename Src, typename Dst>
void launch_cast(Dst* dst, const Src* src, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = aligned_to(16, dst, src);
    const int64_t work = (vec ? n / 8 : n) / 2;  // two vectors per thread
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
    if (vec) {
        cast_kernel<8><<<blocks, kThreads, 0, stream>>>(dst, src, n);
    } else {
        cast_kernel<1><<<blocks, kThreads, 0, stream>>>(dst, src, n);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void cast_f32_to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
    MF_CHECK(n >= 0, "cast_f32_to_bf16: negative element count ", n);
    MF_CHECK(n == 0 || (dst != nullptr && src != nullptr), "cast_f32_to_bf16: null buffer");
    launch_cast(dst, src, n, stream);
}

void cast_bf16_to_f32(float* dst, const bf16* src, int64_t n, cudaStream_t stream) {
    MF_CHECK(n >= 0, "cast_bf16_to_f32: negative element count ", n);
    MF_CHECK(n == 0 || (dst != nullptr && src != nullptr), "cast_bf16_to_f32: null buffer");
    launch_cast(dst, src, n, stream);
}

}  // namespace mf::cuda
