// Device memory hooks for builds without CUDA: every device request is an error.
#include "core/device_choice.h"
#include "core/tensor.h"

namespace mf {

void* device_alloc(size_t) { MF_FAIL("this moeforge was built without CUDA (MOEFORGE_CUDA=OFF)"); }
void device_free(void*) {}
void device_memset_zero(void*, size_t) { MF_FAIL("this moeforge was built without CUDA"); }
bool cuda_available() { return false; }
size_t device_memory_used() { return 0; }
int current_cuda_device() { return 0; }
void wait_for_stream(void*) {}
void set_device_wait_limit(double, int) {}

}  // namespace mf
