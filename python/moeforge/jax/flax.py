"""Flax modules over moeforge.jax.moe_ffn: the dropless MoE feed-forward of a Qwen3-MoE-style layer.

    from flax import nnx
    from moeforge.jax.flax import MoEFFN
    ffn = MoEFFN(hidden=64, intermediate=32, num_experts=8, top_k=2, rngs=nnx.Rngs(0))
    y = ffn(x)                                   # x [..., 64] -> y [..., 64]

Parameters (HF Qwen3-MoE's layout, which moeforge.jax.loader fills from a checkpoint):
  router  [E, H]      the gate's weight (logits = x · routerᵀ)
  gate_up [E, 2I, H]  each expert's gate rows, then its up rows
  down    [E, H, I]
stored in param_dtype (float32 or bfloat16). The layer computes in compute_dtype: by default
bfloat16 when JAX's default backend is a GPU and float32 otherwise, the dtypes moeforge's kernels
take there; x and the parameters are cast to it, and y is cast back to x's dtype. Gradients reach
the parameters in their own dtype through the casts.

MoEFFN is the NNX module; LinenMoEFFN the same layer as a Linen module (params "router", "gate_up",
"down")."""

import math
from typing import Optional

import jax
import jax.numpy as jnp
from flax import linen, nnx

from ._functions import moe_ffn


def default_compute_dtype():
    """bfloat16 where JAX's default backend is a GPU, float32 elsewhere (moeforge's dtype rule)."""
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def _router_options(top_k, norm_topk_prob, router, n_group, topk_group, routed_scaling_factor, masked_score):
    return dict(top_k=top_k, norm_topk_prob=norm_topk_prob, router=router, n_group=n_group, topk_group=topk_group,
                routed_scaling_factor=routed_scaling_factor, masked_score=masked_score)


def _apply(x, router, gate_up, down, compute_dtype, options, correction_bias=None):
    dtype = jnp.dtype(compute_dtype if compute_dtype is not None else default_compute_dtype())
    y = moe_ffn(x.astype(dtype), router.astype(dtype), gate_up.astype(dtype), down.astype(dtype),
                correction_bias=correction_bias, **options)
    return y.astype(x.dtype)


class MoEFFN(nnx.Module):
    """The MoE feed-forward (moeforge.jax.moe_ffn) with its parameters: router [E, H], gate_up
    [E, 2I, H], down [E, H, I], initialised from N(0, init_std²) in param_dtype. Router options as
    moe_ffn's (softmax top-k with norm_topk_prob is Qwen3-MoE's). __call__(x [..., H]) -> [..., H]."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *, rngs: nnx.Rngs,
                 norm_topk_prob: bool = True, router: str = "softmax", n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, masked_score: float = -math.inf, param_dtype=jnp.float32,
                 compute_dtype=None, init_std: float = 0.02):
        if jnp.dtype(param_dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"moeforge.jax.flax.MoEFFN: param_dtype={param_dtype}, expected float32 or bfloat16")
        H, I, E = hidden, intermediate, num_experts

        def normal(shape):
            return (init_std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(param_dtype)

        self.router = nnx.Param(normal((E, H)))
        self.gate_up = nnx.Param(normal((E, 2 * I, H)))
        self.down = nnx.Param(normal((E, H, I)))
        # (plain Python values: static in NNX's graph)
        self.compute_dtype = compute_dtype
        self.top_k, self.norm_topk_prob, self.router_kind = top_k, norm_topk_prob, router
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor, self.masked_score = routed_scaling_factor, masked_score

    def __call__(self, x, correction_bias=None):
        options = _router_options(self.top_k, self.norm_topk_prob, self.router_kind, self.n_group, self.topk_group,
                                  self.routed_scaling_factor, self.masked_score)
        return _apply(x, self.router[...], self.gate_up[...], self.down[...], self.compute_dtype, options,
                      correction_bias)


class LinenMoEFFN(linen.Module):
    """MoEFFN as a Linen module: params "router" [E, H], "gate_up" [E, 2I, H], "down" [E, H, I]."""
    hidden: int
    intermediate: int
    num_experts: int
    top_k: int
    norm_topk_prob: bool = True
    router_kind: str = "softmax"  # (moe_ffn's router=; "router" names the parameter)
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    masked_score: float = -math.inf
    param_dtype: jnp.dtype = jnp.float32
    compute_dtype: Optional[jnp.dtype] = None
    init_std: float = 0.02

    @linen.compact
    def __call__(self, x, correction_bias=None):
        H, I, E = self.hidden, self.intermediate, self.num_experts
        init = linen.initializers.normal(self.init_std)
        router = self.param("router", init, (E, H), self.param_dtype)
        gate_up = self.param("gate_up", init, (E, 2 * I, H), self.param_dtype)
        down = self.param("down", init, (E, H, I), self.param_dtype)
        options = _router_options(self.top_k, self.norm_topk_prob, self.router_kind, self.n_group, self.topk_group,
                                  self.routed_scaling_factor, self.masked_score)
        return _apply(x, router, gate_up, down, self.compute_dtype, options, correction_bias)
