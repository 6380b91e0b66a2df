// Inline PTX wrappers for the tensor-core kernels (attention.cu, grouped_gemm.cu): asynchronous
// global -> shared copies (cp.async), shared -> register fragment loads (ldmatrix) and the bf16
// warp-level matrix multiply-accumulate (mma.sync m16n8k16, fp32 accumulators). These are the
// sm_80 instructions; Hopper (sm_90a, what we build for) runs them as they are.
//
// Invariants the callers keep:
//   - cp.async: `smem` is a shared-memory address and both addresses are 16-byte aligned. Copies
//     complete in commit groups: cp_async_commit() closes the group of the copies issued since the
//     last commit, cp_async_wait<N>() blocks the thread until at most N of its groups are pending;
//     a __syncthreads() after the wait makes the data visible to the whole block.
//   - ldmatrix and mma are .sync.aligned: all 32 lanes of the warp execute them together, with the
//     same instruction and no divergence. For ldmatrix.x4, lane l gives the address of row l % 8 of
//     8x8 matrix l / 8 (each row 8 bf16 = 16 bytes, 16-byte aligned, in shared memory); register j
//     receives the lane's two elements of matrix j (.trans: of its transpose).
//   - mma m16n8k16 fragments, lane = 4·g + t: A (16 x 16, row-major) a0 = (row g, k 2t..2t+1),
//     a1 = (row g+8, same k), a2 = (row g, k 2t+8..2t+9), a3 = (row g+8, k 2t+8..); B (16 x 8,
//     "col": k-major) b0 = (k 2t..2t+1, col g), b1 = (k 2t+8..2t+9, col g); C/D (16 x 8, fp32)
//     d0, d1 = (row g, cols 2t, 2t+1), d2, d3 = (row g+8, same cols). Each 32-bit register holds two
//     bf16, the lower index in the low half.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace mf::cuda {

using bf16 = __nv_bfloat16;

// The 32-bit shared-state-space address of a generic pointer into shared memory.
__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy, bypassing L1 (.cg); when !valid nothing is read and the 16 bytes
// are zero-filled (the callers still pass an address inside the tensor then).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
    const int src_bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem), "r"(src_bytes));
}
// Closes the group of cp.async copies this thread issued since the last commit.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 bf16 matrices from shared memory into r[0..3] (row addresses: see the file comment).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const bf16* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}
// The same, each matrix transposed on the way (reads a fragment of an operand that is not
// contiguous along k).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const bf16* smem) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(smem)));
}

// d += a · b for one m16n8k16 tile: a = the 4 A registers, b0, b1 = the 2 B registers, d = the 4
// fp32 accumulators (layouts in the file comment). Accumulates in fp32 in place.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

}  // namespace mf::cuda
