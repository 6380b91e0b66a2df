// The grouped products of grouped_gemm.cuh (forward, input gradient when written, weight gradient:
// the same formulas, offsets contract, clamping of bad offsets and argument checks) on Hopper's
// warpgroup tensor-core instructions (wgmma, sm_90a), for the shapes they serve (the *_supported
// functions; the calls refuse others). One persistent launch per product for all groups, offsets
// read on the device only; deterministic (each output element owned by one block, fp32 sums in a
// fixed k order, no atomics).
// H200 (MF_BENCH=1 test_cuda_grouped_gemm; 65536 rows over 64 experts, P2's per-rank share, uneven
// loads; TFLOP/s, sm90 vs cuBLAS given host offsets; forward / input gradient / bf16 weight
// gradient written): gate_up (C 2048, OC 1536) 689 / 673 / 606 vs 560 / 583 / 576; down (C 768,
// OC 2048) 607 / 646 / 540 vs 471 / 431 / 439. At 512 rows per expert: gate_up 634 / 613 / 538 vs
// 408 / 435 / 414, down 560 / 601 / 496 vs 333 / 306 / 310.
// What mattered, in order: a persistent grid (the producer loads the next tile while the consumers
// store), 16-byte stores (2-byte-pair stores left half-written sectors: 610 -> 689 gate_up fwd). Not
// kept: a 128 x 128 tile with two blocks per SM (550 / 423 fwd before the stores), clusters of two
// blocks sharing the weight slices by multicast (478 / 334: the pair moves in lockstep); the same
// on the persistent kernel (pairs of row tiles of one group, each block loading half the weight
// slice for both, stages released by both blocks' consumers): 542 / 502 vs 676 / 603 unpaired; a
// staged epilogue (each consumer warpgroup's 64 x 256 share rounded into swizzled shared memory and
// stored by TMA while it multiplies the next tile; 3 stages + 64 KB instead of 4 stages), 2026-12-04,
// µs staged vs direct at 16384 rows / 65536 rows over 128 experts: gate_up forward 275 / 675 vs 255 /
// 670, down forward 156 / 373 vs 147 / 363, bf16 weight gradients 384 / 781 vs 400 / 755 (gate_up)
// and 203 / 404 vs 209 / 384 (down). At 16384 rows the products are bound by L2 and DRAM (ncu:
// gate_up forward at 86 % of L2 and 65 % of DRAM throughput: every expert's weights read for 128 rows).

#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/grouped_gemm.cuh"

namespace mf::cuda {

// At most this many groups (their row table lives in shared memory); callers with more take
// another path.
constexpr int64_t kSm90MaxGroups = 1024;

// The kernels are persistent, one block per SM, and a block holds a whole SM (registers, shared
// memory), so a kernel on another stream (the EP exchange's copies) cannot start until they end.
// Reserving n SMs launches them on n fewer; 0 (the default) uses every SM.
void set_grouped_gemm_sm90_reserved_sms(int sms);

bool grouped_matmul_forward_sm90_supported(int64_t C, int64_t OC);
bool grouped_matmul_backward_input_sm90_supported(int64_t C, int64_t OC);
bool grouped_matmul_backward_weight_sm90_supported(int64_t C, int64_t OC);

// out[M, OC]: out[r] = inp[r] · weight[e]ᵀ for the rows r of every group e (written). Needs C % 64 == 0
// and OC % 8 == 0 (the last column tile may overhang OC: it is stored in part).
void grouped_matmul_forward_sm90(bf16* out, const bf16* inp, const bf16* weight, const int32_t* offsets, int64_t M,
                                 int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

// dinp[M, C]: dinp[r] = dout[r] · weight[e] for the rows r of every group e (written; rows outside
// the groups untouched). Needs OC % 64 == 0 and C % 8 == 0.
void grouped_matmul_backward_input_sm90(bf16* dinp, const bf16* dout, const bf16* weight, const int32_t* offsets,
                                        int64_t M, int64_t E, int64_t C, int64_t OC, cudaStream_t stream);

// The SwiGLU MLP's products with the activation in their epilogue (bitwise the separate passes:
// the product rounded to bf16 as stored, then swiglu.cuh's formulas, rounded once):
// forward, h[M, 2I] = inp · weight[e]ᵀ (weight [E, 2I, C], gate rows then up rows, as
// grouped_matmul_forward_sm90 with OC = 2I) and a[M, I] = silu(h[:, :I]) · h[:, I:], both written
// for the rows of the groups (others untouched); needs C % 64 == 0 and I % 8 == 0. A tile multiplies
// 128 gate and the 128 matching up rows of the weight, so that one lane holds both halves of a pair.
bool grouped_matmul_forward_swiglu_sm90_supported(int64_t C, int64_t I);
void grouped_matmul_forward_swiglu_sm90(bf16* h, bf16* a, const bf16* inp, const bf16* weight, const int32_t* offsets,
                                        int64_t M, int64_t E, int64_t C, int64_t I, cudaStream_t stream);
// backward through the down product and the activation: da = dout · weight[e] (weight [E, OC, I],
// as grouped_matmul_backward_input_sm90 with C = I; da itself is not stored) and dh[M, 2I] =
// swiglu_backward(da, h) for the rows of the groups (others untouched); needs OC % 64 == 0 and
// I % 8 == 0.
// Not used by the MoE block or moeforge.jax: their epilogues run after the tile's products on the
// same warps, not beside the next tile's, and the separate passes came out faster (expert MLP forward
// + backward under jit at J1's geometry, H200, 2026-12-04, separate vs one-pass: 1.723 vs 1.766 ms at
// 2048 tokens, 4.041 vs 4.222 ms at 8192; bench/results/j1_2026-12-04/README.md).
bool grouped_matmul_backward_swiglu_sm90_supported(int64_t I, int64_t OC);
void grouped_matmul_backward_swiglu_sm90(bf16* dh, const bf16* dout, const bf16* weight, const bf16* h,
                                         const int32_t* offsets, int64_t M, int64_t E, int64_t I, int64_t OC,
                                         cudaStream_t stream);

// dweight[E, OC, C] (f32 or bf16): dweight[e] (+)= Σ_{r in group e} dout[r]ᵀ · inp[r], every group
// written (zeros for a group without rows) or, with `accumulate`, added to in fp32 and rounded once.
// With `offsets2` (a second [E + 1] table, same contract) group e's rows are those of both tables,
// [offsets[e], offsets[e + 1]) then [offsets2[e], offsets2[e + 1]), summed in that order.
// Needs OC % 8 == 0 and C % 8 == 0 (tiles that overhang OC or C are stored in part).
// With `square_sum` (one double on the device), *square_sum += Σ dweight² over the values stored
// (rounded and accumulated as stored), in a fixed order (each thread's 128 values in fp32, then
// double: per-warp sums of each tile, one fixed-order pass over them; relative error below 128·2^-24):
// the clipping norm's share of this gradient without reading it again.
// squares_scratch: grouped_matmul_backward_weight_sm90_squares_bytes(E, C, OC) bytes.
size_t grouped_matmul_backward_weight_sm90_squares_bytes(int64_t E, int64_t C, int64_t OC);
void grouped_matmul_backward_weight_sm90(void* dweight, DType dweight_dtype, const bf16* dout, const bf16* inp,
                                         const int32_t* offsets, int64_t M, int64_t E, int64_t C, int64_t OC,
                                         bool accumulate, cudaStream_t stream, const int32_t* offsets2 = nullptr,
                                         double* square_sum = nullptr, void* squares_scratch = nullptr);

}  // namespace mf::cuda
