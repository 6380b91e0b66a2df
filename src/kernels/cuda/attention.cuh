// Flash attention on the GPU: GQA, causal, packed documents; bf16 q/k/v/out, fp32 softmax math.
// The CPU reference is kernels/cpu/attention.h, and the semantics are its own:
//   q[B, T, Hq, D], k/v[B, T, Hkv, D], out[B, T, Hq, D]; query head h reads KV head h / (Hq / Hkv);
//   token t of row b attends token s iff s <= t and doc_ids[b, s] == doc_ids[b, t] (doc_ids may be
//   null: plain causal); scale = fp32(1 / sqrt(D)); lse[B, Hq, T] (fp32) = log Σ_s exp(scale · q_t·k_s).
//
// Documents are contiguous runs of positions (what packing produces), so the keys of query t lie
// in [run_start(t), t], where run_start(t) is the first position of the run of equal doc ids that
// holds t; the kernels visit only key tiles that meet that range and mask inside it by comparing
// doc ids exactly. NOTE: a doc id that recurs after a different id in the same row (never produced
// by the loader) is therefore treated as a new document.
//
// Forward writes out and lse. Backward WRITES dq, dk, dv (=, unlike the CPU reference, which adds):
// each of them is the gradient of one projection output. It needs the forward's out and lse and a
// workspace of attention_backward_workspace_bytes(shape) bytes of device memory (the per-row
// D_t = dout_t · out_t, and fp32 partial dK/dV when the query heads of a KV group are split over
// blocks: at most ~210 MB, see the .cu file; the size depends on the current device's SM count).
// Both are deterministic (no atomics) and asynchronous on the stream.
//
// Requirements (checked, mf::Error otherwise): D in {16, 32, 64, 128}, Hq a multiple of Hkv,
// every pointer 16-byte aligned, B · T · Hq · D < 2^40.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mf::cuda {

using bf16 = __nv_bfloat16;

struct AttentionShape {
    int64_t B, T, Hq, Hkv, D;
};

// out[B, T, Hq, D] (written), lse[B, Hq, T] (written, natural log).
void attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const int32_t* doc_ids,
                       const AttentionShape& shape, cudaStream_t stream);

// Bytes of device workspace attention_backward needs (one fp32 per query row and head).
size_t attention_backward_workspace_bytes(const AttentionShape& shape);

// dq[B, T, Hq, D], dk/dv[B, T, Hkv, D] (all written) from dout[B, T, Hq, D] and the forward's
// q, k, v, out, lse. workspace: attention_backward_workspace_bytes(shape) bytes, 16-byte aligned.
void attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k, const bf16* v,
                        const bf16* out, const float* lse, const int32_t* doc_ids, const AttentionShape& shape,
                        void* workspace, cudaStream_t stream);

}  // namespace mf::cuda
