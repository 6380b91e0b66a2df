// Sigmoid-gated row, CUDA. s = σ(g) = 1 / (1 + expf(−g)) in fp32 (IEEE expf, as the CPU reference;
// expf(−g) = inf gives s = 0).
//   forward   a grid-stride loop over kVec-element column groups of y [N, H] (16-byte bf16 accesses
//             when H % 8 == 0 and the buffers are 16-byte aligned, else single elements); each thread
//             reads its row's logit and writes y = bf16(y + s · value). Elementwise.
//   backward  one warp per row: pass 1 sums dy · value over the lane's vectors in fp32 (lane l owns
//             vectors l, l + 32, ...), a xor butterfly combines the lanes, lane 0 writes
//             dgate = s · (1 − s) · Σ; pass 2 writes dvalue = s · dy. The order depends on H and the
//             path only, so results are bitwise reproducible; no atomics. Each element of dy is read
//             and dvalue written by the same lane, the sum taken first, so dvalue may alias dy.
#include <algorithm>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/sigmoid_gate.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxBlocks = 65536;

// ----------------------------------------------------------------------------------------------
// kernels

__device__ __forceinline__ float sigmoid(float g) { return 1.0f / (1.0f + expf(-g)); }

template <int kVec>
__global__ void sigmoid_gate_forward_kernel(bf16* y, const bf16* value, const bf16* gate_logits, int64_t N, int64_t H) {
    const int64_t vec_per_row = H / kVec;
    const int64_t total = N * vec_per_row;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total; idx += stride) {
        const int64_t n = idx / vec_per_row;
        const int64_t h = (idx - n * vec_per_row) * kVec;
        const float s = sigmoid(detail::to_f32(gate_logits[n]));
        float out[kVec], v[kVec];
        detail::load_f32<kVec>(out, y + n * H + h);
        detail::load_f32<kVec>(v, value + n * H + h);
#pragma unroll
        for (int e = 0; e < kVec; ++e) out[e] += s * v[e];
        detail::store_f32<kVec>(y + n * H + h, out);
    }
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    sigmoid_gate_backward_kernel(bf16* dvalue, bf16* dgate_logits, const bf16* dy, const bf16* value,
                                 const bf16* gate_logits, int64_t N, int64_t H) {
    const int lane = threadIdx.x % 32;
    const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
    if (row >= N) return;  // whole warps leave together: the butterfly below stays converged
    const bf16* g = dy + row * H;
    const bf16* x = value + row * H;
    const int64_t num_vec = H / kVec;
    float sum = 0.0f;
    for (int64_t v = lane; v < num_vec; v += 32) {
        float a[kVec], b[kVec];
        detail::load_f32<kVec>(a, g + v * kVec);
        detail::load_f32<kVec>(b, x + v * kVec);
#pragma unroll
        for (int e = 0; e < kVec; ++e) sum += a[e] * b[e];
    }
    sum = detail::group_sum<32>(sum);
    const float s = sigmoid(detail::to_f32(gate_logits[row]));
    if (lane == 0) dgate_logits[row] = detail::from_f32<bf16>(s * (1.0f - s) * sum);
    bf16* dv = dvalue + row * H;
    for (int64_t v = lane; v < num_vec; v += 32) {
        float a[kVec];
        detail::load_f32<kVec>(a, g + v * kVec);
#pragma unroll
        for (int e = 0; e < kVec; ++e) a[e] *= s;
        detail::store_f32<kVec>(dv + v * kVec, a);
    }
}

// ----------------------------------------------------------------------------------------------
// launchers

int grid_for(int64_t work) {
    return static_cast<int>(std::clamp<int64_t>((work + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

void check_shape(const char* op, int64_t N, int64_t H) {
    MF_CHECK(N >= 0 && H >= 0, op, ": negative shape N=", N, " H=", H);
    MF_CHECK((N + kWarps - 1) / kWarps <= std::numeric_limits<int32_t>::max(), op, ": N = ", N, " is too large");
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void sigmoid_gate_forward(bf16* y, const bf16* value, const bf16* gate_logits, int64_t N, int64_t H,
                          cudaStream_t stream) {
    check_shape("sigmoid_gate_forward", N, H);
    if (N == 0 || H == 0) return;
    MF_CHECK(y != nullptr && value != nullptr && gate_logits != nullptr, "sigmoid_gate_forward: null buffer");
    if (H % 8 == 0 && aligned_to(16, y, value)) {
        sigmoid_gate_forward_kernel<8><<<grid_for(N * H / 8), kThreads, 0, stream>>>(y, value, gate_logits, N, H);
    } else {
        sigmoid_gate_forward_kernel<1><<<grid_for(N * H), kThreads, 0, stream>>>(y, value, gate_logits, N, H);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void sigmoid_gate_backward(bf16* dvalue, bf16* dgate_logits, const bf16* dy, const bf16* value, const bf16* gate_logits,
                           int64_t N, int64_t H, cudaStream_t stream) {
    check_shape("sigmoid_gate_backward", N, H);
    if (N == 0) return;
    MF_CHECK(dgate_logits != nullptr && gate_logits != nullptr &&
                 (H == 0 || (dvalue != nullptr && dy != nullptr && value != nullptr)),
             "sigmoid_gate_backward: null buffer");
    const unsigned blocks = static_cast<unsigned>((N + kWarps - 1) / kWarps);
    if (H % 8 == 0 && aligned_to(16, dvalue, dy, value)) {
        sigmoid_gate_backward_kernel<8>
            <<<blocks, kThreads, 0, stream>>>(dvalue, dgate_logits, dy, value, gate_logits, N, H);
    } else {
        sigmoid_gate_backward_kernel<1>
            <<<blocks, kThreads, 0, stream>>>(dvalue, dgate_logits, dy, value, gate_logits, N, H);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
