// Buffer casts between fp32 and bf16, and the device helpers the other kernel files of this
// directory share: 16-byte vector loads/stores of bf16 (8 elements) or fp32 (4 elements) turned
// into fp32 registers, conversions, and warp sums.
//
// Invariants of the helpers: a kVec-wide load/store needs its pointer aligned to kVec elements
// (kVec * sizeof(T) bytes, at most 16 per instruction); callers pick kVec = 1 when a buffer or
// a row length does not allow it. fp32 -> bf16 always rounds to nearest even (__float2bfloat16_rn),
// the same rounding as the host's mf::f32_to_bf16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

namespace mf::cuda {

using bf16 = __nv_bfloat16;

// dst[i] = bf16(src[i]) (round to nearest even), i < n. dst and src must not overlap.
void cast_f32_to_bf16(bf16* dst, const float* src, int64_t n, cudaStream_t stream);
// dst[i] = float(src[i]) (exact), i < n. dst and src must not overlap.
void cast_bf16_to_f32(float* dst, const bf16* src, int64_t n, cudaStream_t stream);

// True when every pointer is aligned to `bytes` (nullptrs count as aligned).
template <typename... Ptrs>
inline bool aligned_to(int64_t bytes, const Ptrs*... ptrs) {
    return ((reinterpret_cast<uintptr_t>(ptrs) % static_cast<uintptr_t>(bytes) == 0) && ...);
}

#ifdef __CUDACC__
namespace detail {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) {
    return x;
}
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    return __float2bfloat16_rn(x);
}

// kVec bf16 values as raw bits (kVec 8: one 16-byte vector; kVec 1: one element), for caching a
// row in registers at half the cost of fp32 copies.
template <int kVec>
using Bf16Raw = std::conditional_t<kVec == 8, uint4, bf16>;

template <int kVec>
__device__ __forceinline__ Bf16Raw<kVec> load_raw(const bf16* p) {
    static_assert(kVec == 1 || kVec == 8, "raw bf16 loads move 1 or 8 elements");
    return *reinterpret_cast<const Bf16Raw<kVec>*>(p);
}

template <int kVec>
__device__ __forceinline__ void unpack(float (&out)[kVec], const Bf16Raw<kVec>& raw) {
    if constexpr (kVec == 1) {
        out[0] = __bfloat162float(raw);
    } else {
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 f = __bfloat1622float2(pairs[j]);
            out[2 * j] = f.x;
            out[2 * j + 1] = f.y;
        }
    }
}

// out[0..kVec) = float(p[0..kVec)). kVec is 1 or a multiple of the elements in 16 bytes.
template <int kVec, typename T>
__device__ __forceinline__ void load_f32(float (&out)[kVec], const T* p) {
    if constexpr (kVec == 1) {
        out[0] = to_f32(p[0]);
    } else if constexpr (sizeof(T) == 2) {
        static_assert(kVec % 8 == 0, "bf16 vector loads move 8 elements");
#pragma unroll
        for (int i = 0; i < kVec; i += 8) {
            const uint4 raw = *reinterpret_cast<const uint4*>(p + i);
            const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __bfloat1622float2(pairs[j]);
                out[i + 2 * j] = f.x;
                out[i + 2 * j + 1] = f.y;
            }
        }
    } else {
        static_assert(kVec % 4 == 0, "fp32 vector loads move 4 elements");
#pragma unroll
        for (int i = 0; i < kVec; i += 4) {
            const float4 f = *reinterpret_cast<const float4*>(p + i);
            out[i] = f.x;
            out[i + 1] = f.y;
            out[i + 2] = f.z;
            out[i + 3] = f.w;
        }
    }
}

// p[0..kVec) = T(in[0..kVec)) (bf16: round to nearest even).
template <int kVec, typename T>
__device__ __forceinline__ void store_f32(T* p, const float (&in)[kVec]) {
    if constexpr (kVec == 1) {
        p[0] = from_f32<T>(in[0]);
    } else if constexpr (sizeof(T) == 2) {
        static_assert(kVec % 8 == 0, "bf16 vector stores move 8 elements");
#pragma unroll
        for (int i = 0; i < kVec; i += 8) {
            uint4 raw;
            __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
            for (int j = 0; j < 4; ++j) pairs[j] = __floats2bfloat162_rn(in[i + 2 * j], in[i + 2 * j + 1]);
            *reinterpret_cast<uint4*>(p + i) = raw;
        }
    } else {
        static_assert(kVec % 4 == 0, "fp32 vector stores move 4 elements");
#pragma unroll
        for (int i = 0; i < kVec; i += 4) {
            *reinterpret_cast<float4*>(p + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
        }
    }
}

// Sum over the aligned groups of kWidth lanes (a power of two <= 32) by a xor butterfly: every
// lane of a group ends with the same bits (fp32 addition is commutative), in a fixed order.
template <int kWidth = 32>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = kWidth / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(kFullMask, v, offset);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, offset));
    return v;
}

}  // namespace detail
#endif  // __CUDACC__

}  // namespace mf::cuda
