// A GPU timeline recorder for any CUDA program, loaded through CUDA's injection hook:
//   MOEFORGE_TRACE_DIR=dir CUDA_INJECTION64_PATH=build/bench/libmf_gpu_trace.so <program>
// CUPTI's activity records (kernels, memcpys, memsets with device timestamps and streams) go to
// dir/trace_<pid>.tsv, one line each: kind, start ns, end ns, device, stream, then the kernel name
// or the byte count. bench/trace/summary.py turns the files into per-step tables. The machines have
// no Nsight Systems; this is the part of it the benchmarks need. NOTE: the recording costs host time;
// a one-GPU P1 step ran ~4% slower under it, but a 2-process EP=2 P2 step about twice as slow, so
// read kernel durations from it there, not the EP step's idle time.
#include <cupti.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

namespace {

std::mutex g_mu;
FILE* g_out = nullptr;
constexpr size_t kBufferBytes = size_t{16} << 20;

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
    *buffer = static_cast<uint8_t*>(std::aligned_alloc(8, kBufferBytes));
    *size = *buffer != nullptr ? kBufferBytes : 0;
    *max_records = 0;
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid) {
    std::lock_guard<std::mutex> lock(g_mu);
    CUpti_Activity* rec = nullptr;
    while (g_out != nullptr && cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL || rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
            const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
            std::fprintf(g_out, "K\t%llu\t%llu\t%u\t%u\t%s\n", static_cast<unsigned long long>(k->start),
                         static_cast<unsigned long long>(k->end), k->deviceId, k->streamId,
                         k->name != nullptr ? k->name : "?");
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
            std::fprintf(g_out, "C\t%llu\t%llu\t%u\t%u\t%llu\n", static_cast<unsigned long long>(m->start),
                         static_cast<unsigned long long>(m->end), m->deviceId, m->streamId,
                         static_cast<unsigned long long>(m->bytes));
        } else if (rec->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
            const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
            std::fprintf(g_out, "S\t%llu\t%llu\t%u\t%u\t%llu\n", static_cast<unsigned long long>(m->start),
                         static_cast<unsigned long long>(m->end), m->deviceId, m->streamId,
                         static_cast<unsigned long long>(m->bytes));
        }
    }
    std::free(buffer);
}

void flush_at_exit() {
    cuptiActivityFlushAll(1);
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_out != nullptr) std::fclose(g_out);
    g_out = nullptr;
}

}  // namespace

extern "C" int InitializeInjection() {
    const char* dir = std::getenv("MOEFORGE_TRACE_DIR");
    const std::string path = std::string(dir != nullptr ? dir : ".") + "/trace_" + std::to_string(getpid()) + ".tsv";
    g_out = std::fopen(path.c_str(), "w");
    if (g_out == nullptr) return 0;
    if (cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed) != CUPTI_SUCCESS) return 0;
    for (CUpti_ActivityKind kind :
         {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY, CUPTI_ACTIVITY_KIND_MEMSET})
        cuptiActivityEnable(kind);
    std::atexit(flush_at_exit);
    return 1;
}
