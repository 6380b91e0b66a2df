"""moeforge.jax's functions: each a jax.custom_vjp over a forward and a backward XLA FFI handler
(moeforge._jax_ffi), with its shapes and dtypes checked at trace time. The C API's dtype rule holds:
activations and weights are bfloat16 on a GPU and float32 on the CPU (the CPU reference kernels);
another dtype is refused here, and a float32 array on a GPU (or bfloat16 on the CPU) is refused by
the handler when it runs, with the C API's message."""

import functools
import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from .. import ops
from . import _ffi

_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# --- checks -----------------------------------------------------------------------------------------

def _array(fn: str, name: str, a, ndim: Optional[int] = None):
    if a is None:
        raise TypeError(f"moeforge.jax.{fn}: {name} is required (got None)")
    a = jnp.asarray(a)
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"moeforge.jax.{fn}: {name} has shape {tuple(a.shape)}, expected {ndim} dimensions")
    return a


def _floats(fn: str, **arrays):
    """The arrays' common float dtype (float32 or bfloat16); refuses any other, and a mix."""
    dtype = None
    for name, a in arrays.items():
        if a.dtype not in _FLOATS:
            raise TypeError(f"moeforge.jax.{fn}: {name} is {a.dtype}; moeforge takes float32 (on the CPU) or "
                            "bfloat16 (on a GPU)")
        if dtype is None:
            dtype, first = a.dtype, name
        elif a.dtype != dtype:
            raise TypeError(f"moeforge.jax.{fn}: {name} is {a.dtype} but {first} is {dtype}; they must match")
    return dtype


def _group_sizes(fn: str, group_sizes, num_groups: int):
    gs = _array(fn, "group_sizes", group_sizes, 1)
    if gs.shape[0] != num_groups:
        raise ValueError(f"moeforge.jax.{fn}: group_sizes has {gs.shape[0]} entries, the weights {num_groups} groups")
    if not jnp.issubdtype(gs.dtype, jnp.integer):
        raise TypeError(f"moeforge.jax.{fn}: group_sizes is {gs.dtype}, expected an integer dtype (int32)")
    return gs.astype(jnp.int32)


def _device_kind(dtype) -> str:
    """The C API's device for byte sizes: bfloat16 runs on a GPU, float32 on the CPU."""
    return "cuda" if dtype == jnp.dtype(jnp.bfloat16) else "cpu"


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


# --- grouped_matmul ---------------------------------------------------------------------------------

def grouped_matmul(x, w, group_sizes):
    """jax.lax.ragged_dot's product on moeforge's grouped GEMMs: out[m] = x[m] · w[g] for the rows m
    of group g, the groups consecutive from row 0 in the order of w. x [M, K], w [G, K, N],
    group_sizes [G] (integer; a negative size counts as 0, offsets are clamped to M). Rows past the
    last group are zero, and so is their gradient; an empty group's weight gradient is exactly 0.
    Returns out [M, N] in x's dtype."""
    x, w = _array("grouped_matmul", "x", x, 2), _array("grouped_matmul", "w", w, 3)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"moeforge.jax.grouped_matmul: x {tuple(x.shape)} and w {tuple(w.shape)}: x's columns "
                         f"({x.shape[1]}) must equal w's dimension 1 (K = {w.shape[1]})")
    _floats("grouped_matmul", x=x, w=w)
    gs = _group_sizes("grouped_matmul", group_sizes, w.shape[0])
    return _grouped_matmul(x, w, gs)


def _grouped_matmul_forward(x, w, gs):
    M, (G, _, N) = x.shape[0], w.shape
    return _ffi.call("grouped_matmul", (_spec((M, N), x.dtype), _spec((G + 1,), jnp.int32)), x, w, gs)


@jax.custom_vjp
def _grouped_matmul(x, w, gs):
    return _grouped_matmul_forward(x, w, gs)[0]


def _grouped_matmul_fwd(x, w, gs):
    out, offsets = _grouped_matmul_forward(x, w, gs)
    return out, (x, w, offsets)


def _grouped_matmul_bwd(res, dout):
    x, w, offsets = res
    dx, dw = _ffi.call("grouped_matmul_bwd", (_spec(x.shape, x.dtype), _spec(w.shape, w.dtype)),
                       dout.astype(x.dtype), x, w, offsets)
    return dx, dw, None


_grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


# --- expert_mlp -------------------------------------------------------------------------------------

def expert_mlp(x, w_gate_up, w_down, group_sizes):
    """The experts' SwiGLU MLP over row groups: for the rows of group e,
        h = x · w_gate_up[e]ᵀ,  a = silu(h[:, :I]) · h[:, I:],  y = a · w_down[e]ᵀ
    with x [M, H], w_gate_up [E, 2I, H] (gate rows first, then up: HF Qwen3-MoE's gate_up_proj and
    moeforge's stacked layout), w_down [E, H, I] (HF's down_proj), group_sizes [E] (integer, as
    grouped_matmul's). Rows past the last group are zero, and so is their gradient. On a GPU h and a
    are rounded to bfloat16 as the kernels store them. Returns y [M, H]."""
    fn = "expert_mlp"
    x, gu, dn = _array(fn, "x", x, 2), _array(fn, "w_gate_up", w_gate_up, 3), _array(fn, "w_down", w_down, 3)
    E, two_i, H = gu.shape
    if two_i % 2:
        raise ValueError(f"moeforge.jax.{fn}: w_gate_up {tuple(gu.shape)} must be [E, 2I, H] (an even dimension 1)")
    if x.shape[1] != H:
        raise ValueError(f"moeforge.jax.{fn}: x {tuple(x.shape)} has {x.shape[1]} columns, w_gate_up "
                         f"{tuple(gu.shape)} takes H = {H}")
    if tuple(dn.shape) != (E, H, two_i // 2):
        raise ValueError(f"moeforge.jax.{fn}: w_down is {tuple(dn.shape)}, expected [E, H, I] = "
                         f"{(E, H, two_i // 2)} for w_gate_up {tuple(gu.shape)}")
    _floats(fn, x=x, w_gate_up=gu, w_down=dn)
    gs = _group_sizes(fn, group_sizes, E)
    return _expert_mlp(x, gu, dn, gs)


def _expert_mlp_forward(x, gu, dn, gs):
    M, (E, two_i, H) = x.shape[0], gu.shape
    results = (_spec((M, H), x.dtype), _spec((M, two_i), x.dtype), _spec((M, two_i // 2), x.dtype),
               _spec((E + 1,), jnp.int32))
    return _ffi.call("expert_mlp", results, x, gu, dn, gs)


@jax.custom_vjp
def _expert_mlp(x, gu, dn, gs):
    return _expert_mlp_forward(x, gu, dn, gs)[0]


def _expert_mlp_fwd(x, gu, dn, gs):
    y, h, a, offsets = _expert_mlp_forward(x, gu, dn, gs)
    return y, (x, gu, dn, h, a, offsets)


def _expert_mlp_bwd(res, dy):
    x, gu, dn, h, a, offsets = res
    results = (_spec(x.shape, x.dtype), _spec(gu.shape, gu.dtype), _spec(dn.shape, dn.dtype),
               _spec(a.shape, a.dtype), _spec(h.shape, h.dtype))  # (the last two: the handler's scratch)
    dx, dgu, ddn, _, _ = _ffi.call("expert_mlp_bwd", results, dy.astype(x.dtype), x, gu, dn, h, a, offsets)
    return dx, dgu, ddn, None


_expert_mlp.defvjp(_expert_mlp_fwd, _expert_mlp_bwd)


# --- moe_ffn ----------------------------------------------------------------------------------------

class _MoeConfig(NamedTuple):
    top_k: int
    norm_topk_prob: bool
    sigmoid: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    masked_zero: bool

    def dims(self, H: int, I: int, E: int) -> dict:
        """The C API's MoE block dims (moeforge.ops' spelling)."""
        return dict(hidden=H, intermediate=I, num_experts=E, top_k=self.top_k, norm_topk_prob=self.norm_topk_prob,
                    activation="swiglu", router="sigmoid" if self.sigmoid else "softmax", n_group=self.n_group,
                    topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                    masked_score=0.0 if self.masked_zero else -math.inf)

    def attrs(self) -> dict:
        return dict(top_k=self.top_k, norm_topk_prob=self.norm_topk_prob, router=int(self.sigmoid),
                    n_group=self.n_group, topk_group=self.topk_group, masked_zero=self.masked_zero,
                    routed_scaling_factor=self.routed_scaling_factor)


def _moe_config(E: int, top_k, norm_topk_prob, router, n_group, topk_group, routed_scaling_factor, masked_score,
                has_bias: bool, fn: str = "moe_ffn") -> _MoeConfig:
    """The router's settings checked (errors name fn, the public function) for E experts."""
    if router not in ("softmax", "sigmoid"):
        raise ValueError(f"moeforge.jax.{fn}: router={router!r}, expected 'softmax' or 'sigmoid'")
    sigmoid = router == "sigmoid"
    if not isinstance(top_k, int) or not 1 <= top_k <= E:
        raise ValueError(f"moeforge.jax.{fn}: top_k={top_k!r} must be an int in [1, num_experts = {E}]")
    if has_bias and not sigmoid:
        raise ValueError(f"moeforge.jax.{fn}: correction_bias is the sigmoid router's; router is 'softmax'")
    if not sigmoid and (n_group, topk_group, routed_scaling_factor) != (1, 1, 1.0):
        raise ValueError(f"moeforge.jax.{fn}: n_group, topk_group and routed_scaling_factor are the sigmoid "
                         "router's; router is 'softmax'")
    if not isinstance(n_group, int) or n_group < 1 or E % n_group:
        raise ValueError(f"moeforge.jax.{fn}: n_group={n_group!r} must divide num_experts = {E}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"moeforge.jax.{fn}: topk_group={topk_group!r} must lie in [1, n_group = {n_group}]")
    if topk_group < n_group and top_k > topk_group * (E // n_group):
        raise ValueError(f"moeforge.jax.{fn}: top_k={top_k} exceeds the {topk_group * (E // n_group)} experts of "
                         f"the topk_group={topk_group} kept groups")
    if not math.isfinite(routed_scaling_factor):
        raise ValueError(f"moeforge.jax.{fn}: routed_scaling_factor={routed_scaling_factor!r} is not finite")
    if not (masked_score == 0.0 or masked_score == -math.inf):
        raise ValueError(f"moeforge.jax.{fn}: masked_score={masked_score!r}; the C API takes -inf or 0.0")
    return _MoeConfig(top_k, bool(norm_topk_prob), sigmoid, n_group, topk_group, float(routed_scaling_factor),
                      masked_score == 0.0)


def _correction_bias(fn: str, correction_bias, E: int):
    """The sigmoid router's bias as float32[E], or an empty array when there is none (the handler then
    passes none)."""
    if correction_bias is None:
        return jnp.zeros((0,), jnp.float32)
    bias = _array(fn, "correction_bias", correction_bias, 1)
    if bias.shape[0] != E or bias.dtype != jnp.float32:
        raise ValueError(f"moeforge.jax.{fn}: correction_bias is {bias.dtype}{list(bias.shape)}, expected "
                         f"float32[{E}]")
    return bias


def moe_ffn(x, router_w, w_gate_up, w_down, *, top_k: int, norm_topk_prob: bool = True, router: str = "softmax",
            correction_bias=None, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
            masked_score: float = -math.inf, ep_axis: Optional[str] = None):
    """The whole dropless MoE layer (moeforge's MoE block, one custom_vjp): router logits
    x · router_wᵀ (float32), top_k experts per token, the (token, expert) pairs grouped by expert, the
    expert_mlp of each expert on its rows, and y[t] = Σ_k w[t, k] · expert_{idx[t, k]}(x[t]). No token
    is dropped. x [..., H], router_w [E, H], w_gate_up [E, 2I, H], w_down [E, H, I] (expert_mlp's
    layout), all one dtype. Routers:
      "softmax" (Qwen3-MoE, Mixtral, OLMoE): w = the top_k softmax probabilities (ties to the lower
        expert index), renormalised to sum 1 when norm_topk_prob;
      "sigmoid" (DeepSeek-V3): scores σ(logits); the top_k of scores + correction_bias ([E] float32,
        optional, not differentiated) within the topk_group best of n_group groups (a group's score:
        its two largest; an expert of a dropped group competes with masked_score, -inf or 0); w = the
        chosen scores, / their sum when norm_topk_prob, × routed_scaling_factor.
    Returns y [..., H] in x's dtype. Gradients: x, router_w, w_gate_up, w_down.
    ep_axis: expert parallelism over that mesh axis, inside jax.shard_map(..., check_vma=False), with
    w_gate_up / w_down this device's E/P experts and x its tokens (moeforge.jax.ep.moe_ffn_ep)."""
    if ep_axis is not None:
        from .ep import moe_ffn_ep
        return moe_ffn_ep(x, router_w, w_gate_up, w_down, ep_axis=ep_axis, top_k=top_k,
                          norm_topk_prob=norm_topk_prob, router=router, correction_bias=correction_bias,
                          n_group=n_group, topk_group=topk_group, routed_scaling_factor=routed_scaling_factor,
                          masked_score=masked_score)
    fn = "moe_ffn"
    x = _array(fn, "x", x)
    rw, gu, dn = (_array(fn, "router_w", router_w, 2), _array(fn, "w_gate_up", w_gate_up, 3),
                  _array(fn, "w_down", w_down, 3))
    if x.ndim < 1:
        raise ValueError(f"moeforge.jax.{fn}: x is a scalar, expected [..., H]")
    E, two_i, H = gu.shape
    if two_i % 2:
        raise ValueError(f"moeforge.jax.{fn}: w_gate_up {tuple(gu.shape)} must be [E, 2I, H] (an even dimension 1)")
    if x.shape[-1] != H:
        raise ValueError(f"moeforge.jax.{fn}: x {tuple(x.shape)} ends in {x.shape[-1]}, w_gate_up {tuple(gu.shape)} "
                         f"takes H = {H}")
    if tuple(rw.shape) != (E, H):
        raise ValueError(f"moeforge.jax.{fn}: router_w is {tuple(rw.shape)}, expected [E, H] = {(E, H)}")
    if tuple(dn.shape) != (E, H, two_i // 2):
        raise ValueError(f"moeforge.jax.{fn}: w_down is {tuple(dn.shape)}, expected [E, H, I] = {(E, H, two_i // 2)}")
    _floats(fn, x=x, router_w=rw, w_gate_up=gu, w_down=dn)
    cfg = _moe_config(E, top_k, norm_topk_prob, router, n_group, topk_group, routed_scaling_factor, masked_score,
                      correction_bias is not None)
    bias = _correction_bias(fn, correction_bias, E)
    lead = x.shape[:-1]
    y = _moe_ffn(cfg, x.reshape(-1, H), rw, gu, dn, bias)
    return y.reshape(*lead, H)


def _workspace_words(cfg: _MoeConfig, x, gu) -> tuple:
    """int32 words of the activations (the forward writes, the backward reads) and of the backward's
    scratch (with the slack for aligning it), as the C API sizes them for x's rows."""
    N, (E, two_i, H) = x.shape[0], gu.shape
    dims, device = cfg.dims(H, two_i // 2, E), _device_kind(x.dtype)
    act = ops.moe_block_activation_bytes(dims, N, device)
    scratch = ops.moe_block_workspace_bytes(dims, N, device) - act + (256 if device == "cuda" else 64)
    return -(-act // 4), -(-scratch // 4)


def _moe_ffn_forward(cfg, x, rw, gu, dn, bias):
    act_words, _ = _workspace_words(cfg, x, gu)
    results = (_spec(x.shape, x.dtype), _spec((act_words,), jnp.int32))
    return _ffi.call("moe_ffn", results, x, rw, gu, dn, bias, **cfg.attrs())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _moe_ffn(cfg, x, rw, gu, dn, bias):
    return _moe_ffn_forward(cfg, x, rw, gu, dn, bias)[0]


def _moe_ffn_fwd(cfg, x, rw, gu, dn, bias):
    y, acts = _moe_ffn_forward(cfg, x, rw, gu, dn, bias)
    return y, (x, rw, gu, dn, bias, acts)


def _moe_ffn_bwd(cfg, res, dy):
    x, rw, gu, dn, bias, acts = res
    _, scratch_words = _workspace_words(cfg, x, gu)
    results = (_spec(x.shape, x.dtype), _spec(rw.shape, rw.dtype), _spec(gu.shape, gu.dtype),
               _spec(dn.shape, dn.dtype), _spec((scratch_words,), jnp.int32))  # (the last: the handler's scratch)
    dx, drw, dgu, ddn, _ = _ffi.call("moe_ffn_bwd", results, dy.astype(x.dtype), x, rw, gu, dn, bias, acts,
                                     **cfg.attrs())
    return dx, drw, dgu, ddn, None


_moe_ffn.defvjp(_moe_ffn_fwd, _moe_ffn_bwd)
