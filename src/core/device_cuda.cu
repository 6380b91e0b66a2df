// Device memory hooks backed by the CUDA runtime.
#include <cuda_runtime.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <thread>

#include "core/cuda_check.h"
#include "core/device_choice.h"
#include "core/poll.h"
#include "core/tensor.h"

namespace mf {

void* device_alloc(size_t nbytes) {
    void* ptr = nullptr;
    MF_CHECK_CUDA(cudaMalloc(&ptr, nbytes));
    return ptr;
}

void device_free(void* ptr) { cudaFree(ptr); }

void device_memset_zero(void* ptr, size_t nbytes) { MF_CHECK_CUDA(cudaMemset(ptr, 0, nbytes)); }

bool cuda_available() {
    int count = 0;
    return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
}

int current_cuda_device() {
    int device = 0;
    MF_CHECK_CUDA(cudaGetDevice(&device));
    return device;
}

size_t device_memory_used() {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return total_bytes - free_bytes;
}

namespace {
std::atomic<double> g_wait_limit_s{0.0};
std::atomic<int> g_wait_rank{-1};
}  // namespace

void set_device_wait_limit(double seconds, int rank) {
    g_wait_limit_s.store(seconds > 0 ? seconds : 0.0);
    g_wait_rank.store(rank);
}

void wait_for_stream(void* stream) {
    const auto s = static_cast<cudaStream_t>(stream);
    const double limit = g_wait_limit_s.load();
    if (limit <= 0) {
        MF_CHECK_CUDA(cudaStreamSynchronize(s));
        return;
    }
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
        const cudaError_t st = cudaStreamQuery(s);
        if (st == cudaSuccess) return;
        if (st != cudaErrorNotReady) MF_CHECK_CUDA(st);
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit) {
            int device = -1;
            cudaGetDevice(&device);
            std::fprintf(stderr,
                         "rank %d: timed out after %g s (dist.timeout_s) waiting for work on GPU %d, which waits for a "
                         "collective whose peer stopped answering; ending this process\n",
                         g_wait_rank.load(), limit, device);
            std::fflush(nullptr);
            ::_exit(1);
        }
        poll_pause(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
}

}  // namespace mf
