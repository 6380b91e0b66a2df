// Inline PTX wrappers for the shared-memory mbarriers (sm_90) that asynchronous copies (TMA, bulk
// copies) complete on: grouped_gemm_sm90.cu and the staged loss kernel of cross_entropy.cu.
//   - A barrier is initialised by one thread (mbar_init) before any other thread uses it; the
//     caller then makes the initialisation visible (fence.mbarrier_init and a block or cluster
//     barrier) before any copy completes on it or any thread waits on it.
//   - Each phase completes when its expected arrivals have arrived and the bytes announced with
//     mbar_arrive_expect_tx have landed; mbar_wait(bar, parity) returns once the phase of that parity
//     has completed (the phase before the first counts as complete: parity 1 passes at once on a
//     fresh barrier).
#pragma once

#include <cstdint>

#include "kernels/cuda/mma_sm80.cuh"

namespace mf::cuda {

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}

// Arrives once and expects `bytes` of asynchronous copies to complete on the barrier.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
                 : "memory");
}

// Waits until the barrier's phase of the given parity has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    asm volatile(
        "{\n"
        ".reg .pred done;\n"
        "WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT;\n"
        "}\n" ::"r"(smem_u32(bar)),
        "r"(parity)
        : "memory");
}

}  // namespace mf::cuda
