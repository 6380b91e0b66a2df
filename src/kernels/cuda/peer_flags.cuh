// Stream-ordered flags between GPUs that map each other's memory (CUDA IPC), for the peer exchange
// of parallel/peer_exchange.h. A flag is a 64-bit counter in one GPU's memory; its peers raise it
// (peer_signal, a system-scope release store after everything before it on the stream, the
// copies into that GPU included) and the owner's streams wait for it (peer_wait, a
// one-thread kernel spinning on a system-scope acquire load). Plain C++ declarations: the
// communicator (a .cpp) calls them.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <span>

namespace mf::cuda {

// Holds `stream` until *flag >= target. *flag is in this GPU's memory. After timeout_ns
// nanoseconds (the device's global timer) it gives up: stores `code` into *error unless another
// wait stored one first (error: host memory mapped into the device, which the host polls) and
// returns, so the stream moves on and the host reports the late peer. A wait that finds *error
// already set returns at once (one late peer does not cost one timeout per pending wait).
void peer_wait(const uint64_t* flag, uint64_t target, uint64_t timeout_ns, int* error, int code, cudaStream_t stream);

// *flag = value (flag may be a peer GPU's memory) once everything before it on `stream` is done,
// with a system-scope fence and release store, so a peer that sees the value sees those writes.
void peer_signal(uint64_t* flag, uint64_t value, cudaStream_t stream);

// Copies by SM threads: dst[0, bytes) = src[0, bytes) for every span, all spans of one call in one
// launch where every span is 16-byte aligned (pointers and size), so a local copy runs beside a copy
// into a peer's memory; a span that is not aligned is copied byte by byte in a launch of its own.
// dst or src may be a peer GPU's memory. The copy engines (cudaMemcpyAsync) do the same without
// SMs, but get a small share of memory bandwidth while memory-bound kernels run.
struct CopySpan {
    void* dst;
    const void* src;
    size_t bytes;
};
void peer_copy(std::span<const CopySpan> spans, cudaStream_t stream);

}  // namespace mf::cuda
