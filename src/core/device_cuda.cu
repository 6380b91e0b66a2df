// Device memory hooks backed by the CUDA runtime.
#include <cuda_runtime.h>

#include "core/cuda_check.h"
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

size_t device_memory_used() {
    size_t free_bytes = 0, total_bytes = 0;
    if (cudaMemGetInfo(&free_bytes, &total_bytes) != cudaSuccess) return 0;
    return total_bytes - free_bytes;
}

}  // namespace mf
