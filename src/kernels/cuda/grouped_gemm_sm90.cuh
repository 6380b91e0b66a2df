// The grouped forward product (grouped_gemm.cuh's grouped_matmul_forward: same formula, offsets
// contract, clamping of bad offsets and argument checks) on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a), for the shapes it serves: an sm_90 device, C a multiple of 64 and
// OC a multiple of 256 (grouped_matmul_forward_sm90_supported; the call refuses others). One
// launch for all groups, offsets read on the device only; deterministic (no atomics, fixed order).
// Opt-in (MOEFORGE_GROUPED_GEMM=sm90 sends the forward products here) until it beats the cuBLAS
// path (MF_BENCH=1 test_cuda_grouped_gemm, H200, 131072 rows over 64 experts = the EP=2 shape):
// gate_up (C 2048, OC 1536) 621 TFLOP/s vs 647 for cuBLAS reading the offsets and 695 given host
// offsets; down (C 768, OC 2048) 431 vs 486 / 607; P2 EP=2 126.2 vs 124.7 ms/step. (A first
// version with cp.async and block barriers ran 479 / 376.) Next: a persistent grid whose epilogue
// overlaps the next tile's loads (the down product's K loop is only 12 slices long), then the
// input- and weight-gradient products.
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
