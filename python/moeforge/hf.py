"""`import moeforge.hf`: Transformers v5 MoE models run their experts on moeforge's kernels.

The import registers an experts implementation named "moeforge" with transformers' ExpertsInterface
and makes it the default for models created after it (an explicit `experts_implementation=` still
wins). The experts function has transformers' signature `(self, hidden_states, top_k_index,
top_k_weights)`; its work is two torch custom ops over moeforge's C API:

    moeforge::experts           permute (expert offsets on the device), gather, grouped GEMM up
                                (+ bias), the activation, grouped GEMM down (+ bias), weighted unpermute
    moeforge::experts_backward  the explicit backward: every gradient from its own kernel,
                                deterministic (no atomics), no W + BA or other weight copies

registered with `register_fake` (shapes for torch.compile) and `register_autograd`, so autograd and
`torch.compile(fullgraph=True)` see one opaque op; eager calls skip the dispatcher's round trip through
each op's twin autograd.Function (the same implementation, setup_context and backward; see "eager
calls"). CUDA tensors run on torch's current stream; CPU tensors on moeforge's fp32 reference kernels.

Served, bf16 on a GPU or fp32 on the CPU, with transformers' layout flags honoured:
  - gated SwiGLU experts (transformers' default gate, SiLU): gate_up_proj [E, 2I, H] (gate rows first)
    and down_proj [E, H, I] (Qwen2/3-MoE, Mixtral, OLMoE, DeepSeek-V3/GLM-4.5 and the others);
  - gpt-oss (GptOssExperts): its interleaved, clamped SwiGLU, with biases and transposed weights;
  - non-gated relu² experts (has_gate=False: up_proj [E, I, H], Nemotron-H);
  - is_transposed ([E, H, P] / [E, I, H]) and has_bias (per-expert biases of both projections) for
    any of these.
Indices >= E (expert parallelism's sentinels) contribute nothing. Anything else (separate gate and up
projections, other custom gates or activations, other dtypes) falls back to transformers' stock
implementation with one logged reason per module kind; `status(model)` says which modules run where.

The RMSNorm of the families served (NORM_CLASSES) runs on moeforge too, as the custom ops
moeforge::rms_norm / moeforge::rms_norm_backward: their classes' forward is replaced while the
import's default is on (disable() restores it), with the stock forward kept for inputs moeforge does
not serve (other dtypes or devices).

The input embedding (a plain torch.nn.Embedding) of models created while the default is on, and of
one given to `enable(model)`, runs on moeforge too:
moeforge::embedding / moeforge::embedding_backward, whose gradient is a deterministic per-id sum
(stock for max_norm, scale_grad_by_freq or sparse embeddings).

    import moeforge.hf                     # every MoE model created from now on
    moeforge.hf.enable(model)              # one already created
    moeforge.hf.status(model)              # {"experts_implementation": ..., "modules": {...}}
    moeforge.hf.disable()                  # the stock default again
"""

import functools
import logging
import math
import os
import sys
from typing import Any, Dict, Optional

import torch
from transformers import modeling_utils
from transformers.integrations import moe as _hf_moe

from . import ops
from ._native import Context

IMPLEMENTATION = "moeforge"
_log = logging.getLogger("moeforge.hf")
# Asked once: torch.compile traces the experts function, and a call into the extension there would
# break the graph.
_HAS_CUDA = ops.has_cuda()

# --- the ops -----------------------------------------------------------------------------------------


# torch tensors reach the C API through their own methods (data_ptr, shape, ...), not a DLPack
# capsule each: a few microseconds less per tensor and call.
ops.register_array_type(torch.Tensor, {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.int32: "int32",
                                       torch.int64: "int64", torch.float64: "float64"})
# The current stream's handle without building a torch.cuda.Stream object (its public spelling,
# torch.cuda.current_stream(device).cuda_stream, as the fallback).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(index: int) -> int:
    if _raw_stream is not None:
        return _raw_stream(index)
    return torch.cuda.current_stream(index).cuda_stream


def _context(t: torch.Tensor, workspace: Optional[torch.Tensor] = None) -> Optional[Context]:
    """Where moeforge runs the work on `t`: torch's current stream of its device (and a scratch
    tensor torch allocated, if given), or the CPU."""
    if t.is_cuda:
        index = t.get_device()
        return Context(device=index, stream=_current_stream(index), workspace=workspace)
    return None


def _no_grads(ctx) -> tuple:
    """An op's backward result when its main output got no gradient: None for every input."""
    return (None,) * len(ctx.needs_input_grad)


# --- eager calls ---------------------------------------------------------------------------------------
# In eager mode a call of a custom op goes through torch's dispatcher: the op's autograd kernel builds a
# Python autograd.Function per call and redispatches below autograd to the implementation. That round
# trip is ~40 us of host time per call (bench/hf_op_overhead.py: 99 us per RMSNorm forward against 59
# for the same implementation under a plain autograd.Function), and at the start of a training step,
# where the GPU waits for the host, it shows in the step time. So eager calls take the short way: each
# op with an autograd formula has a twin autograd.Function with the same forward (the op's own
# implementation), setup_context and backward, and each backward op is called as its implementation;
# under torch.compile (and for tensor subclasses: fake, functional, distributed tensors) the op itself
# is called, as before, so graphs still see one opaque op with its fake kernel.
# (off unless MOEFORGE_HF_EAGER_TWINS=1 until the GPU machine has run test_hf with it; bench/d1.sh measures both)
_twins_env = os.environ.get("MOEFORGE_HF_EAGER_TWINS", "")
if _twins_env not in ("", "0", "1"):
    raise ValueError(f"moeforge.hf: MOEFORGE_HF_EAGER_TWINS must be 0 or 1, got {_twins_env!r}")
EAGER_FAST_PATH = _twins_env == "1"
_eager: dict = {}  # op -> the callable an eager call runs instead
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _call(op, *args):
    """op(*args), the short way in eager mode (see above)."""
    if EAGER_FAST_PATH and not torch.compiler.is_compiling():
        fast = _eager.get(op)
        if fast is not None and all(type(a) in _PLAIN_TENSORS for a in args if isinstance(a, torch.Tensor)):
            return fast(*args)
    return op(*args)


def _register_autograd(op, backward, setup_context) -> None:
    """op.register_autograd(backward, setup_context), and the op's eager twin (where torch's CustomOpDef
    keeps the undecorated implementation, `_init_fn`; without it every call goes through the op)."""
    op.register_autograd(backward, setup_context=setup_context)
    impl = getattr(op, "_init_fn", None)
    if impl is None:
        return

    def forward(*args):
        return impl(*args)

    # (named after the op: autograd's node for it is "EagerTwin_<op>Backward", in profiles and graphs)
    twin = type(f"EagerTwin_{getattr(op, '_name', 'op')}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
    })
    _eager[op] = twin.apply


def _register_eager(op) -> None:
    """An op without an autograd formula (a backward): eager calls run its implementation directly."""
    impl = getattr(op, "_init_fn", None)
    if impl is not None:
        _eager[op] = impl


def _bytes_tensor(nbytes: int, device: torch.device) -> torch.Tensor:
    """A torch-allocated buffer of nbytes (a multiple of 4) for a C API workspace (torch's allocators
    align it as the C API asks: 512 bytes on a GPU, 64 on the CPU; and torch counts it)."""
    return torch.empty(nbytes // 4, dtype=torch.int32, device=device)


def _served_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype moeforge computes in on a device: bf16 on a GPU, fp32 on the CPU (None: not served)."""
    return {"cuda": torch.bfloat16, "cpu": torch.float32}.get(device_type)


def _permute(top_k_index: torch.Tensor, num_experts: int, ctx) -> tuple:
    n = top_k_index.numel()
    dev = top_k_index.device
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(n, dtype=torch.int32, device=dev)
    pair_row = torch.empty(n, dtype=torch.int32, device=dev)
    ops.moe_permute_indices(offsets, sorted_pair, pair_row, top_k_index, num_experts, ctx=ctx)
    return offsets, sorted_pair, pair_row


def _gather(hidden: torch.Tensor, sorted_pair: torch.Tensor, top_k: int, ctx) -> torch.Tensor:
    x_perm = hidden.new_empty(sorted_pair.numel(), hidden.shape[1])
    ops.moe_gather(x_perm, hidden, sorted_pair, top_k, ctx=ctx)
    return x_perm


# The expert activations: "swiglu" (silu(gate) · up over the [gate | up] halves), "clamped_swiglu"
# (gpt-oss: gate and up interleaved, clamped at `limit`, (up + 1) · gate · σ(alpha · gate)) and
# "relu2" (non-gated: max(h, 0)², Nemotron-H).
ACTIVATIONS = ("swiglu", "clamped_swiglu", "relu2")


def _activation_width(activation: str, proj_width: int) -> int:
    return proj_width if activation == "relu2" else proj_width // 2


def _activate(h_perm: torch.Tensor, activation: str, alpha: float, limit: float, ctx) -> torch.Tensor:
    a_perm = h_perm.new_empty(h_perm.shape[0], _activation_width(activation, h_perm.shape[1]))
    if activation == "swiglu":
        ops.swiglu_forward(a_perm, h_perm, ctx=ctx)
    elif activation == "clamped_swiglu":
        ops.clamped_swiglu_forward(a_perm, h_perm, alpha, limit, ctx=ctx)
    else:
        ops.relu2_forward(a_perm, h_perm, ctx=ctx)
    return a_perm


def _activate_backward(da_perm: torch.Tensor, h_perm: torch.Tensor, activation: str, alpha: float, limit: float,
                       ctx) -> torch.Tensor:
    dh_perm = torch.empty_like(h_perm)
    if activation == "swiglu":
        ops.swiglu_backward(dh_perm, da_perm, h_perm, ctx=ctx)
    elif activation == "clamped_swiglu":
        ops.clamped_swiglu_backward(dh_perm, da_perm, h_perm, alpha, limit, ctx=ctx)
    else:
        ops.relu2_backward(dh_perm, da_perm, h_perm, ctx=ctx)
    return dh_perm


# A projection's three products for both weight layouts: [E, out, in] (out = inp · W[e]ᵀ) and, with
# `transposed`, [E, in, out] (out = inp · W[e]), each on a grouped GEMM of the C API.
def _project(out, inp, weight, offsets, transposed: bool, ctx) -> None:
    if transposed:
        ops.grouped_gemm_input_grad(out, inp, weight, offsets, ctx=ctx)
    else:
        ops.grouped_gemm_forward(out, inp, weight, offsets, ctx=ctx)


def _project_input_grad(dinp, dout, weight, offsets, transposed: bool, ctx) -> None:
    if transposed:
        ops.grouped_gemm_forward(dinp, dout, weight, offsets, ctx=ctx)
    else:
        ops.grouped_gemm_input_grad(dinp, dout, weight, offsets, ctx=ctx)


def _project_weight_grad(dweight, dout, inp, offsets, transposed: bool, ctx) -> None:
    if transposed:
        ops.grouped_gemm_weight_grad(dweight, inp, dout, offsets, ctx=ctx)
    else:
        ops.grouped_gemm_weight_grad(dweight, dout, inp, offsets, ctx=ctx)


def _bias_grad(d_rows: torch.Tensor, offsets: torch.Tensor, num_experts: int, ctx) -> torch.Tensor:
    """[E, width]: the sum of each expert's rows of d_rows [M, width] (zero for an expert without
    rows), as the grouped weight gradient against a block of ones: fp32 sums in a fixed order."""
    ones = d_rows.new_ones(d_rows.shape[0], 8)  # (8 columns: the grouped kernels' alignment)
    sums = d_rows.new_empty(num_experts, d_rows.shape[1], 8)
    ops.grouped_gemm_weight_grad(sums, d_rows, ones, offsets, ctx=ctx)
    return sums[:, :, 0].contiguous()


def _widths(w_up: torch.Tensor, w_down: torch.Tensor, transposed: bool) -> tuple:
    """(E, proj width, hidden) of the up projection; the down projection maps the activation back."""
    E = w_up.shape[0]
    return (E, w_up.shape[2], w_up.shape[1]) if transposed else (E, w_up.shape[1], w_up.shape[2])


@torch.library.custom_op("moeforge::experts", mutates_args=())
def experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
            w_down: torch.Tensor, b_up: Optional[torch.Tensor], b_down: Optional[torch.Tensor], activation: str,
            alpha: float, limit: float, transposed: bool
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [T, H]; top_k_index int32 [T, K] in [0, E); top_k_weights fp32 [T, K]; w_up [E, P, H]
    (P = 2I gated, I for relu2; transposed: [E, H, P]); w_down [E, H, I] (transposed: [E, I, H]);
    b_up [E, P] and b_down [E, H] or None. Returns out [T, H] = Σ_k w[t, k] · (down_e(act(up_e(x_t) +
    b_up[e])) + b_down[e]) with e = top_k_index[t, k], and what the backward reads: the expert offsets
    [E + 1], the permutation (sorted_pair, pair_row: [T·K]), h_perm [T·K, P] (before the activation,
    with its bias) and y_perm [T·K, H] (with its bias)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moeforge::experts: activation {activation!r}, expected one of {ACTIVATIONS}")
    # (torch will not hand a tensor that requires grad to DLPack; the op's own autograd is below)
    hidden, w_up, w_down, top_k_weights = (t.detach() for t in (hidden, w_up, w_down, top_k_weights))
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E, P, _ = _widths(w_up, w_down, transposed)
    ctx = _context(hidden)
    offsets, sorted_pair, pair_row = _permute(top_k_index, E, ctx)
    h_perm = hidden.new_empty(T * K, P)
    y_perm = hidden.new_empty(T * K, H)
    out = hidden.new_empty(T, H)
    if T == 0:
        return out, offsets.zero_(), sorted_pair, pair_row, h_perm, y_perm
    # every pair has an expert in [0, E) (the caller maps EP sentinels to expert 0 with weight 0)
    row_expert = top_k_index.reshape(-1).long()[sorted_pair.long()] if b_up is not None or b_down is not None else None
    x_perm = _gather(hidden, sorted_pair, K, ctx)
    _project(h_perm, x_perm, w_up, offsets, transposed, ctx)
    if b_up is not None:
        h_perm += b_up.detach()[row_expert]
    a_perm = _activate(h_perm, activation, alpha, limit, ctx)
    _project(y_perm, a_perm, w_down, offsets, transposed, ctx)
    if b_down is not None:
        y_perm += b_down.detach()[row_expert]
    ops.moe_unpermute(out, y_perm, top_k_weights, pair_row, ctx=ctx)
    return out, offsets, sorted_pair, pair_row, h_perm, y_perm


@experts.register_fake
def _(hidden, top_k_index, top_k_weights, w_up, w_down, b_up, b_down, activation, alpha, limit, transposed):
    T, H = hidden.shape
    n = top_k_index.numel()
    E, P, _ = _widths(w_up, w_down, transposed)
    i32 = dict(dtype=torch.int32, device=hidden.device)
    return (hidden.new_empty(T, H), torch.empty(E + 1, **i32), torch.empty(n, **i32), torch.empty(n, **i32),
            hidden.new_empty(n, P), hidden.new_empty(n, H))


@torch.library.custom_op("moeforge::experts_backward", mutates_args=())
def experts_backward(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                     w_down: torch.Tensor, offsets: torch.Tensor, sorted_pair: torch.Tensor, pair_row: torch.Tensor,
                     h_perm: torch.Tensor, y_perm: torch.Tensor, with_b_up: bool, with_b_down: bool,
                     activation: str, alpha: float, limit: float, transposed: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of experts' out: (d hidden, d top_k_weights (fp32), d w_up, d w_down, d b_up,
    d b_down; a bias's is empty when it has none), each written whole (experts without rows get zero
    gradients). The expert input is gathered again and the activation recomputed from h_perm rather
    than kept from the forward."""
    dout, hidden, top_k_weights, w_up, w_down, h_perm, y_perm = (
        t.detach() for t in (dout, hidden, top_k_weights, w_up, w_down, h_perm, y_perm))
    T, H = hidden.shape
    K = top_k_weights.shape[1]
    E = w_up.shape[0]
    ctx = _context(hidden)
    dx = torch.zeros_like(hidden)  # (the gather's backward adds into it)
    dw = torch.zeros_like(top_k_weights)
    db_up = hidden.new_zeros(E, h_perm.shape[1]) if with_b_up else hidden.new_empty(0)
    db_down = hidden.new_zeros(E, H) if with_b_down else hidden.new_empty(0)
    if T == 0:
        return dx, dw, torch.zeros_like(w_up), torch.zeros_like(w_down), db_up, db_down
    dw_up = torch.empty_like(w_up)  # written whole by the weight gradients
    dw_down = torch.empty_like(w_down)
    dy_perm = torch.empty_like(y_perm)
    ops.moe_unpermute_backward(dy_perm, dw, dout, y_perm, top_k_weights, pair_row, ctx=ctx)
    if with_b_down:
        db_down = _bias_grad(dy_perm, offsets, E, ctx)
    a_perm = _activate(h_perm, activation, alpha, limit, ctx)
    _project_weight_grad(dw_down, dy_perm, a_perm, offsets, transposed, ctx)
    da_perm = torch.empty_like(a_perm)
    _project_input_grad(da_perm, dy_perm, w_down, offsets, transposed, ctx)
    dh_perm = _activate_backward(da_perm, h_perm, activation, alpha, limit, ctx)
    if with_b_up:
        db_up = _bias_grad(dh_perm, offsets, E, ctx)
    x_perm = _gather(hidden, sorted_pair, K, ctx)
    _project_weight_grad(dw_up, dh_perm, x_perm, offsets, transposed, ctx)
    dx_perm = torch.empty_like(x_perm)
    _project_input_grad(dx_perm, dh_perm, w_up, offsets, transposed, ctx)
    ops.moe_gather_backward(dx, dx_perm, pair_row, K, ctx=ctx)
    return dx, dw, dw_up, dw_down, db_up, db_down


@experts_backward.register_fake
def _(dout, hidden, top_k_weights, w_up, w_down, offsets, sorted_pair, pair_row, h_perm, y_perm, with_b_up,
      with_b_down, activation, alpha, limit, transposed):
    E, H = w_up.shape[0], hidden.shape[1]
    return (torch.empty_like(hidden), torch.empty_like(top_k_weights), torch.empty_like(w_up),
            torch.empty_like(w_down), hidden.new_empty(E, h_perm.shape[1]) if with_b_up else hidden.new_empty(0),
            hidden.new_empty(E, H) if with_b_down else hidden.new_empty(0))


_register_eager(experts_backward)


def _setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    hidden, _, top_k_weights, w_up, w_down, b_up, b_down, activation, alpha, limit, transposed = inputs
    _, offsets, sorted_pair, pair_row, h_perm, y_perm = output
    ctx.save_for_backward(hidden, top_k_weights, w_up, w_down, offsets, sorted_pair, pair_row, h_perm, y_perm)
    ctx.options = (b_up is not None, b_down is not None, activation, alpha, limit, transposed)


def _backward(ctx, dout, *_unused):
    if dout is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    hidden, top_k_weights, w_up, w_down, offsets, sorted_pair, pair_row, h_perm, y_perm = ctx.saved_tensors
    with_b_up, with_b_down, activation, alpha, limit, transposed = ctx.options
    dx, dw, dw_up, dw_down, db_up, db_down = _call(
        experts_backward, dout.contiguous(), hidden, top_k_weights, w_up, w_down, offsets, sorted_pair, pair_row,
        h_perm, y_perm, with_b_up, with_b_down, activation, alpha, limit, transposed)
    return (dx, None, dw, dw_up, dw_down, db_up if with_b_up else None, db_down if with_b_down else None, None, None,
            None, None)


_register_autograd(experts, _backward, _setup_context)

# --- the experts function ------------------------------------------------------------------------------

_reported: set = set()


def _report(kind: str, reason: str, instead: str) -> None:
    """Logs, once per (module kind, reason), why moeforge does not serve a module and what runs instead."""
    if (kind, reason) not in _reported:
        _reported.add((kind, reason))
        _log.warning("moeforge.hf: %s runs %s: %s", kind, instead, reason)


def _is_silu(act) -> bool:
    return isinstance(act, torch.nn.SiLU) or type(act).__name__ in ("SiLU", "SiLUActivation")


def _is_relu2(act) -> bool:
    return type(act).__name__ == "ReLUSquaredActivation"


def _is_experts_module(module: torch.nn.Module) -> bool:
    """A transformers experts module: stacked expert weights (tensors, not Linear submodules)."""
    up = getattr(module, "gate_up_proj", None)
    if up is None:
        up = getattr(module, "up_proj", None)
    return isinstance(up, torch.Tensor) and isinstance(getattr(module, "down_proj", None), torch.Tensor)


def _layout(module: torch.nn.Module) -> tuple:
    """(activation, alpha, limit) of an experts module moeforge serves, or (None, reason)."""
    gate = getattr(type(module), "_apply_gate", None)
    custom_gate = gate is not None and gate is not getattr(_hf_moe, "_default_apply_gate", gate)
    if not getattr(module, "has_gate", True):
        act = getattr(module, "act_fn", None)
        if not _is_relu2(act):
            return None, f"non-gated experts with activation {type(act).__name__} (served: relu2)"
        return ("relu2", 0.0, 0.0), None
    if type(module).__name__ == "GptOssExperts":  # (its _apply_gate: interleaved, clamped; see ops)
        alpha, limit = getattr(module, "alpha", None), getattr(module, "limit", None)
        if not isinstance(alpha, (int, float)) or not isinstance(limit, (int, float)):
            return None, "GptOssExperts without numeric alpha / limit"
        return ("clamped_swiglu", float(alpha), float(limit)), None
    if getattr(module, "is_concatenated", True) is False:  # (gpt-oss's interleaving is served above)
        return None, "gate and up not concatenated (is_concatenated=False) outside gpt-oss are not served yet"
    if custom_gate:
        return None, f"a custom gate ({type(module).__name__}._apply_gate) is not served yet"
    act = getattr(module, "act_fn", None)
    if not _is_silu(act):
        return None, f"activation {type(act).__name__} (SwiGLU needs SiLU)"
    return ("swiglu", 0.0, 0.0), None


def _weights(module: torch.nn.Module) -> tuple:
    """(w_up, w_down, b_up, b_down) as the module holds them (biases None without has_bias)."""
    gated = getattr(module, "has_gate", True)
    up_name = "gate_up_proj" if gated else "up_proj"
    w_up, w_down = getattr(module, up_name, None), getattr(module, "down_proj", None)
    if not getattr(module, "has_bias", False):
        return w_up, w_down, None, None
    return w_up, w_down, getattr(module, up_name + "_bias", None), getattr(module, "down_proj_bias", None)


def _experts_plan(module: torch.nn.Module, hidden_states: Optional[torch.Tensor] = None) -> tuple:
    """((activation, alpha, limit, w_up, w_down, b_up, b_down), None) for a transformers experts
    module moeforge serves, else (None, the reason)."""
    spec, reason = _layout(module)
    if spec is None:
        return None, reason
    weights = _weights(module)
    reason = _experts_refusal(module, spec[0], *weights, hidden_states)
    return (None, reason) if reason is not None else (spec + weights, None)


def unsupported_reason(module: torch.nn.Module, hidden_states: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why `module` (a transformers experts module) cannot run on moeforge, or None when it can."""
    return _experts_plan(module, hidden_states)[1]


def _experts_refusal(module, activation: str, w_up, w_down, b_up, b_down, hidden_states) -> Optional[str]:
    """_experts_plan's checks of the weights of a served layout."""
    up_name = "up_proj" if activation == "relu2" else "gate_up_proj"
    if not isinstance(w_up, torch.Tensor) or not isinstance(w_down, torch.Tensor):
        return f"no stacked {up_name} / down_proj tensors"
    if w_up.dim() != 3 or w_down.dim() != 3 or w_up.shape[0] != w_down.shape[0]:
        return f"expert weights of shapes {tuple(w_up.shape)} and {tuple(w_down.shape)}"
    transposed = bool(getattr(module, "is_transposed", False))
    E, P, H = _widths(w_up, w_down, transposed)
    inter = _activation_width(activation, P)
    want_down = (E, inter, H) if transposed else (E, H, inter)
    if (activation != "relu2" and P % 2 != 0) or tuple(w_down.shape) != want_down:
        layout = "[E, H, P], [E, I, H]" if transposed else "[E, P, H], [E, H, I]"
        return f"{up_name} {tuple(w_up.shape)} and down_proj {tuple(w_down.shape)} are not {layout}"
    if getattr(module, "has_bias", False):
        if not isinstance(b_up, torch.Tensor) or not isinstance(b_down, torch.Tensor):
            return "has_bias without both bias tensors"
        if tuple(b_up.shape) != (E, P) or tuple(b_down.shape) != (E, H):
            return f"biases of shapes {tuple(b_up.shape)} and {tuple(b_down.shape)} (expected [{E}, {P}], [{E}, {H}])"
    dtypes = {str(t.dtype) for t in (w_up, w_down, b_up, b_down) if t is not None}
    if len(dtypes) > 1:
        return f"expert weights and biases in mixed dtypes ({', '.join(sorted(dtypes))})"
    device = w_up.device.type
    want = _served_dtype(device)
    if want is None:
        return f"device {device}"
    if w_up.dtype != want:
        return f"{w_up.dtype} expert weights on {device} (moeforge runs {want} there)"
    if device == "cuda" and not _HAS_CUDA:
        return "moeforge was built without CUDA (or sees no GPU)"
    if hidden_states is not None and hidden_states.device != w_up.device:
        return f"hidden states on {hidden_states.device}, experts on {w_up.device}"
    return None


def _stock(module, hidden_states, top_k_index, top_k_weights):
    stock = _hf_moe.ALL_EXPERTS_FUNCTIONS.get("grouped_mm") if hasattr(torch, "_grouped_mm") else None
    if stock is None:
        stock = _hf_moe.ALL_EXPERTS_FUNCTIONS["batched_mm"]
    return stock(module, hidden_states, top_k_index, top_k_weights)


def experts_forward(module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts signature: hidden_states [T, H], top_k_index [T, K], top_k_weights
    [T, K] (or [T, E], DeepSeek-V2 style). Returns [T, H] in hidden_states' dtype."""
    plan, reason = _experts_plan(module, hidden_states)
    if plan is None:
        _report(type(module).__name__, reason, "transformers' stock experts")
        return _stock(module, hidden_states, top_k_index, top_k_weights)
    activation, alpha, limit, w_up, w_down, b_up, b_down = plan
    index, weights = _valid_routing(top_k_index, top_k_weights, w_up.shape[0])
    contiguous = (lambda t: None if t is None else t.contiguous())  # (no copies for ordinary parameters)
    out = _call(experts, hidden_states.contiguous(), index, weights, w_up.contiguous(), w_down.contiguous(),
                contiguous(b_up), contiguous(b_down), activation, alpha, limit,
                bool(getattr(module, "is_transposed", False)))[0]
    return out.to(hidden_states.dtype)


def _valid_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int) -> tuple:
    """The experts ops' routing arguments: int32 indices in [0, E) and fp32 weights [T, K], an index
    outside [0, E) (expert parallelism's sentinel) mapped to expert 0 with weight 0; top_k_weights
    [T, E] (DeepSeek-V2 style) gathered at the chosen experts."""
    valid = (top_k_index >= 0) & (top_k_index < num_experts)
    index = torch.where(valid, top_k_index, torch.zeros_like(top_k_index))
    weights = top_k_weights
    if weights.shape != top_k_index.shape:
        weights = weights.gather(1, index)
    return index.to(torch.int32).contiguous(), (weights.float() * valid).contiguous()


# --- PEFT LoRA on the experts (target_parameters): the base and rank-r products apart ------------------
#
# PEFT 0.21 wraps an experts module whose gate_up_proj / down_proj are LoRA targets in ParamWrappers
# that, for each forward, parametrise the stacked weight as W + s·B·A (a copy of the whole expert
# stack). moeforge.hf replaces ParamWrapper.forward while it is on: where the innermost module is a
# served experts module and each wrapper has one active, unmerged adapter, the experts run as
# moeforge::experts_lora, which adds s·(x·Aᵀ)·Bᵀ to each projection with two rank-r grouped GEMMs and
# never forms W + B·A; the gradients of A and B (and of W, only where it trains) come from the
# op's own backward. Anything else runs PEFT's forward.

def _lora_project(out, inp, w, a, b, scale: float, offsets, ctx) -> None:
    """out [M, OC] = inp · W[e]ᵀ (+ scale · (inp · A[e]ᵀ) · B[e]ᵀ with A [E, r, C], B [E, OC, r])."""
    _project(out, inp, w, offsets, False, ctx)
    if a is not None:
        t = inp.new_empty(inp.shape[0], a.shape[1])
        ops.grouped_gemm_forward(t, inp, a, offsets, ctx=ctx)
        extra = torch.empty_like(out)
        ops.grouped_gemm_forward(extra, t, b, offsets, ctx=ctx)
        out.add_(extra, alpha=scale)


def _lora_project_backward(d_inp, d_out, inp, w, a, b, scale: float, offsets, need_w: bool, ctx) -> tuple:
    """d_inp [M, C] written; returns (d W or an empty tensor, d A, d B; empty without LoRA)."""
    empty = d_out.new_empty(0)
    dw = empty
    if need_w:
        dw = torch.empty_like(w)
        _project_weight_grad(dw, d_out, inp, offsets, False, ctx)
    _project_input_grad(d_inp, d_out, w, offsets, False, ctx)
    if a is None:
        return dw, empty, empty
    t = inp.new_empty(inp.shape[0], a.shape[1])
    ops.grouped_gemm_forward(t, inp, a, offsets, ctx=ctx)
    db = torch.empty_like(b)
    ops.grouped_gemm_weight_grad(db, d_out, t, offsets, ctx=ctx)
    dt = torch.empty_like(t)
    ops.grouped_gemm_input_grad(dt, d_out, b, offsets, ctx=ctx)
    dt.mul_(scale)
    da = torch.empty_like(a)
    ops.grouped_gemm_weight_grad(da, dt, inp, offsets, ctx=ctx)
    ops.grouped_gemm_input_grad(d_inp, dt, a, offsets, accumulate=True, ctx=ctx)
    return dw, da, db.mul_(scale)


@torch.library.custom_op("moeforge::experts_lora", mutates_args=())
def experts_lora(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, a_up: Optional[torch.Tensor], b_up: Optional[torch.Tensor],
                 a_down: Optional[torch.Tensor], b_down: Optional[torch.Tensor], scale_up: float, scale_down: float,
                 activation: str, alpha: float, limit: float
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moeforge::experts (untransposed, without biases) with LoRA on either projection: w_up [E, P, H]
    gets scale_up · b_up [E, P, r] · a_up [E, r, H], w_down [E, H, I] scale_down · b_down [E, H, r] ·
    a_down [E, r, I] (either pair None: no LoRA there), each as its own rank-r products. Returns what
    moeforge::experts returns."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"moeforge::experts_lora: activation {activation!r}, expected one of {ACTIVATIONS}")
    hidden, top_k_weights, w_up, w_down = (t.detach() for t in (hidden, top_k_weights, w_up, w_down))
    a_up, b_up, a_down, b_down = (None if t is None else t.detach() for t in (a_up, b_up, a_down, b_down))
    T, H = hidden.shape
    K = top_k_index.shape[1]
    E, P = w_up.shape[0], w_up.shape[1]
    ctx = _context(hidden)
    offsets, sorted_pair, pair_row = _permute(top_k_index, E, ctx)
    h_perm, y_perm, out = hidden.new_empty(T * K, P), hidden.new_empty(T * K, H), hidden.new_empty(T, H)
    if T == 0:
        return out, offsets.zero_(), sorted_pair, pair_row, h_perm, y_perm
    x_perm = _gather(hidden, sorted_pair, K, ctx)
    _lora_project(h_perm, x_perm, w_up, a_up, b_up, scale_up, offsets, ctx)
    a_perm = _activate(h_perm, activation, alpha, limit, ctx)
    _lora_project(y_perm, a_perm, w_down, a_down, b_down, scale_down, offsets, ctx)
    ops.moe_unpermute(out, y_perm, top_k_weights, pair_row, ctx=ctx)
    return out, offsets, sorted_pair, pair_row, h_perm, y_perm


@experts_lora.register_fake
def _(hidden, top_k_index, top_k_weights, w_up, w_down, a_up, b_up, a_down, b_down, scale_up, scale_down, activation,
      alpha, limit):
    T, H = hidden.shape
    n = top_k_index.numel()
    i32 = dict(dtype=torch.int32, device=hidden.device)
    return (hidden.new_empty(T, H), torch.empty(w_up.shape[0] + 1, **i32), torch.empty(n, **i32),
            torch.empty(n, **i32), hidden.new_empty(n, w_up.shape[1]), hidden.new_empty(n, H))


@torch.library.custom_op("moeforge::experts_lora_backward", mutates_args=())
def experts_lora_backward(dout: torch.Tensor, hidden: torch.Tensor, top_k_weights: torch.Tensor, w_up: torch.Tensor,
                          w_down: torch.Tensor, a_up: Optional[torch.Tensor], b_up: Optional[torch.Tensor],
                          a_down: Optional[torch.Tensor], b_down: Optional[torch.Tensor], offsets: torch.Tensor,
                          sorted_pair: torch.Tensor, pair_row: torch.Tensor, h_perm: torch.Tensor,
                          y_perm: torch.Tensor, scale_up: float, scale_down: float, activation: str, alpha: float,
                          limit: float, need_w_up: bool, need_w_down: bool) -> list[torch.Tensor]:
    """experts_lora's gradients: [d hidden, d top_k_weights, d w_up, d w_down, d a_up, d b_up, d a_down,
    d b_down], each empty where not asked for (a frozen base weight) or absent (no LoRA there)."""
    dout, hidden, top_k_weights, w_up, w_down, h_perm, y_perm = (
        t.detach() for t in (dout, hidden, top_k_weights, w_up, w_down, h_perm, y_perm))
    a_up, b_up, a_down, b_down = (None if t is None else t.detach() for t in (a_up, b_up, a_down, b_down))
    K = top_k_weights.shape[1]
    ctx = _context(hidden)
    dx, dw = torch.zeros_like(hidden), torch.zeros_like(top_k_weights)
    if hidden.shape[0] == 0:
        zeros = lambda t, need=True: torch.zeros_like(t) if t is not None and need else hidden.new_empty(0)  # noqa
        return [dx, dw, zeros(w_up, need_w_up), zeros(w_down, need_w_down), zeros(a_up), zeros(b_up), zeros(a_down),
                zeros(b_down)]
    dy_perm = torch.empty_like(y_perm)
    ops.moe_unpermute_backward(dy_perm, dw, dout, y_perm, top_k_weights, pair_row, ctx=ctx)
    a_perm = _activate(h_perm, activation, alpha, limit, ctx)
    da_perm = torch.empty_like(a_perm)
    dw_down, da_down, db_down = _lora_project_backward(da_perm, dy_perm, a_perm, w_down, a_down, b_down, scale_down,
                                                       offsets, need_w_down, ctx)
    dh_perm = _activate_backward(da_perm, h_perm, activation, alpha, limit, ctx)
    x_perm = _gather(hidden, sorted_pair, K, ctx)
    dx_perm = torch.empty_like(x_perm)
    dw_up, da_up, db_up = _lora_project_backward(dx_perm, dh_perm, x_perm, w_up, a_up, b_up, scale_up, offsets,
                                                 need_w_up, ctx)
    ops.moe_gather_backward(dx, dx_perm, pair_row, K, ctx=ctx)
    return [dx, dw, dw_up, dw_down, da_up, db_up, da_down, db_down]


@experts_lora_backward.register_fake
def _(dout, hidden, top_k_weights, w_up, w_down, a_up, b_up, a_down, b_down, offsets, sorted_pair, pair_row, h_perm,
      y_perm, scale_up, scale_down, activation, alpha, limit, need_w_up, need_w_down):
    like = lambda t, need=True: torch.empty_like(t) if t is not None and need else hidden.new_empty(0)  # noqa: E731
    return [torch.empty_like(hidden), torch.empty_like(top_k_weights), like(w_up, need_w_up), like(w_down, need_w_down),
            like(a_up), like(b_up), like(a_down), like(b_down)]


_register_eager(experts_lora_backward)


def _lora_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    hidden, _, top_k_weights, w_up, w_down, a_up, b_up, a_down, b_down = inputs[:9]
    _, offsets, sorted_pair, pair_row, h_perm, y_perm = output
    ctx.save_for_backward(hidden, top_k_weights, w_up, w_down, a_up, b_up, a_down, b_down, offsets, sorted_pair,
                          pair_row, h_perm, y_perm)
    ctx.options = inputs[9:]


def _lora_backward(ctx, dout, *_unused):
    if dout is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    saved = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = _call(experts_lora_backward, dout.contiguous(), *saved, *ctx.options, need[3], need[4])
    present = lambda g, want: g if want and g.numel() > 0 else None  # noqa: E731
    dx, dw, dw_up, dw_down, da_up, db_up, da_down, db_down = grads
    return (dx, None, dw, present(dw_up, need[3]), present(dw_down, need[4]), present(da_up, need[5]),
            present(db_up, need[6]), present(da_down, need[7]), present(db_down, need[8]), None, None, None, None,
            None)


_register_autograd(experts_lora, _lora_backward, _lora_setup_context)

try:
    from peft.tuners.lora.layer import ParamWrapper as _ParamWrapper
except ImportError:  # (no PEFT: nothing to wrap)
    _ParamWrapper = None
_stock_param_wrapper_forward = _ParamWrapper.forward if _ParamWrapper is not None else None


def _lora_plan(wrapper, hidden: torch.Tensor) -> tuple:
    """((the experts' _experts_plan, {parameter name: (A, B, scale)}), None) when moeforge::experts_lora
    serves the chain of ParamWrappers starting at `wrapper` for these hidden states, else (None, reason)."""
    factors = {}
    layer = wrapper
    while isinstance(layer, _ParamWrapper):
        if layer.disable_adapters or layer.merged:
            return None, "adapters disabled or merged"
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if len(active) != 1:
            return None, f"{len(active)} active adapters on {layer.parameter_name} (served: one)"
        if layer.parameter_name in factors or layer.parameter_name not in ("gate_up_proj", "up_proj", "down_proj"):
            return None, f"LoRA on {layer.parameter_name}"
        if not layer._did_swap_in_out_features:  # (PEFT's mark of an [E, out, in] parameter)
            return None, "LoRA on transposed experts (is_transposed) is not served yet"
        lhs, rhs, scale = layer.get_delta_factors(active[0])  # ΔW = scale · lhs · rhs: B [E, out, r], A [E, r, in]
        factors[layer.parameter_name] = (rhs.contiguous(), lhs.contiguous(), float(scale))
        layer = layer.base_layer
    if not _is_experts_module(layer):
        return None, f"the wrapped module is a {type(layer).__name__}, not stacked experts"
    impl = getattr(getattr(layer, "config", None), "_experts_implementation", IMPLEMENTATION)
    if impl != IMPLEMENTATION:
        return None, f"the experts run {impl!r}"
    experts_plan, reason = _experts_plan(layer, hidden)
    if experts_plan is None:
        return None, reason
    if getattr(layer, "is_transposed", False) or getattr(layer, "has_bias", False):
        return None, "LoRA on transposed or biased experts is not served yet"
    for name, (a, _, _) in factors.items():
        if hidden.is_cuda and a.shape[1] % 8 != 0:
            return None, f"LoRA rank {a.shape[1]} on the GPU (served: a multiple of 8)"
    return (experts_plan, factors), None


def _routing_args(args: tuple, kwargs: dict) -> Optional[tuple]:
    """(top_k_index, top_k_weights) of an experts call, or None for another signature."""
    names = ("top_k_index", "top_k_weights")
    values = list(args) + [kwargs[n] for n in names[len(args):] if n in kwargs]
    if len(values) != 2 or any(n not in names for n in kwargs):
        return None
    return tuple(values)


def _param_wrapper_forward(self, x, *args, **kwargs):
    """ParamWrapper.forward while moeforge.hf is on (see the section's comment)."""
    routing = _routing_args(args, kwargs)
    plan, reason = _lora_plan(self, x) if routing is not None else (None, "a call that is not the experts'")
    if plan is None:
        _report("ParamWrapper", reason, "PEFT's LoRA forward")
        return _stock_param_wrapper_forward(self, x, *args, **kwargs)
    (activation, alpha, limit, w_up, w_down, _, _), factors = plan
    up_name = "up_proj" if activation == "relu2" else "gate_up_proj"
    a_up, b_up, s_up = factors.get(up_name, (None, None, 0.0))
    a_down, b_down, s_down = factors.get("down_proj", (None, None, 0.0))
    index, weights = _valid_routing(*routing, w_up.shape[0])
    out = _call(experts_lora, x.contiguous(), index, weights, w_up.contiguous(), w_down.contiguous(), a_up, b_up,
                a_down, b_down, s_up, s_down, activation, alpha, limit)[0]
    return out.to(x.dtype)


def _patch_peft() -> None:
    if _ParamWrapper is not None:
        _ParamWrapper.forward = _param_wrapper_forward


def _unpatch_peft() -> None:
    if _ParamWrapper is not None:
        _ParamWrapper.forward = _stock_param_wrapper_forward


# --- the whole sparse MoE block (router, top-k, permute, experts, unpermute: one op) -------------------

_SIGMOID_FIELDS = ("num_group", "topk_group", "routed_scaling_factor", "e_score_correction_bias")


def _dims_of(x, gate_up, top_k, norm_topk_prob, sigmoid, n_group, topk_group, routed_scaling_factor) -> dict:
    """The C API's MoE block dims of moe_block's arguments."""
    return dict(hidden=x.shape[1], intermediate=gate_up.shape[1] // 2, num_experts=gate_up.shape[0], top_k=top_k,
                norm_topk_prob=norm_topk_prob, activation="swiglu", router="sigmoid" if sigmoid else "softmax",
                n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor)


@torch.library.custom_op("moeforge::moe_block", mutates_args=())
def moe_block(x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              correction_bias: Optional[torch.Tensor], top_k: int, norm_topk_prob: bool, sigmoid: bool, n_group: int,
              topk_group: int, routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The routed part of a sparse MoE block, whole: x [N, H], router [E, H], gate_up [E, 2I, H] (gate
    rows first), down [E, H, I]; the softmax router (top-k of softmax(x · routerᵀ), renormalised with
    norm_topk_prob) or, with `sigmoid`, DeepSeek-V3's (σ(x · routerᵀ) + correction_bias [E] f32 chosen
    by groups, the weights renormalised and scaled). Returns y [N, H] = Σ_k w · expert(x) and the
    activations the backward reads (an opaque int32 buffer of mf_moe_block_activation_bytes)."""
    x, router, gate_up, down = (t.detach() for t in (x, router, gate_up, down))
    dims = _dims_of(x, gate_up, top_k, norm_topk_prob, sigmoid, n_group, topk_group, routed_scaling_factor)
    acts = _bytes_tensor(ops.moe_block_activation_bytes(dims, x.shape[0], x.device.type), x.device)
    y = torch.empty_like(x)
    ops.moe_block_forward(dims, y, x, router, gate_up, down, correction_bias=correction_bias, workspace=acts,
                          ctx=_context(x))
    return y, acts


@moe_block.register_fake
def _(x, router, gate_up, down, correction_bias, top_k, norm_topk_prob, sigmoid, n_group, topk_group,
      routed_scaling_factor):
    N = x.shape[0]
    if isinstance(N, int):
        dims = _dims_of(x, gate_up, top_k, norm_topk_prob, sigmoid, n_group, topk_group, routed_scaling_factor)
        words = ops.moe_block_activation_bytes(dims, N, x.device.type) // 4
    else:  # (a symbolic token count: the buffer's size is the op's own business)
        words = torch.library.get_ctx().new_dynamic_size()
    return torch.empty_like(x), x.new_empty(words, dtype=torch.int32)


@torch.library.custom_op("moeforge::moe_block_backward", mutates_args=())
def moe_block_backward(dy: torch.Tensor, x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor,
                       down: torch.Tensor, correction_bias: Optional[torch.Tensor], acts: torch.Tensor, top_k: int,
                       norm_topk_prob: bool, sigmoid: bool, n_group: int, topk_group: int,
                       routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_block's gradients (d x, d router, d gate_up, d down), from the forward's activations; the
    backward's scratch is torch's, for this call only."""
    dy, x, router, gate_up, down, acts = (t.detach() for t in (dy, x, router, gate_up, down, acts))
    dims = _dims_of(x, gate_up, top_k, norm_topk_prob, sigmoid, n_group, topk_group, routed_scaling_factor)
    N, device = x.shape[0], x.device.type
    scratch = _bytes_tensor(ops.moe_block_workspace_bytes(dims, N, device) -
                            ops.moe_block_activation_bytes(dims, N, device), x.device)
    dx, drouter = torch.zeros_like(x), torch.zeros_like(router)  # (accumulated into)
    dgate_up, ddown = torch.empty_like(gate_up), torch.empty_like(down)  # (written whole)
    ops.moe_block_backward(dims, dx, drouter, dgate_up, ddown, dy, None, x, router, gate_up, down,
                           correction_bias=correction_bias, workspace=acts, scratch=scratch,
                           accumulate_expert_grads=False, ctx=_context(x))
    return dx, drouter, dgate_up, ddown


@moe_block_backward.register_fake
def _(dy, x, router, gate_up, down, correction_bias, acts, top_k, norm_topk_prob, sigmoid, n_group, topk_group,
      routed_scaling_factor):
    return torch.empty_like(x), torch.empty_like(router), torch.empty_like(gate_up), torch.empty_like(down)


_register_eager(moe_block_backward)


def _block_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    x, router, gate_up, down, correction_bias = inputs[:5]
    ctx.save_for_backward(x, router, gate_up, down, correction_bias, output[1])
    ctx.options = inputs[5:]


def _block_backward(ctx, dy, *_unused):
    if dy is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    x, router, gate_up, down, correction_bias, acts = ctx.saved_tensors
    grads = _call(moe_block_backward, dy.contiguous(), x, router, gate_up, down, correction_bias, acts, *ctx.options)
    return (*grads, None, None, None, None, None, None, None)


_register_autograd(moe_block, _block_backward, _block_setup_context)

try:  # (transformers' record of which module outputs a forward collects: router logits for the aux loss)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # pragma: no cover - an older transformers
    _active_collector = None


def _router_logits_recorded() -> bool:
    collected = _active_collector.get() if _active_collector is not None else None
    return bool(collected) and "router_logits" in collected


def _router(module: torch.nn.Module) -> tuple:
    """(router spec, None) of a block's gate that moe_block computes, or (None, reason). The spec is
    (weight, correction_bias, top_k, norm_topk_prob, sigmoid, n_group, topk_group, routed_scaling_factor)."""
    gate = getattr(module, "gate", None)
    family = FUSED_BLOCKS.get(type(module).__name__)
    if family is None or type(gate).__name__ != family[1]:
        return None, f"a gate of class {type(gate).__name__} (served: {family[1] if family else 'none'})"
    weight, top_k = getattr(gate, "weight", None), getattr(gate, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        return None, "a gate without a [E, H] weight and an integer top_k"
    if getattr(gate, "bias", None) is not None:
        return None, "a gate with a bias"
    norm = bool(getattr(gate, "norm_topk_prob", True))  # (Mixtral's always renormalises)
    if family[2] == "softmax":
        return (weight, None, top_k, norm, False, 1, 1, 1.0), None
    n_group, topk_group, scaling, bias = (getattr(gate, f, None) for f in _SIGMOID_FIELDS)
    if not isinstance(bias, torch.Tensor) or bias.dtype != torch.float32:
        return None, "a sigmoid gate without an fp32 e_score_correction_bias"
    return (weight, bias, top_k, norm, True, int(n_group), int(topk_group), float(scaling)), None


def _block_plan(module: torch.nn.Module, hidden_states: Optional[torch.Tensor] = None) -> tuple:
    """((router spec, w_up, w_down), None) for a sparse MoE block that runs as one moeforge op, else
    (None, the reason: the block then runs its own forward, its experts still on moeforge where they
    are served)."""
    spec, reason = _router(module)
    if spec is None:
        return None, reason
    experts = getattr(module, "experts", None)
    if hasattr(experts, "base_layer"):  # (a PEFT wrapper: its LoRA runs in its own forward)
        return None, f"PEFT-wrapped experts ({type(experts).__name__})"
    if not _is_experts_module(experts):
        return None, f"experts of class {type(experts).__name__} (not stacked expert tensors)"
    plan, reason = _experts_plan(experts, hidden_states)
    if plan is None:
        return None, reason
    activation, _, _, w_up, w_down, b_up, _ = plan
    if activation != "swiglu" or getattr(experts, "is_transposed", False) or b_up is not None:
        return None, "experts other than untransposed SwiGLU without biases"
    weight = spec[0]
    if weight.dtype != w_up.dtype or weight.device != w_up.device or tuple(weight.shape) != (w_up.shape[0],
                                                                                              w_up.shape[2]):
        return None, (f"a gate weight {tuple(weight.shape)} {weight.dtype} beside experts {tuple(w_up.shape)} "
                      f"{w_up.dtype}")
    if spec[4] and spec[1].device != w_up.device:
        return None, "the correction bias on another device"
    if module.training and getattr(module, "jitter_noise", 0) > 0:
        return None, "router jitter noise in training"
    if hidden_states is not None and hidden_states.dtype != w_up.dtype:
        return None, f"{hidden_states.dtype} hidden states with {w_up.dtype} experts"
    return (spec, w_up, w_down), None


def block_unsupported_reason(module: torch.nn.Module, hidden_states: Optional[torch.Tensor] = None) -> Optional[str]:
    """Why a sparse MoE block cannot run as one moeforge op (it then runs its own forward, the experts
    still on moeforge where they are served), or None when it can."""
    return _block_plan(module, hidden_states)[1]


class _FusedMoeBlock:
    """A transformers sparse MoE block whose routed part (router, top-k, permute, experts, unpermute)
    is one moeforge op; shared experts stay the block's own modules. The same parameters, names and
    submodules as the family's class (it is a subclass); its own forward where the op does not serve
    it (a logged reason), or while transformers records the router logits (output_router_logits: the
    aux loss reads them from the gate)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        plan, reason = (None, "router logits recorded") if _router_logits_recorded() else _block_plan(
            self, hidden_states)
        if plan is None or hidden_states.numel() == 0:
            if plan is None:
                _report(type(self).__name__, reason, "its own forward")
            return super().forward(hidden_states)
        (weight, bias, *router_options), w_up, w_down = plan
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        y = _call(moe_block, x.contiguous(), weight.contiguous(), w_up.contiguous(), w_down.contiguous(),
                  None if bias is None else bias.contiguous(), *router_options)[0]
        shared = FUSED_BLOCKS[type(self).__name__][3]
        if shared == "gated_shared_expert":  # Qwen2-MoE
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        elif shared == "shared_experts":  # DeepSeek-V3, GLM-4.5
            y = y + self.shared_experts(x)
        return y.reshape(shape)


# The sparse MoE blocks served whole: class -> (modeling module, gate class, router, shared experts).
FUSED_BLOCKS = {
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "Qwen3MoeTopKRouter", "softmax", None),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "Qwen2MoeTopKRouter", "softmax", "gated_shared_expert"),
    "MixtralSparseMoeBlock": ("mixtral", "MixtralTopKRouter", "softmax", None),
    "OlmoeSparseMoeBlock": ("olmoe", "OlmoeTopKRouter", "softmax", None),
    "DeepseekV3MoE": ("deepseek_v3", "DeepseekV3TopkRouter", "sigmoid", "shared_experts"),
    "Glm4MoeMoE": ("glm4_moe", "Glm4MoeTopkRouter", "sigmoid", "shared_experts"),
}
# --- the attention's per-head q/k RMSNorm and rotary embedding, fused (Qwen3-MoE's q_norm / k_norm) ---


@torch.library.custom_op("moeforge::qknorm_rope", mutates_args=())
def qknorm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, Hq, D] and k [N, Hkv, D] (the projections, contiguous): each head RMS-normalised with
    q_weight / k_weight [D], then rotated by cos, sin [N, D] (transformers' position_embeddings, as
    q·cos + rotate_half(q)·sin). Returns (q_out, k_out, q_rstd, k_rstd), the last two f32 for the
    backward."""
    q, k, q_weight, k_weight = q.detach(), k.detach(), q_weight.detach(), k_weight.detach()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    q_rstd = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    k_rstd = torch.empty(k.shape[:2], dtype=torch.float32, device=k.device)
    if q.shape[0] > 0:
        ops.qknorm_rope_forward(q_out, k_out, q_rstd, k_rstd, q, k, q_weight, k_weight, cos.detach(), sin.detach(),
                                eps=eps, ctx=_context(q))
    return q_out, k_out, q_rstd, k_rstd


@qknorm_rope.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps):
    return (torch.empty_like(q), torch.empty_like(k), q.new_empty(q.shape[:2], dtype=torch.float32),
            k.new_empty(k.shape[:2], dtype=torch.float32))


@torch.library.custom_op("moeforge::qknorm_rope_backward", mutates_args=())
def qknorm_rope_backward(dq_out: torch.Tensor, dk_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, q_rstd: torch.Tensor, k_rstd: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                        torch.Tensor]:
    """qknorm_rope's gradients (d q, d k, d q_weight, d k_weight; the weights' summed in fp32)."""
    args = [t.detach() for t in (dq_out, dk_out, q, k, q_weight, k_weight, q_rstd, k_rstd, cos, sin)]
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    D = q.shape[-1]
    dq_weight = torch.zeros(D, dtype=torch.float32, device=q.device)  # (accumulated into)
    dk_weight = torch.zeros(D, dtype=torch.float32, device=q.device)
    if q.shape[0] > 0:
        ops.qknorm_rope_backward(dq, dk, dq_weight, dk_weight, *args, ctx=_context(q))
    return dq, dk, dq_weight.to(q_weight.dtype), dk_weight.to(k_weight.dtype)


@qknorm_rope_backward.register_fake
def _(dq_out, dk_out, q, k, q_weight, k_weight, q_rstd, k_rstd, cos, sin):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(q_weight), torch.empty_like(k_weight)


_register_eager(qknorm_rope_backward)


def _qknorm_rope_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    q, k, q_weight, k_weight, cos, sin, _ = inputs
    ctx.save_for_backward(q, k, q_weight, k_weight, output[2], output[3], cos, sin)


def _qknorm_rope_backward(ctx, dq_out, dk_out, *_unused):
    if dq_out is None and dk_out is None:
        return _no_grads(ctx)
    q, k, q_weight, k_weight, q_rstd, k_rstd, cos, sin = ctx.saved_tensors
    dq_out = torch.zeros_like(q) if dq_out is None else dq_out.contiguous()
    dk_out = torch.zeros_like(k) if dk_out is None else dk_out.contiguous()
    dq, dk, dq_weight, dk_weight = _call(qknorm_rope_backward, dq_out, dk_out, q, k, q_weight, k_weight, q_rstd,
                                         k_rstd, cos, sin)
    return dq, dk, dq_weight, dk_weight, None, None, None


_register_autograd(qknorm_rope, _qknorm_rope_backward, _qknorm_rope_setup_context)


def qknorm_rope_unsupported_reason(module: torch.nn.Module, hidden_states: torch.Tensor,
                                   position_embeddings) -> Optional[str]:
    """Why an attention module's q/k norm and rotary embedding run stock, or None when moeforge's
    qknorm_rope serves them."""
    want = _served_dtype(hidden_states.device.type)
    if want is None or hidden_states.dtype != want or hidden_states.dim() != 3:
        return f"{hidden_states.dim()}-d {hidden_states.dtype} hidden states on {hidden_states.device.type}"
    if hidden_states.device.type == "cuda" and not _HAS_CUDA:
        return "moeforge was built without CUDA (or sees no GPU)"
    q_norm, k_norm, D = getattr(module, "q_norm", None), getattr(module, "k_norm", None), module.head_dim
    norm_class = FUSED_ATTENTION[type(module).__name__][1]
    if type(q_norm).__name__ != norm_class or type(k_norm).__name__ != norm_class:
        return f"q/k norms of classes {type(q_norm).__name__} / {type(k_norm).__name__} (served: {norm_class})"
    if q_norm.variance_epsilon != k_norm.variance_epsilon:
        return "q and k norms with different epsilons"
    for w in (q_norm.weight, k_norm.weight):
        if w.shape != (D,) or w.dtype != want or w.device != hidden_states.device:
            return f"a {w.dtype} q/k norm weight of shape {tuple(w.shape)} (head dim {D})"
    if D % 2 != 0 or (hidden_states.device.type == "cuda" and D > 256):
        return f"head dim {D} (served: even, at most 256 on a GPU)"
    if not isinstance(position_embeddings, (tuple, list)) or len(position_embeddings) != 2:
        return "position_embeddings that are not (cos, sin)"
    B, T = hidden_states.shape[:2]
    for t in position_embeddings:
        if (not isinstance(t, torch.Tensor) or t.dim() != 3 or t.shape[0] not in (1, B) or t.shape[1:] != (T, D)
                or t.dtype != want or t.requires_grad):
            return "cos/sin tables that are not [B or 1, T, head_dim] constants of the hidden states' dtype"
    return None


class _FusedQKNormRopeAttention:
    """A transformers attention module whose per-head q/k RMSNorm and rotary embedding run as one
    moeforge op (qknorm_rope), the rest as its own forward (projections, the attention interface,
    o_proj, a KV cache's update with the rotated keys); its own forward where the op does not serve
    it (a logged reason): other dtypes, another norm class, tables of another shape."""

    def forward(self, hidden_states: torch.Tensor, position_embeddings, attention_mask, past_key_values=None,
                **kwargs):
        reason = qknorm_rope_unsupported_reason(self, hidden_states, position_embeddings)
        if reason is not None:
            _report(type(self).__name__, reason, "its own q/k norm and rotary embedding")
            return super().forward(hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
        B, T = hidden_states.shape[:2]
        D = self.head_dim
        cos, sin = (t.expand(B, T, D).reshape(B * T, D) for t in position_embeddings)
        q = self.q_proj(hidden_states).reshape(B * T, -1, D)
        k = self.k_proj(hidden_states).reshape(B * T, -1, D)
        q, k = _call(qknorm_rope, q.contiguous(), k.contiguous(), self.q_norm.weight, self.k_norm.weight,
                     cos.contiguous(), sin.contiguous(), float(self.q_norm.variance_epsilon))[:2]
        query_states = q.view(B, T, -1, D).transpose(1, 2)
        key_states = k.view(B, T, -1, D).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(B, T, -1, D).transpose(1, 2)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        modeling = sys.modules[FUSED_ATTENTION[type(self).__name__][2]]
        attention_interface = modeling_utils.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                                  modeling.eager_attention_forward)
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
            sliding_window=self.sliding_window, **kwargs)
        attn_output = attn_output.reshape(B, T, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


# The attention classes whose q/k norm and rotary embedding run fused: class -> (modeling module, norm
# class, the module's import name, filled in by _make_fused_classes). Their forward is Qwen3-MoE's
# (transformers 5.x): q_norm / k_norm over each head, then apply_rotary_pos_emb.
FUSED_ATTENTION = {
    "Qwen3MoeAttention": ["qwen3_moe", "Qwen3MoeRMSNorm", None],
}
_FUSED_OF: Dict[type, type] = {}  # stock class -> its fused subclass


def _make_fused_classes() -> None:
    import importlib
    kinds = [(FUSED_BLOCKS, _FusedMoeBlock, "its routed part on moeforge.moe_block"),
             (FUSED_ATTENTION, _FusedQKNormRopeAttention, "its q/k norm and rotary embedding on moeforge.qknorm_rope")]
    for table, mixin, what in kinds:
        for name, row in table.items():
            try:
                module = importlib.import_module(f"transformers.models.{row[0]}.modeling_{row[0]}")
            except ImportError:
                continue
            stock = getattr(module, name, None)
            if not isinstance(stock, type):
                continue
            if table is FUSED_ATTENTION:
                row[2] = module.__name__
            _FUSED_OF[stock] = type(name, (mixin, stock), {"__module__": __name__, "__qualname__": f"Fused{name}",
                                                           "__doc__": f"{name} with {what}"})


_make_fused_classes()


def _register_block_patches() -> None:
    try:
        from transformers.monkey_patching import get_patch_mapping, register_patch_mapping
    except ImportError:  # pragma: no cover - an older transformers
        return
    taken = get_patch_mapping()
    for stock, fused in _FUSED_OF.items():
        if stock.__name__ in taken and taken[stock.__name__] is not fused:
            _log.warning("moeforge.hf: %s already has a patch mapping (%s): its blocks are not fused",
                         stock.__name__, taken[stock.__name__].__name__)
            continue
        register_patch_mapping({stock.__name__: fused}, overwrite=True)


def _unregister_block_patches() -> None:
    try:
        from transformers.monkey_patching import get_patch_mapping, unregister_patch_mapping
    except ImportError:  # pragma: no cover
        return
    taken = get_patch_mapping()
    unregister_patch_mapping([n for n, cls in taken.items() if cls in _FUSED_OF.values()])


def _fuse_blocks(model: torch.nn.Module, fuse: bool = True) -> None:
    """Swaps the class of each sparse MoE block of `model` to its fused subclass (fuse=False: back)."""
    stock_of = {fused: stock for stock, fused in _FUSED_OF.items()}
    for sub in model.modules():
        swapped = _FUSED_OF.get(type(sub)) if fuse else stock_of.get(type(sub))
        if swapped is not None:
            sub.__class__ = swapped


# --- attention (AttentionInterface "moeforge", with its AttentionMaskInterface entry) -------------------
#
# The mask function hands the attention the mask in the form moeforge's kernels take: None for the
# plain causal mask, or document ids [B, T] int32 (packed sequences, from position_ids; a padded
# batch, each padding token its own document) where a token attends to the earlier tokens of its
# own document. Anything else (sliding windows, KV caches, padding inside a row, custom mask
# functions) gets transformers' sdpa mask, and the attention runs torch's SDPA with it. The plain
# causal mask runs torch's SDPA too (cuDNN's flash attention, faster at these shapes than
# moeforge's own kernel); documents run moeforge's kernel, which skips the blocks between documents
# instead of reading a [B, 1, T, T] mask.

@torch.library.custom_op("moeforge::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              doc_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal GQA attention, token-major: q [B, T, Hq, D], k and v [B, T, Hkv, D] (contiguous), doc_ids
    [B, T] int32 or None; scale 1/sqrt(D). Returns out [B, T, Hq, D] and the row log-sum-exps [B, Hq,
    T] fp32 (what the backward reads)."""
    q, k, v = q.detach(), k.detach(), v.detach()
    B, T, Hq, _ = q.shape
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if q.numel() > 0:
        ops.attention_forward(out, lse, q, k, v, doc_ids, B, T, Hq, k.shape[2], ctx=_context(q))
    return out, lse


@attention.register_fake
def _(q, k, v, doc_ids):
    B, T, Hq, _ = q.shape
    return torch.empty_like(q), q.new_empty(B, Hq, T, dtype=torch.float32)


@torch.library.custom_op("moeforge::attention_backward", mutates_args=())
def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, doc_ids: Optional[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attention's gradients (d q, d k, d v)."""
    dout, q, k, v, out, lse = (t.detach() for t in (dout, q, k, v, out, lse))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() > 0:
        B, T, Hq, _ = q.shape
        ops.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, doc_ids, B, T, Hq, k.shape[2], ctx=_context(q))
    return dq, dk, dv


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, doc_ids):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_register_eager(attention_backward)


def _attention_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    q, k, v, doc_ids = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], doc_ids)


def _attention_backward(ctx, dout, *_unused):
    if dout is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    q, k, v, out, lse, doc_ids = ctx.saved_tensors
    return (*_call(attention_backward, dout.contiguous(), q, k, v, out, lse, doc_ids), None)


_register_autograd(attention, _attention_backward, _attention_setup_context)

from transformers import masking_utils as _masking  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward as _sdpa  # noqa: E402


def _packed_document_ids(mask_function) -> Optional[torch.Tensor]:
    """The document ids of create_causal_mask's packed-sequence mask function (causal AND same
    packed sequence, transformers' find_packed_sequence_indices), or None for any other function."""

    def free_vars(f) -> dict:
        code, cells = getattr(f, "__code__", None), getattr(f, "__closure__", None) or ()
        return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}

    parts = free_vars(mask_function).get("mask_functions")
    if getattr(mask_function, "__name__", "") != "and_mask" or not isinstance(parts, tuple) or len(parts) != 2:
        return None
    if parts[0] is not _masking.causal_mask_function or getattr(parts[1], "__name__", "") != "inner_mask":
        return None
    docs = free_vars(parts[1]).get("packed_sequence_mask")
    return docs if isinstance(docs, torch.Tensor) and docs.dim() == 2 else None


def _padding_document_ids(valid: torch.Tensor) -> Optional[torch.Tensor]:
    """Document ids for a padding mask valid [B, T] whose real tokens are one run per row (left or right
    padding): the run one document, every padding token its own; None (plain causal) when nothing is
    padded, or the string "interior" when a row's real tokens are split."""
    starts = torch.ones_like(valid)
    starts[:, 1:] = ~valid[:, 1:] | ~valid[:, :-1]  # (a token after padding, or padding, starts a document)
    runs = (valid & starts).sum(1)
    flags = torch.stack([valid.all(), (runs > 1).any()]).tolist()  # (one device sync per forward)
    if flags[0]:
        return None
    if flags[1]:
        return "interior"
    return (starts.cumsum(1) - 1).to(torch.int32)


def attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                   mask_function=_masking.causal_mask_function, attention_mask: Optional[torch.Tensor] = None,
                   **kwargs):
    """transformers' AttentionMaskInterface entry "moeforge" (see the section's comment)."""

    def stock():
        return _masking.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                                  kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                                  **kwargs)

    plain = mask_function is _masking.causal_mask_function
    if (kwargs.get("local_size") is not None or kwargs.get("use_vmap") or q_length != kv_length
            or not isinstance(q_offset, int) or q_offset != 0 or kv_offset != 0):
        return stock()
    if plain and attention_mask is None:
        return None
    if plain:
        if torch.compiler.is_compiling():  # (no data-dependent branch in a graph: transformers' mask)
            return stock()
        docs = _padding_document_ids(attention_mask[:, -kv_length:].bool())
        return stock() if isinstance(docs, str) else docs
    docs = _packed_document_ids(mask_function) if attention_mask is None else None
    return stock() if docs is None else docs.to(torch.int32)


def attention_unsupported_reason(module, query, key, value, dropout: float, scaling: Optional[float],
                                 kwargs: dict) -> Optional[str]:
    """Why moeforge's attention kernel cannot serve this call (it then runs torch's SDPA), or None."""
    B, Hq, T, D = query.shape
    want = _served_dtype(query.device.type)
    if want is None or query.dtype != want or key.dtype != want or value.dtype != want:
        return f"{query.dtype} attention on {query.device.type}"
    if query.device.type == "cuda" and (not _HAS_CUDA or D not in (64, 128)):
        return f"head dim {D} on the GPU (served: 64, 128)" if _HAS_CUDA else "moeforge was built without CUDA"
    if key.shape[-1] != D or value.shape[-1] != D or key.shape[2] != T or Hq % key.shape[1] != 0:
        return f"query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}"
    if scaling is not None and abs(scaling * math.sqrt(D) - 1.0) > 1e-6:
        return f"scaling {scaling} (moeforge's is 1/sqrt({D}))"
    if dropout > 0:
        return f"attention dropout {dropout}"
    for key_name in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(key_name) is not None:
            return f"{key_name} (not served)"
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return "non-causal attention"
    return None


def _document_mask(docs: torch.Tensor) -> torch.Tensor:
    """The [B, 1, T, T] boolean mask of document ids (causal within documents), for SDPA."""
    T = docs.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return (docs[:, None, :, None] == docs[:, None, None, :]) & causal


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs):
    """transformers' AttentionInterface entry "moeforge": query [B, Hq, T, D], key and value [B, Hkv,
    T, D]; returns ([B, T, Hq, D], None)."""
    docs = attention_mask if attention_mask is not None and attention_mask.dtype == torch.int32 else None
    if docs is None or kwargs.get("output_attentions", False):
        if docs is not None:
            attention_mask = _document_mask(docs)
        return _sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    reason = attention_unsupported_reason(module, query, key, value, dropout if module.training else 0.0, scaling,
                                          kwargs)
    if reason is not None:
        _report(type(module).__name__, reason, "torch's SDPA")
        return _sdpa(module, query, key, value, _document_mask(docs), dropout=dropout, scaling=scaling, **kwargs)
    out, _ = _call(attention, query.transpose(1, 2).contiguous(), key.transpose(1, 2).contiguous(),
                   value.transpose(1, 2).contiguous(), docs.contiguous())
    return out, None


# --- RMSNorm -------------------------------------------------------------------------------------------


@torch.library.custom_op("moeforge::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] (contiguous), weight [C]: out = weight · x / sqrt(mean(x²) + eps) over the last
    dimension, and rstd (fp32, one per row; what the backward reads)."""
    x, weight = x.detach(), weight.detach()
    C = x.shape[-1]
    rows = x.reshape(-1, C)
    out = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    if rows.shape[0] > 0:
        ops.rmsnorm_forward(out, rstd, rows, weight, eps=eps, ctx=_context(x))
    return out.view(x.shape), rstd


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x), x.new_empty(x.numel() // x.shape[-1], dtype=torch.float32)


@torch.library.custom_op("moeforge::rms_norm_backward", mutates_args=())
def rms_norm_backward(dout: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                      rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of rms_norm's out: (d x, d weight in weight's dtype, summed in fp32)."""
    # (rstd is an output of rms_norm, so it requires grad too: torch exports no such tensor)
    dout, x, weight, rstd = dout.detach(), x.detach(), weight.detach(), rstd.detach()
    C = x.shape[-1]
    rows = x.reshape(-1, C)
    dx = torch.empty_like(rows)  # (written: accumulate_dinp=False never reads it)
    dweight = torch.zeros(C, dtype=torch.float32, device=x.device)  # (the op adds into it)
    if rows.shape[0] > 0:
        ops.rmsnorm_backward(dx, dweight, dout.reshape(-1, C), rows, weight, rstd, accumulate_dinp=False,
                             ctx=_context(x))
    return dx.view(x.shape), dweight.to(weight.dtype)


@rms_norm_backward.register_fake
def _(dout, x, weight, rstd):
    return torch.empty_like(x), torch.empty_like(weight)


_register_eager(rms_norm_backward)


def _rms_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dout, *_unused):
    if dout is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = _call(rms_norm_backward, dout.contiguous(), x, weight, rstd)
    return dx, dweight, None


_register_autograd(rms_norm, _rms_backward, _rms_setup_context)

# The RMSNorm classes whose forward is weight · x / sqrt(mean(x²) + eps) over the last dimension with
# the epsilon in `variance_epsilon` (transformers' MoE families; each checked against its stock
# forward by the GPU machine's tests). Their forward is replaced class-wide while moeforge.hf is on.
NORM_CLASSES = ("Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm", "DeepseekV3RMSNorm",
                "Glm4MoeRMSNorm", "GptOssRMSNorm", "NemotronHRMSNorm")
_stock_norm_forwards: Dict[type, Any] = {}


def norm_unsupported_reason(module: torch.nn.Module, x: torch.Tensor) -> Optional[str]:
    """Why this RMSNorm call runs stock, or None when moeforge serves it."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or x.dim() < 1 or x.shape[-1] != weight.shape[0]:
        return "a weight that is not one value per channel"
    want = _served_dtype(x.device.type)
    if want is None or x.dtype != want or weight.dtype != want or weight.device != x.device:
        return f"{x.dtype} inputs with a {weight.dtype} weight on {x.device.type}"
    if x.device.type == "cuda" and not _HAS_CUDA:
        return "moeforge was built without CUDA (or sees no GPU)"
    return None


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if norm_unsupported_reason(self, hidden_states) is not None:
        return _stock_norm_forwards[type(self)](self, hidden_states)
    return _call(rms_norm, hidden_states.contiguous(), self.weight, float(self.variance_epsilon))[0]


def _patch_norms(classes) -> None:
    for cls in classes:
        if cls.__name__ in NORM_CLASSES and cls not in _stock_norm_forwards and hasattr(cls, "forward"):
            _stock_norm_forwards[cls] = cls.forward
            cls.forward = _norm_forward


def _unpatch_norms() -> None:
    for cls, forward in _stock_norm_forwards.items():
        cls.forward = forward
    _stock_norm_forwards.clear()


def _norm_classes_of_module(module_name: str) -> list:
    """The classes of one modeling module (the one a model's class comes from)."""
    mod = sys.modules.get(module_name)
    return [v for v in vars(mod).values() if isinstance(v, type)] if mod is not None else []


# --- the input embedding (a plain torch.nn.Embedding: models made while the default is on, enable(model)) --


@torch.library.custom_op("moeforge::embedding", mutates_args=())
def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """weight's rows at ids (int32 [N]): [N, C]. padding_idx (-1: none) is the row that gets no
    gradient (torch.nn.Embedding's)."""
    out = weight.new_empty(ids.shape[0], weight.shape[1])
    if ids.shape[0] > 0:
        ops.embedding_forward(out, ids.contiguous(), weight.detach(), ctx=_context(weight))
    return out


@embedding.register_fake
def _(ids, weight, padding_idx):
    return weight.new_empty(ids.shape[0], weight.shape[1])


@torch.library.custom_op("moeforge::embedding_backward", mutates_args=())
def embedding_backward(dout: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """The weight's gradient (weight: its shape and dtype only): each id's row the sum of its tokens'
    dout rows in fp32, in token order (deterministic, no atomics); padding_idx's row (>= 0) zero."""
    dweight = torch.zeros_like(weight)  # (the op adds into it)
    n = ids.shape[0]
    if n > 0:
        workspace = None
        if weight.is_cuda:  # (the sort's scratch from torch's allocator, so that torch counts it)
            nbytes = ops.embedding_backward_workspace_bytes(n, weight.shape[0], "cuda")
            workspace = _bytes_tensor((nbytes + 3) // 4 * 4, weight.device)
        ops.embedding_backward(dweight, dout.detach(), ids.contiguous(), ctx=_context(weight, workspace))
    if padding_idx >= 0:
        dweight[padding_idx].zero_()
    return dweight


@embedding_backward.register_fake
def _(dout, ids, weight, padding_idx):
    return torch.empty_like(weight)


_register_eager(embedding_backward)


def _embedding_setup_context(ctx, inputs, output):
    ids, weight, padding_idx = inputs
    ctx.save_for_backward(ids, weight)
    ctx.padding_idx = padding_idx


def _embedding_backward(ctx, dout):
    ids, weight = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:  # (a frozen table)
        return None, None, None
    return None, _call(embedding_backward, dout.contiguous(), ids, weight, ctx.padding_idx), None


_register_autograd(embedding, _embedding_backward, _embedding_setup_context)


def embedding_unsupported_reason(module: torch.nn.Embedding, input_ids: torch.Tensor) -> Optional[str]:
    """Why this embedding call runs stock, or None when moeforge serves it."""
    if module.max_norm is not None:
        return "max_norm (the lookup renormalises the weight in place)"
    if module.scale_grad_by_freq or module.sparse:
        return "scale_grad_by_freq or a sparse gradient"
    if input_ids.dtype not in (torch.int32, torch.int64) or input_ids.device != module.weight.device:
        return f"{input_ids.dtype} ids on {input_ids.device.type} for a table on {module.weight.device.type}"
    if module.weight.dtype != _served_dtype(module.weight.device.type):
        return f"a {module.weight.dtype} table on {module.weight.device.type}"
    if module.weight.is_cuda and not _HAS_CUDA:
        return "moeforge was built without CUDA (or sees no GPU)"
    return None


class _Embedding(torch.nn.Embedding):
    """A model's input embedding on moeforge (its class swapped in place when the model is made, or by
    enable(model): the same parameter, name and ties). The lookup is a gather either way; the gradient
    is where it pays: a deterministic sorted sum per id instead of torch's sort, scatter and
    per-segment passes."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (torch.nn.Embedding's name)
        if embedding_unsupported_reason(self, input) is not None:
            return super().forward(input)
        if not input.is_cuda and input.numel() > 0 and not torch.compiler.is_compiling():
            # (int64 ids past int32 would wrap into the table when narrowed: refused as stock refuses them)
            lo, hi = int(input.min()), int(input.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(f"moeforge.hf embedding: token id {lo if lo < 0 else hi} is outside "
                                 f"[0, {self.num_embeddings})")
        ids = input.reshape(-1).to(torch.int32)
        # (torch.nn.Embedding keeps padding_idx in [0, num_embeddings): a negative one is normalised)
        out = _call(embedding, ids, self.weight, -1 if self.padding_idx is None else self.padding_idx)
        return out.view(*input.shape, self.embedding_dim)


def _input_embedding(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The model's input embedding module, or None where it has none (or says it has none)."""
    getter = getattr(model, "get_input_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except Exception:  # noqa: BLE001 (called while any model is made: a model's own refusal must not stop that)
        return None


def _swap_embedding(model: torch.nn.Module) -> None:
    emb = _input_embedding(model)
    if type(emb) is torch.nn.Embedding:
        emb.__class__ = _Embedding


# --- the fused linear cross-entropy (opt-in: enable(model, fused_loss=True)) -----------------------------


@torch.library.custom_op("moeforge::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, count: torch.Tensor,
                         logits_bf16: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, C], weight [V, C] (the LM head), targets int32 [N] (-100: ignored). Returns the fp32
    scalar loss = Σ_r CE(hidden[r] · weightᵀ, targets[r]) / count (a 0-d tensor: on a GPU it stays
    there, read by the loss kernel, so neither torch.compile nor the host waits on it) and its
    gradients (d hidden, d weight), computed in the same pass: the [N, V] logits are never stored
    whole. logits_bf16 rounds the logits to bf16 before the softmax, as a bf16 model's lm_head output is."""
    hidden, weight = hidden.detach(), weight.detach()
    n = hidden.shape[0]
    count = count.detach()
    if count.device.type == "cuda":
        # 1 / count stays on the device and the loss kernel reads it there: float(count) would make the
        # host wait for the whole forward (and a host copy to the device would too).
        scale_by = torch.reciprocal(count.to(device=hidden.device, dtype=torch.float32)).reshape(1)
        grad_scale, scale = 1.0, scale_by[0]
    else:
        scale_by, grad_scale = None, 1.0 / float(count)
        scale = grad_scale
    losses = torch.zeros(n, dtype=torch.float32, device=hidden.device)
    if n == 0:
        return losses.sum() * scale, torch.zeros_like(hidden), torch.zeros_like(weight)
    # The op writes dh and dw (accumulate=False: never read, so no zero-fill; for P1's LM head a
    # [151936, 2048] fill and its read by the first chunk's product).
    dh, dw = torch.empty_like(hidden), torch.empty_like(weight)
    logits_dtype = "bfloat16" if logits_bf16 else "float32"
    workspace = None
    if hidden.device.type == "cuda":  # the loss's scratch from torch's allocator, so that torch counts it
        nbytes = ops.lm_head_cross_entropy_workspace_bytes(n, weight.shape[0], logits_dtype, "cuda")
        workspace = torch.empty((nbytes + 3) // 4, dtype=torch.float32, device=hidden.device)
    ops.lm_head_cross_entropy(losses, dh, dw, hidden, weight, targets, grad_scale=grad_scale,
                              logits_dtype=logits_dtype, accumulate=False, grad_scale_by=scale_by,
                              ctx=_context(hidden, workspace))
    return losses.sum() * scale, dh, dw


@linear_cross_entropy.register_fake
def _(hidden, weight, targets, count, logits_bf16):
    return hidden.new_empty((), dtype=torch.float32), torch.empty_like(hidden), torch.empty_like(weight)


def _lce_setup_context(ctx, inputs, output):
    ctx.set_materialize_grads(False)  # (no zero gradients made for the outputs the loss never reads)
    ctx.save_for_backward(output[1], output[2])


@torch.library.custom_op("moeforge::scale_by_", mutates_args=("tensors",))
def scale_by_(tensors: list[torch.Tensor], scale: torch.Tensor) -> None:
    """Each tensor *= scale in place (scale: one fp32 element on their device, read there: no host
    sync). A scale of exactly 1 leaves them untouched and unread."""
    scale = scale.detach().reshape(1).to(torch.float32)
    for t in tensors:
        ops.scale_by(t, scale, ctx=_context(t))


@scale_by_.register_fake
def _(tensors, scale):
    return None


def _lce_backward(ctx, dloss, *_unused):
    if dloss is None:  # (the main output took no part in the loss)
        return _no_grads(ctx)
    dh, dw = ctx.saved_tensors
    if torch.compiler.is_compiling():
        # Traced (the backward of a compiled graph): the functional product, which the compiler fuses.
        dh, dw = torch._foreach_mul([dh, dw], dloss.to(dw.dtype))
    else:
        # Eager: the op's own gradients scaled in place by dloss, which is 1 for a loss backpropagated as
        # it is (then nothing is read or written: for P1's LM head, [151936, 2048], a 470 µs pass saved on
        # an H200). The saved outputs are thereby consumed: a second backward through this loss
        # (retain_graph) is refused by autograd's in-place check rather than given scaled values.
        scale_by_([dh, dw], dloss)  # (through the dispatcher: it bumps their version counters)
    return dh, dw, None, None, None


_register_autograd(linear_cross_entropy, _lce_backward, _lce_setup_context)


class _HiddenHead(torch.nn.Linear):
    """The LM head under the fused loss (its class swapped in place: the same parameters, names and
    ties): it returns its input, the hidden states; the model's replaced forward applies the weight
    itself, fused with the loss, or as the plain product when there are no labels."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def fused_loss_reason(model: torch.nn.Module) -> Optional[str]:
    """Why the fused loss cannot replace `model`'s, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear):
        return "the model has no Linear output embedding (lm_head)"
    if type(head) not in (torch.nn.Linear, _HiddenHead):
        return f"the LM head is a {type(head).__name__}, not a torch.nn.Linear"
    if head.bias is not None:
        return "the LM head has a bias"
    for key in ("final_logit_softcapping", "logit_scale"):
        if getattr(model.config, key, None) not in (None, 0, 0.0, 1, 1.0):
            return f"config.{key} = {getattr(model.config, key)} changes the logits"
    want = _served_dtype(head.weight.device.type)
    if head.weight.dtype != want:
        return f"a {head.weight.dtype} LM head on {head.weight.device.type}"
    return None


def _enable_fused_loss(model: torch.nn.Module) -> None:
    reason = fused_loss_reason(model)
    if reason is not None:
        raise ValueError(f"moeforge.hf: fused_loss=True: {reason}")
    if getattr(model, "_moeforge_stock_forward", None) is not None:
        return
    stock = model.forward
    head = model.get_output_embeddings()

    # (wraps: inspect.signature(model.forward) is stock's, which HF Trainer reads to keep the dataset's
    # columns and to pass num_items_in_batch)
    @functools.wraps(stock)
    def forward(*args, labels=None, num_items_in_batch=None, shift_labels=None, **kwargs):
        """The model's forward with the loss on moeforge's fused LM head + cross-entropy: as
        transformers computes it (labels shifted by one, -100 ignored, the sum over
        num_items_in_batch when given, else the mean), plus the router's auxiliary loss where the
        model adds one; the output's logits are None."""
        want_tuple = kwargs.get("return_dict", None) is False
        kwargs["return_dict"] = True
        out = stock(*args, **kwargs)
        hidden = out.logits  # (the head returned its input)
        # (a new output of the model's class: its keys, what HF Trainer's outputs["loss"] and
        # to_tuple() read, are the non-None fields given at construction)
        fields = {k: v for k, v in out.items() if k != "logits"}
        if labels is None and shift_labels is None:
            fields["logits"] = torch.nn.functional.linear(hidden, head.weight)
            out = type(out)(**fields)
            return out.to_tuple() if want_tuple else out
        if shift_labels is None:
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
        targets = shift_labels.reshape(-1).to(device=hidden.device, dtype=torch.int32).contiguous()
        count = num_items_in_batch if num_items_in_batch is not None else (targets != -100).sum()
        count = torch.as_tensor(count).detach()
        loss = _call(linear_cross_entropy, hidden.reshape(-1, hidden.shape[-1]).contiguous(), head.weight, targets,
                     count, head.weight.dtype == torch.bfloat16)[0]
        aux = getattr(out, "aux_loss", None)
        if aux is not None and kwargs.get("output_router_logits", getattr(model.config, "output_router_logits", False)):
            loss = loss + getattr(model.config, "router_aux_loss_coef", 0.0) * aux.to(loss.device)
        fields["loss"] = loss
        out = type(out)(**fields)
        return out.to_tuple() if want_tuple else out

    model._moeforge_stock_forward = stock
    model.forward = forward
    head.__class__ = _HiddenHead


def _disable_fused_loss(model: torch.nn.Module) -> None:
    stock = getattr(model, "_moeforge_stock_forward", None)
    if stock is not None:
        model.forward = stock
        model._moeforge_stock_forward = None
        model.get_output_embeddings().__class__ = torch.nn.Linear


# --- registration and the default ----------------------------------------------------------------------

_hf_moe.ExpertsInterface.register(IMPLEMENTATION, experts_forward)
modeling_utils.AttentionInterface.register(IMPLEMENTATION, attention_forward)
_masking.AttentionMaskInterface.register(IMPLEMENTATION, attention_mask)
_stock_default = modeling_utils.PreTrainedModel.get_correct_experts_implementation
_stock_attention_default = modeling_utils.PreTrainedModel.get_correct_attn_implementation
_stock_post_init = modeling_utils.PreTrainedModel.post_init
_enabled = False


def _default_to_moeforge(self, requested_experts=None, *args, **kwargs):
    # (called while a model is made: its family's RMSNorm classes are patched here)
    _patch_norms(_norm_classes_of_module(type(self).__module__))
    if requested_experts is None:
        return IMPLEMENTATION
    return _stock_default(self, requested_experts, *args, **kwargs)


def _attention_default_to_moeforge(self, requested_attention=None, *args, **kwargs):
    # (where transformers would choose SDPA by default: moeforge's attention, which is SDPA for the
    # plain causal mask and moeforge's kernel for documents)
    chosen = _stock_attention_default(self, requested_attention, *args, **kwargs)
    return IMPLEMENTATION if requested_attention is None and chosen == "sdpa" else chosen


def _post_init_on_moeforge(self, *args, **kwargs):
    # (the end of every transformers model's __init__: its input embedding exists by then)
    result = _stock_post_init(self, *args, **kwargs)
    _swap_embedding(self)
    return result


def enable(model: Optional[torch.nn.Module] = None, fused_loss: Optional[bool] = None) -> None:
    """Without a model: moeforge becomes the default of models created from now on (what the import
    does): their experts, sparse MoE blocks (FUSED_BLOCKS, through transformers' patch mapping),
    RMSNorm, input embedding (a plain torch.nn.Embedding) and, where transformers would pick SDPA,
    attention. With one: that model's experts, blocks,
    RMSNorm, SDPA attention and input embedding (a plain torch.nn.Embedding) run on moeforge now, and with fused_loss=True its loss too (the LM head
    and cross-entropy fused, the logits never formed; the forward then returns logits=None when given
    labels); fused_loss=False restores its own."""
    global _enabled
    if model is None:
        if fused_loss is not None:
            raise ValueError("moeforge.hf.enable: fused_loss is per model: enable(model, fused_loss=True)")
        modeling_utils.PreTrainedModel.get_correct_experts_implementation = _default_to_moeforge
        modeling_utils.PreTrainedModel.get_correct_attn_implementation = _attention_default_to_moeforge
        modeling_utils.PreTrainedModel.post_init = _post_init_on_moeforge
        _register_block_patches()
        _patch_peft()
        _enabled = True
        return
    _patch_norms({type(m) for m in model.modules()})
    _fuse_blocks(model)
    _swap_embedding(model)
    setter = getattr(model, "set_experts_implementation", None)
    if callable(setter):
        setter(IMPLEMENTATION)
    else:
        model.config._experts_implementation = IMPLEMENTATION
    if getattr(model.config, "_attn_implementation", None) == "sdpa" and callable(
            getattr(model, "set_attn_implementation", None)):
        model.set_attn_implementation(IMPLEMENTATION)
    if fused_loss:
        _enable_fused_loss(model)
    elif fused_loss is False:
        _disable_fused_loss(model)


def disable() -> None:
    """transformers' stock defaults again for models created from now on (models already made keep
    theirs; `model.set_experts_implementation("grouped_mm")` and `model.set_attn_implementation("sdpa")`
    switch one back)."""
    global _enabled
    modeling_utils.PreTrainedModel.get_correct_experts_implementation = _stock_default
    modeling_utils.PreTrainedModel.get_correct_attn_implementation = _stock_attention_default
    modeling_utils.PreTrainedModel.post_init = _stock_post_init
    _unregister_block_patches()
    _unpatch_peft()
    _unpatch_norms()
    _enabled = False


def is_enabled() -> bool:
    return _enabled


def status(model: torch.nn.Module) -> Dict[str, Any]:
    """What runs where: the model's experts and attention implementations; for each experts module
    and each sparse MoE block (by class) how many there are and whether moeforge serves them (or why
    not); the RMSNorm classes patched; whether the fused loss is on and the input embedding is
    moeforge's."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None) if config is not None else None

    def tally(entries: Dict[str, Dict[str, Any]], sub, reason: Optional[str]) -> None:
        entry = entries.setdefault(type(sub).__name__, {"count": 0, "moeforge": True, "reason": None})
        entry["count"] += 1
        if reason is not None:
            entry["moeforge"], entry["reason"] = False, reason

    modules: Dict[str, Dict[str, Any]] = {}
    blocks: Dict[str, Dict[str, Any]] = {}
    qk: Dict[str, Dict[str, Any]] = {}
    for sub in model.modules():
        if _is_experts_module(sub):
            tally(modules, sub, unsupported_reason(sub))
        if type(sub).__name__ in FUSED_BLOCKS:
            fused = isinstance(sub, _FusedMoeBlock)
            tally(blocks, sub, block_unsupported_reason(sub) if fused else "not patched (created before the import?)")
        if type(sub).__name__ in FUSED_ATTENTION:
            tally(qk, sub, None if isinstance(sub, _FusedQKNormRopeAttention) else
                  "not patched (created before the import?)")
    norms = sorted({type(m).__name__ for m in model.modules() if type(m) in _stock_norm_forwards})
    return {"experts_implementation": impl, "default": IMPLEMENTATION if _enabled else "stock",
            "patched": impl == IMPLEMENTATION, "modules": modules, "moe_blocks": blocks, "qknorm_rope": qk,
            "attention": getattr(config, "_attn_implementation", None) if config is not None else None,
            "rms_norm": norms, "fused_loss": getattr(model, "_moeforge_stock_forward", None) is not None,
            "embedding": isinstance(_input_embedding(model), _Embedding)}


enable()
