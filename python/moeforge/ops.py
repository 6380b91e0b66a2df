"""moeforge's ops, one function per op of the C API (include/moeforge/moeforge.h documents each
formula, shape and dtype). Tensors are DLPack objects (numpy arrays, torch tensors), DLPack capsules
or moeforge.RawTensor; outputs are the caller's, written or accumulated ("+=") as the header says.
Activations are float32 on the CPU and bfloat16 on a GPU; routers, losses and optimizer states are
float32. `ctx` (a moeforge.Context: device, stream as an integer, workspace) says where CUDA work
runs; None is the CPU or the engine's stream. Every call raises a moeforge.Error subclass carrying
the engine's message on bad arguments.

MoE block dims are a dict: hidden, intermediate, num_experts, top_k, and optionally norm_topk_prob
(False), activation ("swiglu" | "relu2"), router ("softmax" | "sigmoid"), n_group, topk_group,
routed_scaling_factor, masked_score."""

from ._native import (  # noqa: F401
    adamw_update,
    attention_backward,
    attention_forward,
    clamped_swiglu_backward,
    clamped_swiglu_forward,
    embedding_backward,
    embedding_backward_workspace_bytes,
    embedding_forward,
    group_offsets,
    grouped_gemm_forward,
    grouped_gemm_input_grad,
    grouped_gemm_weight_grad,
    lm_head_cross_entropy,
    lm_head_cross_entropy_workspace_bytes,
    moe_aux_dprobs,
    moe_aux_stats,
    moe_aux_stats_workspace_bytes,
    moe_block_activation_bytes,
    moe_block_backward,
    moe_block_forward,
    moe_block_workspace_bytes,
    moe_gather,
    moe_gather_backward,
    moe_permute_indices,
    moe_permute_indices_workspace_bytes,
    moe_unpermute,
    moe_unpermute_backward,
    qknorm_rope_backward,
    qknorm_rope_forward,
    relu2_backward,
    relu2_forward,
    rmsnorm_backward,
    rmsnorm_forward,
    router_sigmoid_backward,
    router_sigmoid_forward,
    router_softmax_topk_backward,
    router_softmax_topk_forward,
    scale_by,
    swiglu_backward,
    swiglu_forward,
    synchronize,
    zero_rows_past_groups,
)
from ._native import built_with_cuda, has_cuda, register_array_type  # noqa: F401
