// Causal depthwise conv1d + SiLU, CUDA.
//   forward   a thread walks 16 consecutive tokens of one channel with the channel's taps in a register
//             window (TapWindow: each input loaded once, cleared where a segment starts): the fp32 dot
//             with the channel's weights, silu, one bf16 store. Consecutive threads take consecutive
//             channels, so every row load is coalesced.
//   backward  a block takes 128 channels and kRowsPerBlock consecutive tokens and each thread walks
//             its channel's tokens in order: it recomputes pre (the same window) and dpre = dout · silu'(pre), adds
//             dpre · tap into its K weight sums and dpre into its bias sum, and keeps the last K dpre
//             values in registers, so dinp[m] = Σ_d [m visible to m+d] weight[K−1−d] · dpre[m+d] is
//             written once the walk has passed m + K − 1 (the walk runs K−1 tokens past its range,
//             for dinp only). Partial sums go to scratch [blocks, C·K] and [blocks, C]; reduce_partial_rows
//             adds them in a fixed order. Everything is a function of N, C and K: bitwise reproducible.
#include <algorithm>
#include <limits>
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/cuda/conv1d.cuh"
#include "kernels/cuda/reduce.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 128;
constexpr int64_t kRowsPerBlock = 64;  // backward
constexpr int64_t kForwardRows = 16;
constexpr int kMaxK = static_cast<int>(kConv1dMaxTaps);
static_assert(kMaxK == 8, "with_taps dispatches K = 1..8");

int64_t backward_row_blocks(int64_t N) { return std::max<int64_t>(1, (N + kRowsPerBlock - 1) / kRowsPerBlock); }

// ----------------------------------------------------------------------------------------------
// kernels (templated on the taps K, so the windows below live in registers)

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

// Whether token n opens a segment (a row or a document): nothing before it is visible to it or later.
__device__ __forceinline__ bool starts_segment(const int32_t* doc_ids, int64_t n, int64_t T) {
    return n % T == 0 || (doc_ids != nullptr && doc_ids[n] != doc_ids[n - 1]);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// The input window of channel c at token n: taps[j] = inp[n − (K−1) + j] where visible from n, else 0.
// It starts at token n0 (the taps visible from it loaded), then advance() moves it one token on:
// the oldest tap leaves, the segment's start (if n opens one) clears the older ones, inp[n] enters.
template <int K>
struct TapWindow {
    float taps[K];
    __device__ __forceinline__ void start(const bf16* inp, const int32_t* doc_ids, int64_t n0, int64_t T, int64_t C,
                                          int64_t c) {
        const int back = visible_back(doc_ids, n0, T, K);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) {
            const int d = K - 1 - j;
            taps[j] = d <= back ? __bfloat162float(inp[(n0 - d) * C + c]) : 0.0f;
        }
        taps[K - 1] = __bfloat162float(inp[n0 * C + c]);
    }
    __device__ __forceinline__ void advance(const bf16* inp, const int32_t* doc_ids, int64_t n, int64_t T, int64_t C,
                                            int64_t c) {
        const bool fresh = starts_segment(doc_ids, n, T);
#pragma unroll
        for (int j = 0; j < K - 1; ++j) taps[j] = fresh ? 0.0f : taps[j + 1];
        taps[K - 1] = __bfloat162float(inp[n * C + c]);
    }
    // pre = bias + Σ_j w[j]·taps[j], j ascending (the CPU reference's order).
    __device__ __forceinline__ float pre(const float (&w)[K], float bias) const {
        float p = bias;
#pragma unroll
        for (int j = 0; j < K; ++j) p += w[j] * taps[j];
        return p;
    }
};

// grid (ceil(C / kThreads), forward row blocks): a thread walks kForwardRows tokens of one channel,
// each input element loaded once (plus the K−1 before its first token).
template <int K>
__global__ void __launch_bounds__(kThreads)
    conv1d_silu_forward_kernel(bf16* out, const bf16* inp, const float* weight, const float* bias,
                               const int32_t* doc_ids, int64_t N, int64_t T, int64_t C) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kForwardRows;
    const int64_t r1 = std::min<int64_t>(r0 + kForwardRows, N);
    float w[K];
#pragma unroll
    for (int j = 0; j < K; ++j) w[j] = weight[c * K + j];
    const float b = bias != nullptr ? bias[c] : 0.0f;
    TapWindow<K> win;
    win.start(inp, doc_ids, r0, T, C, c);
    for (int64_t n = r0; n < r1; ++n) {
        if (n > r0) win.advance(inp, doc_ids, n, T, C, c);
        const float pre = win.pre(w, b);
        out[n * C + c] = __float2bfloat16_rn(pre * sigmoid(pre));
    }
}

// grid (ceil(C / kThreads), row blocks). partial_w [row blocks, C·K], partial_b [row blocks, C] (may be null).
template <int K>
__global__ void __launch_bounds__(kThreads)
    conv1d_silu_backward_kernel(bf16* dinp, float* partial_w, float* partial_b, const bf16* dout, const bf16* inp,
                                const float* weight, const float* bias, const int32_t* doc_ids, int64_t N, int64_t T,
                                int64_t C) {
    const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kRowsPerBlock;
    const int64_t r1 = std::min<int64_t>(r0 + kRowsPerBlock, N);
    float w[K], dw[K];
    float window[K];  // window[d] = dpre[n − d]
    int window_back[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
        w[j] = weight[c * K + j];
        dw[j] = 0.0f;
        window[j] = 0.0f;
        window_back[j] = 0;
    }
    const float b = bias != nullptr ? bias[c] : 0.0f;
    float db = 0.0f;
    TapWindow<K> win;
    win.start(inp, doc_ids, r0, T, C, c);
    int back = visible_back(doc_ids, r0, T, K);  // the taps visible from n, kept as the walk moves on
    for (int64_t n = r0; n < r1 + K - 1; ++n) {
        float dpre = 0.0f;
        int back_n = 0;
        if (n < N) {
            if (n > r0) {
                win.advance(inp, doc_ids, n, T, C, c);
                back = starts_segment(doc_ids, n, T) ? 0 : std::min(back + 1, K - 1);
            }
            back_n = back;
            const float pre = win.pre(w, b);
            const float s = sigmoid(pre);
            dpre = __bfloat162float(dout[n * C + c]) * (s * (1.0f + pre * (1.0f - s)));
            if (n < r1) {
#pragma unroll
                for (int j = 0; j < K; ++j) dw[j] += dpre * win.taps[j];
                db += dpre;
            }
        }
#pragma unroll
        for (int d = K - 1; d > 0; --d) {
            window[d] = window[d - 1];
            window_back[d] = window_back[d - 1];
        }
        window[0] = dpre;
        window_back[0] = back_n;
        const int64_t m = n - (K - 1);  // every token m .. m+K−1 that m feeds has been seen
        if (m >= r0 && m < r1) {
            float g = 0.0f;
#pragma unroll
            for (int d = 0; d < K; ++d) {
                if (window_back[K - 1 - d] >= d) g += w[K - 1 - d] * window[K - 1 - d];
            }
            dinp[m * C + c] = __float2bfloat16_rn(g);
        }
    }
#pragma unroll
    for (int j = 0; j < K; ++j) partial_w[static_cast<int64_t>(blockIdx.y) * C * K + c * K + j] = dw[j];
    if (partial_b != nullptr) partial_b[static_cast<int64_t>(blockIdx.y) * C + c] = db;
}

// Calls f(std::integral_constant<int, K>{}) for the runtime K in 1..kMaxK.
template <typename F>
void with_taps(int64_t K, F&& f) {
    switch (K) {
        case 1:
            return f(std::integral_constant<int, 1>{});
        case 2:
            return f(std::integral_constant<int, 2>{});
        case 3:
            return f(std::integral_constant<int, 3>{});
        case 4:
            return f(std::integral_constant<int, 4>{});
        case 5:
            return f(std::integral_constant<int, 5>{});
        case 6:
            return f(std::integral_constant<int, 6>{});
        case 7:
            return f(std::integral_constant<int, 7>{});
        case 8:
            return f(std::integral_constant<int, 8>{});
    }
    MF_CHECK(false, "conv1d_silu: K = ", K, " taps, supported 1..", kMaxK);
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
    const int64_t row_blocks = (N + kForwardRows - 1) / kForwardRows;
    MF_CHECK(row_blocks < 65536, "conv1d_silu_forward: N = ", N, " is too large");
    const dim3 grid(static_cast<unsigned>((C + kThreads - 1) / kThreads), static_cast<unsigned>(row_blocks));
    with_taps(K, [&](auto k) {
        conv1d_silu_forward_kernel<k.value><<<grid, kThreads, 0, stream>>>(out, inp, weight, bias, doc_ids, N, T, C);
    });
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
    with_taps(K, [&](auto k) {
        conv1d_silu_backward_kernel<k.value>
            <<<grid, kThreads, 0, stream>>>(dinp, partial_w, partial_b, dout, inp, weight, bias, doc_ids, N, T, C);
    });
    MF_CHECK_CUDA(cudaGetLastError());
    reduce_partial_rows(dweight, dweight_dtype, partial_w, row_blocks, C * K, /*accumulate=*/true, stream);
    if (dbias != nullptr)
        reduce_partial_rows(dbias, dbias_dtype, partial_b, row_blocks, C, /*accumulate=*/true, stream);
}

}  // namespace mf::cuda
