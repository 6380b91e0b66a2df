// AdamW, CUDA. The per-call constants (decay factor, lerp weight, −lr / (1 − β1^t),
// sqrt(1 − β2^t), ...) are computed on the host in double and cast to fp32 exactly as
// kernels/cpu/adamw.cpp does; the per-element math uses the same fp32 operations in the same order,
// written with the _rn intrinsics so that nvcc cannot contract them into FMAs: on the same fp32
// inputs the GPU reproduces the CPU reference bit for bit (sqrtf and division are IEEE).
// A grid-stride loop over groups of 8 elements (16-byte accesses when every buffer is 16-byte
// aligned, else single elements); the n % 8 tail is done element by element. Elementwise, so
// deterministic.
#include <algorithm>
#include <cmath>

#include "core/cuda_check.h"
#include "kernels/cuda/adamw.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65536;

struct AdamWConstants {
    float grad_mul, decay, lerp_weight, one_minus_lerp_weight, beta2, one_minus_beta2, neg_step_size,
        bias_correction2_sqrt, eps;
    bool lerp_from_start;
};

AdamWConstants make_constants(const AdamWParams& p) {
    MF_CHECK(p.step >= 1, "adamw: step must start at 1, got ", p.step);
    const double lr = p.lr;
    const double beta1 = p.beta1;
    const double beta2 = p.beta2;
    AdamWConstants c{};
    c.grad_mul = p.grad_scale;
    c.decay = static_cast<float>(1.0 - lr * static_cast<double>(p.weight_decay));
    c.lerp_weight = static_cast<float>(1.0 - beta1);
    c.one_minus_lerp_weight = 1.0f - c.lerp_weight;
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(p.step));
    const double bias_correction2 = 1.0 - std::pow(beta2, static_cast<double>(p.step));
    c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
    c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    c.eps = p.eps;
    c.lerp_from_start = c.lerp_weight < 0.5f;
    return c;
}

// ----------------------------------------------------------------------------------------------
// kernels

// One element; p, m, v updated in place (fp32 registers).
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float g, const AdamWConstants& c) {
    const float p_decayed = __fmul_rn(p, c.decay);
    const float diff = __fsub_rn(g, m);
    m = c.lerp_from_start ? __fadd_rn(m, __fmul_rn(c.lerp_weight, diff))
                          : __fsub_rn(g, __fmul_rn(diff, c.one_minus_lerp_weight));
    v = __fadd_rn(__fmul_rn(v, c.beta2), __fmul_rn(__fmul_rn(c.one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.bias_correction2_sqrt), c.eps);
    p = __fadd_rn(p_decayed, __fmul_rn(c.neg_step_size, __fdiv_rn(m, denom)));
}

// Elements n - n % kVec .. n - 1 (the part no vector covers), one per thread of block 0.
template <int kVec, typename TP, typename TS, typename TG>
__device__ __forceinline__ void adamw_tail(TP* param, TS* m, TS* v, const TG* grad, bf16* param_copy, int64_t n,
                                           const AdamWConstants& c, const float* grad_scale) {
    const int64_t tail = n / kVec * kVec + threadIdx.x;
    if (blockIdx.x != 0 || tail >= n) return;
    float pf = detail::to_f32(param[tail]), mf = detail::to_f32(m[tail]), vf = detail::to_f32(v[tail]);
    float gf = __fmul_rn(detail::to_f32(grad[tail]), c.grad_mul);
    if (grad_scale != nullptr) gf = __fmul_rn(gf, *grad_scale);
    adamw_element(pf, mf, vf, gf, c);
    param[tail] = detail::from_f32<TP>(pf);
    m[tail] = detail::from_f32<TS>(mf);
    v[tail] = detail::from_f32<TS>(vf);
    if (param_copy != nullptr) param_copy[tail] = __float2bfloat16_rn(pf);
}

// One element at a time (buffers not all 16-byte aligned).
template <typename TP, typename TS, typename TG>
__global__ void adamw_scalar_kernel(TP* param, TS* m, TS* v, const TG* grad, bf16* param_copy, int64_t n,
                                    AdamWConstants c, const float* grad_scale) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
        float pf = detail::to_f32(param[i]), mf = detail::to_f32(m[i]), vf = detail::to_f32(v[i]);
        float gf = __fmul_rn(detail::to_f32(grad[i]), c.grad_mul);
        if (grad_scale != nullptr) gf = __fmul_rn(gf, *grad_scale);
        adamw_element(pf, mf, vf, gf, c);
        param[i] = detail::from_f32<TP>(pf);
        m[i] = detail::from_f32<TS>(mf);
        v[i] = detail::from_f32<TS>(vf);
        if (param_copy != nullptr) param_copy[i] = __float2bfloat16_rn(pf);
    }
}

// Eight elements of T as the 16-byte words they were loaded in, converted one element at a time
// where they are used: a bf16 vector occupies 4 registers instead of 8 floats, so the bf16 policy's
// kernel holds 16 elements of 4 buffers in flight per thread in ~32 registers (with the vectors
// converted at load it needed 96 registers: two blocks per SM).
template <typename T>
struct Words8;
template <>
struct Words8<bf16> {
    uint4 w;
    __device__ __forceinline__ void load(const bf16* p) { w = *reinterpret_cast<const uint4*>(p); }
    __device__ __forceinline__ void store(bf16* p) const { *reinterpret_cast<uint4*>(p) = w; }
    __device__ __forceinline__ uint32_t& word(int e) { return e < 2 ? w.x : e < 4 ? w.y : e < 6 ? w.z : w.w; }
    __device__ __forceinline__ float get(int e) {
        const uint32_t x = word(e);
        return __uint_as_float(e % 2 == 0 ? x << 16 : x & 0xffff0000u);
    }
    // Elements e, e + 1 (e even), rounded to nearest even as __float2bfloat16_rn rounds.
    __device__ __forceinline__ void set2(int e, float lo, float hi) {
        const __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
        word(e) = *reinterpret_cast<const uint32_t*>(&pair);
    }
};
template <>
struct Words8<float> {
    float4 a, b;
    __device__ __forceinline__ void load(const float* p) {
        a = reinterpret_cast<const float4*>(p)[0];
        b = reinterpret_cast<const float4*>(p)[1];
    }
    __device__ __forceinline__ void store(float* p) const {
        reinterpret_cast<float4*>(p)[0] = a;
        reinterpret_cast<float4*>(p)[1] = b;
    }
    __device__ __forceinline__ float& at(int e) {
        float4& q = e < 4 ? a : b;
        const int k = e % 4;
        return k == 0 ? q.x : k == 1 ? q.y : k == 2 ? q.z : q.w;
    }
    __device__ __forceinline__ float get(int e) { return at(e); }
    __device__ __forceinline__ void set2(int e, float lo, float hi) {
        at(e) = lo;
        at(e + 1) = hi;
    }
};

// TP: param storage (master) type; TS: m, v storage type; TG: gradient type. param_copy: optional bf16.
// kUnroll vectors of 8 (i, i + stride, ...) per thread and iteration: all loads are issued before any
// store, so that enough bytes are in flight when each vector is small (the bf16 policy).
template <int kUnroll, typename TP, typename TS, typename TG>
__global__ void adamw_vec8_kernel(TP* param, TS* m, TS* v, const TG* grad, bf16* param_copy, int64_t n,
                                  AdamWConstants c, const float* grad_scale) {
    const float gs = grad_scale != nullptr ? *grad_scale : 1.0f;
    const bool scaled = grad_scale != nullptr;
    const int64_t num_vec = n / 8;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < num_vec; i += kUnroll * stride) {
        Words8<TP> pw[kUnroll];
        Words8<TS> mw[kUnroll], vw[kUnroll];
        Words8<TG> gw[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t at = (i + u * stride) * 8;
            if (i + u * stride < num_vec) {
                pw[u].load(param + at);
                mw[u].load(m + at);
                vw[u].load(v + at);
                gw[u].load(grad + at);
            }
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            const int64_t at = (i + u * stride) * 8;
            if (i + u * stride < num_vec) {
                Words8<bf16> copy;
#pragma unroll
                for (int e = 0; e < 8; e += 2) {
                    float pf[2], mf[2], vf[2];
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        pf[k] = pw[u].get(e + k);
                        mf[k] = mw[u].get(e + k);
                        vf[k] = vw[u].get(e + k);
                        const float g = __fmul_rn(gw[u].get(e + k), c.grad_mul);
                        adamw_element(pf[k], mf[k], vf[k], scaled ? __fmul_rn(g, gs) : g, c);
                    }
                    pw[u].set2(e, pf[0], pf[1]);
                    mw[u].set2(e, mf[0], mf[1]);
                    vw[u].set2(e, vf[0], vf[1]);
                    copy.set2(e, pf[0], pf[1]);
                }
                pw[u].store(param + at);
                mw[u].store(m + at);
                vw[u].store(v + at);
                if (param_copy != nullptr) copy.store(param_copy + at);
            }
        }
    }
    adamw_tail<8>(param, m, v, grad, param_copy, n, c, grad_scale);
}

// ----------------------------------------------------------------------------------------------
// launchers

template <typename TP, typename TS, typename TG>
void launch_adamw(TP* param, TS* m, TS* v, const TG* grad, bf16* param_copy, int64_t n, const AdamWConstants& c,
                  const float* grad_scale, cudaStream_t stream) {
    if (n == 0) return;
    const bool vec = aligned_to(16, param, m, v, grad, param_copy);
    // Two vectors of 8 per thread when the parameters are 16-bit (8 elements are then only 64 bytes of
    // loads), one for fp32 masters.
    constexpr int kUnroll = sizeof(TP) == 2 ? 2 : 1;
    const int64_t work = (vec ? n / 8 : n) / (vec ? kUnroll : 1);
    const int blocks = static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
    if (vec) {
        adamw_vec8_kernel<kUnroll><<<blocks, kThreads, 0, stream>>>(param, m, v, grad, param_copy, n, c, grad_scale);
    } else {
        adamw_scalar_kernel<<<blocks, kThreads, 0, stream>>>(param, m, v, grad, param_copy, n, c, grad_scale);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void adamw_update_bf16(bf16* param, bf16* m, bf16* v, const bf16* grad, int64_t n, const AdamWParams& p,
                       const float* grad_scale, cudaStream_t stream) {
    MF_CHECK(n >= 0, "adamw_update_bf16: negative element count ", n);
    const AdamWConstants c = make_constants(p);
    if (n == 0) return;
    MF_CHECK(param != nullptr && m != nullptr && v != nullptr && grad != nullptr, "adamw_update_bf16: null buffer");
    launch_adamw(param, m, v, grad, static_cast<bf16*>(nullptr), n, c, grad_scale, stream);
}

void adamw_update_mixed(float* master, float* m, float* v, const void* grad, DType grad_dtype, bf16* param_bf16,
                        int64_t n, const AdamWParams& p, const float* grad_scale, cudaStream_t stream) {
    MF_CHECK(n >= 0, "adamw_update_mixed: negative element count ", n);
    const AdamWConstants c = make_constants(p);
    if (n == 0) return;
    MF_CHECK(master != nullptr && m != nullptr && v != nullptr && grad != nullptr, "adamw_update_mixed: null buffer");
    switch (grad_dtype) {
        case DType::f32:
            launch_adamw(master, m, v, static_cast<const float*>(grad), param_bf16, n, c, grad_scale, stream);
            break;
        case DType::bf16:
            launch_adamw(master, m, v, static_cast<const bf16*>(grad), param_bf16, n, c, grad_scale, stream);
            break;
        default:
            MF_FAIL("adamw_update_mixed: grad dtype must be f32 or bf16, got ", dtype_name(grad_dtype));
    }
}

}  // namespace mf::cuda
