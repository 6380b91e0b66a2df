// Fused QK-norm + RoPE, CUDA. A block (128 threads) works on one token at a time:
//   1. threads compute the token's cos/sin row (D/2 angles, fp32 cosf/sinf of pos · inv_freq[i],
//      inv_freq computed on the host exactly as the CPU reference does) into shared memory, once
//      for all its Hq + Hkv heads;
//   2. a group of G lanes (a power of two <= 32) takes one head at a time: lane l of the group owns
//      the pair chunks c = l, l + G, ... (kVec = 8 consecutive pairs with 16-byte loads when
//      D/2 % 8 == 0, else single pairs), holding both halves x[c] and x[c + D/2] in registers; Σx²
//      is a xor butterfly inside the group; then norm, weight and rotation are applied and written.
//   The rotation's cos/sin come either from positions (step 1) or from tables cos, sin [N, D] bf16
//   (transformers' position_embeddings, any rope type), read into shared memory per token; the two
//   halves may then differ: y[i] = n[i]·cos[i] − n[i+D/2]·sin[i], y[i+D/2] = n[i+D/2]·cos[i+D/2] +
//   n[i]·sin[i+D/2], as transformers' q·cos + rotate_half(q)·sin.
// Backward: the same walk; dn = inverse rotation of dy, then the RMSNorm backward per head. The
// weight gradients dn ⊙ x̂ accumulate per group in shared memory (each lane owns fixed words, laid
// out so a group's lanes touch consecutive words; heads and tokens in a fixed order), the groups
// are added in order into scratch [2][block][D] (q, then k), and reduce_partial_rows sums the
// blocks in order. The backward grid depends on N only, so the result is bitwise reproducible.
// No atomics. Every lane of a warp runs the same number of head iterations (idle groups pass zeros
// through the shuffles), so the full-mask shuffles are always converged.
// RoPE alone (rope_forward / rope_backward, no norm, partial rotary): the same token loop, angle row
// (R/2 angles of inv_freq over R = rotary_dim) and vector loads; with no per-head reduction the
// block's threads take the token's (head, pair chunk) items in a flat stride, each rotating its pair
// chunk (backward: by −angle, the transposed rotation) and, out of place, copying the pass-through
// chunks of dims [R, D). Elementwise, hence deterministic.
#include <algorithm>
#include <cmath>
#include <initializer_list>

#include "core/cuda_check.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/rope_qknorm.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int kMaxHeadDim = 256;
constexpr int64_t kMaxBackwardBlocks = 2048;  // N / 2048 tokens per block at most

struct InvFreq {
    float v[kMaxHeadDim / 2];
};

// The source of a QK-norm kernel's rotation: the tables when cos != null, else positions and inv_freq.
struct Rotation {
    const int32_t* positions;
    InvFreq inv_freq;
    const bf16* cos;
    const bf16* sin;
};

// Chunks one lane holds: with 8-wide chunks D <= 256 needs at most 16 chunks, so G >= chunks and
// one per lane; single pairs need up to 128 / 32 = 4 per lane.
template <int kVec>
constexpr int kPerLane = kVec == 8 ? 1 : 4;

// The R/2 frequencies of R rotated dims (R = D with the norm).
InvFreq make_inv_freq(int64_t R, float theta) {
    // Exactly as kernels/cpu/rope.cpp: 1 / pow(theta, (float)(2i) / (float)R) in fp32.
    InvFreq f{};
    for (int64_t i = 0; i < R / 2; ++i) {
        f.v[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(R));
    }
    return f;
}

int group_width(int64_t chunks) {
    int g = 1;
    while (g < chunks && g < 32) g *= 2;
    return g;
}

// Floats of one group's weight-gradient accumulators in shared memory: [q, k][D], padded by G so
// that the groups sharing a warp start on different banks.
int group_stride(int64_t D, int G) { return static_cast<int>(2 * D + G); }

int64_t backward_blocks(int64_t N) { return std::clamp<int64_t>(N, 1, kMaxBackwardBlocks); }

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float group_sum_width(float v, int width) {
    for (int offset = width / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(detail::kFullMask, v, offset);
    return v;
}

// Fills cos_s/sin_s [D/2] for one token (all threads take part; syncs before and after).
__device__ __forceinline__ void fill_angles(float* cos_s, float* sin_s, const InvFreq& inv_freq, int32_t position,
                                            int half) {
    __syncthreads();
    const float pos = static_cast<float>(position);
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        const float angle = pos * inv_freq.v[i];
        cos_s[i] = cosf(angle);
        sin_s[i] = sinf(angle);
    }
    __syncthreads();
}

// Fills cos_s/sin_s [D] for one token (both halves: equal when made from an angle); all threads take
// part; syncs before and after.
__device__ __forceinline__ void fill_rotation(float* cos_s, float* sin_s, const Rotation& rot, int64_t token, int D) {
    const int half = D / 2;
    __syncthreads();
    if (rot.cos != nullptr) {
        for (int i = threadIdx.x; i < D; i += blockDim.x) {
            cos_s[i] = __bfloat162float(rot.cos[token * D + i]);
            sin_s[i] = __bfloat162float(rot.sin[token * D + i]);
        }
    } else {
        const float pos = static_cast<float>(rot.positions[token]);
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            const float angle = pos * rot.inv_freq.v[i];
            cos_s[i] = cos_s[i + half] = cosf(angle);
            sin_s[i] = sin_s[i + half] = sinf(angle);
        }
    }
    __syncthreads();
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rope_qknorm_forward_kernel(bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q, const bf16* k,
                               const bf16* q_weight, const bf16* k_weight, Rotation rot, int64_t N, int Hq, int Hkv,
                               int D, int G, float eps) {
    constexpr int kLane = kPerLane<kVec>;
    extern __shared__ float smem[];
    const int half = D / 2;
    float* cos_s = smem;
    float* sin_s = smem + D;
    const int chunks = half / kVec;
    const int groups = blockDim.x / G;
    const int group = threadIdx.x / G;
    const int lane_g = threadIdx.x % G;
    const int H = Hq + Hkv;

    for (int64_t token = blockIdx.x; token < N; token += gridDim.x) {
        fill_rotation(cos_s, sin_s, rot, token, D);
        for (int h0 = 0; h0 < H; h0 += groups) {
            const int h = h0 + group;
            const bool active = h < H;
            const bool is_q = h < Hq;
            const int64_t head_row = is_q ? token * Hq + h : token * Hkv + (h - Hq);
            const bf16* x = (is_q ? q : k) + head_row * D;
            const bf16* w = is_q ? q_weight : k_weight;

            float lo[kLane][kVec], hi[kLane][kVec];
            float sum_sq = 0.0f;
#pragma unroll
            for (int j = 0; j < kLane; ++j) {
                const int c = lane_g + G * j;
                if (active && c < chunks) {
                    detail::load_f32<kVec>(lo[j], x + c * kVec);
                    detail::load_f32<kVec>(hi[j], x + half + c * kVec);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) sum_sq += lo[j][e] * lo[j][e] + hi[j][e] * hi[j][e];
                }
            }
            sum_sq = group_sum_width(sum_sq, G);
            if (!active) continue;
            const float r = 1.0f / sqrtf(sum_sq / static_cast<float>(D) + eps);
            if (lane_g == 0) (is_q ? q_rstd : k_rstd)[head_row] = r;
            bf16* y = (is_q ? q_out : k_out) + head_row * D;
#pragma unroll
            for (int j = 0; j < kLane; ++j) {
                const int c = lane_g + G * j;
                if (c < chunks) {
                    float w_lo[kVec], w_hi[kVec], y_lo[kVec], y_hi[kVec];
                    detail::load_f32<kVec>(w_lo, w + c * kVec);
                    detail::load_f32<kVec>(w_hi, w + half + c * kVec);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) {
                        const int i = c * kVec + e;
                        const float a = w_lo[e] * (lo[j][e] * r);
                        const float b = w_hi[e] * (hi[j][e] * r);
                        y_lo[e] = a * cos_s[i] + (-b) * sin_s[i];
                        y_hi[e] = b * cos_s[half + i] + a * sin_s[half + i];
                    }
                    detail::store_f32<kVec>(y + c * kVec, y_lo);
                    detail::store_f32<kVec>(y + half + c * kVec, y_hi);
                }
            }
        }
    }
}

// RoPE without the norm. Shared memory: cos[R/2], sin[R/2]. sign = +1 rotates by +angle (forward),
// −1 by −angle (backward). x and y may be the same buffers (in place): every element is read and
// written by one thread, the pass-through dims then not copied.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(bf16* q_out, bf16* k_out, const bf16* q, const bf16* k, const int32_t* positions, InvFreq inv_freq,
                int64_t N, int Hq, int Hkv, int D, int R, float sign) {
    extern __shared__ float smem[];
    const int half = R / 2;
    float* cos_s = smem;
    float* sin_s = smem + half;
    const int pair_chunks = half / kVec;
    const int pass_chunks = (D - R) / kVec;
    const int H = Hq + Hkv;

    for (int64_t token = blockIdx.x; token < N; token += gridDim.x) {
        fill_angles(cos_s, sin_s, inv_freq, positions[token], half);
        for (int item = threadIdx.x; item < H * pair_chunks; item += blockDim.x) {
            const int h = item / pair_chunks;
            const int c = item - h * pair_chunks;
            const bool is_q = h < Hq;
            const int64_t head_row = is_q ? token * Hq + h : token * Hkv + (h - Hq);
            const bf16* x = (is_q ? q : k) + head_row * D;
            bf16* y = (is_q ? q_out : k_out) + head_row * D;
            float a[kVec], b[kVec], y_lo[kVec], y_hi[kVec];
            detail::load_f32<kVec>(a, x + c * kVec);
            detail::load_f32<kVec>(b, x + half + c * kVec);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                const int i = c * kVec + e;
                const float s = sign * sin_s[i];
                y_lo[e] = a[e] * cos_s[i] + (-b[e]) * s;
                y_hi[e] = b[e] * cos_s[i] + a[e] * s;
            }
            detail::store_f32<kVec>(y + c * kVec, y_lo);
            detail::store_f32<kVec>(y + half + c * kVec, y_hi);
        }
        for (int item = threadIdx.x; item < H * pass_chunks; item += blockDim.x) {
            const int h = item / pass_chunks;
            const int p = item - h * pass_chunks;
            const bool is_q = h < Hq;
            const int64_t head_row = is_q ? token * Hq + h : token * Hkv + (h - Hq);
            const bf16* x = (is_q ? q : k) + head_row * D + R + p * kVec;
            bf16* y = (is_q ? q_out : k_out) + head_row * D + R + p * kVec;
            if (x != y) *reinterpret_cast<detail::Bf16Raw<kVec>*>(y) = detail::load_raw<kVec>(x);
        }
    }
}

// Shared memory: cos[D/2], sin[D/2], then dw[groups][2][D] (q, k) when partial != null.
// partial: [2][gridDim.x][D] (q block rows, then k block rows).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rope_qknorm_backward_kernel(bf16* dq, bf16* dk, float* partial, const bf16* dq_out, const bf16* dk_out,
                                const bf16* q, const bf16* k, const bf16* q_weight, const bf16* k_weight,
                                const float* q_rstd, const float* k_rstd, Rotation rot, int64_t N, int Hq, int Hkv,
                                int D, int G) {
    constexpr int kLane = kPerLane<kVec>;
    extern __shared__ float smem[];
    const int half = D / 2;
    float* cos_s = smem;
    float* sin_s = smem + D;
    float* dw_s = smem + 2 * D;
    const int chunks = half / kVec;
    const int groups = blockDim.x / G;
    const int group = threadIdx.x / G;
    const int lane_g = threadIdx.x % G;
    const int H = Hq + Hkv;
    // Weight-gradient sums per group in shared memory, [q, k][D] with column (half, c, e) stored at
    // e·2·chunks + half·chunks + c, so the lanes of a group touch consecutive words.
    const int stride = 2 * D + G;
    float* my_dw = dw_s + group * stride;
    if (partial != nullptr) {
        for (int i = threadIdx.x; i < groups * stride; i += blockDim.x) dw_s[i] = 0.0f;
    }  // fill_rotation syncs before anyone accumulates

    for (int64_t token = blockIdx.x; token < N; token += gridDim.x) {
        fill_rotation(cos_s, sin_s, rot, token, D);
        for (int h0 = 0; h0 < H; h0 += groups) {
            const int h = h0 + group;
            const bool active = h < H;
            const bool is_q = h < Hq;
            const int64_t head_row = is_q ? token * Hq + h : token * Hkv + (h - Hq);
            const bf16* x = (is_q ? q : k) + head_row * D;
            const bf16* dy = (is_q ? dq_out : dk_out) + head_row * D;
            const bf16* w = is_q ? q_weight : k_weight;
            const float r = active ? (is_q ? q_rstd : k_rstd)[head_row] : 0.0f;

            // dn (inverse rotation of dy) and x̂, both halves; Σ g·x̂ over the head.
            float dn_lo[kLane][kVec], dn_hi[kLane][kVec], xh_lo[kLane][kVec], xh_hi[kLane][kVec];
            float sum_gx = 0.0f;
#pragma unroll
            for (int j = 0; j < kLane; ++j) {
                const int c = lane_g + G * j;
                if (active && c < chunks) {
                    float a[kVec], b[kVec], w_lo[kVec], w_hi[kVec];
                    detail::load_f32<kVec>(a, dy + c * kVec);
                    detail::load_f32<kVec>(b, dy + half + c * kVec);
                    detail::load_f32<kVec>(xh_lo[j], x + c * kVec);
                    detail::load_f32<kVec>(xh_hi[j], x + half + c * kVec);
                    detail::load_f32<kVec>(w_lo, w + c * kVec);
                    detail::load_f32<kVec>(w_hi, w + half + c * kVec);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) {
                        const int i = c * kVec + e;
                        // the transposed rotation: dn_lo = a·cos_lo + b·sin_hi, dn_hi = b·cos_hi − a·sin_lo
                        dn_lo[j][e] = a[e] * cos_s[i] + b[e] * sin_s[half + i];
                        dn_hi[j][e] = b[e] * cos_s[half + i] + a[e] * (-sin_s[i]);
                        xh_lo[j][e] *= r;
                        xh_hi[j][e] *= r;
                        sum_gx += (dn_lo[j][e] * w_lo[e]) * xh_lo[j][e] + (dn_hi[j][e] * w_hi[e]) * xh_hi[j][e];
                        if (partial != nullptr) {
                            float* acc = my_dw + (is_q ? 0 : D) + e * 2 * chunks + c;
                            acc[0] += dn_lo[j][e] * xh_lo[j][e];
                            acc[chunks] += dn_hi[j][e] * xh_hi[j][e];
                        }
                    }
                }
            }
            sum_gx = group_sum_width(sum_gx, G);
            if (!active) continue;
            const float mean_gx = sum_gx / static_cast<float>(D);
            bf16* dx = (is_q ? dq : dk) + head_row * D;
#pragma unroll
            for (int j = 0; j < kLane; ++j) {
                const int c = lane_g + G * j;
                if (c < chunks) {
                    float w_lo[kVec], w_hi[kVec], out_lo[kVec], out_hi[kVec];
                    detail::load_f32<kVec>(w_lo, w + c * kVec);
                    detail::load_f32<kVec>(w_hi, w + half + c * kVec);
#pragma unroll
                    for (int e = 0; e < kVec; ++e) {
                        out_lo[e] = r * (dn_lo[j][e] * w_lo[e] - xh_lo[j][e] * mean_gx);
                        out_hi[e] = r * (dn_hi[j][e] * w_hi[e] - xh_hi[j][e] * mean_gx);
                    }
                    detail::store_f32<kVec>(dx + c * kVec, out_lo);
                    detail::store_f32<kVec>(dx + half + c * kVec, out_hi);
                }
            }
        }
    }

    if (partial == nullptr) return;
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * D; i += blockDim.x) {
        const int which = i / D;
        const int col = i % D;
        const int upper = col / half;
        const int c = (col % half) / kVec;
        const int e = (col % half) % kVec;
        const int at = which * D + e * 2 * chunks + upper * chunks + c;
        float sum = 0.0f;
        for (int g = 0; g < groups; ++g) sum += dw_s[g * stride + at];
        partial[(static_cast<int64_t>(which) * gridDim.x + blockIdx.x) * D + col] = sum;
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

void check_shape(const char* op, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, float theta) {
    MF_CHECK(N >= 0 && Hq >= 0 && Hkv >= 0 && D > 0 && D % 2 == 0 && D <= kMaxHeadDim, op, ": bad shape N=", N,
             " Hq=", Hq, " Hkv=", Hkv, " D=", D, " (D must be even and <= ", kMaxHeadDim, ")");
    MF_CHECK(Hq + Hkv <= 65536, op, ": too many heads (", Hq, " + ", Hkv, ")");
    MF_CHECK(theta > 0.0f, op, ": theta must be positive, got ", theta);
}

// 16-byte vectors serve a rotated span of D dims when its halves are whole vectors and every buffer
// is 16-byte aligned.
bool use_vectors(int64_t D, std::initializer_list<const void*> ptrs) {
    if ((D / 2) % 8 != 0) return false;
    for (const void* p : ptrs)
        if (!aligned_to(16, p)) return false;
    return true;
}

void check_rope_shape(const char* op, int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t R, float theta) {
    MF_CHECK(N >= 0 && Hq >= 0 && Hkv >= 0 && D > 0, op, ": bad shape N=", N, " Hq=", Hq, " Hkv=", Hkv, " D=", D);
    MF_CHECK(R > 0 && R % 2 == 0 && R <= D && R <= kMaxHeadDim, op, ": rotary_dim = ", R,
             " must be even and in [2, min(D = ", D, ", ", kMaxHeadDim, ")]");
    MF_CHECK(Hq + Hkv <= 65536, op, ": too many heads (", Hq, " + ", Hkv, ")");
    MF_CHECK(theta > 0.0f, op, ": theta must be positive, got ", theta);
}

// RoPE alone, forward (sign +1) or backward (sign −1).
void launch_rope(const char* op, bf16* q_out, bf16* k_out, const bf16* q, const bf16* k, const int32_t* positions,
                 int64_t N, int64_t Hq, int64_t Hkv, int64_t D, int64_t R, float theta, float sign,
                 cudaStream_t stream) {
    check_rope_shape(op, N, Hq, Hkv, D, R, theta);
    if (N == 0 || Hq + Hkv == 0) return;
    MF_CHECK(positions != nullptr, op, ": null positions");
    MF_CHECK(Hq == 0 || (q_out != nullptr && q != nullptr), op, ": null query buffer");
    MF_CHECK(Hkv == 0 || (k_out != nullptr && k != nullptr), op, ": null key buffer");
    const InvFreq inv_freq = make_inv_freq(R, theta);
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, 1 << 20));
    const size_t shared = static_cast<size_t>(R) * sizeof(float);
    if ((D - R) % 8 == 0 && use_vectors(R, {q_out, k_out, q, k})) {
        rope_kernel<8><<<blocks, kThreads, shared, stream>>>(q_out, k_out, q, k, positions, inv_freq, N,
                                                             static_cast<int>(Hq), static_cast<int>(Hkv),
                                                             static_cast<int>(D), static_cast<int>(R), sign);
    } else {
        rope_kernel<1><<<blocks, kThreads, shared, stream>>>(q_out, k_out, q, k, positions, inv_freq, N,
                                                             static_cast<int>(Hq), static_cast<int>(Hkv),
                                                             static_cast<int>(D), static_cast<int>(R), sign);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

namespace {

void launch_qknorm_forward(const char* op, bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q,
                           const bf16* k, const bf16* q_weight, const bf16* k_weight, const Rotation& rot, int64_t N,
                           int64_t Hq, int64_t Hkv, int64_t D, float eps, cudaStream_t stream) {
    MF_CHECK(eps >= 0.0f, op, ": eps must be >= 0, got ", eps);
    if (N == 0 || Hq + Hkv == 0) return;
    MF_CHECK(Hq == 0 || (q_out != nullptr && q_rstd != nullptr && q != nullptr && q_weight != nullptr), op,
             ": null query buffer");
    MF_CHECK(Hkv == 0 || (k_out != nullptr && k_rstd != nullptr && k != nullptr && k_weight != nullptr), op,
             ": null key buffer");
    const bool vec = use_vectors(D, {q_out, k_out, q, k, q_weight, k_weight});
    const int kvec = vec ? 8 : 1;
    const int G = group_width(D / 2 / kvec);
    const int threads = kThreads;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(N, 1 << 20));
    const size_t shared = static_cast<size_t>(2 * D) * sizeof(float);
    if (vec) {
        rope_qknorm_forward_kernel<8><<<blocks, threads, shared, stream>>>(
            q_out, k_out, q_rstd, k_rstd, q, k, q_weight, k_weight, rot, N, static_cast<int>(Hq), static_cast<int>(Hkv),
            static_cast<int>(D), G, eps);
    } else {
        rope_qknorm_forward_kernel<1><<<blocks, threads, shared, stream>>>(
            q_out, k_out, q_rstd, k_rstd, q, k, q_weight, k_weight, rot, N, static_cast<int>(Hq), static_cast<int>(Hkv),
            static_cast<int>(D), G, eps);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void launch_qknorm_backward(const char* op, bf16* dq, bf16* dk, void* dq_weight, void* dk_weight, DType dweight_dtype,
                            const bf16* dq_out, const bf16* dk_out, const bf16* q, const bf16* k, const bf16* q_weight,
                            const bf16* k_weight, const float* q_rstd, const float* k_rstd, const Rotation& rot,
                            int64_t N, int64_t Hq, int64_t Hkv, int64_t D, void* scratch, size_t scratch_bytes,
                            cudaStream_t stream) {
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16, op,
             ": dweight dtype must be f32 or bf16, got ", dtype_name(dweight_dtype));
    if (N == 0 || Hq + Hkv == 0) return;
    MF_CHECK(
        Hq == 0 || (dq != nullptr && dq_out != nullptr && q != nullptr && q_weight != nullptr && q_rstd != nullptr), op,
        ": null query buffer");
    MF_CHECK(
        Hkv == 0 || (dk != nullptr && dk_out != nullptr && k != nullptr && k_weight != nullptr && k_rstd != nullptr),
        op, ": null key buffer");
    const bool want_dw = dq_weight != nullptr || dk_weight != nullptr;
    float* partial = nullptr;
    if (want_dw) {
        const size_t needed = rope_qknorm_backward_scratch_bytes(N, D);
        MF_CHECK(scratch != nullptr && scratch_bytes >= needed, op, ": scratch has ", scratch_bytes, " bytes, needs ",
                 needed);
        MF_CHECK(aligned_to(16, scratch), op, ": scratch must be 16-byte aligned");
        partial = static_cast<float*>(scratch);
    }
    const bool vec = use_vectors(D, {dq, dk, dq_out, dk_out, q, k, q_weight, k_weight});
    const int kvec = vec ? 8 : 1;
    const int G = group_width(D / 2 / kvec);
    const int threads = kThreads;
    const int64_t blocks = backward_blocks(N);
    const size_t shared =
        static_cast<size_t>(2 * D + (want_dw ? (threads / G) * group_stride(D, G) : 0)) * sizeof(float);
    if (vec) {
        MF_CHECK_CUDA(cudaFuncSetAttribute(rope_qknorm_backward_kernel<8>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared)));
        rope_qknorm_backward_kernel<8><<<static_cast<unsigned>(blocks), threads, shared, stream>>>(
            dq, dk, partial, dq_out, dk_out, q, k, q_weight, k_weight, q_rstd, k_rstd, rot, N, static_cast<int>(Hq),
            static_cast<int>(Hkv), static_cast<int>(D), G);
    } else {
        MF_CHECK_CUDA(cudaFuncSetAttribute(rope_qknorm_backward_kernel<1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(shared)));
        rope_qknorm_backward_kernel<1><<<static_cast<unsigned>(blocks), threads, shared, stream>>>(
            dq, dk, partial, dq_out, dk_out, q, k, q_weight, k_weight, q_rstd, k_rstd, rot, N, static_cast<int>(Hq),
            static_cast<int>(Hkv), static_cast<int>(D), G);
    }
    MF_CHECK_CUDA(cudaGetLastError());
    if (dq_weight != nullptr) reduce_partial_rows(dq_weight, dweight_dtype, partial, blocks, D, true, stream);
    if (dk_weight != nullptr) {
        reduce_partial_rows(dk_weight, dweight_dtype, partial + blocks * D, blocks, D, true, stream);
    }
}

Rotation from_positions(const char* op, const int32_t* positions, int64_t N, int64_t D, float theta) {
    MF_CHECK(N == 0 || positions != nullptr, op, ": null positions");
    return Rotation{positions, make_inv_freq(D, theta), nullptr, nullptr};
}

Rotation from_tables(const char* op, const bf16* cos, const bf16* sin, int64_t N) {
    MF_CHECK(N == 0 || (cos != nullptr && sin != nullptr), op, ": null cos/sin table");
    return Rotation{nullptr, InvFreq{}, cos, sin};
}

}  // namespace

void rope_qknorm_forward(bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q, const bf16* k,
                         const bf16* q_weight, const bf16* k_weight, const int32_t* positions, int64_t N, int64_t Hq,
                         int64_t Hkv, int64_t D, float theta, float eps, cudaStream_t stream) {
    const char* op = "rope_qknorm_forward";
    check_shape(op, N, Hq, Hkv, D, theta);
    launch_qknorm_forward(op, q_out, k_out, q_rstd, k_rstd, q, k, q_weight, k_weight,
                          from_positions(op, positions, N, D, theta), N, Hq, Hkv, D, eps, stream);
}

void rope_qknorm_table_forward(bf16* q_out, bf16* k_out, float* q_rstd, float* k_rstd, const bf16* q, const bf16* k,
                               const bf16* q_weight, const bf16* k_weight, const bf16* cos, const bf16* sin, int64_t N,
                               int64_t Hq, int64_t Hkv, int64_t D, float eps, cudaStream_t stream) {
    const char* op = "rope_qknorm_table_forward";
    check_shape(op, N, Hq, Hkv, D, 1.0f);
    launch_qknorm_forward(op, q_out, k_out, q_rstd, k_rstd, q, k, q_weight, k_weight, from_tables(op, cos, sin, N), N,
                          Hq, Hkv, D, eps, stream);
}

void rope_forward(bf16* q_out, bf16* k_out, const bf16* q, const bf16* k, const int32_t* positions, int64_t N,
                  int64_t Hq, int64_t Hkv, int64_t D, int64_t rotary_dim, float theta, cudaStream_t stream) {
    launch_rope("rope_forward", q_out, k_out, q, k, positions, N, Hq, Hkv, D, rotary_dim, theta, 1.0f, stream);
}

void rope_backward(bf16* dq, bf16* dk, const bf16* dq_out, const bf16* dk_out, const int32_t* positions, int64_t N,
                   int64_t Hq, int64_t Hkv, int64_t D, int64_t rotary_dim, float theta, cudaStream_t stream) {
    launch_rope("rope_backward", dq, dk, dq_out, dk_out, positions, N, Hq, Hkv, D, rotary_dim, theta, -1.0f, stream);
}

size_t rope_qknorm_backward_scratch_bytes(int64_t N, int64_t D) {
    MF_CHECK(N >= 0 && D > 0 && D <= kMaxHeadDim, "rope_qknorm_backward: bad shape N=", N, " D=", D);
    return static_cast<size_t>(2 * backward_blocks(N) * D) * sizeof(float);
}

void rope_qknorm_backward(bf16* dq, bf16* dk, void* dq_weight, void* dk_weight, DType dweight_dtype, const bf16* dq_out,
                          const bf16* dk_out, const bf16* q, const bf16* k, const bf16* q_weight, const bf16* k_weight,
                          const float* q_rstd, const float* k_rstd, const int32_t* positions, int64_t N, int64_t Hq,
                          int64_t Hkv, int64_t D, float theta, void* scratch, size_t scratch_bytes,
                          cudaStream_t stream) {
    const char* op = "rope_qknorm_backward";
    check_shape(op, N, Hq, Hkv, D, theta);
    launch_qknorm_backward(op, dq, dk, dq_weight, dk_weight, dweight_dtype, dq_out, dk_out, q, k, q_weight, k_weight,
                           q_rstd, k_rstd, from_positions(op, positions, N, D, theta), N, Hq, Hkv, D, scratch,
                           scratch_bytes, stream);
}

void rope_qknorm_table_backward(bf16* dq, bf16* dk, void* dq_weight, void* dk_weight, DType dweight_dtype,
                                const bf16* dq_out, const bf16* dk_out, const bf16* q, const bf16* k,
                                const bf16* q_weight, const bf16* k_weight, const float* q_rstd, const float* k_rstd,
                                const bf16* cos, const bf16* sin, int64_t N, int64_t Hq, int64_t Hkv, int64_t D,
                                void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    const char* op = "rope_qknorm_table_backward";
    check_shape(op, N, Hq, Hkv, D, 1.0f);
    launch_qknorm_backward(op, dq, dk, dq_weight, dk_weight, dweight_dtype, dq_out, dk_out, q, k, q_weight, k_weight,
                           q_rstd, k_rstd, from_tables(op, cos, sin, N), N, Hq, Hkv, D, scratch, scratch_bytes, stream);
}

}  // namespace mf::cuda
