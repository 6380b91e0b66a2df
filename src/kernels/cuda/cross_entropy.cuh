// Fused LM head + cross-entropy on the GPU: logits for a chunk of tokens are computed with cuBLAS,
// turned into the loss and its gradient, and dropped, so [N, V] logits never exist at once.
//   logits[n] = h[n] · wᵀ (w [V, C]);  loss[n] = logsumexp(logits[n]) − logits[n][target[n]]
// Targets equal to -100 (kIgnoreIndex) are ignored: loss 0, no gradient. A target outside [0, V)
// that is not -100 gives loss NaN and no gradient (visible, never an out-of-bounds read).
// CPU reference and spec: kernels/cpu/cross_entropy.h.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/tensor.h"
#include "kernels/cuda/cast.cuh"

namespace mf::cuda {

// Bytes of scratch lm_head_cross_entropy needs for chunks of `chunk` tokens: one [chunk, V] logits
// buffer (fp32 or bf16), which the loss kernel overwrites in place with the bf16 dlogits.
size_t lm_head_cross_entropy_scratch_bytes(int64_t chunk, int64_t V, DType logits_dtype = DType::f32);

// losses [N] fp32 (written). When dh / dw are non-null, the gradients of Σ_n grad_scale · loss[n]:
//   dh [N, C] bf16 += dlogits · w          dw [V, C] (dw_dtype f32 or bf16) += dlogitsᵀ · h
// with dlogits[n, v] = grad_scale · (softmax(logits[n])[v] − [v == target[n]]) rounded to bf16.
// h [N, C] bf16, w [V, C] bf16, targets [N] int32. Per chunk of `chunk` tokens (the last may be
// shorter): one GEMM (bf16 in, fp32 logits out; or logits rounded to bf16 with logits_dtype bf16,
// as a bf16 model's are: half the logits traffic, twice the tokens per chunk of scratch), one kernel
// (per-row max and Σ exp in fp32, the loss, dlogits written in place as bf16 rows of stride 2V over
// fp32 logits, V over bf16 ones), two GEMMs accumulating dh and dw
// (fp32 accumulation; dw rounded to bf16 once per chunk when it is bf16). cuBLAS results are
// deterministic for a given GPU and library. The handle is set to `stream`.
// accumulate = false writes dh and dw instead (=, not +=): their old contents are never read (the
// first chunk's dw GEMM and every dh GEMM have β = 0; N = 0 zero-fills dw), so they may be
// uninitialised, and a caller saves the zero-fill and its read.
// scratch: lm_head_cross_entropy_scratch_bytes(chunk, V, logits_dtype) bytes, 16-byte aligned.
// grad_scale_by (may be null): one fp32 value on the device that multiplies grad_scale, read by the
// kernel (a scale the host does not know, such as 1 / the count of targets, without a sync).
// CPU reference: cpu::lm_head_cross_entropy with bf16_logits = (logits_dtype == bf16).
void lm_head_cross_entropy(cublasHandle_t handle, float* losses, bf16* dh, void* dw, DType dw_dtype, const bf16* h,
                           const bf16* w, const int32_t* targets, int64_t N, int64_t C, int64_t V, float grad_scale,
                           void* scratch, size_t scratch_bytes, int64_t chunk, cudaStream_t stream,
                           DType logits_dtype = DType::f32, bool accumulate = true,
                           const float* grad_scale_by = nullptr);

// The loss kernel alone (step 2 of lm_head_cross_entropy, which calls it per chunk), on logits already
// computed: losses [rows] fp32 (written); logits [rows, V] fp32 or bf16 (logits_dtype), overwritten,
// when want_grad, by dlogits[r, v] = grad_scale · (softmax(logits[r])[v] − [v == targets[r]]) as bf16
// rows at the start of each row's own bytes (bf16 row stride V · dtype_size(logits_dtype) / 2); an
// ignored (-100) or out-of-range target gives loss 0 or NaN and a zero dlogits row. want_grad = false
// leaves the logits as they were. grad_scale_by: as for lm_head_cross_entropy. The kernel is the one
// cross_entropy_loss_kernel names (for a 16-byte aligned `logits`; any other alignment streams).
void cross_entropy_loss_rows(float* losses, void* logits, DType logits_dtype, const int32_t* targets, int64_t rows,
                             int64_t V, float grad_scale, const float* grad_scale_by, bool want_grad,
                             cudaStream_t stream);

// Which loss kernel runs on rows of V logits of logits_dtype (16-byte aligned), with the environment as
// it is now (MOEFORGE_CE_KERNEL: unset or empty = automatic, "staged", "streaming"; any other value
// throws). staged: each row in num_slices slices (1, 2, 4 or 8) of slice_elements logits (the last may
// be shorter), one CTA each, a thread-block cluster per row; streaming: one block per row,
// num_slices = 1, slice_elements = V. "staged" picks staged wherever a row fits in 8 slices of 47 KiB
// and V is a multiple of the 16-byte vector, streaming elsewhere; automatic does the same when
// kCrossEntropyStagedByDefault, else streams.
struct CrossEntropyLossKernel {
    bool staged;
    int num_slices;
    int64_t slice_elements;
    const char* name() const { return staged ? "staged" : "streaming"; }
};
CrossEntropyLossKernel cross_entropy_loss_kernel(int64_t V, DType logits_dtype);

// The automatic choice: false (streaming) until the staged kernel has been timed against it on the
// GPU (test_cuda_loss_optim's `BENCH ce loss` lines, MF_BENCH=1).
inline constexpr bool kCrossEntropyStagedByDefault = false;

}  // namespace mf::cuda
