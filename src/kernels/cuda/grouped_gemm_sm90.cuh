// The grouped forward product (grouped_gemm.cuh's grouped_matmul_forward: same formula, offsets
// contract, clamping of bad offsets and argument checks) on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a), for the shapes it serves: an sm_90 device, C a multiple of 64 and
// OC a multiple of 128 (grouped_matmul_forward_sm90_supported; the call refuses others). One
// launch for all groups, offsets read on the device only; deterministic (no atomics, fixed order).
// Opt-in (MOEFORGE_GROUPED_GEMM=sm90 sends the forward products here): this first version, with
// cp.async loads and block barriers, measured 479 TFLOP/s at the Qwen3-30B-A3B gate_up shape under
// EP=2 (131072 rows, 64 experts) against 684 for the cuBLAS path on the same H200, and P2 EP=2 ran
// 129.5 vs 125.8 ms/step with it (MF_BENCH=1 test_cuda_grouped_gemm). What it lacks for that: tile
// loads by the tensor-memory accelerator on mbarriers, a producer warp, 128 x 256 tiles.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/grouped_gemm.cuh"

namespace mf::cuda {

bool grouped_matmul_forward_sm90_supported(int64_t C, int64_t OC);

// out[M, OC]: out[r] = inp[r] · weight[e]ᵀ for the rows r of every group e (written).
void grouped_matmul_forward_sm90(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                                 int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

}  // namespace mf::cuda
