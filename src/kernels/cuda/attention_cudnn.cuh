// Causal attention through cuDNN's fused flash-attention engines (the backend graph API), for the
// plain causal mask: every row one document. Same semantics and layouts as attention.cuh
// (q[B, T, Hq, D], k/v[B, T, Hkv, D], lse[B, Hq, T] natural log, scale 1/sqrt(D)); packed documents
// stay with the kernels of attention.cu.
//
// Graphs are built and planned once per (device, shape, direction) and cached; a shape cuDNN does
// not serve (no engine, or a build without cuDNN) is reported once on stderr and answered
// `false` by cudnn_attention_serves from then on, so the caller falls back to attention.cu.
// MOEFORGE_ATTENTION=native turns this path off.
//
// Backward: cuDNN offers two algorithms. `dq_accumulate` (the fast one) sums dQ in an fp32
// workspace with atomics: not bitwise repeatable. `dp_workspace` materialises dP (2·B·Hq·T² bytes)
// and is deterministic; it runs over slices of the batch whose dP fits 1 GiB (the size of the LM
// head's scratch, so the step's peak memory does not grow). The default follows DESIGN.md's
// determinism rule unless the caller asks otherwise (set_cudnn_attention_deterministic).
#pragma once

#include "kernels/cuda/attention.cuh"

namespace mf::cuda {

// True when compiled with cuDNN, not turned off, the mask is plain causal, and cuDNN has engines for
// this shape in both directions on the current device (plans are built here on first use).
bool cudnn_attention_serves(const AttentionShape& shape);

// Whether the backward uses cuDNN's deterministic algorithm (default true). Plans are rebuilt on change.
void set_cudnn_attention_deterministic(bool deterministic);
bool cudnn_attention_deterministic();

// Device workspace (bytes, 256-aligned) the two passes need; the shape must be served.
size_t cudnn_attention_forward_workspace_bytes(const AttentionShape& shape);
size_t cudnn_attention_backward_workspace_bytes(const AttentionShape& shape);

// attention_forward / attention_backward (doc_ids = null) on cuDNN. dq, dk, dv are written.
void cudnn_attention_forward(bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v,
                             const AttentionShape& shape, void* workspace, cudaStream_t stream);
void cudnn_attention_backward(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                              const bf16* v, const bf16* out, const float* lse, const AttentionShape& shape,
                              void* workspace, cudaStream_t stream);

}  // namespace mf::cuda
