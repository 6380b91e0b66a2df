// Grouped expert GEMMs through cuBLAS (cuBLASLt): the three products of grouped_gemm.cuh with the same
// formulas, shapes, accumulate/write semantics, offsets contract and requirements (C and OC
// multiples of 8, 16-byte aligned pointers, 0 <= E <= kMaxGroupedExperts, M < 2^31):
//   forward          out[r, :]  = inp[r, :] · weight[e]ᵀ                       (written)
//   backward input   dinp[r, :] (=|+=) dout[r, :] · weight[e]                   (accumulate flag)
//   backward weight  dweight[e] += Σ_{r in group e} dout[r, :]ᵀ · inp[r, :]     (always accumulates)
// Group e owns rows [offsets[e], offsets[e + 1]); rows outside [offsets[0], offsets[E]) are neither
// read nor written and an empty group leaves dweight[e] unchanged. Bad offsets are clamped exactly
// like the own kernel does (to [0, M] and to the running maximum), so no access leaves the buffers.
//
// NOTE: unlike grouped_gemm.cuh, the host needs the group sizes (it issues one cuBLASLt product per
// non-empty group): a call given `host_offsets` (the same E + 1 values the device holds, e.g. kept
// from an earlier read) uses them; without them it copies the device offsets into a pinned host
// buffer and SYNCHRONISES the stream once. Calls with M == 0, E == 0 or an empty product return at
// once.
// Results are deterministic (no atomics; see the .cu file for why).
//
// A GroupedGemmCublas holds the state the calls reuse (pinned offsets, side streams, cuBLASLt
// workspaces, a cache of layouts and algorithms). It is bound to the device current at construction
// and serves one issuing stream at a time (not thread-safe); the cuBLASLt handle must outlive it.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <span>

#include "core/tensor.h"
#include "kernels/cuda/grouped_gemm.cuh"

namespace mf::cuda {

class GroupedGemmCublas {
 public:
    // lt: the cuBLASLt handle (not owned); num_lanes: streams the per-group products are spread over
    // (the caller's plus num_lanes - 1 side streams; 1 = the caller's only). 4 was the best or near it
    // at the Qwen3-30B-A3B expert shapes on the H200. Each lane owns a 16 MiB cuBLASLt workspace.
    explicit GroupedGemmCublas(cublasLtHandle_t lt, int num_lanes = 4);
    ~GroupedGemmCublas();
    GroupedGemmCublas(const GroupedGemmCublas&) = delete;
    GroupedGemmCublas& operator=(const GroupedGemmCublas&) = delete;

    struct State;  // defined in the .cu file
    State& state() { return *state_; }

 private:
    std::unique_ptr<State> state_;
};

// out[M, OC]: out[r] = inp[r] · weight[e]ᵀ for the rows r of every group e (written).
void grouped_matmul_forward_cublas(GroupedGemmCublas& ctx, bf16* out, const bf16* inp, const bf16* weight,
                                   const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                   cudaStream_t stream, std::span<const int32_t> host_offsets = {});

// dinp[M, C]: dinp[r] = dout[r] · weight[e] (or += when accumulate) for the rows r of every group e.
void grouped_matmul_backward_input_cublas(GroupedGemmCublas& ctx, bf16* dinp, const bf16* dout, const bf16* weight,
                                          const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                          bool accumulate, cudaStream_t stream,
                                          std::span<const int32_t> host_offsets = {});

// dweight[E, OC, C] (fp32 or bf16): dweight[e] += Σ_{r in group e} dout[r]ᵀ · inp[r], summed in fp32 and
// added once to the stored value (the product's epilogue reads the old value: beta = 1). With
// accumulate false the sum is written instead (beta = 0: the old value is neither read nor needed)
// and an empty group's dweight[e] is zeroed, so every dweight[e] is written: the same values as
// zeroing dweight and accumulating, bit for bit, without the zeroing pass or the read.
void grouped_matmul_backward_weight_cublas(GroupedGemmCublas& ctx, void* dweight, DType dweight_dtype, const bf16* dout,
                                           const bf16* inp, const int32_t* offsets, int64_t M, int64_t E, int64_t C,
                                           int64_t OC, cudaStream_t stream, std::span<const int32_t> host_offsets = {},
                                           bool accumulate = true);

}  // namespace mf::cuda
