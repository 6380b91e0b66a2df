// Token embedding, CUDA (bf16 storage, fp32 sums).
//   forward   out[n, :] = wte[ids[n], :]: one warp per row copies 16-byte vectors (8 bf16) when C % 8 == 0
//             and the buffers are 16-byte aligned, else single elements.
//   backward  deterministic scatter-add, no atomics:
//             1. key[n] = ids[n] (or V for an id outside [0, V), which sorts last and is skipped),
//                value[n] = n;
//             2. cub::DeviceRadixSort::SortPairs over the bits of V: stable, so within one id the
//                token indices stay ascending;
//             3. one warp per (sorted position i, slice of 32·8 columns): only the warp at the head
//                of a run of equal ids works; it sums the run's dout rows in sorted (= token) order
//                in fp32, four rows in flight at a time, and adds the sum to dwte[id] once.
//             Every dwte element is written by exactly one thread, in a fixed order.
// NOTE: a token id repeated very often (say a padding id on every position) is summed by one warp
// per column slice serially; correct and deterministic, but that run is latency-bound.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>
#include <limits>

#include "core/cuda_check.h"
#include "kernels/cuda/embedding.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr size_t kAlign = 256;

size_t align_up(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// Bits needed to hold values 0..V (V itself is the key of an invalid id).
int key_bits(int64_t V) {
    int bits = 1;
    while (bits < 31 && (int64_t{1} << bits) <= V) ++bits;
    return bits;
}

size_t cub_sort_bytes(int64_t N, int64_t V) {
    size_t bytes = 0;
    MF_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const int32_t*>(nullptr),
                                                  static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                                  static_cast<int32_t*>(nullptr), static_cast<int>(N), 0, key_bits(V)));
    return bytes;
}

// ----------------------------------------------------------------------------------------------
// kernels

// One warp per token row: the id is loaded once, then every lane issues its row loads back to back.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    embedding_forward_kernel(bf16* out, const int32_t* ids, const bf16* wte, int64_t N, int64_t V, int64_t C) {
    using Raw = detail::Bf16Raw<kVec>;
    const int64_t n = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    if (n >= N) return;
    const int32_t id = ids[n];
    const bool valid = id >= 0 && id < V;
    const bf16* src = wte + static_cast<int64_t>(valid ? id : 0) * C;
    bf16* dst = out + n * C;
    Raw zero;
    if constexpr (kVec == 8) {
        zero = make_uint4(0, 0, 0, 0);
    } else {
        zero = __ushort_as_bfloat16(0);
    }
#pragma unroll 4
    for (int64_t c = static_cast<int64_t>(threadIdx.x % 32) * kVec; c < C; c += 32 * kVec) {
        *reinterpret_cast<Raw*>(dst + c) = valid ? detail::load_raw<kVec>(src + c) : zero;
    }
}

__global__ void embedding_keys_kernel(int32_t* keys, int32_t* values, const int32_t* ids, int64_t N, int64_t V) {
    const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const int32_t id = ids[n];
    keys[n] = (id >= 0 && id < V) ? id : static_cast<int32_t>(V);
    values[n] = static_cast<int32_t>(n);
}

// blockIdx.y: the column slice [slice·32·kVec, (slice+1)·32·kVec); warp w of the grid: sorted position.
template <int kVec, typename TW>
__global__ void embedding_backward_kernel(TW* dwte, const bf16* dout, const int32_t* sorted_ids,
                                          const int32_t* sorted_tokens, int64_t N, int64_t V, int64_t C) {
    constexpr int kUnroll = 4;
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    if (i >= N) return;
    const int32_t id = sorted_ids[i];
    if (id >= V || (i > 0 && sorted_ids[i - 1] == id)) return;  // invalid id, or not the head of its run
    const int64_t c = (static_cast<int64_t>(blockIdx.y) * 32 + threadIdx.x % 32) * kVec;
    if (c >= C) return;

    float acc[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) acc[j] = 0.0f;
    for (int64_t j = i;; j += kUnroll) {
        bool in_run[kUnroll];
        float rows[kUnroll][kVec];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            in_run[u] = j + u < N && sorted_ids[j + u] == id;
            if (in_run[u]) detail::load_f32<kVec>(rows[u], dout + static_cast<int64_t>(sorted_tokens[j + u]) * C + c);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
            if (in_run[u]) {
#pragma unroll
                for (int k = 0; k < kVec; ++k) acc[k] += rows[u][k];
            }
        }
        if (!in_run[kUnroll - 1]) break;
    }
    TW* row = dwte + static_cast<int64_t>(id) * C + c;
    float old[kVec];
    detail::load_f32<kVec>(old, row);
#pragma unroll
    for (int k = 0; k < kVec; ++k) old[k] += acc[k];
    detail::store_f32<kVec>(row, old);
}

// ----------------------------------------------------------------------------------------------
// launchers

template <typename TW>
void launch_embedding_backward(TW* dwte, const bf16* dout, const int32_t* sorted_ids, const int32_t* sorted_tokens,
                               int64_t N, int64_t V, int64_t C, cudaStream_t stream) {
    const bool vec = C % 8 == 0 && aligned_to(16, dwte, dout);
    const int64_t cols_per_slice = 32 * (vec ? 8 : 1);
    const int64_t slices = (C + cols_per_slice - 1) / cols_per_slice;
    MF_CHECK(slices <= 65535, "embedding_backward: C = ", C, " is too wide");
    const dim3 grid(static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock), static_cast<unsigned>(slices));
    if (vec) {
        embedding_backward_kernel<8><<<grid, kThreads, 0, stream>>>(dwte, dout, sorted_ids, sorted_tokens, N, V, C);
    } else {
        embedding_backward_kernel<1><<<grid, kThreads, 0, stream>>>(dwte, dout, sorted_ids, sorted_tokens, N, V, C);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

void check_shape(const char* op, int64_t N, int64_t V, int64_t C) {
    MF_CHECK(N >= 0 && V > 0 && C >= 0, op, ": bad shape N=", N, " V=", V, " C=", C);
    MF_CHECK(N <= std::numeric_limits<int32_t>::max() && V < std::numeric_limits<int32_t>::max(), op, ": N = ", N,
             " or V = ", V, " does not fit int32 indices");
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// public entries

void embedding_forward(bf16* out, const int32_t* ids, const bf16* wte, int64_t N, int64_t V, int64_t C,
                       cudaStream_t stream) {
    check_shape("embedding_forward", N, V, C);
    if (N == 0 || C == 0) return;
    MF_CHECK(out != nullptr && ids != nullptr && wte != nullptr, "embedding_forward: null buffer");
    const bool vec = C % 8 == 0 && aligned_to(16, out, wte);
    MF_CHECK((N + kWarpsPerBlock - 1) / kWarpsPerBlock <= std::numeric_limits<int32_t>::max(),
             "embedding_forward: N = ", N, " is too large");
    const unsigned blocks = static_cast<unsigned>((N + kWarpsPerBlock - 1) / kWarpsPerBlock);
    if (vec) {
        embedding_forward_kernel<8><<<blocks, kThreads, 0, stream>>>(out, ids, wte, N, V, C);
    } else {
        embedding_forward_kernel<1><<<blocks, kThreads, 0, stream>>>(out, ids, wte, N, V, C);
    }
    MF_CHECK_CUDA(cudaGetLastError());
}

size_t embedding_backward_scratch_bytes(int64_t N, int64_t V) {
    check_shape("embedding_backward", N, V, 0);
    const size_t ints = align_up(static_cast<size_t>(N) * sizeof(int32_t));
    return 4 * ints + align_up(cub_sort_bytes(N, V));
}

void embedding_backward(void* dwte, DType dwte_dtype, const bf16* dout, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C, void* scratch, size_t scratch_bytes, cudaStream_t stream) {
    check_shape("embedding_backward", N, V, C);
    if (N == 0 || C == 0) return;
    MF_CHECK(dwte != nullptr && dout != nullptr && ids != nullptr && scratch != nullptr,
             "embedding_backward: null buffer");
    const size_t needed = embedding_backward_scratch_bytes(N, V);
    MF_CHECK(scratch_bytes >= needed, "embedding_backward: scratch has ", scratch_bytes, " bytes, needs ", needed);
    MF_CHECK(aligned_to(kAlign, scratch), "embedding_backward: scratch must be ", kAlign, "-byte aligned");

    const size_t ints = align_up(static_cast<size_t>(N) * sizeof(int32_t));
    char* base = static_cast<char*>(scratch);
    int32_t* keys_in = reinterpret_cast<int32_t*>(base);
    int32_t* keys_out = reinterpret_cast<int32_t*>(base + ints);
    int32_t* values_in = reinterpret_cast<int32_t*>(base + 2 * ints);
    int32_t* values_out = reinterpret_cast<int32_t*>(base + 3 * ints);
    void* sort_temp = base + 4 * ints;
    size_t sort_bytes = needed - 4 * ints;

    embedding_keys_kernel<<<static_cast<unsigned>((N + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        keys_in, values_in, ids, N, V);
    MF_CHECK_CUDA(cudaGetLastError());
    MF_CHECK_CUDA(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, keys_in, keys_out, values_in, values_out,
                                                  static_cast<int>(N), 0, key_bits(V), stream));
    switch (dwte_dtype) {
        case DType::f32:
            launch_embedding_backward(static_cast<float*>(dwte), dout, keys_out, values_out, N, V, C, stream);
            break;
        case DType::bf16:
            launch_embedding_backward(static_cast<bf16*>(dwte), dout, keys_out, values_out, N, V, C, stream);
            break;
        default:
            MF_FAIL("embedding_backward: dwte dtype must be f32 or bf16, got ", dtype_name(dwte_dtype));
    }
}

}  // namespace mf::cuda
