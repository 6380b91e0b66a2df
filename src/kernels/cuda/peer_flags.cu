// Flags between GPUs (see peer_flags.cuh). One thread each: they order copies, they move no data.
#include <algorithm>
#include <cstdint>

#include "core/cuda_check.h"
#include "kernels/cuda/peer_flags.cuh"

namespace mf::cuda {

namespace {

__device__ __forceinline__ uint64_t load_acquire_sys(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release_sys(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__global__ void peer_wait_kernel(const uint64_t* flag, uint64_t target, uint64_t timeout_ns, int* error, int code) {
    const uint64_t start = global_ns();
    while (load_acquire_sys(flag) < target) {
        if (*reinterpret_cast<volatile int*>(error) != 0) return;
        if (global_ns() - start > timeout_ns) {
            atomicCAS_system(error, 0, code);
            return;
        }
        __nanosleep(200);
    }
}

__global__ void peer_signal_kernel(uint64_t* flag, uint64_t value) {
    __threadfence_system();
    store_release_sys(flag, value);
}

__global__ void copy16_kernel(uint4* dst, const uint4* src, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        dst[i] = src[i];
}

__global__ void copy1_kernel(unsigned char* dst, const unsigned char* src, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        dst[i] = src[i];
}

}  // namespace

void peer_copy(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
    if (bytes == 0) return;
    constexpr int kThreads = 512, kMaxBlocks = 264;
    const bool wide = (reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) | bytes) % 16 == 0;
    const size_t n = wide ? bytes / 16 : bytes;
    const int blocks = static_cast<int>(std::min<size_t>((n + kThreads - 1) / kThreads, kMaxBlocks));
    if (wide)
        copy16_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(src), n);
    else
        copy1_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<unsigned char*>(dst),
                                                      static_cast<const unsigned char*>(src), n);
    MF_CHECK_CUDA(cudaGetLastError());
}

void peer_wait(const uint64_t* flag, uint64_t target, uint64_t timeout_ns, int* error, int code,
               cudaStream_t stream) {
    peer_wait_kernel<<<1, 1, 0, stream>>>(flag, target, timeout_ns, error, code);
    MF_CHECK_CUDA(cudaGetLastError());
}

void peer_signal(uint64_t* flag, uint64_t value, cudaStream_t stream) {
    peer_signal_kernel<<<1, 1, 0, stream>>>(flag, value);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
