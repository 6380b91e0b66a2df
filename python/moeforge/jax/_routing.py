"""moeforge.jax's routing pieces, each a jax.custom_vjp over a forward and a backward XLA FFI handler
(moeforge._jax_ffi), with shapes and dtypes checked at trace time:

    idx, w, probs = route(logits, top_k=8)                    # the softmax or sigmoid router
    aux = load_balancing_loss(idx, probs, num_experts=E)      # transformers' load_balancing_loss_func
    x_perm, group_sizes, routing = permute(x, idx, E)         # the (token, slot) pairs grouped by expert
    y = unpermute(expert_mlp(x_perm, w_gate_up, w_down, group_sizes), w, routing)

which is moe_ffn taken apart (its routed output, with logits = x · router_wᵀ in float32). Router and
loss math is float32 on every device; x_perm and y are activations (float32 on the CPU, bfloat16 on a
GPU); indices are int32 and have no gradient."""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import ops
from . import _ffi
from ._functions import _MoeConfig, _array, _correction_bias, _floats, _moe_config, _spec

_F32, _I32 = jnp.float32, jnp.int32


def _integers(fn: str, name: str, a, ndim=None):
    a = _array(fn, name, a, ndim)
    if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"moeforge.jax.{fn}: {name} is {a.dtype}, expected an integer dtype (int32)")
    return a.astype(_I32)


def _float32(fn: str, name: str, a, ndim=None):
    """a as float32 (router and loss math is float32; the cast is differentiated as a cast)."""
    a = _array(fn, name, a, ndim)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise TypeError(f"moeforge.jax.{fn}: {name} is {a.dtype}, expected a floating dtype (float32)")
    return a.astype(_F32)


def _num_experts(fn: str, num_experts) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"moeforge.jax.{fn}: num_experts={num_experts!r} must be an int >= 1")
    return num_experts


# --- route ------------------------------------------------------------------------------------------

def route(logits, *, top_k: int, norm_topk_prob: bool = True, router: str = "softmax", correction_bias=None,
          n_group: int = 1, topk_group: int = 1, routed_scaling_factor: float = 1.0,
          masked_score: float = -math.inf):
    """moe_ffn's routers on logits [..., E] (computed in float32: another float dtype is cast).
    Returns (topk_idx int32 [..., K], topk_weight float32 [..., K], probs float32 [..., E]), the K experts
    in descending order, ties to the lower expert index:
      "softmax": probs = softmax(logits); topk_weight = the K largest, renormalised to sum 1 when
        norm_topk_prob;
      "sigmoid": probs = σ(logits) (the scores); the K largest of scores + correction_bias ([E] float32,
        optional, only chooses) within the topk_group best of n_group groups (a group's score: its two
        largest; an expert of a dropped group competes with masked_score, -inf or 0); topk_weight = the
        chosen scores, / (their sum + 1e-20) when norm_topk_prob, × routed_scaling_factor.
    Gradients reach logits from topk_weight (the indices held fixed) and from probs (e.g. an aux loss's,
    load_balancing_loss); topk_idx has none. On a GPU, E <= 1024 and K <= 32."""
    fn = "route"
    logits = _float32(fn, "logits", logits)
    if logits.ndim < 1:
        raise ValueError(f"moeforge.jax.{fn}: logits is a scalar, expected [..., E]")
    lead, E = logits.shape[:-1], logits.shape[-1]
    cfg = _moe_config(E, top_k, norm_topk_prob, router, n_group, topk_group, routed_scaling_factor, masked_score,
                      correction_bias is not None, fn=fn)
    flat = logits.reshape(-1, E)
    if cfg.sigmoid:
        idx, weight, probs = _route_sigmoid(cfg, flat, _correction_bias(fn, correction_bias, E))
    else:
        idx, weight, probs = _route_softmax(cfg, flat)
    K = cfg.top_k
    return idx.reshape(*lead, K), weight.reshape(*lead, K), probs.reshape(*lead, E)


def _route_results(cfg: _MoeConfig, logits):
    N, E = logits.shape
    return _spec((N, E), _F32), _spec((N, cfg.top_k), _I32), _spec((N, cfg.top_k), _F32)


def _route_softmax_forward(cfg, logits):
    probs, idx, weight = _ffi.call("route_softmax", _route_results(cfg, logits), logits,
                                   norm_topk_prob=cfg.norm_topk_prob)
    return idx, weight, probs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route_softmax(cfg, logits):
    return _route_softmax_forward(cfg, logits)


def _route_softmax_fwd(cfg, logits):
    idx, weight, probs = _route_softmax_forward(cfg, logits)
    return (idx, weight, probs), (probs, idx)


def _route_softmax_bwd(cfg, res, cts):
    probs, idx = res
    _, dweight, dprobs = cts  # (topk_idx's cotangent: float0, no gradient)
    dlogits = _ffi.call("route_softmax_bwd", _spec(probs.shape, _F32), dweight.astype(_F32), dprobs.astype(_F32),
                        probs, idx, norm_topk_prob=cfg.norm_topk_prob)
    return (dlogits,)


_route_softmax.defvjp(_route_softmax_fwd, _route_softmax_bwd)


def _route_sigmoid_forward(cfg, logits, bias):
    scores, idx, weight = _ffi.call("route_sigmoid", _route_results(cfg, logits), logits, bias,
                                    norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group,
                                    topk_group=cfg.topk_group, masked_zero=cfg.masked_zero,
                                    routed_scaling_factor=cfg.routed_scaling_factor)
    return idx, weight, scores


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route_sigmoid(cfg, logits, bias):
    return _route_sigmoid_forward(cfg, logits, bias)


def _route_sigmoid_fwd(cfg, logits, bias):
    idx, weight, scores = _route_sigmoid_forward(cfg, logits, bias)
    return (idx, weight, scores), (scores, idx)


def _route_sigmoid_bwd(cfg, res, cts):
    scores, idx = res
    _, dweight, dscores = cts
    dlogits = _ffi.call("route_sigmoid_bwd", _spec(scores.shape, _F32), dweight.astype(_F32), scores, idx,
                        norm_topk_prob=cfg.norm_topk_prob, routed_scaling_factor=cfg.routed_scaling_factor)
    # the C API's backward takes topk_weight's gradient alone: the scores' own goes through σ' here
    return dlogits + dscores.astype(_F32) * scores * (1.0 - scores), None


_route_sigmoid.defvjp(_route_sigmoid_fwd, _route_sigmoid_bwd)


# --- load_balancing_loss ----------------------------------------------------------------------------

# Whether a call can run on a GPU here (a CUDA build that sees one): only then do the ops take scratch.
_GPU = bool(_ffi.BUILT_WITH_CUDA) and ops.has_cuda()


def _scratch_words(nbytes: int) -> int:
    """int32 words of a scratch result of nbytes (the C API's figure for a GPU) with 256 bytes of
    alignment slack (an mf_context's workspace is 256-byte aligned)."""
    return -(-nbytes // 4) + 64


def _aux_scratch_words(N: int, E: int) -> int:
    """The scratch result of mf_moe_aux_stats on a GPU (its per-block partial sums)."""
    return _scratch_words(ops.moe_aux_stats_workspace_bytes(N, E, "cuda") if _GPU else 0)


def load_balancing_loss(topk_idx, probs, mask=None, *, num_experts: int):
    """transformers' load_balancing_loss_func (the Switch/Mixtral auxiliary loss) on router outputs, over
    the C API's statistics: with R the counted tokens of all the layers together,
        tokens_per_expert[k, e] = Σ_t mask[t] · [topk_idx[t, k] = e] / R
        router_prob_per_expert[e] = Σ_t mask[t] · probs[t, e] / R
        loss = num_experts · Σ_{k, e} tokens_per_expert[k, e] · router_prob_per_expert[e]
             = num_experts · Σ_e counts[e] · prob_sums[e] / R²
    topk_idx [..., K] (integer; an index outside [0, num_experts), an EP sentinel, counts nothing) and
    probs [..., E = num_experts] (route's probs, float32) of one layer, or two lists with one entry per
    layer (the statistics summed over the layers, as transformers concatenates them); mask [...]
    (optional; 1 a counted token, 0 padding: transformers' attention_mask), the same for every layer,
    whose leading shapes must then match it. Returns a float32 scalar (0 when no token is counted).
    The gradient reaches probs only (the top-k choice is not differentiated)."""
    fn = "load_balancing_loss"
    E = _num_experts(fn, num_experts)
    layered = isinstance(topk_idx, (list, tuple))
    if layered != isinstance(probs, (list, tuple)):
        raise TypeError(f"moeforge.jax.{fn}: topk_idx and probs must both be arrays (one layer) or both lists "
                        "(one entry per layer)")
    idx_layers, prob_layers = (list(topk_idx), list(probs)) if layered else ([topk_idx], [probs])
    if len(idx_layers) != len(prob_layers) or not idx_layers:
        raise ValueError(f"moeforge.jax.{fn}: topk_idx has {len(idx_layers)} layers and probs {len(prob_layers)}; "
                         "expected the same number, at least 1")
    if mask is not None:
        mask = _float32(fn, "mask", mask)
    idx2, probs2, masks = [], [], []
    for layer, (i, p) in enumerate(zip(idx_layers, prob_layers)):
        where = f" (layer {layer})" if layered else ""
        i, p = _integers(fn, "topk_idx" + where, i), _float32(fn, "probs" + where, p)
        if p.ndim < 1 or p.shape[-1] != E:
            raise ValueError(f"moeforge.jax.{fn}: probs{where} has shape {tuple(p.shape)}, expected [..., "
                             f"num_experts = {E}]")
        if i.ndim != p.ndim or i.shape[:-1] != p.shape[:-1] or i.shape[-1] < 1:
            raise ValueError(f"moeforge.jax.{fn}: topk_idx{where} has shape {tuple(i.shape)}, expected "
                             f"[{', '.join(map(str, p.shape[:-1] + ('K',)))}] for probs {tuple(p.shape)}")
        if mask is not None and mask.shape != p.shape[:-1]:
            raise ValueError(f"moeforge.jax.{fn}: mask has shape {tuple(mask.shape)}, expected the tokens' "
                             f"{tuple(p.shape[:-1])} (probs{where} {tuple(p.shape)})")
        N = math.prod(p.shape[:-1])
        idx2.append(i.reshape(N, i.shape[-1]))
        probs2.append(p.reshape(N, E))
        masks.append(jnp.ones((N,), _F32) if mask is None else mask.reshape(N))
    return _aux_loss(E, tuple(idx2), tuple(probs2), tuple(masks))


def _aux_forward(E, idx, probs, masks):
    """The loss, the layers' summed counts [E] and 1 / R (0 when R is 0)."""
    counts, prob_sums = jnp.zeros((E,), _F32), jnp.zeros((E,), _F32)
    for i, p, m in zip(idx, probs, masks):
        N = p.shape[0]
        results = (_spec((E,), _F32), _spec((E,), _F32), _spec((_aux_scratch_words(N, E),), _I32))
        c, s, _ = _ffi.call("aux_stats", results, i, p, m)
        counts, prob_sums = counts + c, prob_sums + s
    rows = sum(jnp.sum(m) for m in masks)
    inv_rows = jnp.where(rows > 0, 1.0 / jnp.where(rows > 0, rows, 1.0), 0.0)
    loss = E * jnp.sum(counts * prob_sums) * inv_rows * inv_rows
    return loss, counts, inv_rows


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _aux_loss(E, idx, probs, masks):
    return _aux_forward(E, idx, probs, masks)[0]


def _aux_loss_fwd(E, idx, probs, masks):
    loss, counts, inv_rows = _aux_forward(E, idx, probs, masks)
    return loss, (counts, inv_rows, masks)


def _aux_loss_bwd(E, res, dloss):
    counts, inv_rows, masks = res
    # dprobs[t, e] = E · counts[e] · mask[t] / R² · dloss: the factor folded into counts, scale 1
    scaled = counts * (E * inv_rows * inv_rows * dloss.astype(_F32))
    dprobs = tuple(_ffi.call("aux_dprobs", _spec((m.shape[0], E), _F32), scaled, m, scale=1.0) for m in masks)
    return None, dprobs, None


_aux_loss.defvjp(_aux_loss_fwd, _aux_loss_bwd)


# --- permute / unpermute ----------------------------------------------------------------------------

class Routing(NamedTuple):
    """Where permute put each (token, slot) pair p = t·K + k of topk_idx [N, K], for unpermute: the N·K
    pairs grouped by expert, stable (each expert's rows in pair order, so in token order).
      expert_offsets [E + 1] int32   expert e's rows of x_perm are [expert_offsets[e], expert_offsets[e + 1])
      sorted_pair    [N·K] int32     row r of x_perm holds pair sorted_pair[r]; -1 on the rows past
                                     expert_offsets[E] (as many as pairs were dropped)
      pair_row       [N·K] int32     the inverse: pair p sits at row pair_row[p]; -1 for a dropped pair
    A pair whose expert lies outside [0, E) (an EP sentinel: another rank's expert) is dropped: it has no
    row, so no expert sees it and unpermute adds nothing for it. A pytree: it passes through jit, vmap,
    scan and checkpoint as three int32 arrays."""
    expert_offsets: jax.Array
    sorted_pair: jax.Array
    pair_row: jax.Array

    @property
    def group_sizes(self):
        """[E] int32: each expert's rows (expert_mlp's and grouped_matmul's group_sizes)."""
        return self.expert_offsets[1:] - self.expert_offsets[:-1]


def _permute_scratch_words(N: int, K: int, E: int) -> int:
    """The scratch result of mf_moe_permute_indices on a GPU (its per-tile expert histogram)."""
    return _scratch_words(ops.moe_permute_indices_workspace_bytes(N, K, E, "cuda") if _GPU else 0)


def permute(x, topk_idx, num_experts: int):
    """The dropless permutation: x [N, H] (activations), topk_idx [N, K] (integer; route's) →
    (x_perm [N·K, H], group_sizes [E] int32, routing), where x_perm's rows are the pairs grouped by
    expert (row r = x[routing.sorted_pair[r] // K], expert e's rows in token order, then one zero row per
    dropped pair: an index outside [0, num_experts) is an EP sentinel and is dropped), and routing is
    the Routing that unpermute takes. expert_mlp(x_perm, w_gate_up, w_down, group_sizes) runs each
    expert on its rows (and leaves the dropped pairs' rows zero). The gradient reaches x (each token's
    rows summed back); topk_idx has none. On a GPU, num_experts <= 4096."""
    fn = "permute"
    x, idx = _array(fn, "x", x, 2), _integers(fn, "topk_idx", topk_idx, 2)
    E = _num_experts(fn, num_experts)
    if idx.shape[0] != x.shape[0] or idx.shape[1] < 1:
        raise ValueError(f"moeforge.jax.{fn}: topk_idx has shape {tuple(idx.shape)}, expected [N = {x.shape[0]}, "
                         "K >= 1] for x's rows")
    _floats(fn, x=x)
    x_perm, offsets, sorted_pair, pair_row = _permute(E, x, idx)
    routing = Routing(offsets, sorted_pair, pair_row)
    return x_perm, routing.group_sizes, routing


def _permute_forward(E, x, idx):
    (N, H), K = x.shape, idx.shape[1]
    results = (_spec((N * K, H), x.dtype), _spec((E + 1,), _I32), _spec((N * K,), _I32), _spec((N * K,), _I32),
               _spec((_permute_scratch_words(N, K, E),), _I32))
    return _ffi.call("permute", results, x, idx, num_experts=E)[:4]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _permute(E, x, idx):
    return tuple(_permute_forward(E, x, idx))


def _permute_fwd(E, x, idx):
    x_perm, offsets, sorted_pair, pair_row = _permute_forward(E, x, idx)
    return (x_perm, offsets, sorted_pair, pair_row), pair_row.reshape(idx.shape)  # (its shape gives N and K)


def _permute_bwd(E, pair_row, cts):
    dx_perm = cts[0]  # (the indices' cotangents: float0)
    (N, K), H = pair_row.shape, dx_perm.shape[1]
    dx = _ffi.call("permute_bwd", _spec((N, H), dx_perm.dtype), dx_perm, pair_row.reshape(-1), top_k=K)
    return dx, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def unpermute(y_perm, topk_weight, routing: Routing):
    """The pairs' rows back to their tokens, weighted: y[t] = Σ_k topk_weight[t, k] · y_perm[pair_row[t·K + k]]
    (k ascending, in float32, rounded to y_perm's dtype; a dropped pair adds nothing). y_perm [N·K, H]
    (activations, e.g. expert_mlp's output on permute's x_perm), topk_weight [N, K] (route's; computed in
    float32), routing: permute's Routing of the same topk_idx. Returns y [N, H]. Gradients reach y_perm
    (a dropped pair's row: 0) and topk_weight (<dy[t], y_perm[row]>; 0 for a dropped pair)."""
    fn = "unpermute"
    y = _array(fn, "y_perm", y_perm, 2)
    w = _float32(fn, "topk_weight", topk_weight, 2)
    if not isinstance(routing, Routing):
        raise TypeError(f"moeforge.jax.{fn}: routing is {type(routing).__name__}, expected the Routing that "
                        "permute returned")
    N, K = w.shape
    pair_row = _integers(fn, "routing.pair_row", routing.pair_row, 1)
    if pair_row.shape[0] != N * K:
        raise ValueError(f"moeforge.jax.{fn}: routing.pair_row has {pair_row.shape[0]} pairs, topk_weight "
                         f"{tuple(w.shape)} {N * K}: they must come from the same topk_idx")
    if y.shape[0] != N * K:
        raise ValueError(f"moeforge.jax.{fn}: y_perm has shape {tuple(y.shape)}, expected [N·K = {N * K}, H] for "
                         f"topk_weight {tuple(w.shape)}")
    _floats(fn, y_perm=y)
    return _unpermute(y, w, pair_row)


def _unpermute_forward(y, w, pair_row):
    return _ffi.call("unpermute", _spec((w.shape[0], y.shape[1]), y.dtype), y, w, pair_row)


@jax.custom_vjp
def _unpermute(y, w, pair_row):
    return _unpermute_forward(y, w, pair_row)


def _unpermute_fwd(y, w, pair_row):
    return _unpermute_forward(y, w, pair_row), (y, w, pair_row)


def _unpermute_bwd(res, dout):
    y, w, pair_row = res
    dy, dw = _ffi.call("unpermute_bwd", (_spec(y.shape, y.dtype), _spec(w.shape, _F32)), dout.astype(y.dtype), y,
                       w, pair_row)
    return dy, dw, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)
