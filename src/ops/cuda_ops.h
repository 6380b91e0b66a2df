// The CUDA side of ops.h: the same entries (already checked by ops.cpp), implemented in
// cuda_ops.cu over the kernels in kernels/cuda, or refusing in cuda_ops_none.cpp when moeforge is
// built without CUDA. Only ops.cpp calls these.
#pragma once

#include <span>
#include <vector>

#include "core/tensor.h"

namespace mf::ops::cuda_impl {

void zero(const Tensor& t);
void copy(const Tensor& dst, const Tensor& src);
void copy_from_host(const Tensor& dst, const void* src);
void copy_to_host(void* dst, const Tensor& src);
void fill_normal(const Tensor& x, uint64_t seed, float mean, float std);
void add(const Tensor& out, const Tensor& a, const Tensor& b);
void cast(const Tensor& dst, const Tensor& src);
void synchronize();
void sum_squares_to(const Tensor& sums, std::span<const int64_t> slots, std::span<const Tensor> xs);
// Phase clock events (ops::phase_mark): record event `index` on the op stream; read events 1..count-1
// as ms after event 0 (synchronises).
void record_mark(int index);
// ops::background: switch the op stream to the background stream (behind the op stream's work so
// far) and back, returning the ticket; abandon switches back after an exception.
void background_begin();
int64_t background_end();
void background_abandon();
void wait_background(int64_t ticket);
std::vector<double> mark_times_ms(int count);
void matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight);
void matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                     const Tensor& weight, bool accumulate_dinp);
void add_bias(const Tensor& out, const Tensor& bias);
void bias_backward(const Tensor& dbias, const Tensor& dout);
void embedding_forward(const Tensor& out, const Tensor& ids, const Tensor& wte);
void embedding_backward(const Tensor& dwte, const Tensor& dout, const Tensor& ids);
void rmsnorm_forward(const Tensor& out, const Tensor& rstd, const Tensor& inp, const Tensor& weight, float eps);
void rmsnorm_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                      const Tensor& weight, const Tensor& rstd);
void qknorm_rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                         const Tensor& q_raw, const Tensor& k_raw, const Tensor& q_weight, const Tensor& k_weight,
                         const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float eps, float theta);
void qknorm_rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq_weight, const Tensor& dk_weight,
                          const Tensor& dq, const Tensor& dk, const Tensor& q_raw, const Tensor& k_raw,
                          const Tensor& q_weight, const Tensor& k_weight, const Tensor& q_rstd, const Tensor& k_rstd,
                          const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, float theta);
void rope_forward(const Tensor& q, const Tensor& k, const Tensor& q_raw, const Tensor& k_raw, const Tensor& positions,
                  int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, float theta);
void rope_backward(const Tensor& dq_raw, const Tensor& dk_raw, const Tensor& dq, const Tensor& dk,
                   const Tensor& positions, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                   int64_t rotary_dim, float theta);

void attention_forward(const Tensor& out, const Tensor& lse, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& doc_ids, int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads);
void attention_backward(const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& doc_ids,
                        int64_t B, int64_t T, int64_t num_heads, int64_t num_kv_heads);
void swiglu_forward(const Tensor& out, const Tensor& inp);
void swiglu_backward(const Tensor& dinp, const Tensor& dout, const Tensor& inp);
void sigmoid_gate_forward(const Tensor& y, const Tensor& value, const Tensor& gate_logits);
void sigmoid_gate_backward(const Tensor& dvalue, const Tensor& dgate_logits, const Tensor& dy, const Tensor& value,
                           const Tensor& gate_logits);
void router_forward(const Tensor& probs, const Tensor& topk_idx, const Tensor& topk_weight, const Tensor& logits,
                    bool norm_topk_prob);
void router_backward(const Tensor& dlogits, const Tensor& dtopk_weight, const Tensor& dprobs, const Tensor& probs,
                     const Tensor& topk_idx, bool norm_topk_prob);
void moe_aux_stats(const Tensor& counts, const Tensor& prob_sums, const Tensor& topk_idx, const Tensor& probs,
                   const Tensor& mask);
void moe_aux_dprobs(const Tensor& dprobs, const Tensor& counts, const Tensor& mask, float scale);
void moe_permute_indices(const Tensor& expert_offsets, const Tensor& sorted_pair, const Tensor& pair_row,
                         const Tensor& topk_idx, int64_t num_experts);
void moe_gather_forward(const Tensor& x_perm, const Tensor& x, const Tensor& sorted_pair, int64_t top_k);
void moe_gather_backward(const Tensor& dx, const Tensor& dx_perm, const Tensor& pair_row, int64_t top_k);
void moe_unpermute_forward(const Tensor& out, const Tensor& y_perm, const Tensor& topk_weight, const Tensor& pair_row);
void moe_unpermute_backward(const Tensor& dy_perm, const Tensor& dtopk_weight, const Tensor& dout,
                            const Tensor& y_perm, const Tensor& topk_weight, const Tensor& pair_row);
void ep_token_positions(const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                        const Tensor& expert_dest);
void ep_pack_rows(const Tensor& rows, const Tensor& src, const Tensor& send_pos, const Tensor& counts);
void ep_pack_meta(const Tensor& meta, const Tensor& send_pos, const Tensor& counts, const Tensor& topk_idx,
                  const Tensor& topk_weight, const Tensor& pair_row, const Tensor& expert_offsets,
                  const Tensor& row_base, const Tensor& expert_dest);
void ep_scatter_rows(const Tensor& local, const Tensor& rows, const Tensor& meta);
void ep_scatter_grad(const Tensor& dlocal, const Tensor& dweight, const Tensor& drows, const Tensor& meta,
                     const Tensor& y_local);
void ep_reduce_rows(const Tensor& out, const Tensor& local, const Tensor& meta, bool weighted);
void ep_sum_blocks(const Tensor& out, const Tensor& rows, const Tensor& send_pos, const Tensor& counts,
                   bool accumulate);
void ep_gather_slots(const Tensor& dtopk_weight, const Tensor& dweight_rows, const Tensor& send_pos,
                     const Tensor& counts, const Tensor& topk_idx, const Tensor& expert_dest);
void grouped_matmul_forward(const Tensor& out, const Tensor& inp, const Tensor& weight, const Tensor& offsets,
                            std::span<const int32_t> host_offsets);
void grouped_matmul_backward(const Tensor& dinp, const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                             const Tensor& weight, const Tensor& offsets, std::span<const int32_t> host_offsets,
                             bool accumulate_dinp, bool accumulate_dweight);
void grouped_matmul_backward_weight(const Tensor& dweight, const Tensor& dout, const Tensor& inp,
                                    std::span<const Tensor> offsets,
                                    std::span<const std::span<const int32_t>> host_offsets, bool accumulate,
                                    const Tensor& square_sum);
bool grouped_matmul_uses_host_offsets();
void set_grouped_matmul_reserved_sms(int sms);
void lm_head_cross_entropy(const Tensor& losses, const Tensor& dh, const Tensor& dw, const Tensor& h, const Tensor& w,
                           const Tensor& targets, float grad_scale, DType logits_dtype);
void adamw_update(const Tensor& param, const Tensor& master, const Tensor& m, const Tensor& v, const Tensor& grad,
                  float lr, float beta1, float beta2, float eps, float weight_decay, int64_t step,
                  float grad_scale);
double sum(const Tensor& x);
double sum_squares(const Tensor& x);
bool all_finite(const Tensor& x);

}  // namespace mf::ops::cuda_impl
