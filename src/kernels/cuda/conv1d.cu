// Causal depthwise conv1d + SiLU, CUDA.
//   forward   one thread per (token, channel): the visible taps (those inside the token's segment),
//             the fp32 dot with the channel's weights, silu, one bf16 store. Consecutive threads take
//             consecutive channels, so every load of a tap row is coalesced.
//   backward  a block takes 128 channels and kRowsPerBlock consecutive tokens and each thread walks
//             its channel's tokens in order: it recomputes pre and dpre = dout · silu'(pre), adds
//             dpre · tap into its K weight sums and dpre into its bias sum, and keeps the last K dpre
//             values in registers, so dinp[m] = Σ_d [m visible to m+d] weight[K−1−d] · dpre[m+d] is
//             written once the walk has passed m + K − 1 (the walk runs K−1 tokens past its range,
//             for dinp only). Partial sums go to scratch [blocks, C·K] and [blocks, C]; reduce_partial_rows
//             adds them in a fixed order. Everything is a function of N, C and K: bitwise reproducible.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/conv1d.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kRowsPerBlock = 64;
constexpr int kMaxK = static_cast<int>(kConv1dMaxTaps);

int64_t backward_row_blocks(int64_t N) { return std::max<int64_t>(1, (N + kRowsPerBlock - 1) / kRowsPerBlock); }

// ----------------------------------------------------------------------------------------------
// kernels

// How many tokens before n are visible to n (0 .. K−1): the run of tokens n−1, n−2, ... of n's row
// with n's document id, cut at K−1.
__device__ __forceinline__ int visible_back(const int32_t* doc_ids, int64_t n, int64_t T, int K) {
    int back = 0;
    while (back < K - 1) {
        const int64_t m = n - back;  // the token whose predecessor is tested
        if (m % T == 0) break;
        if (doc_ids != nullptr && doc_ids[m] != doc_ids[m - 1]) break;
        ++back;
    }
    return back;
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// pre[n, c] with the taps (0 where not visible) left in taps[j].
__device__ __forceinline__ float pre_activation(float (&taps)[kMaxK], const bf16* inp, const float* w, float bias,
                                                int back, int64_t n, int64_t C, int64_t c, int K) {
    float pre = bias;
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
        taps[j] = 0.0f;
        if (j < K) {
            const int d = K - 1 - j;
            if (d <= back) taps[j] = __bfloat162float(inp[(n - d) * C + c]);
            pre += w[j] * taps[j];
        }
    }
    return pre;
}

__global__ void __launch_bounds__(kThreads)
    conv1d_silu_forward_kernel(bf16* out, const bf16* inp, const float* weight, const float* bias,
                               const int32_t* doc_ids, int64_t N, int64_t T, int64_t C, int K) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= N * C) return;
    const int64_t n = idx / C, c = idx % C;
    float w[kMaxK], taps[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) w[j] = j < K ? weight[c * K + j] : 0.0f;
    const int back = visible_back(doc_ids, n, T, K);
    const float pre = pre_activation(taps, inp, w, bias != nullptr ? bias[c] : 0.0f, back, n, C, c, K);
    out[idx] = __float2bfloat16_rn(pre * sigmoid(pre));
}

// grid (ceil(C / kThreads), row blocks). partial_w [row blocks, C·K], partial_b [row blocks, C] (may be null).
__global__ void __launch_bounds__(kThreads)
    conv1d_silu_backward_kernel(bf16* dinp, float* partial_w, float* partial_b, const bf16* dout, const bf16* inp,
                                const float* weight, const float* bias, const int32_t* doc_ids, int64_t N, int64_t T,
                                int64_t C, int K) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
    const int64_t r1 = std::min<int64_t>(r0 + kRowsPerBlock, N);
    float w[kMaxK], dw[kMaxK], taps[kMaxK];
    float window[kMaxK];  // window[d] = dpre[n − d]
    int window_back[kMaxK];
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
        w[j] = j < K ? weight[c * K + j] : 0.0f;
        dw[j] = 0.0f;
        window[j] = 0.0f;
        window_back[j] = 0;
    }
    const float b = bias != nullptr ? bias[c] : 0.0f;
    float db = 0.0f;
    for (int64_t n = r0; n < r1 + K - 1; ++n) {
        float dpre = 0.0f;
        int back = 0;
        if (n < N) {
            back = visible_back(doc_ids, n, T, K);
            const float pre = pre_activation(taps, inp, w, b, back, n, C, c, K);
            const float s = sigmoid(pre);
            dpre = __bfloat162float(dout[n * C + c]) * (s * (1.0f + pre * (1.0f - s)));
            if (n < r1) {
#pragma unroll
                for (int j = 0; j < kMaxK; ++j) dw[j] += dpre * taps[j];
                db += dpre;
            }
        }
#pragma unroll
        for (int d = kMaxK - 1; d > 0; --d) {
            window[d] = window[d - 1];
            window_back[d] = window_back[d - 1];
        }
        window[0] = dpre;
        window_back[0] = back;
        const int64_t m = n - (K - 1);  // every token m .. m+K−1 that m feeds has been seen
        if (m >= r0 && m < r1) {
            float g = 0.0f;
#pragma unroll
            for (int d = 0; d < kMaxK; ++d) {
                if (d < K && window_back[K - 1 - d] >= d) g += w[K - 1 - d] * window[K - 1 - d];
            }
            dinp[m * C + c] = __float2bfloat16_rn(g);
        }
    }
#pragma unroll
    for (int j = 0; j < kMaxK; ++j) {
        if (j < K) partial_w[static_cast<int64_t>(blockIdx.y) * C * K + c * K + j] = dw[j];
    }
    if (partial_b != nullptr) partial_b[static_cast<int64_t>(blockIdx.y) * C + c] = db;
}

void check_shape(const char* op, int64_t N, int64_t T, int64_t C, int64_t K) {
    MF_CHECK(N >= 0 && T > 0 && C > 0 && N % T == 0, op, ": bad shape N=", N, " T=", T, " C=", C);
    MF_CHECK(K >= 1 && K <= kConv1dMaxTaps, op, ": K = ", K, " taps, supported 1..", kConv1dMaxTaps);
    MF_CHECK(N * C < std::numeric_limits<int64_t>::max() / 2 && backward_row_blocks(N) < 65536, op, ": N = ", N,
             " is too large");
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void conv1d_silu_forward(bf16* out, const bf16* inp, const float* weight, const float* bias, const int32_t* doc_ids,
                         int64_t N, int64_t T, int64_t C, int64_t K, cudaStream_t stream) {
    check_shape("conv1d_silu_forward", N, T, C, K);
    if (N == 0) return;
    MF_CHECK(out != nullptr && inp != nullptr && weight != nullptr, "conv1d_silu_forward: null buffer");
    const int64_t blocks = (N * C + kThreads - 1) / kThreads;
    MF_CHECK(blocks < std::numeric_limits<int32_t>::max(), "conv1d_silu_forward: N·C = ", N * C, " is too large");
    conv1d_silu_forward_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(out, inp, weight, bias, doc_ids,
                                                                                       N, T, C, static_cast<int>(K));
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t conv1d_silu_backward_scratch_bytes(int64_t N, int64_t C, int64_t K) {
    return static_cast<size_t>(backward_row_blocks(N) * C * (K + 1)) * sizeof(float);
}

void conv1d_silu_backward(bf16* dinp, void* dweight, DType dweight_dtype, void* dbias, DType dbias_dtype,
                          const bf16* dout, const bf16* inp, const float* weight, const float* bias,
                          const int32_t* doc_ids, int64_t N, int64_t T, int64_t C, int64_t K, void* scratch,
                          size_t scratch_bytes, cudaStream_t stream) {
    check_shape("conv1d_silu_backward", N, T, C, K);
    if (N == 0) return;
    MF_CHECK(dinp != nullptr && dweight != nullptr && dout != nullptr && inp != nullptr && weight != nullptr,
             "conv1d_silu_backward: null buffer");
    MF_CHECK(dbias == nullptr || bias != nullptr, "conv1d_silu_backward: dbias without a bias");
    for (const DType t : {dweight_dtype, dbias_dtype}) {
        MF_CHECK(t == DType::f32 || t == DType::bf16, "conv1d_silu_backward: gradient dtype must be f32 or bf16, got ",
                 dtype_name(t));
    }
    const size_t needed = conv1d_silu_backward_scratch_bytes(N, C, K);
    MF_CHECK(scratch != nullptr && scratch_bytes >= needed && aligned_to(16, scratch),
             "conv1d_silu_backward: scratch has ", scratch_bytes, " bytes, needs ", needed, " (16-byte aligned)");
    const int64_t row_blocks = backward_row_blocks(N);
    float* partial_w = static_cast<float*>(scratch);
    float* partial_b = dbias != nullptr ? partial_w + row_blocks * C * K : nullptr;
    const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(row_blocks));
    conv1d_silu_backward_kernel<<<grid, kThreads, 0, stream>>>(dinp, partial_w, partial_b, dout, inp, weight, bias,
                                                               doc_ids, N, T, C, static_cast<int>(K));
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(dweight, dweight_dtype, partial_w, row_blocks, C * K, /*accumulate=*/true, stream);
    if (dbias != nullptr)
        reduce_partial_rows(dbias, dbias_dtype, partial_b, row_blocks, C, /*accumulate=*/true, stream);
}

}  // namespace mf::cuda
