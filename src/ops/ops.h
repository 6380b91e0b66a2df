// The backend-neutral op API the model is written against.
//
// Every op takes Tensor views, checks shapes, dtypes and that all tensors live on one device,
// then runs the CPU reference kernel (f32 activations) or the CUDA kernel (bf16 activations,
// fp32 accumulation; fp32 for router, softmax and loss math). Accumulation semantics follow the
// kernels: forward outputs are written; backward outputs marked "+=" accumulate, so callers zero
// an activation gradient once and several consumers add into it. Parameter gradients may be f32
// or bf16 on the GPU (the precision policy), f32 on the CPU.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/tensor.h"

namespace mf::ops {

// --- memory ----------------------------------------------------------------------------------------
void zero(const Tensor& t);
void copy(const Tensor& dst, const Tensor& src);          // same dtype, same device
void copy_from_host(const Tensor& dst, const void* src);  // dst.nbytes() bytes
void copy_to_host(void* dst, const Tensor& src);
// x = mean + std · N(0, 1), reproducible from (seed, index) on either device (fast model init for
// benchmarks; HF-style init from a Mersenne twister lives in the model).
void fill_normal(const Tensor& x, uint64_t seed, float mean, float std);
void add(const Tensor& out, const Tensor& a, const Tensor& b);  // out = a + b (out may alias a)
void cast(const Tensor& dst, const Tensor& src);                // f32 <-> bf16, any device
void synchronize(Device device);  // waits for all device work: the op stream and the background stream

// --- dense -----------------------------------------------------------------------------------------
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight);  // out[N,OC] = inp[N,C]·wᵀ
// dinp[N,C] += dout·w (written instead when !accumulate_dinp; dinp may be undefined to skip);
// dweight[OC,C] += doutᵀ·inp (may be undefined).
void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp = true);

// out[N, C] += bias[C], in place (out: activations, bias: a parameter; N = out.numel() / C).
void add_bias(const Tensor& out, const Tensor& bias);
// dbias[C] += Σ_n dout[n, c] (dout [N, C]); the column sums in fp32 in a fixed order, then added once.
void bias_backward(const Tensor& dbias, const Tensor& dout);

void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte);
void embedding_backward(const Tensor& dwte, const Tensor& dout, const Tensor& ids);  // dwte +=
// The scratch embedding_backward takes for N tokens over V words on `device` (0 on the CPU).
size_t embedding_backward_scratch_bytes(int64_t N, int64_t V, Device device);

void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
// dinp += (or =, never read, when !accumulate_dinp), dweight +=; either may be undefined to skip.
void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd, bool accumulate_dinp = true);

// q[B,T,Hq·D], k/v[B,T,Hkv·D] (token-major), doc_ids[B·T]; out[B,T,Hq·D], lse[B,Hq,T] (f32).
// Per-head RMSNorm (weight [D]) then RoPE, on q_raw[N, Hq·D] and k_raw[N, Hkv·D] -> q, k and the
// f32 statistics q_rstd[N·Hq], k_rstd[N·Hkv].
void qknorm_rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                         const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                         const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float eps, float theta);
// dq_raw, dk_raw: written (distinct from dq and dk); dq_weight, dk_weight +=. dq and dk (the
// gradients at q and k) are used as scratch.
void qknorm_rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight, const Tensor& dk_weight,
                          const Tensor& dq, const Tensor& dk, const Tensor& q_raw, const Tensor& k_raw,
                          const Tensor& q_weight, const Tensor& k_weight, const Tensor& q_rstd, const Tensor& k_rstd,
                          const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float theta);

// qknorm_rope_forward / backward with the rotation of tables cos, sin [N, D] (transformers'
// position_embeddings, any rope type; f32 on the CPU, bf16 on CUDA; kernels/cpu/rope.h's table
// rotation) instead of positions. The backward only reads dq and dk (dq_raw, dk_raw: written;
// dq_weight, dk_weight +=).
void qknorm_rope_table_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                               const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                               const Tensor& cos, const Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                               float eps);
void qknorm_rope_table_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight,
                                const Tensor& dk_weight, const Tensor& dq, const Tensor& dk, const Tensor& q_raw,
                                const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                                const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& cos, const Tensor& sin,
                                int64_t num_heads, int64_t num_kv_heads);

// RoPE alone (no norm), HF rotate_half layout with partial rotary: of each head of head_dim D only
// the first rotary_dim R dims (even, <= D) rotate, pair (i, i + R/2) at angle pos · θ^(-2i/R) (fp32,
// as HF computes inv_freq), and dims [R, D) pass through (R = D: the whole head). q_raw[N, Hq·D],
// k_raw[N, Hkv·D] -> q, k (written; may alias q_raw, k_raw: in place); positions[N] i32.
void rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_raw, const Tensor& k_raw, const Tensor& positions,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, float theta);
// The transposed rotation: dq_raw, dk_raw (written; may alias dq, dk) from the gradients dq, dk at
// q and k; the pass-through dims are copied.
void rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq, const Tensor& dk,
                   const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t rotary_dim, float theta);

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& doc_ids, int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& doc_ids,
                        int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads);  // dq, dk, dv: written

void swiglu_forward(const Tensor& out, const Tensor& inp);                        // inp[N, 2I] -> out[N, I]
void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp);  // dinp written
// Squared ReLU (Nemotron-H's non-gated experts and MLPs): out = max(inp, 0)², any shape, out may
// alias inp; dinp = dout · 2 · max(inp, 0) (written; may alias dout). Same numel; f32 on the CPU, bf16
// on the GPU (fp32 math, one rounding).
void relu2_forward(const Tensor& out, const Tensor& inp);
void relu2_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp);
// gpt-oss's expert activation (transformers GptOssExperts; spec: kernels/cpu/clamped_swiglu.h): inp [N, 2I]
// holds gate and up interleaved by column (gate_i at 2i, up_i at 2i + 1); g = min(gate, limit),
// u = clamp(up, −limit, limit), out [N, I] = (u + 1) · g · σ(alpha · g). f32 on the CPU, bf16 on the GPU.
void clamped_swiglu_forward(const Tensor& out, const Tensor& inp, float alpha = 1.702f, float limit = 7.0f);
// dinp [N, 2I] written (interleaved like inp; may alias inp); each clamp passes the gradient where its
// input lies within it, as torch's clamp does.
void clamped_swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp, float alpha = 1.702f,
                             float limit = 7.0f);

// A row gated by the sigmoid of one logit (Qwen2-MoE's shared_expert_gate): y[N, H] += s · value[N, H]
// with s = σ(gate_logits[n]) in fp32; gate_logits [N] or [N, 1] in the activation dtype (the output
// of matmul_forward with a [1, H] weight).
void sigmoid_gate_forward(const Tensor& y, const Tensor& value, const Tensor& gate_logits);
// dvalue[N, H] = s · dy (written; may alias dy); dgate_logits[N] = s · (1 − s) · Σ_h dy · value
// (written, activation dtype; the row sum in fp32 in a fixed order).
void sigmoid_gate_backward(const Tensor& dvalue, const Tensor& dgate_logits, const Tensor& dy, const Tensor& value,
                           const Tensor& gate_logits);

// --- MoE -------------------------------------------------------------------------------------------
// logits[N,E] (f32) -> probs[N,E] f32, topk_idx[N,K] i32, topk_weight[N,K] f32.
void router_forward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_weight, const Tensor& logits,
                    bool norm_topk_prob);
// dlogits[N,E] f32 written; dprobs may be undefined.
void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_idx, bool norm_topk_prob);
// The sigmoid router (DeepSeek-V3, Nemotron-H; spec: kernels/cpu/router_sigmoid.h): scores = σ(logits)
// [N,E] f32 (written, kept for backward); the K experts of the largest scores + correction_bias
// within the topk_group best of n_group groups (group score: the sum of its two largest), in
// descending order, ties to the lower index -> topk_idx [N,K] i32; topk_weight [N,K] f32 = the chosen
// scores (without the bias), / (their sum + 1e-20) when norm_topk_prob, × routed_scaling_factor.
// logits [N,E] f32; correction_bias [E] f32 (bf16 too on the GPU) or undefined (zeros); it only
// chooses. masked_score: what an expert of a dropped group competes with: −inf (HF Nemotron-H: never
// chosen) or 0 (HF DeepSeek-V3's masked_fill value). Refused: n_group not dividing E, topk_group
// outside [1, n_group], groups of one expert (n_group > 1), K > topk_group · E / n_group; on the GPU
// also E > 1024, K > 32, and n_group > 32 when topk_group < n_group.
void router_sigmoid_forward(const Tensor& scores, const Tensor& topk_idx, const Tensor& topk_weight,
                            const Tensor& logits, const Tensor& correction_bias, int64_t n_group, int64_t topk_group,
                            bool norm_topk_prob, float routed_scaling_factor, float masked_score);
// dlogits [N,E] f32 (written): the gradient of topk_weight through the scaling, renormalisation and σ,
// the indices fixed (zero for experts not chosen). dtopk_weight [N,K] f32; scores, topk_idx: the forward's.
void router_sigmoid_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& scores,
                             const Tensor& topk_idx, bool norm_topk_prob, float routed_scaling_factor);
// Aux-loss statistics, accumulated over layers: counts[E] += Σ_t mask_t·#{k: idx=e}, prob_sums[E] += Σ_t mask_t·p_te
// (an index outside [0, E) counts nothing).
void moe_aux_stats(const Tensor& counts, const Tensor& prob_sums, const Tensor& topk_idx, const Tensor& probs,
                   const Tensor& mask);
// dprobs[t, e] = scale · counts[e] · mask[t]  (written; f32).
void moe_aux_dprobs(const Tensor& dprobs, const Tensor& counts, const Tensor& mask, float scale);

void moe_permute_indices(const Tensor& expert_offsets, const Tensor& sorted_pair, const Tensor& pair_row,
                         const Tensor& topk_idx, int64_t num_experts);
// The scratch moe_permute_indices and moe_aux_stats take on `device` for N rows of K choices among
// num_experts (0 on the CPU): the context's workspace serves it when it holds this many bytes.
size_t moe_permute_indices_scratch_bytes(int64_t N, int64_t K, int64_t num_experts, Device device);
size_t moe_aux_stats_scratch_bytes(int64_t N, int64_t num_experts, Device device);
void moe_gather_forward(const Tensor& x_perm, const Tensor& x, const Tensor& sorted_pair, int64_t top_k);
void moe_gather_backward(const Tensor& dx, const Tensor& dx_perm, const Tensor& pair_row, int64_t top_k);  // dx +=
// Ragged groups given by their sizes (a framework's group_sizes, as jax.lax.ragged_dot's):
// offsets [E + 1] i32 (written) from group_sizes [E] i32, a negative size counting as 0 and every
// offset clamped to num_rows (on the device, no host sync); and the rows [offsets[E], rows) of x
// set to zero (the rows no group covers).
void group_offsets(const Tensor& offsets, const Tensor& group_sizes, int64_t num_rows);
void zero_rows_past_groups(const Tensor& x, const Tensor& offsets);
void moe_unpermute_forward(const Tensor& out, const Tensor& y_perm, const Tensor& topk_weight, const Tensor& pair_row);
void moe_unpermute_backward(const Tensor& dy_perm, const Tensor& dtopk_weight, const Tensor& dout, const Tensor& y_perm,
                            const Tensor& topk_weight, const Tensor& pair_row);

// --- expert-parallel token exchange (model/ep_exchange.h) -----------------------------------------
// Under EP a token travels once to every *destination* that owns at least one of its top-k experts
// (a destination is one chunk of one EP rank's experts; V of them; expert_dest[E] i32 maps each
// expert to its destination). The owner expands the token into the expert-major rows of its
// experts and, on the way back, sums its slots' outputs per token, so the source adds one row per
// destination instead of one per (token, expert) pair.
//   send_pos[V, N] i32: the token's position among the tokens bound for v (token order), or -1 when
//                       none of its slots goes to v;  counts[V] i32: tokens bound for each v.
//   A *block buffer* holds destination v's tokens at rows [Σ_{v' < v} counts[v'], + counts[v]), in
//   send-position order (the layout of the send buffer, and of what comes back to the source).
//   meta[M, 2K] i32, one row per sent token: columns [0, K) the destination's local row of slot k
//   (-1 when expert topk_idx[t, k] is not the destination's), columns [K, 2K) the slot's routing
//   weight (f32 bits; 0 for slots that are not the destination's).
// Local rows outside [0, rows of the local tensor) are skipped, never accessed; so are expert ids
// outside [0, E), destinations outside [0, V), send positions outside [0, counts[v]) and block rows
// past the end of a buffer (values the host cannot check without a sync: the kernels range-check
// them; a skipped term adds nothing). All sums are fp32 in a fixed order (k ascending, v ascending);
// no atomics. Row tensors: f32 on the CPU, bf16 on the GPU; meta, send_pos, counts, topk_idx,
// expert_dest, pair_row, expert_offsets, row_base i32. 1 <= K <= 32. Owner-side ops: meta and the
// received rows have the same M rows (slice both to what arrived).
void ep_token_positions(const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                        const Tensor& expert_dest);
// rows[Σ counts, H] (written): block v's row send_pos[v, t] = src[t] (src [N, H]).
void ep_pack_rows(const Tensor& rows, const Tensor& src, const Tensor& send_pos, const Tensor& counts);
// meta[Σ counts, 2K] (written), the same rows: slot k of token t with expert e = topk_idx[t, k] in
// v's block row holds row_base[e] + pair_row[t·K + k] − expert_offsets[e] and topk_weight[t, k] when
// expert_dest[e] == v, else -1 and 0. row_base[E]: where the destination puts this rank's rows of e.
// expert_offsets[E + 1], pair_row[N·K]: moe_permute_indices' over the same topk_idx; a pair_row
// outside [expert_offsets[e], expert_offsets[e + 1]) also gives -1 and 0.
void ep_pack_meta(const Tensor& meta, const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                  const Tensor& topk_weight, const Tensor& pair_row, const Tensor& expert_offsets,
                  const Tensor& row_base, const Tensor& expert_dest);
// Owner side, forward: local[d] = rows[i] for every slot k of received row i with d = meta[i, k].
// Local rows no slot names are untouched; a local row named twice gets one of the rows.
void ep_scatter_rows(const Tensor& local, const Tensor& rows, const Tensor& meta);
// Owner side, backward: dlocal[d] = w[i, k] · drows[i]  and  dweight[i, k] (f32 [M, K], written) =
// <drows[i], y_local[d]> (0 for slots without a row). Local rows no slot names are untouched.
void ep_scatter_grad(const Tensor& dlocal, const Tensor& dweight, const Tensor& drows, const Tensor& meta,
                     const Tensor& y_local);
// Owner side, the way back: out[i] (written, [M, H]) = Σ_k (weighted ? w[i, k] : 1) · local[meta[i, k]];
// out may also be f32 on the GPU (partial sums sent back unrounded).
void ep_reduce_rows(const Tensor& out, const Tensor& local, const Tensor& meta, bool weighted);
// Source side: out[t] = Σ_v rows[block v, send_pos[v, t]] over v ascending with send_pos >= 0 (rows
// may also be f32 on the GPU)
// (written, 0 for a token bound nowhere; with accumulate out[t] = old + Σ, the sum taken first).
void ep_sum_blocks(const Tensor& out, const Tensor& rows, const Tensor& send_pos, const Tensor& counts,
                   bool accumulate);
// dtopk_weight[N, K] (f32, written): slot k of token t = dweight_rows[block v, send_pos[v, t]][k] with
// v = expert_dest[topk_idx[t, k]] (dweight_rows f32 [Σ counts, K]); 0 for a slot that was not sent.
void ep_gather_slots(const Tensor& dtopk_weight, const Tensor& dweight_rows, const Tensor& send_pos,
                     const Tensor& counts, const Tensor& topk_idx, const Tensor& expert_dest);

// out[M, OC] = inp[M, C]·W[e]ᵀ per expert row group; weight[E, OC, C]; offsets[E+1] on the device.
// host_offsets (optional): the same E + 1 values already on the host. The GPU's cuBLAS path needs
// them on the host and otherwise reads them back (one stream sync per call); on the CPU they are
// checked against `offsets`.
void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets,
                            std::span<const int32_t> host_offsets = {});
// dweight +=; dinp += (or, with accumulate_dinp false, written: the rows of the groups get the
// product, so the caller need not zero them first); either may be undefined. With accumulate_dweight
// false every dweight[e] is written (an empty group's with zeros): the values of zeroing dweight and
// accumulating, without either pass.
void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, std::span<const int32_t> host_offsets = {},
                             bool accumulate_dinp = true, bool accumulate_dweight = true);
// The weight gradient alone, of groups whose rows lie in one or two row tables: group e's rows are
// [offsets[p][e], offsets[p][e + 1]) of every table p, summed in table order (host_offsets: empty,
// or one host copy per table, as above); written like grouped_matmul_backward's unless accumulate.
// With square_sum (one f64 on dweight's device): square_sum += Σ dweight² of the gradient as
// stored, in a fixed order (the clipping norm's share of it; the GPU's own kernel forms it while
// storing, without reading the gradient again).
void grouped_matmul_backward_weight(const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                    std::span<const Tensor> offsets,
                                    std::span<const std::span<const int32_t>> host_offsets, bool accumulate,
                                    const Tensor& square_sum = Tensor());
// The SwiGLU expert MLP's first product with its activation: h[M, 2I] = inp · weight[e]ᵀ (weight
// [E, 2I, C], gate rows then up rows) and a[M, I] = swiglu(h), for the rows of the groups. The values
// of grouped_matmul_forward then swiglu_forward (bitwise), in one pass where the GPU's sm90 epilogue
// serves (h and a written for the groups' rows only; a's other rows are unspecified).
void grouped_matmul_swiglu_forward(const Tensor& h, const Tensor& a, const Tensor& inp, const Tensor& weight,
                                   const Tensor& offsets, std::span<const int32_t> host_offsets = {});
// Its backward through the second product: da = dout · weight[e] (weight [E, OC, I], written as
// grouped_matmul_backward's dinp) and dh[M, 2I] = swiglu_backward(da, h) for the groups' rows
// (bitwise those two ops); da [M, I] is scratch, left unwritten by the GPU's one-pass path, so its
// contents afterwards (and dh's rows outside the groups) are unspecified.
void grouped_matmul_swiglu_backward(const Tensor& dh, const Tensor& da, const Tensor& dout, const Tensor& weight,
                                    const Tensor& h, const Tensor& offsets, std::span<const int32_t> host_offsets = {});
// Whether callers on `device` should pass host offsets to the grouped products of a weight [E, OC, C]
// (its forward, written input gradient and weight gradient): the GPU's cuBLAS path needs them
// (reading the offsets once and passing them to every call saves a sync per call), the sm90 kernels
// read the offsets on the device (then false: no host copy, no sync); on the CPU they cost nothing
// and are checked.
bool grouped_matmul_uses_host_offsets(Device device, int64_t E, int64_t C, int64_t OC);
// SMs the grouped matmuls leave free, from now on, for kernels on other streams: the GPU's own
// grouped GEMMs are persistent (one block per SM, each holding a whole SM), so a kernel queued on
// another stream, such as the EP exchange's copies, could not start until they end. 0 (the
// default) gives them every SM. No effect on the CPU.
void set_grouped_matmul_reserved_sms(Device device, int sms);

// --- Mamba-2 ---------------------------------------------------------------------------------------
// One Mamba-2 mixer (HF nemotron_h NemotronHMamba2Mixer, torch_forward) between in_proj and out_proj:
// in_proj's rows give z [N, I], xBC [N, I + 2·G·S] and dt [N, H]; xbc = conv1d_silu(xBC); y = the scan;
// out_proj takes gated_rmsnorm(y, z). I = H·P; head h reads B/C group h / (H/G). Tokens are token-major,
// N = B·T (B rows of T). doc_ids [N] i32, or undefined (every row one document): the conv window and the
// scan state reset at every segment start, a segment being a run of consecutive tokens of one row with
// one document id (kernels/cpu/doc_segments.h): nothing crosses a row or a document, exactly. Activations:
// f32 on the CPU, bf16 on the GPU; parameters and their gradients f32, or f32 or bf16 on the GPU.
// One Mamba-2 layer's scan geometry.
struct SsdDims {
    int64_t T = 0;           // tokens per row (N = B·T)
    int64_t num_heads = 0;   // H
    int64_t head_dim = 0;    // P
    int64_t num_groups = 0;  // G (H % G == 0)
    int64_t state_size = 0;  // S
    int64_t chunk_size = 0;  // the SSD chunk (>= 1; the GPU path's; the CPU reference ignores it)
    float dt_min = 0.0f;     // the clamp after softplus (HF's torch path: time_step_min, inf)
    float dt_max = INFINITY;
};
// out[N, C] = silu(bias[c] + Σ_{j<K} weight[c, j] · inp[n − (K−1) + j, c]), taps outside the token's row or
// document are 0. weight [C, K] or HF's conv1d.weight [C, 1, K] (same bytes), bias [C] (undefined = none).
void conv1d_silu_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& bias,
                         const Tensor& doc_ids, int64_t T);
// dinp written; dweight +=, dbias += (dbias undefined when bias is). The pre-activation is recomputed.
void conv1d_silu_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dbias, const Tensor& dout,
                          const Tensor& inp, const Tensor& weight, const Tensor& bias, const Tensor& doc_ids,
                          int64_t T);

// Elements of the chunk-state tensor the forward saves for the backward: B · ceil(T/chunk) · H · P · S (f32).
int64_t ssd_chunk_states_numel(int64_t N, const SsdDims& d);
// y[N, H·P] = the scan over xbc[N, I + 2·G·S] (x | B | C, as the conv writes it), dt[N, H] (raw: before
// dt_bias, softplus and the clamp), dt_bias[H], A_log[H], D[H]:
//   δ = clamp(softplus(dt + dt_bias), dt_min, dt_max),  A = −exp(A_log),
//   state_n[P, S] = exp(δ_n·A)·state_{n−1} + δ_n·x_n⊗B_n (0 before a segment),  y_n = C_n·state_n + D·x_n.
// states: f32, ssd_chunk_states_numel elements (the state entering each chunk; written on the GPU, unused
// by the CPU reference, which must still be given it).
void ssd_scan_forward(const Tensor& y, const Tensor& states, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                      const Tensor& A_log, const Tensor& D, const Tensor& doc_ids, const SsdDims& d);
// dxbc [N, I+2GS] written; ddt [N, H] written (the gradient at the raw dt: through softplus and the clamp,
// zero where clamped); ddt_bias, dA_log, dD +=. states: as the forward wrote it.
void ssd_scan_backward(const Tensor& dxbc, const Tensor& ddt, const Tensor& ddt_bias, const Tensor& dA_log,
                       const Tensor& dD, const Tensor& dy, const Tensor& xbc, const Tensor& dt, const Tensor& dt_bias,
                       const Tensor& A_log, const Tensor& D, const Tensor& states, const Tensor& doc_ids,
                       const SsdDims& d);

// Gated RMSNorm (HF Zamba2RMSNormGated, norm_before_gate=False): g = x · silu(z) (fp32); per group of
// group_size consecutive channels rstd = 1/sqrt(mean(g²) + eps); out = weight · (g · rstd). x, z, out
// [N, I]; weight [I]; rstd [N · I/group_size] f32 (written).
void gated_rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& x, const Tensor& z,
                           const Tensor& weight, int64_t group_size, float eps);
// dx, dz written; dweight +=.
void gated_rmsnorm_backward(const Tensor& dx, const Tensor& dz, const Tensor& dweight, const Tensor& dout,
                            const Tensor& x, const Tensor& z, const Tensor& weight, const Tensor& rstd,
                            int64_t group_size);

// --- loss ------------------------------------------------------------------------------------------
// losses[N] f32 written; with grad_scale != 0 also dh[N,C] += and dw[V,C] += (dh/dw undefined to skip),
// or dh = and dw = when !accumulate (their old contents are then never read: they may be uninitialised).
// logits_dtype: f32, or bf16 to round the logits to bf16 before the softmax (a bf16 model's
// logits; on the GPU half the logits traffic and twice the tokens per chunk).
// grad_scale_by (optional): one f32 element on the op's device multiplying grad_scale, read where it
// lies (on a GPU by the kernel: a scale such as 1 / count known only on the device, without a sync).
void lm_head_cross_entropy(const Tensor& losses, const Tensor& dh, const Tensor& dw, const Tensor& h, const Tensor& w,
                           const Tensor& targets, float grad_scale, DType logits_dtype = DType::f32,
                           bool accumulate = true, const Tensor& grad_scale_by = Tensor());
// The scratch lm_head_cross_entropy takes for N rows over V words on `device` (0 on the CPU): a caller
// that hands it this much as the scope's workspace (ExecContext::workspace) owns all its memory.
size_t lm_head_cross_entropy_scratch_bytes(int64_t N, int64_t V, DType logits_dtype, Device device);

// --- optimizer -------------------------------------------------------------------------------------
struct AdamWHyper {
    float lr, beta1, beta2, eps, weight_decay;
    int64_t step;             // 1-based
    float grad_scale = 1.0f;  // every gradient is multiplied by it first (the clipping coefficient)
};
// torch.optim.AdamW on one parameter group. CPU: param, m, v, grad f32. CUDA, policy bf16: param,
// m, v, grad bf16 (master undefined). CUDA, policy mixed: master, m, v f32, grad f32 or bf16,
// and param (bf16) receives the rounded master.
void adamw_update(const Tensor& param, const Tensor& master, const Tensor& m, const Tensor& v, const Tensor& grad,
                  const AdamWHyper& h);

// --- reductions ------------------------------------------------------------------------------------
double sum(const Tensor& x);          // Σ x (f32 tensors), in a fixed order
double sum_squares(const Tensor& x);  // Σ x², in a fixed order
// sums[slot] = Σ x² (sums: f64 on x's device), the same value sum_squares(x) returns, left on the
// device (no host sync; may be issued inside ops::background).
void sum_squares_to(const Tensor& sums, int64_t slot, const Tensor& x);
// The same for many tensors of one dtype, sums[slots[i]] = Σ xs[i]², in a couple of launches on the
// GPU however many there are (the per-tensor passes of a gradient norm are mostly tiny tensors).
void sum_squares_to(const Tensor& sums, std::span<const int64_t> slots, std::span<const Tensor> xs);
bool all_finite(const Tensor& x);
// x *= scale[0] in place (x f32, or bf16 on the GPU: the product in fp32, rounded; scale: one f32 on
// x's device, read there, no host sync). A scale of exactly 1 leaves x untouched and unread: scaling
// by a loss's incoming gradient, which is usually 1, then costs a launch.
void scale_by(const Tensor& x, const Tensor& scale);

// --- execution context -----------------------------------------------------------------------------
// Where CUDA ops run: a device, a stream and scratch. Every op runs on its calling thread's current
// context. Without a scope that is the engine's own stream on the thread's current device (one per
// device for the process, created on first use; a blocking stream, so work on the legacy default
// stream, such as the communicators' NCCL calls and cudaMemset, stays ordered with it both ways).
// A binding runs ops on a stream its framework owns by opening an ExecScope: every op the thread
// issues until the scope ends goes to `stream` on `device`, with scratch of its own (`workspace`
// when given and large enough, else a buffer kept per (device, stream)) and a background stream of
// its own (ops::background). Scopes nest; the one before is restored when a scope ends, the current
// device included. A stream's scratch is reused op after op, which is safe because its ops are
// ordered on it: two threads must not issue on one stream at once. On the CPU a scope changes
// nothing; a CUDA scope in a build without CUDA is refused.
struct ExecContext {
    int device = -1;             // CUDA device ordinal; -1: the calling thread's current device
    void* stream = nullptr;      // a cudaStream_t; nullptr: the engine's stream on that device
    void* workspace = nullptr;   // optional caller-owned device scratch, 256-byte aligned, kept alive
    size_t workspace_bytes = 0;  // until the stream has run the scope's ops
};
// What a scope restores (cuda_ops.cu's view of it is private).
struct ExecSaved {
    bool entered = false;
    void* context = nullptr;  // the thread's context before (nullptr: none, the engine's stream)
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    int device = -1;
};
class ExecScope {
 public:
    explicit ExecScope(const ExecContext& context);
    ~ExecScope();
    ExecScope(const ExecScope&) = delete;
    ExecScope& operator=(const ExecScope&) = delete;

 private:
    ExecSaved saved_;
};
// The cudaStream_t that CUDA ops issued now on this thread go to (nullptr on the CPU, or in a build
// without CUDA).
void* current_stream(Device device);

// --- background stream -----------------------------------------------------------------------------
// For memory-bound passes (zeroing, norms) that may run beside the op stream's compute.
// background(device, f) calls f with every op it issues enqueued on a second stream, behind all that
// the op stream holds at the call, and returns a ticket; wait_background(device, t) puts all that the
// op stream gets afterwards behind that work (and every earlier background work). Ops issued inside
// f get scratch of their own, so they may run while the op stream's run; ops that read results back
// to the host, and nested background calls, must not be issued there. On the CPU f runs at once and
// tickets are 0; so it does on the GPU with MOEFORGE_BACKGROUND=0 in the environment (everything on the
// op stream, in issue order: for measurements and for ruling the second stream out).
using BackgroundTicket = int64_t;
BackgroundTicket background(Device device, const std::function<void()>& f);
void wait_background(Device device, BackgroundTicket ticket);

// --- profiling -------------------------------------------------------------------------------------
// When enabled, every op synchronises the device before and after itself and adds its wall time
// to a per-op total: a coarse breakdown of a step (it serialises the GPU; never on in training).
void set_profiling(bool enabled);
struct OpTime {
    std::string name;
    double seconds;
    int64_t calls;
};
std::vector<OpTime> profile_report();  // sorted by time, descending
void reset_profile();

// Phase clock: where a step's time goes without serialising it. Between phase_start and phase_stop,
// phase_mark(name) records a point on the device stream (a CUDA event; on the CPU the host clock)
// and the host time at which it was enqueued. Per mark, phase_report gives the mean over spans of
// when the device reached it (gpu_ms) and when the host enqueued it (host_ms), both from the span's
// start: where gpu_ms runs close behind host_ms the device waited for the host's issue; the gap
// between consecutive gpu_ms is that phase's share of the step. Marks are cheap no-ops when off.
void phase_start(Device device);  // synchronises, then starts a span (the clock is on until phase_stop)
bool phase_clock_on();
void phase_mark(std::string_view name);
void phase_stop();  // synchronises and adds the span's marks to the report
struct PhaseTime {
    std::string name;
    double gpu_ms, host_ms;  // means over the spans that recorded the mark
    int64_t count;
};
std::vector<PhaseTime> phase_report();  // in the order the marks were first seen

}  // namespace mf::ops
