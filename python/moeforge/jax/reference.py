"""Pure-JAX twins of moeforge.jax's functions, for tests and as the readable definition: the same
formulas, group conventions and dtype flow (float32 accumulation, or float64 for float64 inputs;
results rounded to the inputs' dtype where moeforge's kernels store them), written with dense
per-group masks rather than grouped kernels, so they cost O(rows · groups) memory: meant for small
shapes. Differentiable by jax.grad
(the top-k choice is not differentiated, as in moeforge and HF)."""

import math

import jax
import jax.numpy as jnp
from jax import lax

from ._routing import Routing

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def _acc(dtype):
    """The accumulation dtype: float32, or float64 for float64 inputs (the tests' exact reference)."""
    return jnp.float64 if jnp.dtype(dtype) == jnp.dtype(jnp.float64) else _F32


def group_offsets(group_sizes, num_rows: int):
    """offsets [G + 1] int32: 0, then the running sum of group_sizes, a negative size counting as 0
    and every offset clamped to num_rows (mf_group_offsets)."""
    sizes = jnp.maximum(jnp.asarray(group_sizes, jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(sizes), num_rows).astype(jnp.int32)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


def group_mask(group_sizes, num_rows: int):
    """mask [M, G] bool: true where row m lies in group g's rows [offsets[g], offsets[g + 1])."""
    off = group_offsets(group_sizes, num_rows)
    rows = jnp.arange(num_rows)[:, None]
    return (rows >= off[None, :-1]) & (rows < off[None, 1:])


def grouped_matmul(x, w, group_sizes):
    """out[m] = x[m] · w[g(m)], x [M, K], w [G, K, N]; rows past the last group 0 (ragged_dot)."""
    acc = _acc(x.dtype)
    mask = group_mask(group_sizes, x.shape[0]).astype(acc)
    every = jnp.einsum("mk,gkn->mgn", x, w, precision=_HIGHEST, preferred_element_type=acc)
    return jnp.einsum("mgn,mg->mn", every, mask, precision=_HIGHEST).astype(x.dtype)


def grouped_matmul_t(x, w, group_sizes):
    """out[m] = x[m] · w[g(m)]ᵀ, x [M, C], w [G, OC, C] (the C API's weight layout)."""
    acc = _acc(x.dtype)
    mask = group_mask(group_sizes, x.shape[0]).astype(acc)
    every = jnp.einsum("mc,goc->mgo", x, w, precision=_HIGHEST, preferred_element_type=acc)
    return jnp.einsum("mgo,mg->mo", every, mask, precision=_HIGHEST).astype(x.dtype)


def swiglu(h):
    """h [..., 2I] = [gate | up] -> silu(gate) · up [..., I], in float32, rounded to h's dtype."""
    half = h.shape[-1] // 2
    acc = _acc(h.dtype)
    gate, up = h[..., :half].astype(acc), h[..., half:].astype(acc)
    return (jax.nn.silu(gate) * up).astype(h.dtype)


def expert_mlp(x, w_gate_up, w_down, group_sizes):
    """moeforge.jax.expert_mlp: y = (silu(gate) · up) · w_down[e]ᵀ with [gate | up] = x · w_gate_up[e]ᵀ
    per group; w_gate_up [E, 2I, H] (gate rows first), w_down [E, H, I]; h and a rounded to x's dtype."""
    h = grouped_matmul_t(x, w_gate_up, group_sizes)
    return grouped_matmul_t(swiglu(h), w_down, group_sizes)


def route(logits, *, top_k: int, norm_topk_prob: bool = True, router: str = "softmax", correction_bias=None,
          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0, masked_score: float = -math.inf):
    """The routers of moe_ffn and moeforge.jax.route on logits [N, E] (float32; float64 stays float64):
    (topk_idx [N, K] int32, topk_weight [N, K], probs or sigmoid scores [N, E]), as moeforge.jax.route
    returns them. Ties go to the lower
    expert index (lax.top_k's order); the choice is not differentiated, the chosen values and probs are."""
    acc = _acc(logits.dtype)
    logits = logits.astype(acc)
    if router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        weight, idx = lax.top_k(probs, top_k)
        if norm_topk_prob:
            weight = weight / jnp.sum(weight, axis=-1, keepdims=True)
        return idx.astype(jnp.int32), weight, probs
    if router != "sigmoid":
        raise ValueError(f"router={router!r}, expected 'softmax' or 'sigmoid'")
    N, E = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = lax.stop_gradient(scores if correction_bias is None else scores + correction_bias.astype(acc))
    if topk_group < n_group:
        per_group = E // n_group
        group_score = jnp.sum(lax.top_k(choice.reshape(N, n_group, per_group), 2)[0], axis=-1)
        _, kept = lax.top_k(group_score, topk_group)
        keep = jnp.zeros((N, n_group), bool).at[jnp.arange(N)[:, None], kept].set(True)
        choice = jnp.where(jnp.repeat(keep, per_group, axis=1), choice, jnp.asarray(masked_score, acc))
    _, idx = lax.top_k(choice, top_k)
    weight = jnp.take_along_axis(scores, idx, axis=-1)
    if norm_topk_prob:
        weight = weight / (jnp.sum(weight, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weight * routed_scaling_factor, scores


def moe_ffn(x, router_w, w_gate_up, w_down, *, top_k: int, norm_topk_prob: bool = True, router: str = "softmax",
            correction_bias=None, n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
            masked_score: float = -math.inf):
    """moeforge.jax.moe_ffn: float32 router logits x · router_wᵀ, route(), every expert's MLP on every
    token (h, a and each expert's output rounded to x's dtype, as the kernels store them), and
    y[t] = Σ_k w[t, k] · expert_{idx[t, k]}(x[t]) summed in float32, rounded to x's dtype."""
    lead, H, acc = x.shape[:-1], x.shape[-1], _acc(x.dtype)
    x2 = x.reshape(-1, H)
    logits = jnp.einsum("th,eh->te", x2, router_w, precision=_HIGHEST, preferred_element_type=acc)
    idx, weight, _ = route(logits, top_k=top_k, norm_topk_prob=norm_topk_prob, router=router,
                           correction_bias=correction_bias, n_group=n_group, topk_group=topk_group,
                           routed_scaling_factor=routed_scaling_factor, masked_score=masked_score)
    h = jnp.einsum("th,eoh->teo", x2, w_gate_up, precision=_HIGHEST, preferred_element_type=acc).astype(x.dtype)
    a = swiglu(h)
    every = jnp.einsum("tei,ehi->teh", a, w_down, precision=_HIGHEST, preferred_element_type=acc).astype(x.dtype)
    chosen = jnp.take_along_axis(every, idx[:, :, None], axis=1).astype(acc)  # [N, K, H]
    y = jnp.sum(weight[:, :, None] * chosen, axis=1)
    return y.astype(x.dtype).reshape(*lead, H)


def load_balancing_loss(topk_idx, probs, mask=None, *, num_experts: int):
    """moeforge.jax.load_balancing_loss, as transformers' load_balancing_loss_func writes it: the layers'
    tokens concatenated, the one-hot expert mask [T, K, E] (an index outside [0, E) is all zero), its
    masked mean over the tokens times the masked mean router probability, summed, times E (0 when no
    token is counted)."""
    idx_layers, prob_layers = ((list(topk_idx), list(probs)) if isinstance(topk_idx, (list, tuple))
                               else ([topk_idx], [probs]))
    idx = jnp.concatenate([i.reshape(-1, i.shape[-1]) for i in idx_layers])
    p = jnp.concatenate([q.reshape(-1, num_experts) for q in prob_layers])
    acc = _acc(p.dtype)
    p = p.astype(acc)
    if mask is None:
        m = jnp.ones((idx.shape[0],), acc)
    else:
        m = jnp.concatenate([jnp.asarray(mask, acc).reshape(-1)] * len(idx_layers))
    expert_mask = jax.nn.one_hot(idx, num_experts, dtype=acc)  # [T, K, E]
    rows = jnp.sum(m)
    inv_rows = jnp.where(rows > 0, 1.0 / jnp.where(rows > 0, rows, 1.0), 0.0)
    tokens_per_expert = jnp.einsum("t,tke->ke", m, expert_mask, precision=_HIGHEST) * inv_rows
    router_prob_per_expert = jnp.einsum("t,te->e", m, p, precision=_HIGHEST) * inv_rows
    return num_experts * jnp.sum(tokens_per_expert * router_prob_per_expert[None, :])


def permute(x, topk_idx, num_experts: int):
    """moeforge.jax.permute by a stable sort of the pairs on their expert (a dropped pair, expert outside
    [0, E), sorted last): (x_perm [N·K, H], group_sizes [E] int32, Routing)."""
    N, K = topk_idx.shape
    flat = jnp.asarray(topk_idx, jnp.int32).reshape(-1)
    kept = (flat >= 0) & (flat < num_experts)
    key = jnp.where(kept, flat, num_experts)
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    sizes = jnp.zeros((num_experts + 1,), jnp.int32).at[key].add(1)[:num_experts]
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes).astype(jnp.int32)])
    rows = jnp.arange(N * K, dtype=jnp.int32)
    sorted_pair = jnp.where(rows < offsets[-1], order, -1)
    pair_row = jnp.where(kept, jnp.zeros((N * K,), jnp.int32).at[order].set(rows), -1)
    x_perm = jnp.where((sorted_pair >= 0)[:, None], x[jnp.maximum(sorted_pair, 0) // K], 0).astype(x.dtype)
    return x_perm, sizes, Routing(offsets, sorted_pair, pair_row)


def unpermute(y_perm, topk_weight, routing):
    """moeforge.jax.unpermute: y[t] = Σ_k w[t, k] · y_perm[pair_row[t·K + k]] (a dropped pair adds 0),
    summed in float32, rounded to y_perm's dtype."""
    N, K = topk_weight.shape
    acc = _acc(y_perm.dtype)
    rows = routing.pair_row.reshape(N, K)
    picked = jnp.where((rows >= 0)[:, :, None], y_perm[jnp.maximum(rows, 0)].astype(acc), 0)  # [N, K, H]
    return jnp.sum(topk_weight.astype(acc)[:, :, None] * picked, axis=1).astype(y_perm.dtype)
