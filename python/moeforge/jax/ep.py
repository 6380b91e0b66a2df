"""Expert parallelism for moeforge.jax: the dropless MoE layer with the experts sharded over a mesh
axis, called inside jax.shard_map(..., check_vma=False).

    from functools import partial
    from jax.sharding import PartitionSpec as P
    from moeforge.jax.ep import moe_ffn_ep

    @partial(jax.shard_map, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"),
             check_vma=False)
    def layer(x, router_w, w_gate_up, w_down):          # per device: E/P experts, N/P tokens
        return moe_ffn_ep(x, router_w, w_gate_up, w_down, ep_axis="ep", top_k=8)

Per device p of the P on ep_axis (global expert e lives on device e // (E/P)):
  1. route the local tokens: float32 logits x · router_wᵀ, then moeforge.jax.reference.route (the
     routers of moe_ffn; top-k ties to the lower expert index);
  2. sort the (token, k) pairs by global expert (stable), so each destination's rows are one slice;
  3. all_gather the per-expert row counts: C[s, e] = rows device s sends to expert e. Every offset
     and size of both exchanges follows from C, with no further collective;
  4. dispatch: exchange the rows (ragged_all_to_all, or the padded all_to_all below); device p
     receives the slices of devices 0..P-1 in that order, each sorted by expert;
  5. re-group the received rows by local expert (stable argsort), run moeforge.jax.expert_mlp with
     group sizes Σ_s C[s, local experts], undo the grouping;
  6. combine: the reverse exchange brings each row's output back to its token's device, and
     y[t] = Σ_k w[t, k] · y_k[t] summed in float32, rounded to x's dtype (as moe_ffn does).
No row is dropped: the receive buffer holds the worst case, every local pair of every device routed
to one device's experts: P · N_local · min(top_k, E/P) rows of H (memory ∝ the global token count;
the price of being dropless with static shapes).

Exchanges. `exchange="ragged"`: jax.lax.ragged_all_to_all (XLA:GPU; XLA:CPU does not implement it).
`exchange="dense"`: each device pads its slice for every destination to the largest possible slice
(N_local · min(top_k, E/P) rows), one tiled all_to_all, then scatters the valid rows to the offsets
ragged_all_to_all would use: the same result, bit for bit, at P times the traffic of the worst case.
The default follows moeforge's dtype rule (bfloat16 runs on a GPU, float32 on the CPU): "ragged" for
bfloat16, "dense" for float32.

Gradients come from autodiff: jax differentiates ragged_all_to_all (its transpose is the reverse
exchange), all_to_all and all_gather; expert_mlp has its custom_vjp. router_w's gradient is the sum
over devices, which shard_map's transpose adds for a replicated input.

NOTE: check_vma=False is required: moeforge's FFI calls type their results as unvarying, which a
shard_map that checks varying axes would mis-transpose; moe_ffn_ep refuses a varying input."""

import math
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax import lax

from . import reference
from ._functions import _moe_config, expert_mlp

_FN = "moe_ffn_ep"
_FLOATS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


class _Slices(NamedTuple):
    """One exchange: this device's slices of the operand (send_offsets, send_sizes, one per device),
    where they land on their receivers (remote_offsets), and the slices received here (recv_offsets,
    recv_sizes, one per source device). Zero-sized slices have offset 0."""
    send_offsets: jax.Array
    send_sizes: jax.Array
    remote_offsets: jax.Array
    recv_offsets: jax.Array
    recv_sizes: jax.Array


class _Plan(NamedTuple):
    order: jax.Array         # [n·K] the (token, k) pairs sorted by global expert (stable)
    dispatch: _Slices        # the rows to the experts' devices
    combine: _Slices         # their outputs back
    regroup: jax.Array       # [capacity] grouped by local expert: position -> received row
    group_sizes: jax.Array   # [E/P] rows per local expert


def _exclusive_cumsum(a, axis=0):
    return jnp.cumsum(a, axis=axis) - a


def _zero_empty(offsets, sizes):
    return jnp.where(sizes > 0, offsets, 0).astype(jnp.int32)


def _plan(idx, num_experts: int, num_devices: int, capacity: int, ep_axis) -> _Plan:
    """Every offset and size of the two exchanges, and the local regrouping, from the chosen experts
    idx [n, K] of this device's tokens and the all_gathered counts of every device."""
    P, E = num_devices, num_experts
    local = E // P
    me = lax.axis_index(ep_axis)
    flat = idx.reshape(-1)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    counts = jnp.zeros((E,), jnp.int32).at[flat].add(1)
    C = lax.all_gather(counts, ep_axis)                                  # [P, E]: C[s, e]
    M = C.reshape(P, P, local).sum(axis=2)                               # [P, P]: rows s -> d
    send, recv = M[me], M[:, me]
    send_off, recv_off = _exclusive_cumsum(send), _exclusive_cumsum(recv)
    lands_at = _exclusive_cumsum(M, axis=0)[me]                          # my slice's offset on d
    returns_to = _exclusive_cumsum(M, axis=1)[:, me]                     # s's slice for me, on s
    dispatch = _Slices(_zero_empty(send_off, send), send, _zero_empty(lands_at, send),
                       _zero_empty(recv_off, recv), recv)
    combine = _Slices(_zero_empty(recv_off, recv), recv, _zero_empty(returns_to, recv),
                      _zero_empty(send_off, send), send)
    # Received rows come source by source, each source's sorted by expert: segments (s, j) of
    # R[s, j] rows. A row's local expert is its segment's j; rows past them sort last.
    R = lax.dynamic_slice_in_dim(C, me * local, local, axis=1)           # [P, E/P]
    ends = jnp.cumsum(R.reshape(-1))
    segment = jnp.searchsorted(ends, jnp.arange(capacity, dtype=jnp.int32), side="right")
    expert = jnp.where(segment < P * local, segment % local, local)
    regroup = jnp.argsort(expert, stable=True).astype(jnp.int32)
    return _Plan(order, dispatch, combine, regroup, R.sum(axis=0).astype(jnp.int32))


# --- exchanges --------------------------------------------------------------------------------------

def _exchange_ragged(rows, num_out: int, s: _Slices, ep_axis):
    out = jnp.zeros((num_out,) + rows.shape[1:], rows.dtype)
    return lax.ragged_all_to_all(rows, out, s.send_offsets, s.send_sizes, s.remote_offsets, s.recv_sizes,
                                 axis_name=ep_axis)


def _exchange_dense(rows, num_out: int, s: _Slices, ep_axis, num_devices: int, block: int):
    """ragged_all_to_all's result through one tiled all_to_all of slices padded to `block` rows."""
    P, H = num_devices, rows.shape[1]
    i = jnp.arange(block, dtype=jnp.int32)[None, :]
    src = s.send_offsets[:, None] + i                                      # [P, block]
    valid = i < s.send_sizes[:, None]
    blocks = jnp.where(valid[..., None], rows[jnp.clip(src, 0, rows.shape[0] - 1)], jnp.zeros((), rows.dtype))
    got = lax.all_to_all(blocks.reshape(P * block, H), ep_axis, 0, 0, tiled=True)
    dst = jnp.where(i < s.recv_sizes[:, None], s.recv_offsets[:, None] + i, num_out)  # num_out: dropped
    out = jnp.zeros((num_out, H), rows.dtype)
    return out.at[dst.reshape(-1)].add(got, mode="drop")  # (slices are disjoint: an add into zeros is a set)


# --- the layer --------------------------------------------------------------------------------------

def _check(x, router_w, w_gate_up, w_down, ep_axis, exchange):
    x, rw, gu, dn = (jnp.asarray(a) for a in (x, router_w, w_gate_up, w_down))
    if x.ndim < 1 or rw.ndim != 2 or gu.ndim != 3 or dn.ndim != 3:
        raise ValueError(f"moeforge.jax.{_FN}: x {tuple(x.shape)}, router_w {tuple(rw.shape)}, w_gate_up "
                         f"{tuple(gu.shape)}, w_down {tuple(dn.shape)}: expected [..., H], [E, H], [E/P, 2I, H], "
                         "[E/P, H, I]")
    P = lax.axis_size(ep_axis)
    (E, H), (local, two_i, _) = rw.shape, gu.shape
    if local * P != E:
        raise ValueError(f"moeforge.jax.{_FN}: w_gate_up holds {local} experts on each of the {P} devices of "
                         f"{ep_axis!r}, router_w scores {E}: each device must hold E/P = {E / P:g}")
    if two_i % 2 or gu.shape[2] != H or x.shape[-1] != H or tuple(dn.shape) != (local, H, two_i // 2):
        raise ValueError(f"moeforge.jax.{_FN}: x {tuple(x.shape)}, w_gate_up {tuple(gu.shape)}, w_down "
                         f"{tuple(dn.shape)} do not fit router_w {tuple(rw.shape)}: expected [..., {H}], "
                         f"[{local}, 2I, {H}], [{local}, {H}, I]")
    dtypes = {a.dtype for a in (x, rw, gu, dn)}
    if len(dtypes) != 1 or x.dtype not in _FLOATS:
        raise TypeError(f"moeforge.jax.{_FN}: x, router_w, w_gate_up, w_down are {[str(d) for d in dtypes]}; they "
                        "must share one dtype, float32 (CPU) or bfloat16 (GPU)")
    if any(getattr(jax.typeof(a), "vma", frozenset()) for a in (x, rw, gu, dn)):
        raise ValueError(f"moeforge.jax.{_FN}: call it inside jax.shard_map(..., check_vma=False); moeforge's FFI "
                         "calls do not carry varying-axis types")
    if exchange is None:
        exchange = "ragged" if x.dtype == jnp.dtype(jnp.bfloat16) else "dense"
    if exchange not in ("ragged", "dense"):
        raise ValueError(f"moeforge.jax.{_FN}: exchange={exchange!r}, expected 'ragged', 'dense' or None")
    return x, rw, gu, dn, P, exchange


def moe_ffn_ep(x, router_w, w_gate_up, w_down, *, ep_axis, top_k: int, norm_topk_prob: bool = True,
               router: str = "softmax", correction_bias=None, n_group: int = 1, topk_group: int = 1,
               routed_scaling_factor: float = 1.0, masked_score: float = -math.inf, exchange: Optional[str] = None):
    """moeforge.jax.moe_ffn with expert parallelism over the mesh axis ep_axis, inside
    jax.shard_map(..., check_vma=False): x [..., H] this device's tokens, router_w [E, H] replicated,
    w_gate_up [E/P, 2I, H] and w_down [E/P, H, I] this device's experts (global experts
    p·E/P .. (p+1)·E/P - 1 on device p), all one dtype. Router options as moe_ffn's; exchange "ragged",
    "dense" or None (by dtype; see the module's text). Returns y [..., H] in x's dtype: the rows of the
    unsharded moe_ffn for these tokens. Differentiable in x, router_w, w_gate_up and w_down."""
    x, rw, gu, dn, P, exchange = _check(x, router_w, w_gate_up, w_down, ep_axis, exchange)
    E, H = rw.shape
    local = gu.shape[0]
    _moe_config(E, top_k, norm_topk_prob, router, n_group, topk_group, routed_scaling_factor, masked_score,
                correction_bias is not None)  # (moe_ffn's checks of the router options)
    lead, x2 = x.shape[:-1], x.reshape(-1, H)
    n = x2.shape[0]
    if n == 0:
        return jnp.zeros(x.shape, x.dtype)  # (every device has the same shape: no device waits)
    logits = jnp.einsum("th,eh->te", x2, rw, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    bias = None if correction_bias is None else jnp.asarray(correction_bias, jnp.float32)
    idx, weight, _ = reference.route(logits, top_k=top_k, norm_topk_prob=norm_topk_prob, router=router,
                                     correction_bias=bias, n_group=n_group, topk_group=topk_group,
                                     routed_scaling_factor=routed_scaling_factor, masked_score=masked_score)
    block = n * min(top_k, local)     # the most rows one device sends to (or gets back from) one device
    capacity = P * block              # the most rows one device receives
    plan = _plan(idx, E, P, capacity, ep_axis)
    if exchange == "ragged":
        def send(rows, num_out, s):
            return _exchange_ragged(rows, num_out, s, ep_axis)
    else:
        def send(rows, num_out, s):
            return _exchange_dense(rows, num_out, s, ep_axis, P, block)

    rows = x2[plan.order // top_k]                                         # [n·K, H] sorted by expert
    received = send(rows, capacity, plan.dispatch)                         # [capacity, H]
    grouped = received[plan.regroup]
    y_grouped = expert_mlp(grouped, gu, dn, plan.group_sizes)
    ungroup = jnp.zeros((capacity,), jnp.int32).at[plan.regroup].set(jnp.arange(capacity, dtype=jnp.int32))
    y_sorted = send(y_grouped[ungroup], n * top_k, plan.combine)           # [n·K, H] back in `order`
    unsort = jnp.zeros((n * top_k,), jnp.int32).at[plan.order].set(jnp.arange(n * top_k, dtype=jnp.int32))
    y_pairs = y_sorted[unsort].reshape(n, top_k, H).astype(jnp.float32)
    y = jnp.sum(weight.astype(jnp.float32)[:, :, None] * y_pairs, axis=1)
    return y.astype(x.dtype).reshape(*lead, H)
