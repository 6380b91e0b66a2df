// Elementwise helpers: grid-stride loops (memory-bound, tiny next to the GEMMs); the reductions
// use one block so their order is fixed and results are bitwise reproducible.
#include <type_traits>

#include "core/cuda_check.h"
#include "kernels/cuda/elementwise.cuh"

namespace mf::cuda {

namespace {

constexpr int kThreads = 256;

int grid_for(int64_t n) {
    const int64_t blocks = (n + kThreads - 1) / kThreads;
    return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);
}

__global__ void add_bf16_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
        out[i] = __float2bfloat16_rn(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

template <typename T>
__device__ float to_float(T v);
template <>
__device__ float to_float<float>(float v) {
    return v;
}
template <>
__device__ float to_float<bf16>(bf16 v) {
    return __bfloat162float(v);
}

template <typename T>
__global__ void count_nonfinite_kernel(unsigned long long* count, const T* x, int64_t n) {
    unsigned long long local = 0;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
        local += isfinite(to_float(x[i])) ? 0 : 1;
    if (local != 0) atomicAdd(count, local);  // an integer count: order does not matter
}

__global__ void sum_f32_kernel(double* out, const float* x, int64_t n) {
    __shared__ double partial[1024];
    double s = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
    partial[threadIdx.x] = s;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (static_cast<int>(threadIdx.x) < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) *out = partial[0];
}

__global__ void aux_dprobs_kernel(float* dprobs, const float* counts, const float* mask, float scale, int64_t N,
                                  int64_t E) {
    const int64_t total = N * E;
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x)
        dprobs[i] = scale * counts[i % E] * mask[i / E];
}

__device__ uint64_t mix64(uint64_t x) {  // splitmix64 finaliser
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

template <typename T>
__global__ void fill_normal_kernel(T* x, int64_t n, uint64_t seed, float mean, float std) {
    for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
        const uint64_t h = mix64(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(i));
        const float u1 = (static_cast<float>(h >> 40) + 1.0f) / 16777217.0f;  // (0, 1]
        const float u2 = static_cast<float>((h >> 16) & 0xFFFFFF) / 16777216.0f;
        const float z = sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
        if constexpr (std::is_same_v<T, float>)
            x[i] = mean + std * z;
        else
            x[i] = __float2bfloat16_rn(mean + std * z);
    }
}

}  // namespace

void fill_normal(void* x, DType dtype, int64_t n, uint64_t seed, float mean, float std, cudaStream_t stream) {
    MF_CHECK(dtype == DType::f32 || dtype == DType::bf16, "fill_normal: f32 or bf16");
    if (n == 0) return;
    if (dtype == DType::f32)
        fill_normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<float*>(x), n, seed, mean, std);
    else
        fill_normal_kernel<<<grid_for(n), kThreads, 0, stream>>>(static_cast<bf16*>(x), n, seed, mean, std);
    MF_CHECK_CUDA(cudaGetLastError());
}

void add_bf16(bf16* out, const bf16* a, const bf16* b, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    add_bf16_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, a, b, n);
    MF_CHECK_CUDA(cudaGetLastError());
}

void count_nonfinite(unsigned long long* count, const void* x, DType dtype, int64_t n, cudaStream_t stream) {
    MF_CHECK(dtype == DType::f32 || dtype == DType::bf16, "count_nonfinite: f32 or bf16");
    MF_CHECK_CUDA(cudaMemsetAsync(count, 0, sizeof(unsigned long long), stream));
    if (n == 0) return;
    if (dtype == DType::f32)
        count_nonfinite_kernel<<<grid_for(n), kThreads, 0, stream>>>(count, static_cast<const float*>(x), n);
    else
        count_nonfinite_kernel<<<grid_for(n), kThreads, 0, stream>>>(count, static_cast<const bf16*>(x), n);
    MF_CHECK_CUDA(cudaGetLastError());
}

void sum_f32(double* out, const float* x, int64_t n, cudaStream_t stream) {
    sum_f32_kernel<<<1, 1024, 0, stream>>>(out, x, n);
    MF_CHECK_CUDA(cudaGetLastError());
}

void aux_dprobs(float* dprobs, const float* counts, const float* mask, float scale, int64_t N, int64_t E,
                cudaStream_t stream) {
    if (N * E == 0) return;
    aux_dprobs_kernel<<<grid_for(N * E), kThreads, 0, stream>>>(dprobs, counts, mask, scale, N, E);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
