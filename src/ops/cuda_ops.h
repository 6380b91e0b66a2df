// The CUDA side of ops.h as one table. For every op of ops.h that has a CUDA body, CudaOps holds a
// pointer of exactly that op's type, derived from its declaration in ops.h (decltype), so a body
// whose signature drifts from ops.h does not compile. cuda_ops.cu fills the table with its bodies
// over kernels/cuda; a build without CUDA links cuda_ops_none.cpp, whose table is all null. ops.cpp
// checks the arguments, picks the device by the tensors and calls the entry; a null entry is the
// one "built without CUDA" refusal (ops.cpp's cuda_op). Only ops.cpp and the two table files use
// this header.
//
// Adding an op: its declaration in ops.h; its checks, CPU path and `cuda_call(&CudaOps::name, ...)`
// in ops.cpp; its body in cuda_ops.cu; its name in MF_CUDA_OPS. The compiler holds them together:
// a dispatch without a name, or a name without a body of the declared type, does not compile.
#pragma once

#include <cstdint>
#include <span>
#include <type_traits>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

// The ops of ops.h with a CUDA body, by name (in any order; each becomes a CudaOps entry).
// clang-format off
#define MF_CUDA_OPS(X)                                                                                                 \
    X(zero) X(copy) X(copy_from_host) X(copy_to_host) X(fill_normal) X(add) X(cast) X(synchronize)                     \
    X(matmul_forward) X(matmul_backward) X(add_bias) X(bias_backward) X(embedding_forward) X(embedding_backward)       \
    X(embedding_backward_scratch_bytes)                                                                                \
    X(rmsnorm_forward) X(rmsnorm_backward) X(qknorm_rope_forward) X(qknorm_rope_backward) X(rope_forward)              \
    X(qknorm_rope_table_forward) X(qknorm_rope_table_backward) X(rope_backward) X(attention_forward) X(attention_backward) X(swiglu_forward) X(swiglu_backward)                   \
    X(relu2_forward) X(relu2_backward) X(router_sigmoid_forward) X(router_sigmoid_backward)                            \
    X(clamped_swiglu_forward) X(clamped_swiglu_backward)                                                               \
    X(sigmoid_gate_forward) X(sigmoid_gate_backward)                                                                   \
    X(router_forward) X(router_backward) X(moe_aux_stats) X(moe_aux_dprobs) X(moe_permute_indices)                     \
    X(moe_gather_forward) X(moe_gather_backward) X(moe_unpermute_forward) X(moe_unpermute_backward)                    \
    X(group_offsets) X(zero_rows_past_groups)                                                                          \
    X(ep_token_positions) X(ep_pack_rows) X(ep_pack_meta) X(ep_scatter_rows) X(ep_scatter_grad) X(ep_reduce_rows)      \
    X(ep_sum_blocks) X(ep_gather_slots)                                                                                \
    X(grouped_matmul_forward) X(grouped_matmul_backward) X(grouped_matmul_backward_weight)                             \
    X(grouped_matmul_swiglu_forward) X(grouped_matmul_swiglu_backward)                                                 \
    X(grouped_matmul_uses_host_offsets) X(set_grouped_matmul_reserved_sms)                                             \
    X(conv1d_silu_forward) X(conv1d_silu_backward) X(ssd_scan_forward) X(ssd_scan_backward)                            \
    X(gated_rmsnorm_forward) X(gated_rmsnorm_backward)                                                                 \
    X(lm_head_cross_entropy) X(lm_head_cross_entropy_scratch_bytes)                                                    \
    X(moe_permute_indices_scratch_bytes) X(moe_aux_stats_scratch_bytes)                                                \
    X(adamw_update) X(sum) X(sum_squares) X(all_finite) X(scale_by) X(wait_background)
// clang-format on

namespace mf::ops {

struct CudaOps {
    // ops.h overloads sum_squares_to; the CUDA body is the many-tensor one (the one-tensor form
    // calls it), its type spelled here and checked against ops.h below.
    void (*sum_squares_to)(const Tensor& sums, std::span<const int64_t> slots, std::span<const Tensor> xs) = nullptr;

    // Hooks of ops.cpp's own machinery, with no op of their own in ops.h.
    // ops::phase_mark / phase_stop: record event `index` on the op stream; read events 1..count-1 as
    // ms after event 0 (synchronises).
    void (*record_mark)(int index) = nullptr;
    std::vector<double> (*mark_times_ms)(int count) = nullptr;
    // ops::background: switch the op stream to the background stream (behind the op stream's work so
    // far) and back, returning the ticket; abandon switches back after an exception.
    void (*background_begin)() = nullptr;
    int64_t (*background_end)() = nullptr;
    void (*background_abandon)() = nullptr;
    // ops::ExecScope: make `context` the thread's current one (saving what it replaces), and back.
    void (*exec_enter)(const ExecContext& context, ExecSaved& saved) = nullptr;
    void (*exec_leave)(const ExecSaved& saved) = nullptr;
    void* (*current_stream)() = nullptr;

    // The ops of MF_CUDA_OPS, each typed by its declaration in ops.h.
#define MF_CUDA_OP_ENTRY(name) decltype(&ops::name) name = nullptr;
    MF_CUDA_OPS(MF_CUDA_OP_ENTRY)
#undef MF_CUDA_OP_ENTRY
};

static_assert(std::is_same_v<decltype(static_cast<decltype(CudaOps::sum_squares_to)>(&ops::sum_squares_to)),
                             decltype(CudaOps::sum_squares_to)>,
              "CudaOps::sum_squares_to is an overload of ops::sum_squares_to");

// This build's table: cuda_ops.cu's bodies, or all null without CUDA.
const CudaOps& cuda_ops();

}  // namespace mf::ops
