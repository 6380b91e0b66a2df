// The grouped row products of grouped_gemm.cuh (forward, and the input gradient when written: the
// same formulas, offsets contract, clamping of bad offsets and argument checks) on Hopper's
// warpgroup tensor-core instructions (wgmma, sm_90a), for the shapes they serve (the *_supported
// functions; the calls refuse others). One persistent launch for all groups, offsets read on the
// device only; deterministic (each output element owned by one block, fp32 sums in a fixed k order,
// no atomics).
// H200 (MF_BENCH=1 test_cuda_grouped_gemm; 65536 rows over 64 experts, P2's per-rank share, uneven
// loads; TFLOP/s, sm90 vs cuBLAS given host offsets): gate_up (C 2048, OC 1536) forward 610 vs 560,
// input gradient 584 vs 582; down (C 768, OC 2048) forward 475 vs 471, input gradient 561 vs 432. At
// 512 rows per expert: gate_up 565 / 535 vs 409 / 434, down 439 / 530 vs 333 / 306. A first,
// non-persistent version (one tile per block) ran 577 / 410 forward; a 128 x 128 tile with two
// blocks per SM ran 550 / 423; clusters of two blocks sharing the weight slices by multicast ran
// 478 / 334 (the pair moves in lockstep).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/grouped_gemm.cuh"

namespace mf::cuda {

bool grouped_matmul_forward_sm90_supported(int64_t C, int64_t OC);
bool grouped_matmul_backward_input_sm90_supported(int64_t C, int64_t OC);

// out[M, OC]: out[r] = inp[r] · weight[e]ᵀ for the rows r of every group e (written).
void grouped_matmul_forward_sm90(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                                 int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

// dinp[M, C]: dinp[r] = dout[r] · weight[e] for the rows r of every group e (written; rows outside
// the groups untouched). Needs OC % 64 == 0 and C % 256 == 0.
void grouped_matmul_backward_input_sm90(bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets,
                                        int64_t M, int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

}  // namespace mf::cuda
