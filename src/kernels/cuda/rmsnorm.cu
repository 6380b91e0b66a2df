// RMSNorm, CUDA: one warp per row, bf16 rows read as 16-byte vectors (8 elements per lane access)
// when C % 8 == 0 and the buffers are 16-byte aligned, else element by element.
//   forward   pass 1 sums x² in fp32 (lane partials, then a xor butterfly), keeping the first
//             kCache vectors of each lane in registers as raw bf16; pass 2 writes
//             out = weight ⊙ (x · rstd) from those registers (re-reading only what did not fit).
//   backward  per row: g = dout ⊙ w, x̂ = x · rstd, mean(g ⊙ x̂) by a warp sum, then
//             dinp = rstd · (g − x̂ · mean) (= or +=). The weight gradient dout ⊙ x̂ is accumulated
//             per warp in shared memory [warps, C] (each lane owns fixed columns, rows visited in
//             ascending order), the warps are added in order into scratch [block, C], and
//             reduce_partial_rows sums the blocks in order into dweight. No atomics anywhere.
// The backward grid is a function of N and C only (never of the device), so results are
// bitwise reproducible across runs and machines with the same compiler.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/reduce.cuh"
#include "kernels/cuda/rmsnorm.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCache = 8;  // vectors per lane kept in registers
// Bounds the partial-sum scratch; 256 blocks of 8 warps (2 per SM at 128 registers) is one wave on
// an H200, each warp then walking N / 2048 rows.
constexpr int64_t kMaxBackwardBlocks = 256;
constexpr size_t kMaxSharedBytes = 200 * 1024;

// Warps per backward block: 8, fewer when C is so wide that [warps, C] fp32 would not fit in shared memory.
int backward_warps(int64_t C) {
    const int64_t fit = static_cast<int64_t>(kMaxSharedBytes) / (C * static_cast<int64_t>(sizeof(float)));
    return static_cast<int>(std::clamp<int64_t>(fit, 1, kWarps));
}

int64_t backward_blocks(int64_t N, int64_t C) {
    const int warps = backward_warps(C);
    return std::clamp<int64_t>((N + warps - 1) / warps, 1, kMaxBackwardBlocks);
}

// ----------------------------------------------------------------------------------------------
// kernels

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_forward_kernel(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t N, int C, float eps) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= N) return;
    const bf16* x = inp + row * C;
    bf16* y = out + row * C;
    const int num_vec = C / kVec;

    detail::Bf16Raw<kVec> cache[kCache];
    float sum_sq = 0.0f;
#pragma unroll
    for (int j = 0; j < kCache; ++j) {
        const int v = lane + 32 * j;
        if (v < num_vec) {
            cache[j] = detail::load_raw<kVec>(x + v * kVec);
            float f[kVec];
            detail::unpack<kVec>(f, cache[j]);
#pragma unroll
            for (int k = 0; k < kVec; ++k) sum_sq += f[k] * f[k];
        }
    }
    for (int v = lane + 32 * kCache; v < num_vec; v += 32) {
        float f[kVec];
        detail::load_f32<kVec>(f, x + v * kVec);
#pragma unroll
        for (int k = 0; k < kVec; ++k) sum_sq += f[k] * f[k];
    }
    sum_sq = detail::group_sum<32>(sum_sq);
    const float r = 1.0f / sqrtf(sum_sq / static_cast<float>(C) + eps);
    if (lane == 0) rstd[row] = r;

    auto emit = [&](int v, float(&f)[kVec]) {
        float w[kVec];
        detail::load_f32<kVec>(w, weight + v * kVec);
#pragma unroll
        for (int k = 0; k < kVec; ++k) f[k] = w[k] * (f[k] * r);
        detail::store_f32<kVec>(y + v * kVec, f);
    };
#pragma unroll
    for (int j = 0; j < kCache; ++j) {
        const int v = lane + 32 * j;
        if (v < num_vec) {
            float f[kVec];
            detail::unpack<kVec>(f, cache[j]);
            emit(v, f);
        }
    }
    for (int v = lane + 32 * kCache; v < num_vec; v += 32) {
        float f[kVec];
        detail::load_f32<kVec>(f, x + v * kVec);
        emit(v, f);
    }
}

// Dynamic shared memory: [warps, C] fp32 weight-gradient accumulators (only when partial != null).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_backward_kernel(bf16* dinp, bool accumulate, float* partial, const bf16* dout, const bf16* inp,
                            const bf16* weight, const float* rstd, int64_t N, int C) {
    extern __shared__ float dw_acc[];
    const int lane = threadIdx.x % 32;
    const int warp = threadIdx.x / 32;
    const int warps = blockDim.x / 32;
    const int num_vec = C / kVec;
    float* my_dw = dw_acc + static_cast<int64_t>(warp) * C;
    if (partial != nullptr) {
        for (int v = lane; v < num_vec; v += 32) {
#pragma unroll
            for (int k = 0; k < kVec; ++k) my_dw[v * kVec + k] = 0.0f;
        }
    }

    for (int64_t row = static_cast<int64_t>(blockIdx.x) * warps + warp; row < N;
         row += static_cast<int64_t>(gridDim.x) * warps) {
        const bf16* x = inp + row * C;
        const bf16* dy = dout + row * C;
        const float r = rstd[row];

        // Pass 1: Σ g·x̂ and the weight-gradient terms; the first kCache vectors stay in registers.
        detail::Bf16Raw<kVec> x_cache[kCache];
        detail::Bf16Raw<kVec> dy_cache[kCache];
        float sum_gx = 0.0f;
        auto accumulate_terms = [&](int v, const float(&xf)[kVec], const float(&dyf)[kVec]) {
            float w[kVec];
            detail::load_f32<kVec>(w, weight + v * kVec);
#pragma unroll
            for (int k = 0; k < kVec; ++k) {
                const float x_hat = xf[k] * r;
                sum_gx += (dyf[k] * w[k]) * x_hat;
                if (partial != nullptr) my_dw[v * kVec + k] += dyf[k] * x_hat;
            }
        };
#pragma unroll
        for (int j = 0; j < kCache; ++j) {
            const int v = lane + 32 * j;
            if (v < num_vec) {
                x_cache[j] = detail::load_raw<kVec>(x + v * kVec);
                dy_cache[j] = detail::load_raw<kVec>(dy + v * kVec);
                float xf[kVec], dyf[kVec];
                detail::unpack<kVec>(xf, x_cache[j]);
                detail::unpack<kVec>(dyf, dy_cache[j]);
                accumulate_terms(v, xf, dyf);
            }
        }
        for (int v = lane + 32 * kCache; v < num_vec; v += 32) {
            float xf[kVec], dyf[kVec];
            detail::load_f32<kVec>(xf, x + v * kVec);
            detail::load_f32<kVec>(dyf, dy + v * kVec);
            accumulate_terms(v, xf, dyf);
        }
        if (dinp == nullptr) continue;
        const float mean_gx = detail::group_sum<32>(sum_gx) / static_cast<float>(C);

        // Pass 2: dinp.
        bf16* dx = dinp + row * C;
        auto emit = [&](int v, const float(&xf)[kVec], const float(&dyf)[kVec]) {
            float w[kVec], out[kVec];
            detail::load_f32<kVec>(w, weight + v * kVec);
            if (accumulate) {
                detail::load_f32<kVec>(out, dx + v * kVec);
            } else {
#pragma unroll
                for (int k = 0; k < kVec; ++k) out[k] = 0.0f;
            }
#pragma unroll
            for (int k = 0; k < kVec; ++k) out[k] += r * (dyf[k] * w[k] - (xf[k] * r) * mean_gx);
            detail::store_f32<kVec>(dx + v * kVec, out);
        };
#pragma unroll
        for (int j = 0; j < kCache; ++j) {
            const int v = lane + 32 * j;
            if (v < num_vec) {
                float xf[kVec], dyf[kVec];
                detail::unpack<kVec>(xf, x_cache[j]);
                detail::unpack<kVec>(dyf, dy_cache[j]);
                emit(v, xf, dyf);
            }
        }
        for (int v = lane + 32 * kCache; v < num_vec; v += 32) {
            float xf[kVec], dyf[kVec];
            detail::load_f32<kVec>(xf, x + v * kVec);
            detail::load_f32<kVec>(dyf, dy + v * kVec);
            emit(v, xf, dyf);
        }
    }

    if (partial == nullptr) return;
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < warps; ++w) sum += dw_acc[static_cast<int64_t>(w) * C + c];
        partial[static_cast<int64_t>(blockIdx.x) * C + c] = sum;
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

template <int kVec>
void launch_backward(bf16* dinp, bool accumulate, float* partial, const bf16* dout, const bf16* inp, const bf16* weight,
                     const float* rstd, int64_t N, int64_t C, cudaStream_t stream) {
    const int warps = backward_warps(C);
    const int64_t blocks = backward_blocks(N, C);
    const size_t shared = partial != nullptr ? static_cast<size_t>(warps) * C * sizeof(float) : 0;
    MF_CHECK_CUDA(cudaFuncSetAttribute(rmsnorm_backward_kernel<kVec>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(shared)));
    rmsnorm_backward_kernel<kVec><<<static_cast<unsigned>(blocks), warps * 32, shared, stream>>>(
        dinp, accumulate, partial, dout, inp, weight, rstd, N, static_cast<int>(C));
    MF_CHECK_CUDA(cudaGetLastError());
}

void check_shape(const char* op, int64_t N, int64_t C) {
    MF_CHECK(N >= 0 && C > 0, op, ": bad shape N=", N, " C=", C);
    MF_CHECK(C * static_cast<int64_t>(sizeof(float)) <= static_cast<int64_t>(kMaxSharedBytes), op, ": C = ", C,
             " is wider than supported (", kMaxSharedBytes / sizeof(float), ")");
    MF_CHECK((N + kWarps) / kWarps < std::numeric_limits<int32_t>::max(), op, ": N = ", N, " is too large");
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void rmsnorm_forward(bf16* out, float* rstd, const bf16* inp, const bf16* weight, int64_t N, int64_t C, float eps,
                     cudaStream_t stream) {
    check_shape("rmsnorm_forward", N, C);
    MF_CHECK(eps >= 0.0f, "rmsnorm_forward: eps must be >= 0, got ", eps);
    if (N == 0) return;
    MF_CHECK(out != nullptr && rstd != nullptr && inp != nullptr && weight != nullptr, "rmsnorm_forward: null buffer");
    const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
    if (C % 8 == 0 && aligned_to(16, out, inp, weight)) {
        rmsnorm_forward_kernel<8><<<blocks, kThreads, 0, stream>>>(out, rstd, inp, weight, N, static_cast<int>(C), eps);
    } else {
        rmsnorm_forward_kernel<1><<<blocks, kThreads, 0, stream>>>(out, rstd, inp, weight, N, static_cast<int>(C), eps);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t rmsnorm_backward_scratch_bytes(int64_t N, int64_t C) {
    check_shape("rmsnorm_backward", N, C);
    return static_cast<size_t>(backward_blocks(N, C) * C) * sizeof(float);
}

void rmsnorm_backward(bf16* dinp, bool accumulate_dinp, void* dweight, DType dweight_dtype, const bf16* dout,
                      const bf16* inp, const bf16* weight, const float* rstd, int64_t N, int64_t C, void* scratch,
                      size_t scratch_bytes, cudaStream_t stream) {
    check_shape("rmsnorm_backward", N, C);
    if (N == 0 || (dinp == nullptr && dweight == nullptr)) return;
    MF_CHECK(dout != nullptr && inp != nullptr && weight != nullptr && rstd != nullptr,
             "rmsnorm_backward: null input buffer");
    MF_CHECK(dweight_dtype == DType::f32 || dweight_dtype == DType::bf16,
             "rmsnorm_backward: dweight dtype must be f32 or bf16, got ", dtype_name(dweight_dtype));
    float* partial = nullptr;
    if (dweight != nullptr) {
        const size_t needed = rmsnorm_backward_scratch_bytes(N, C);
        MF_CHECK(scratch != nullptr && scratch_bytes >= needed, "rmsnorm_backward: scratch has ", scratch_bytes,
                 " bytes, needs ", needed);
        MF_CHECK(aligned_to(16, scratch), "rmsnorm_backward: scratch must be 16-byte aligned");
        partial = static_cast<float*>(scratch);
    }
    if (C % 8 == 0 && aligned_to(16, dinp, dout, inp, weight)) {
        launch_backward<8>(dinp, accumulate_dinp, partial, dout, inp, weight, rstd, N, C, stream);
    } else {
        launch_backward<1>(dinp, accumulate_dinp, partial, dout, inp, weight, rstd, N, C, stream);
    }
    if (dweight != nullptr) {
        reduce_partial_rows(dweight, dweight_dtype, partial, backward_blocks(N, C), C, /*accumulate=*/true, stream);
    }
}

}  // namespace mf::cuda
