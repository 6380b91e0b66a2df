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

constexpr int kMaxSpans = 8;

// Span blockIdx.y of a launch: 16-byte moves, grid-stride over its blocks in x.
struct Spans16 {
    uint4* dst[kMaxSpans];
    const uint4* src[kMaxSpans];
    size_t n[kMaxSpans];
};

__global__ void copy16_kernel(Spans16 s) {
    const int k = blockIdx.y;
    uint4* dst = s.dst[k];
    const uint4* src = s.src[k];
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < s.n[k];
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        dst[i] = src[i];
}

__global__ void copy1_kernel(unsigned char* dst, const unsigned char* src, size_t n) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<size_t>(gridDim.x) * blockDim.x)
        dst[i] = src[i];
}

constexpr int kCopyThreads = 512, kCopyBlocks = 264;  // blocks of one launch, shared by its spans

int copy_blocks(size_t units, int spans) {
    const size_t most = static_cast<size_t>(std::max(kCopyBlocks / spans, 32));
    return static_cast<int>(std::max<size_t>(1, std::min((units + kCopyThreads - 1) / kCopyThreads, most)));
}

}  // namespace

void peer_copy(std::span<const CopySpan> spans, cudaStream_t stream) {
    Spans16 wide{};
    int count = 0;
    size_t longest = 0;
    auto flush = [&] {
        if (count == 0) return;
        copy16_kernel<<<dim3(copy_blocks(longest, count), count), kCopyThreads, 0, stream>>>(wide);
        MF_CHECK_CUDA(cudaGetLastError());
        count = 0;
        longest = 0;
    };
    for (const CopySpan& c : spans) {
        if (c.bytes == 0) continue;
        if ((reinterpret_cast<uintptr_t>(c.dst) | reinterpret_cast<uintptr_t>(c.src) | c.bytes) % 16 != 0) {
            copy1_kernel<<<copy_blocks(c.bytes, 1), kCopyThreads, 0, stream>>>(
                static_cast<unsigned char*>(c.dst), static_cast<const unsigned char*>(c.src), c.bytes);
            MF_CHECK_CUDA(cudaGetLastError());
            continue;
        }
        wide.dst[count] = static_cast<uint4*>(c.dst);
        wide.src[count] = static_cast<const uint4*>(c.src);
        wide.n[count] = c.bytes / 16;
        longest = std::max(longest, c.bytes / 16);
        if (++count == kMaxSpans) flush();
    }
    flush();
}

void peer_wait(const uint64_t* flag, uint64_t target, uint64_t timeout_ns, int* error, int code, cudaStream_t stream) {
    peer_wait_kernel<<<1, 1, 0, stream>>>(flag, target, timeout_ns, error, code);
    MF_CHECK_CUDA(cudaGetLastError());
}

void peer_signal(uint64_t* flag, uint64_t value, cudaStream_t stream) {
    peer_signal_kernel<<<1, 1, 0, stream>>>(flag, value);
    MF_CHECK_CUDA(cudaGetLastError());
}

}  // namespace mf::cuda
