/* moeforge's C API: the engine's ops and the whole fine-tuning engine behind raw pointers, POD
 * descriptors and status codes, for the Python and JAX bindings (which link no framework) and any
 * other language.
 *
 * Conventions.
 *   - Every function returns an mf_status; on anything but MF_OK, mf_last_error() holds the reason
 *     (the engine's message, naming the argument, file or field) until the thread's next call. No
 *     C++ exception ever leaves the API.
 *   - Tensors are mf_tensor descriptors of caller-owned memory: data pointer, dtype, device, shape
 *     and optional strides in elements (NULL: row-major contiguous). Only contiguous tensors are
 *     accepted; anything else is refused. An optional tensor is passed as NULL.
 *   - Activations are f32 on the CPU and bf16 on a CUDA device; router, softmax, loss and optimizer
 *     math is f32 (each function says). Outputs are allocated by the caller; "+=" marks outputs that
 *     accumulate, every other output is written.
 *   - An mf_context says where an op runs: a CUDA device, a stream (a cudaStream_t as an integer; 0
 *     is the engine's own stream on that device, which is ordered with the legacy default stream
 *     both ways) and an optional caller workspace the op may use as scratch. NULL means the CPU
 *     or, for CUDA tensors, the engine's stream on the current device. Ops are enqueued on the
 *     stream and return without waiting, except where a function says it reads results back.
 *   - Thread safety: ops may be called from several threads, but two threads must not issue on one
 *     stream at once. An engine handle is used by one thread at a time.
 */
#ifndef MOEFORGE_MOEFORGE_H_
#define MOEFORGE_MOEFORGE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a declaration here changes meaning or layout. */
#define MF_API_VERSION 4

typedef enum mf_status {
    MF_OK = 0,
    MF_ERR_INVALID_ARGUMENT = 1, /* a bad tensor, shape, value, recipe or model input */
    MF_ERR_UNSUPPORTED = 2,      /* valid, but not supported (e.g. a CUDA tensor in a CPU-only build) */
    MF_ERR_CUDA = 3,             /* a CUDA, cuBLAS, cuDNN or NCCL call failed */
    MF_ERR_IO = 4,               /* a file could not be read or written */
    MF_ERR_INTERNAL = 5          /* anything else (a bug: please report it with the message) */
} mf_status;

typedef enum mf_dtype { MF_F32 = 0, MF_BF16 = 1, MF_I32 = 2, MF_I64 = 3, MF_F64 = 4 } mf_dtype;
typedef enum mf_device_type { MF_CPU = 0, MF_CUDA = 1 } mf_device_type;

#define MF_MAX_DIMS 8

typedef struct mf_tensor {
    void* data;           /* may be NULL only when the tensor has no element */
    int32_t dtype;        /* mf_dtype */
    int32_t device_type;  /* mf_device_type */
    int32_t device_index; /* CUDA ordinal (ignored on the CPU) */
    int32_t ndim;         /* 0 .. MF_MAX_DIMS */
    int64_t shape[MF_MAX_DIMS];
    const int64_t* strides; /* ndim strides in elements, or NULL (contiguous) */
} mf_tensor;

typedef struct mf_context {
    int32_t device;  /* CUDA ordinal; -1: the calling thread's current device */
    uint64_t stream; /* cudaStream_t; 0: the engine's stream */
    void* workspace; /* optional device scratch, 256-byte aligned, alive until the stream ran the op */
    size_t workspace_bytes;
} mf_context;

int mf_api_version(void);
/* The message of this thread's last failed call ("" after a success). */
const char* mf_last_error(void);
const char* mf_status_name(mf_status status);
/* Whether a CUDA device can be used: a build with the CUDA backend on a machine with a GPU (1), else 0. */
int mf_has_cuda(void);
/* Whether this build has the CUDA backend (1), whether or not a GPU is present. */
int mf_built_with_cuda(void);
/* Waits until all work the engine issued on `device_type`'s streams has finished. */
mf_status mf_synchronize(const mf_context* ctx, int32_t device_type);

/* --- grouped GEMM over expert row groups --------------------------------------------------------
 * Rows [offsets[e], offsets[e + 1]) of inp belong to expert e (offsets [E + 1] i32, on the tensors'
 * device; groups may be empty; rows past offsets[E] are left alone).                              */
/* out[M, OC] = inp[M, C] · weight[e]ᵀ per group; weight [E, OC, C]. */
mf_status mf_grouped_gemm_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp,
                                  const mf_tensor* weight, const mf_tensor* offsets);
/* dinp[M, C] = dout[M, OC] · weight[e] per group (+= when accumulate). */
mf_status mf_grouped_gemm_input_grad(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout,
                                     const mf_tensor* weight, const mf_tensor* offsets, int accumulate);
/* dweight[e] = dout[rows of e]ᵀ · inp[rows of e] (+= when accumulate; written: an empty group's is 0). */
mf_status mf_grouped_gemm_weight_grad(const mf_context* ctx, const mf_tensor* dweight, const mf_tensor* dout,
                                      const mf_tensor* inp, const mf_tensor* offsets, int accumulate);
/* The SwiGLU expert MLP's first product with its activation: h[M, 2I] = inp[M, C] · weight[e]ᵀ
 * (weight [E, 2I, C], gate rows then up rows) and a[M, I] = silu(h[:, :I]) · h[:, I:] per group:
 * mf_grouped_gemm_forward then mf_swiglu_forward, bit for bit, in one pass on a Hopper GPU. */
mf_status mf_grouped_gemm_swiglu_forward(const mf_context* ctx, const mf_tensor* h, const mf_tensor* a,
                                         const mf_tensor* inp, const mf_tensor* weight, const mf_tensor* offsets);
/* Its gradient through the second product: dh[M, 2I] = swiglu_backward(dout[M, OC] · weight[e], h)
 * per group (weight [E, OC, I]): mf_grouped_gemm_input_grad into da [M, I] then mf_swiglu_backward,
 * bit for bit. da is scratch (a Hopper GPU's one pass never writes it): da's contents afterwards, and
 * dh's rows outside the groups, are unspecified. */
mf_status mf_grouped_gemm_swiglu_backward(const mf_context* ctx, const mf_tensor* dh, const mf_tensor* da,
                                          const mf_tensor* dout, const mf_tensor* weight, const mf_tensor* h,
                                          const mf_tensor* offsets);

/* --- routers ------------------------------------------------------------------------------------
 * logits [N, E] f32 -> probs [N, E] f32 (softmax), topk_idx [N, K] i32 (descending, ties to the
 * lower index), topk_weight [N, K] f32: the chosen probabilities, renormalised to sum 1 when
 * norm_topk_prob (Qwen3-MoE, Mixtral), else as they are (Qwen2-MoE, OLMoE).                       */
mf_status mf_router_softmax_topk_forward(const mf_context* ctx, const mf_tensor* probs, const mf_tensor* topk_idx,
                                         const mf_tensor* topk_weight, const mf_tensor* logits, int norm_topk_prob);
/* dlogits [N, E] f32 (written) from dtopk_weight [N, K] and dprobs [N, E] (optional: the aux loss's). */
mf_status mf_router_softmax_topk_backward(const mf_context* ctx, const mf_tensor* dlogits,
                                          const mf_tensor* dtopk_weight, const mf_tensor* dprobs,
                                          const mf_tensor* probs, const mf_tensor* topk_idx, int norm_topk_prob);
/* The sigmoid router (DeepSeek-V3, Nemotron-H): scores = σ(logits) [N, E]; the K experts of the
 * largest scores + correction_bias ([E] f32, optional) within the topk_group best of n_group groups;
 * topk_weight = the chosen scores (without the bias), / their sum when norm_topk_prob, × scaling.
 * masked_score: what an expert of a dropped group competes with (-inf or 0).                      */
mf_status mf_router_sigmoid_forward(const mf_context* ctx, const mf_tensor* scores, const mf_tensor* topk_idx,
                                    const mf_tensor* topk_weight, const mf_tensor* logits,
                                    const mf_tensor* correction_bias, int64_t n_group, int64_t topk_group,
                                    int norm_topk_prob, float routed_scaling_factor, float masked_score);
mf_status mf_router_sigmoid_backward(const mf_context* ctx, const mf_tensor* dlogits, const mf_tensor* dtopk_weight,
                                     const mf_tensor* scores, const mf_tensor* topk_idx, int norm_topk_prob,
                                     float routed_scaling_factor);

/* --- the load-balancing loss's statistics (transformers' load_balancing_loss_func) ----------------
 * Over the tokens of one or more MoE layers (accumulate layer by layer): counts [E] f32 +=
 * Σ_t mask[t] · #{k: topk_idx[t, k] = e} (an index outside [0, E) counts nothing) and prob_sums [E]
 * f32 += Σ_t mask[t] · probs[t, e], with topk_idx [N, K] i32, probs [N, E] f32, mask [N] f32 (1 a
 * counted token, 0 padding). The loss is then E · Σ_e counts[e] · prob_sums[e] / R² (R the counted
 * rows of all the layers summed).                                                                 */
mf_status mf_moe_aux_stats(const mf_context* ctx, const mf_tensor* counts, const mf_tensor* prob_sums,
                           const mf_tensor* topk_idx, const mf_tensor* probs, const mf_tensor* mask);
/* Its gradient at the probabilities: dprobs [N, E] f32 (written) = scale · counts[e] · mask[t]
 * (scale: E · the loss's weight / R²). */
mf_status mf_moe_aux_dprobs(const mf_context* ctx, const mf_tensor* dprobs, const mf_tensor* counts,
                            const mf_tensor* mask, float scale);
/* The scratch mf_moe_aux_stats takes for num_rows rows over num_experts on device_type (0 on the
 * CPU); a context workspace of this many bytes serves it (otherwise moeforge allocates it, once). */
mf_status mf_moe_aux_stats_workspace_bytes(int64_t num_rows, int64_t num_experts, int32_t device_type, size_t* bytes);

/* --- groups given by their sizes (a framework's group_sizes, as jax.lax.ragged_dot's) -------------
 * offsets [E + 1] i32 (written) = 0, then the running sum of group_sizes [E] i32, on the tensors'
 * device with no host sync; a negative size counts as 0 and every offset is clamped to num_rows
 * (0 .. INT32_MAX), so no group reaches past the rows. The offsets feed the grouped GEMMs above. */
mf_status mf_group_offsets(const mf_context* ctx, const mf_tensor* offsets, const mf_tensor* group_sizes,
                           int64_t num_rows);
/* The rows [offsets[E], M) of x [M, C] set to zero: the rows no group covers (ragged_dot's rows past
 * the last group), offsets [E + 1] i32 read on the device.                                        */
mf_status mf_zero_rows_past_groups(const mf_context* ctx, const mf_tensor* x, const mf_tensor* offsets);

/* --- permute / unpermute ------------------------------------------------------------------------
 * The N·K (token, slot) pairs p = t·K + k grouped by expert, stable: expert_offsets [E + 1] i32,
 * sorted_pair [N·K] i32 (row r holds pair sorted_pair[r]), pair_row [N·K] i32 (its inverse). A pair
 * whose expert lies outside [0, E) (an EP sentinel: another rank's expert) is dropped: pair_row -1,
 * sorted_pair -1 on the rows past expert_offsets[E]; it contributes nothing below.                */
mf_status mf_moe_permute_indices(const mf_context* ctx, const mf_tensor* expert_offsets, const mf_tensor* sorted_pair,
                                 const mf_tensor* pair_row, const mf_tensor* topk_idx, int64_t num_experts);
/* The scratch mf_moe_permute_indices takes for num_rows tokens of top_k pairs among num_experts on
 * device_type (0 on the CPU), as mf_moe_aux_stats_workspace_bytes. */
mf_status mf_moe_permute_indices_workspace_bytes(int64_t num_rows, int64_t top_k, int64_t num_experts,
                                                 int32_t device_type, size_t* bytes);
/* x_perm [N·K, H] = x[sorted_pair[r] / K] (a zero row for a dropped pair's row). */
mf_status mf_moe_gather(const mf_context* ctx, const mf_tensor* x_perm, const mf_tensor* x,
                        const mf_tensor* sorted_pair, int64_t top_k);
/* dx [N, H] += Σ_k dx_perm[pair_row[t·K + k]]. */
mf_status mf_moe_gather_backward(const mf_context* ctx, const mf_tensor* dx, const mf_tensor* dx_perm,
                                 const mf_tensor* pair_row, int64_t top_k);
/* out [N, H] = Σ_k topk_weight[t, k] · y_perm[pair_row[t·K + k]] (k ascending, fp32). */
mf_status mf_moe_unpermute(const mf_context* ctx, const mf_tensor* out, const mf_tensor* y_perm,
                           const mf_tensor* topk_weight, const mf_tensor* pair_row);
/* dy_perm[row] = topk_weight · dout[t] (rows of dropped pairs untouched); dtopk_weight [N, K] f32 =
 * <dout[t], y_perm[row]> (0 for a dropped pair). */
mf_status mf_moe_unpermute_backward(const mf_context* ctx, const mf_tensor* dy_perm, const mf_tensor* dtopk_weight,
                                    const mf_tensor* dout, const mf_tensor* y_perm, const mf_tensor* topk_weight,
                                    const mf_tensor* pair_row);

/* --- expert activations -------------------------------------------------------------------------*/
/* SwiGLU: inp [N, 2I] = [gate | up] halves; out [N, I] = silu(gate) · up; dinp written. */
mf_status mf_swiglu_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp);
mf_status mf_swiglu_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout, const mf_tensor* inp);
/* Squared ReLU (Nemotron-H's non-gated experts): out = max(inp, 0)², inp and out [N, I];
 * dinp = dout · 2 · max(inp, 0) (written). */
mf_status mf_relu2_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp);
mf_status mf_relu2_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout, const mf_tensor* inp);
/* gpt-oss (transformers GptOssExperts): inp [N, 2I] with gate and up interleaved by column;
 * g = min(gate, limit), u = clamp(up, -limit, limit), out [N, I] = (u + 1) · g · σ(alpha · g).
 * gpt-oss: alpha 1.702, limit 7. dinp [N, 2I] written (the clamps pass the gradient inside them). */
mf_status mf_clamped_swiglu_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* inp, float alpha,
                                    float limit);
mf_status mf_clamped_swiglu_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dout,
                                     const mf_tensor* inp, float alpha, float limit);

/* --- the whole MoE block ------------------------------------------------------------------------
 * y = Σ_k w[t, k] · expert_{idx[t, k]}(x[t]), with the router logits x · routerᵀ (router [E, H]),
 * routed by the router kind, the pairs grouped by expert, gate_up [E, 2I, H] (relu²: [E, I, H]),
 * the activation, down [E, H, I]. Its activations live in a caller workspace of at least
 * mf_moe_block_activation_bytes bytes on the tensors' device, which the forward fills and the
 * backward of the same x reads: keep it untouched in between. The backward also needs scratch of
 * mf_moe_block_workspace_bytes − mf_moe_block_activation_bytes bytes: a separate `scratch` tensor,
 * or (scratch NULL) the rest of a workspace of mf_moe_block_workspace_bytes. Both 128-byte aligned
 * on a GPU (what XLA gives its buffers), 64-byte on the CPU.                                      */
typedef enum mf_activation { MF_ACT_SWIGLU = 0, MF_ACT_RELU2 = 1 } mf_activation;
typedef enum mf_router_kind { MF_ROUTER_SOFTMAX = 0, MF_ROUTER_SIGMOID = 1 } mf_router_kind;
typedef struct mf_moe_dims {
    int64_t hidden, intermediate, num_experts, top_k;
    int32_t norm_topk_prob;
    int32_t activation;          /* mf_activation */
    int32_t router;              /* mf_router_kind */
    int64_t n_group, topk_group; /* the sigmoid router's groups (1, 1: none) */
    float routed_scaling_factor; /* the sigmoid router's (1: none) */
    float masked_score;          /* the sigmoid router's (-inf) */
} mf_moe_dims;
/* The activations and the backward's scratch of num_tokens tokens together. */
mf_status mf_moe_block_workspace_bytes(const mf_moe_dims* dims, int64_t num_tokens, int32_t device_type, size_t* bytes);
/* The activations alone: what the forward writes and the backward reads. */
mf_status mf_moe_block_activation_bytes(const mf_moe_dims* dims, int64_t num_tokens, int32_t device_type,
                                        size_t* bytes);
/* y [N, H] written; correction_bias [E] f32 (optional, sigmoid router). */
mf_status mf_moe_block_forward(const mf_context* ctx, const mf_moe_dims* dims, const mf_tensor* y, const mf_tensor* x,
                               const mf_tensor* router, const mf_tensor* gate_up, const mf_tensor* down,
                               const mf_tensor* correction_bias, const mf_tensor* workspace);
/* dx [N, H] +=, drouter +=, dgate_up and ddown += (written when accumulate_expert_grads is 0);
 * dprobs [N, E] f32 (optional): the gradient at the router probabilities (an aux loss's). */
mf_status mf_moe_block_backward(const mf_context* ctx, const mf_moe_dims* dims, const mf_tensor* dx,
                                const mf_tensor* drouter, const mf_tensor* dgate_up, const mf_tensor* ddown,
                                const mf_tensor* dy, const mf_tensor* dprobs, const mf_tensor* x,
                                const mf_tensor* router, const mf_tensor* gate_up, const mf_tensor* down,
                                const mf_tensor* correction_bias, const mf_tensor* workspace, const mf_tensor* scratch,
                                int accumulate_expert_grads);

/* --- attention ----------------------------------------------------------------------------------
 * Causal attention with GQA over B rows of T tokens, token-major: q [B, T, Hq·D], k, v [B, T, Hkv·D],
 * out [B, T, Hq·D], lse [B, Hq, T] f32 (kept for the backward); doc_ids [B·T] i32 (optional): a
 * token attends only to earlier tokens of its own document (packed rows). Scale 1/sqrt(D).       */
mf_status mf_attention_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* lse, const mf_tensor* q,
                               const mf_tensor* k, const mf_tensor* v, const mf_tensor* doc_ids, int64_t batch,
                               int64_t seq_len, int64_t num_heads, int64_t num_kv_heads);
/* dq, dk, dv written. */
mf_status mf_attention_backward(const mf_context* ctx, const mf_tensor* dq, const mf_tensor* dk, const mf_tensor* dv,
                                const mf_tensor* dout, const mf_tensor* q, const mf_tensor* k, const mf_tensor* v,
                                const mf_tensor* out, const mf_tensor* lse, const mf_tensor* doc_ids, int64_t batch,
                                int64_t seq_len, int64_t num_heads, int64_t num_kv_heads);

/* --- token embedding ----------------------------------------------------------------------------
 * out [N, C] = wte [V, C] rows at ids [N] i32 (f32 on the CPU; bf16 on the GPU); the backward
 * dwte [V, C] += Σ dout [N, C] rows over the tokens of each id (dwte f32, or bf16 too on the GPU),
 * deterministic (summed in fp32 in token order, added once). On the CPU an id outside [0, V) is
 * refused with its position; on the GPU the ids are not read on the host: such an id gives a zero
 * row and adds nothing (never an out-of-bounds access).                                            */
mf_status mf_embedding_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* ids,
                               const mf_tensor* wte);
mf_status mf_embedding_backward(const mf_context* ctx, const mf_tensor* dwte, const mf_tensor* dout,
                                const mf_tensor* ids);
/* The scratch mf_embedding_backward takes for num_rows tokens over vocab words on device_type (0 on
 * the CPU); a context whose workspace holds this many bytes is used for it.                        */
mf_status mf_embedding_backward_workspace_bytes(int64_t num_rows, int64_t vocab, int32_t device_type, size_t* bytes);

/* --- RMSNorm ------------------------------------------------------------------------------------
 * out [N, C] = weight · x / sqrt(mean(x²) + eps) (weight [C]; f32 on the CPU; on the GPU bf16
 * activations and an f32 or bf16 weight), rstd [N] f32 (written, kept for the backward).          */
mf_status mf_rmsnorm_forward(const mf_context* ctx, const mf_tensor* out, const mf_tensor* rstd, const mf_tensor* inp,
                             const mf_tensor* weight, float eps);
/* dinp +=, dweight +=; or dinp = with accumulate_dinp 0 (its old contents then never read: it may
 * be uninitialised).                                                                               */
mf_status mf_rmsnorm_backward(const mf_context* ctx, const mf_tensor* dinp, const mf_tensor* dweight,
                              const mf_tensor* dout, const mf_tensor* inp, const mf_tensor* weight,
                              const mf_tensor* rstd, int32_t accumulate_dinp);

/* --- per-head RMSNorm + rotary embedding of the query and key heads (Qwen3's q_norm / k_norm) -----
 * q [N, Hq, D], k [N, Hkv, D] (the projections) -> q_out, k_out (same shapes, written): each head
 * normalised, n = w ⊙ x / sqrt(mean(x²) + eps) (q_weight, k_weight [D]), then rotated by the tables
 * cos, sin [N, D] (transformers' position_embeddings, any rope type: y[i] = n[i]·cos[i] −
 * n[i+D/2]·sin[i], y[i+D/2] = n[i+D/2]·cos[i+D/2] + n[i]·sin[i+D/2], i < D/2), q_rstd [N, Hq] and
 * k_rstd [N, Hkv] f32 (written, for the backward). D even, at most 256 on a GPU. Activations,
 * weights and tables in the device's activation dtype.                                             */
mf_status mf_qknorm_rope_forward(const mf_context* ctx, const mf_tensor* q_out, const mf_tensor* k_out,
                                 const mf_tensor* q_rstd, const mf_tensor* k_rstd, const mf_tensor* q,
                                 const mf_tensor* k, const mf_tensor* q_weight, const mf_tensor* k_weight,
                                 const mf_tensor* cos, const mf_tensor* sin, float eps);
/* dq, dk (written) and dq_weight, dk_weight [D] (+=, f32, or bf16 too on a GPU) from the output
 * gradients dq_out, dk_out (only read), the forward's inputs q, k and its q_rstd, k_rstd. */
mf_status mf_qknorm_rope_backward(const mf_context* ctx, const mf_tensor* dq, const mf_tensor* dk,
                                  const mf_tensor* dq_weight, const mf_tensor* dk_weight, const mf_tensor* dq_out,
                                  const mf_tensor* dk_out, const mf_tensor* q, const mf_tensor* k,
                                  const mf_tensor* q_weight, const mf_tensor* k_weight, const mf_tensor* q_rstd,
                                  const mf_tensor* k_rstd, const mf_tensor* cos, const mf_tensor* sin);

/* --- fused LM head + cross-entropy --------------------------------------------------------------
 * losses [N] f32 = CE(h [N, C] · w [V, C]ᵀ, targets [N] i32) per row, the logits never stored
 * whole; a target of -100 is ignored (loss 0), any other must lie in [0, V). With grad_scale != 0 also dh [N, C] += and
 * dw [V, C] += the gradient of grad_scale · Σ losses (either optional), or = with accumulate 0 (their
 * old contents are then never read: they may be uninitialised). logits_dtype MF_BF16 rounds the
 * logits to bf16 before the softmax (a bf16 model's), else MF_F32. grad_scale_by (optional): one
 * f32 element on the op's device that multiplies grad_scale, read there (on a GPU by the kernel, so a
 * scale known only on the device, such as 1 / the count of targets, costs no host sync).           */
mf_status mf_lm_head_cross_entropy(const mf_context* ctx, const mf_tensor* losses, const mf_tensor* dh,
                                   const mf_tensor* dw, const mf_tensor* h, const mf_tensor* w,
                                   const mf_tensor* targets, float grad_scale, int32_t logits_dtype, int32_t accumulate,
                                   const mf_tensor* grad_scale_by);
/* The scratch mf_lm_head_cross_entropy takes for num_rows rows over vocab words on device_type (0 on
 * the CPU). A context whose workspace holds this many bytes is used for it: the caller then owns all
 * the op's memory (otherwise moeforge allocates it, once per context, and keeps it).               */
mf_status mf_lm_head_cross_entropy_workspace_bytes(int64_t num_rows, int64_t vocab, int32_t logits_dtype,
                                                   int32_t device_type, size_t* bytes);

/* --- scaling by a device scalar ------------------------------------------------------------------
 * x *= scale in place, scale a one-element f32 tensor on x's device read there (no host sync); x f32,
 * or bf16 on a GPU (the product in fp32, rounded to nearest). A scale of exactly 1 leaves x untouched
 * and unread (scaling gradients by a loss's incoming gradient, usually 1, then costs a launch).     */
mf_status mf_scale_by(const mf_context* ctx, const mf_tensor* x, const mf_tensor* scale);

/* --- AdamW --------------------------------------------------------------------------------------
 * torch.optim.AdamW on flat buffers, in place. CPU: param, m, v, grad f32, master NULL. CUDA: param,
 * m, v, grad bf16 and master NULL; or master, m, v f32 (grad f32 or bf16) and param bf16 receiving
 * the rounded master.                                                                             */
typedef struct mf_adamw_hyper {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;     /* 1-based */
    float grad_scale; /* every gradient is multiplied by it first (a clipping coefficient; 1: none) */
} mf_adamw_hyper;
mf_status mf_adamw_update(const mf_context* ctx, const mf_tensor* param, const mf_tensor* master, const mf_tensor* m,
                          const mf_tensor* v, const mf_tensor* grad, const mf_adamw_hyper* hyper);

/* --- the engine: `moeforge finetune`, step by step ----------------------------------------------
 * mf_engine_open reads a recipe (a YAML file's path, or YAML text when is_text is 1, whose relative
 * paths resolve from base_dir, "" or NULL: the current directory), applies the key=value overrides
 * as the CLI takes them, and sets the run up exactly as `moeforge finetune` does (the same code):
 * OUT checked and locked, model and data loaded, and with resume "auto" or a checkpoint directory
 * the run continued from it ("" or NULL: a fresh run; force_resume as --force-resume). Under a
 * multi-process launch (WORLD_SIZE etc. in the environment) every rank opens its own engine. The
 * engine prints what the CLI prints.                                                              */
typedef struct mf_engine mf_engine;
typedef struct mf_step_metrics {
    int64_t step; /* 1-based */
    double loss, ce_loss, aux_loss, grad_norm, lr;
    int64_t tokens; /* non-padding tokens of the step */
    double tokens_per_s, peak_mem_gib, step_seconds;
    int32_t skipped; /* the update was dropped (non-finite, train.on_nonfinite: skip) */
    double val_loss; /* the held-out loss when an evaluation ran after this step, else -1 */
} mf_step_metrics;
mf_status mf_engine_open(mf_engine** engine, const char* recipe, int is_text, const char* base_dir,
                         const char* const* overrides, int64_t num_overrides, const char* resume, int force_resume);
/* One optimizer step and what the CLI records after it (metrics.jsonl, log line, evaluation,
 * checkpoints when due). Refused after the last step. */
mf_status mf_engine_step(mf_engine* engine, mf_step_metrics* metrics);
/* Steps done, train.steps, and whether an interruption (SIGINT/SIGTERM) stopped the run (the
 * signal, else 0). */
mf_status mf_engine_progress(const mf_engine* engine, int64_t* steps_done, int64_t* total_steps,
                             int32_t* interrupted_by);
/* A resumable checkpoint under OUT/checkpoints of the steps done. */
mf_status mf_engine_save_checkpoint(mf_engine* engine);
/* The HF model directory written into OUT (every rank calls it). out_dir (optional) receives OUT,
 * NUL-terminated, truncated to out_dir_bytes. */
mf_status mf_engine_export(mf_engine* engine, char* out_dir, size_t out_dir_bytes);
/* The recipe as resolved, JSON (as OUT/recipe.json), into `json` (optional, NUL-terminated,
 * truncated); *json_bytes receives the size needed including the NUL. */
mf_status mf_engine_recipe_json(const mf_engine* engine, char* json, size_t json_bytes, size_t* needed);
/* Parameters by HF name ("model.layers.0.mlp.experts.gate_up_proj": the engine's stacked form): the
 * count, the i-th name (as above: copied, with the size needed), and a descriptor of the live
 * parameter or its gradient (a view into the engine's buffers: valid until mf_engine_free; on a
 * GPU run it is device memory). Under EP the expert tensors are this rank's shard. */
mf_status mf_engine_num_params(const mf_engine* engine, int64_t* count);
mf_status mf_engine_param_name(const mf_engine* engine, int64_t index, char* name, size_t name_bytes, size_t* needed);
mf_status mf_engine_param(const mf_engine* engine, const char* name, int gradient, mf_tensor* out);
void mf_engine_free(mf_engine* engine);

/* --- a Hugging Face model directory's weights (for bindings that load parameters themselves) ------
 * mf_weights_open maps model.safetensors, or the shards model.safetensors.index.json names, and
 * validates every header as the engine's loader does (the files are untrusted: lengths, offsets,
 * shapes and shard names checked; errors name the file and the tensor; MF_ERR_IO for a file that
 * cannot be read). Names are listed in sorted order; a tensor is read converted to f32.           */
typedef struct mf_weights mf_weights;
mf_status mf_weights_open(mf_weights** weights, const char* model_dir);
mf_status mf_weights_count(const mf_weights* weights, int64_t* count);
/* The index-th name (copied with its NUL, truncated to name_bytes; *needed: the size it needs). */
mf_status mf_weights_name(const mf_weights* weights, int64_t index, char* name, size_t name_bytes, size_t* needed);
/* A tensor's stored dtype as the format spells it ("BF16", "F32", ...; into dtype, dtype_bytes >= 8)
 * and its shape (*ndim dimensions into shape[MF_MAX_DIMS]). */
mf_status mf_weights_info(const mf_weights* weights, const char* name, char* dtype, size_t dtype_bytes, int32_t* ndim,
                          int64_t* shape);
/* The tensor into out, a CPU f32 tensor of its shape, converted from F32, BF16, F16 or F64. */
mf_status mf_weights_read_f32(const mf_weights* weights, const char* name, const mf_tensor* out);
void mf_weights_free(mf_weights* weights);

#ifdef __cplusplus
}
#endif

#endif /* MOEFORGE_MOEFORGE_H_ */
