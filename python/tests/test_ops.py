"""Each op of moeforge.ops on the CPU against a numpy fp64 reference written here from the formulas
(include/moeforge/moeforge.h): the grouped GEMMs with empty experts and ragged groups, the routers,
permute / gather / unpermute and their backwards with EP sentinels (an expert index >= E contributes
nothing), SwiGLU and gpt-oss's clamped SwiGLU, the whole MoE block, attention, RMSNorm, the fused
LM head + cross-entropy and AdamW. Tolerances: conftest.py (CONVENTIONS.md's rule); index outputs
and permutations exactly."""

import math

import numpy as np
import pytest
from conftest import close_by_rule, close_elementwise

import moeforge
from moeforge import ops

f32, i32 = np.float32, np.int32


def rand(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(f32)


# --- grouped GEMM -----------------------------------------------------------------------------------

def grouped(x, w, offsets, dtype):
    out = np.zeros((x.shape[0], w.shape[1]), dtype)
    for e in range(w.shape[0]):
        a, b = offsets[e], offsets[e + 1]
        out[a:b] = x[a:b].astype(dtype) @ w[e].astype(dtype).T
    return out


@pytest.mark.parametrize("offsets", [[0, 3, 3, 10, 10, 13], [0, 0, 0, 0, 0, 0], [0, 13, 13, 13, 13, 13]])
def test_grouped_gemm_forward_and_grads(offsets):
    rng = np.random.default_rng(1)
    E, M, C, OC = 5, 13, 12, 7
    off = np.array(offsets, i32)
    x, w, dy = rand(rng, M, C), rand(rng, E, OC, C), rand(rng, M, OC)
    out = np.zeros((M, OC), f32)
    ops.grouped_gemm_forward(out, x, w, off)
    close_by_rule(out, grouped(x, w, off, np.float64), grouped(x, w, off, f32), what="forward")
    dx = np.full((M, C), 5.0, f32)
    ops.grouped_gemm_input_grad(dx, dy, w, off, accumulate=False)
    ref = np.zeros((M, C))
    for e in range(E):
        a, b = off[e], off[e + 1]
        ref[a:b] = dy[a:b].astype(np.float64) @ w[e].astype(np.float64)
    ref[off[E]:] = 5.0  # rows past the groups are left alone
    close_by_rule(dx, ref, ref.astype(f32), floor=1e-5, what="input grad")
    dw = np.full((E, OC, C), 9.0, f32)
    ops.grouped_gemm_weight_grad(dw, dy, x, off, accumulate=False)
    ref_w = np.zeros((E, OC, C))
    for e in range(E):
        a, b = off[e], off[e + 1]
        ref_w[e] = dy[a:b].astype(np.float64).T @ x[a:b].astype(np.float64)
    close_by_rule(dw, ref_w, ref_w.astype(f32), floor=1e-5, what="weight grad (an empty expert's is 0)")
    assert np.all(dw[[e for e in range(E) if off[e] == off[e + 1]]] == 0)


# --- routers -------------------------------------------------------------------------------------------


def test_group_offsets_and_rows_past_the_groups():
    """ragged_dot's group sizes: offsets by a clamped running sum (negative sizes count as 0, no group
    past the rows), the grouped GEMM over them, and the rows no group covers zeroed."""
    rng = np.random.default_rng(11)
    M, C, OC = 10, 8, 8
    for sizes, want in [([3, 0, 4], [0, 3, 3, 7]), ([5, -2, 9, 1], [0, 5, 5, 10, 10]), ([], [0])]:
        offsets = np.full(len(sizes) + 1, -7, np.int32)
        ops.group_offsets(offsets, np.array(sizes, np.int32), M)
        np.testing.assert_array_equal(offsets, want)
    sizes = np.array([3, 0, 4], np.int32)
    offsets = np.zeros(4, np.int32)
    ops.group_offsets(offsets, sizes, M)
    x, w = rand(rng, M, C), rand(rng, 3, OC, C)
    out = np.full((M, OC), np.nan, f32)
    ops.grouped_gemm_forward(out, x, w, offsets)
    ops.zero_rows_past_groups(out, offsets)
    ref = np.zeros((M, OC))
    for e in range(3):
        ref[offsets[e]:offsets[e + 1]] = x[offsets[e]:offsets[e + 1]].astype(np.float64) @ w[e].astype(np.float64).T
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(moeforge.InvalidArgumentError, match="offsets .* expected 4"):
        ops.group_offsets(np.zeros(3, np.int32), sizes, M)
    with pytest.raises(moeforge.InvalidArgumentError, match="num_rows = -1"):
        ops.group_offsets(offsets, sizes, -1)
    with pytest.raises(moeforge.InvalidArgumentError, match="group_sizes"):
        ops.group_offsets(offsets, sizes.astype(np.int64), M)

def softmax64(logits):
    z = logits.astype(np.float64)
    z = np.exp(z - z.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


@pytest.mark.parametrize("norm", [True, False])
def test_router_softmax_topk(norm):
    rng = np.random.default_rng(2)
    N, E, K = 9, 8, 3
    logits = rand(rng, N, E, scale=2.0)
    probs, idx, w = np.zeros((N, E), f32), np.zeros((N, K), i32), np.zeros((N, K), f32)
    ops.router_softmax_topk_forward(probs, idx, w, logits, norm)
    p64 = softmax64(logits)
    close_elementwise(probs, p64, what="probs")
    want_idx = np.argsort(-p64, axis=1, kind="stable")[:, :K]
    np.testing.assert_array_equal(idx, want_idx)
    chosen = np.take_along_axis(p64, want_idx, 1)
    if norm:
        chosen = chosen / chosen.sum(1, keepdims=True)
    close_elementwise(w, chosen, what="weights")
    # Backward against finite differences of Σ g·w(logits) in fp64 (the indices fixed).
    g = rand(rng, N, K)
    dlogits = np.zeros((N, E), f32)
    ops.router_softmax_topk_backward(dlogits, g, None, probs, idx, norm)

    def objective(lg):
        p = softmax64(lg)
        c = np.take_along_axis(p, want_idx, 1)
        if norm:
            c = c / c.sum(1, keepdims=True)
        return float((c * g).sum())

    h, fd = 1e-6, np.zeros((N, E))
    base = logits.astype(np.float64)
    for n in range(N):
        for e in range(E):
            plus, minus = base.copy(), base.copy()
            plus[n, e] += h
            minus[n, e] -= h
            fd[n, e] = (objective(plus) - objective(minus)) / (2 * h)
    np.testing.assert_allclose(dlogits, fd, rtol=1e-4, atol=1e-6)


def test_router_sigmoid_with_bias_and_groups():
    rng = np.random.default_rng(3)
    N, E, K, G, TG = 6, 16, 4, 4, 2
    logits, bias = rand(rng, N, E, scale=2.0), rand(rng, E, scale=0.5)
    scores, idx, w = np.zeros((N, E), f32), np.zeros((N, K), i32), np.zeros((N, K), f32)
    ops.router_sigmoid_forward(scores, idx, w, logits, bias, n_group=G, topk_group=TG, norm_topk_prob=True,
                               routed_scaling_factor=2.5)
    s64 = 1 / (1 + np.exp(-logits.astype(np.float64)))
    close_elementwise(scores, s64, what="scores")
    for n in range(N):
        choice = s64[n] + bias
        groups = choice.reshape(G, E // G)
        group_score = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-group_score, kind="stable")[:TG]
        masked = np.full(E, -np.inf)
        for gi in keep:
            masked[gi * (E // G):(gi + 1) * (E // G)] = choice[gi * (E // G):(gi + 1) * (E // G)]
        want = np.argsort(-masked, kind="stable")[:K]
        np.testing.assert_array_equal(idx[n], want)
        chosen = s64[n, want]
        close_elementwise(w[n], chosen / (chosen.sum() + 1e-20) * 2.5, what=f"weights row {n}")


# --- permute / gather / unpermute, with EP sentinels -----------------------------------------------------

def test_permute_gather_unpermute_and_backwards_with_sentinels():
    rng = np.random.default_rng(4)
    N, K, E, H = 7, 3, 5, 6
    topk = rng.integers(0, E, (N, K)).astype(i32)
    topk[1, 2] = E  # EP sentinels: experts another rank holds
    topk[4, 0] = E + 3
    topk[:, 1][topk[:, 1] == 2] = 0  # expert 2 gets fewer rows; some rows may leave it empty
    offsets, sorted_pair, pair_row = np.zeros(E + 1, i32), np.zeros(N * K, i32), np.zeros(N * K, i32)
    ops.moe_permute_indices(offsets, sorted_pair, pair_row, topk, E)
    flat = topk.reshape(-1)
    kept = [p for p in range(N * K) if flat[p] < E]
    want_sorted = sorted(kept, key=lambda p: (flat[p], p))  # stable by expert
    counts = np.bincount(flat[kept], minlength=E)
    np.testing.assert_array_equal(offsets, np.concatenate([[0], np.cumsum(counts)]))
    np.testing.assert_array_equal(sorted_pair[:len(kept)], want_sorted)
    assert np.all(sorted_pair[len(kept):] == -1)
    want_row = np.full(N * K, -1)
    want_row[want_sorted] = np.arange(len(kept))
    np.testing.assert_array_equal(pair_row, want_row)

    x = rand(rng, N, H)
    x_perm = np.full((N * K, H), 3.0, f32)
    ops.moe_gather(x_perm, x, sorted_pair, K)
    want_perm = np.zeros((N * K, H), f32)
    want_perm[:len(kept)] = x[np.array(want_sorted) // K]
    np.testing.assert_array_equal(x_perm, want_perm)  # a copy: exact; a dropped pair's row is zeros

    weights = rng.random((N, K)).astype(f32)
    y_perm = rand(rng, N * K, H)
    out = np.zeros((N, H), f32)
    ops.moe_unpermute(out, y_perm, weights, pair_row)
    ref = np.zeros((N, H))
    for t in range(N):
        for k in range(K):
            if pair_row[t * K + k] >= 0:
                ref[t] += float(weights[t, k]) * y_perm[pair_row[t * K + k]].astype(np.float64)
    close_by_rule(out, ref, ref.astype(f32), what="unpermute (sentinels add nothing)")

    dout = rand(rng, N, H)
    dy_perm, dw = np.full((N * K, H), 8.0, f32), np.full((N, K), 8.0, f32)
    ops.moe_unpermute_backward(dy_perm, dw, dout, y_perm, weights, pair_row)
    for t in range(N):
        for k in range(K):
            row = pair_row[t * K + k]
            if row < 0:
                assert dw[t, k] == 0
                continue
            close_elementwise(dy_perm[row], weights[t, k].astype(np.float64) * dout[t], what="dy_perm")
            d = float(dout[t].astype(np.float64) @ y_perm[row].astype(np.float64))
            assert abs(dw[t, k] - d) <= 1e-5 * (1 + abs(d))
    assert np.all(dy_perm[len(kept):] == 8.0), "rows of dropped pairs are not written"

    dx = np.ones((N, H), f32)
    dx_perm = rand(rng, N * K, H)
    ops.moe_gather_backward(dx, dx_perm, pair_row, K)
    ref = np.ones((N, H))
    for t in range(N):
        for k in range(K):
            if pair_row[t * K + k] >= 0:
                ref[t] += dx_perm[pair_row[t * K + k]]
    close_by_rule(dx, ref, ref.astype(f32), what="gather backward (+=)")


# --- activations ---------------------------------------------------------------------------------------

def test_swiglu():
    rng = np.random.default_rng(5)
    x, dy = rand(rng, 4, 10, scale=3), rand(rng, 4, 5)
    out, dx = np.zeros((4, 5), f32), np.zeros((4, 10), f32)
    ops.swiglu_forward(out, x)
    ops.swiglu_backward(dx, dy, x)
    g, u, d = x[:, :5].astype(np.float64), x[:, 5:].astype(np.float64), dy.astype(np.float64)
    s = 1 / (1 + np.exp(-g))
    close_elementwise(out, g * s * u)
    close_elementwise(dx, np.concatenate([d * u * s * (1 + g * (1 - s)), d * g * s], axis=1), rtol=1e-5, atol=1e-6)


def test_relu2():
    rng = np.random.default_rng(8)
    x, dy = rand(rng, 4, 7, scale=2), rand(rng, 4, 7)
    out, dx = np.zeros((4, 7), f32), np.zeros((4, 7), f32)
    ops.relu2_forward(out, x)
    ops.relu2_backward(dx, dy, x)
    r = np.maximum(x.astype(np.float64), 0)
    close_elementwise(out, r * r)
    close_elementwise(dx, dy.astype(np.float64) * 2 * r)
    assert np.any(x < 0) and np.any(x > 0)
    with pytest.raises(moeforge.Error, match="relu2_forward"):
        ops.relu2_forward(np.zeros((4, 6), f32), x)


@pytest.mark.parametrize("alpha,limit", [(1.702, 7.0), (0.5, 2.0)])
def test_clamped_swiglu_gpt_oss(alpha, limit):
    """transformers' GptOssExperts: gate, up = h[..., ::2], h[..., 1::2]; gate.clamp(max=limit);
    up.clamp(-limit, limit); (up + 1) * gate * sigmoid(gate * alpha)."""
    rng = np.random.default_rng(6)
    N, I = 5, 6
    h = rand(rng, N, 2 * I, scale=1.2 * limit)
    dy = rand(rng, N, I)
    out, dh = np.zeros((N, I), f32), np.zeros((N, 2 * I), f32)
    ops.clamped_swiglu_forward(out, h, alpha, limit)
    ops.clamped_swiglu_backward(dh, dy, h, alpha, limit)
    gate, up = h[:, ::2].astype(np.float64), h[:, 1::2].astype(np.float64)
    g, u = np.minimum(gate, limit), np.clip(up, -limit, limit)
    s = 1 / (1 + np.exp(-alpha * g))
    close_elementwise(out, (u + 1) * g * s, rtol=1e-5, atol=1e-6)
    d = dy.astype(np.float64)
    want = np.zeros((N, 2 * I))
    want[:, ::2] = np.where(gate <= limit, d * (u + 1) * s * (1 + alpha * g * (1 - s)), 0)
    want[:, 1::2] = np.where(np.abs(up) <= limit, d * g * s, 0)
    close_elementwise(dh, want, rtol=1e-5, atol=1e-6)
    assert np.any(gate > limit) and np.any(np.abs(up) > limit), "the inputs reach beyond the clamps"
    # The defaults are gpt-oss's.
    out_default = np.zeros_like(out)
    ops.clamped_swiglu_forward(out_default, h)
    ops.clamped_swiglu_forward(out, h, 1.702, 7.0)
    np.testing.assert_array_equal(out_default, out)



def test_load_balancing_statistics_and_gradient():
    """transformers' load_balancing_loss_func over two layers with padding, from the statistics
    (sentinel indices count nothing), and its gradient at the probabilities against the derivative
    of that formula (E / R² · mask[t] · counts[e]: the counts do not depend on the probabilities)."""
    rng = np.random.default_rng(12)
    N, E, K = 7, 5, 2
    mask = np.array([1, 1, 0, 1, 1, 1, 0], f32)
    layers = []
    for _ in range(2):
        probs = softmax64(rand(rng, N, E).astype(np.float64)).astype(f32)
        idx = np.argsort(-probs, axis=1, kind="stable")[:, :K].astype(np.int32)
        layers.append((probs, idx))
    layers[1][1][3, 1] = E + 2  # another rank's expert: counts nothing
    counts, sums = np.zeros(E, f32), np.zeros(E, f32)
    for probs, idx in layers:
        ops.moe_aux_stats(counts, sums, idx, probs, mask)
    want_counts, want_sums = np.zeros(E), np.zeros(E)
    for probs, idx in layers:
        for t in range(N):
            for k in range(K):
                if 0 <= idx[t, k] < E:
                    want_counts[idx[t, k]] += mask[t]
            want_sums += mask[t] * probs[t].astype(np.float64)
    np.testing.assert_allclose(counts, want_counts, rtol=1e-6)
    np.testing.assert_allclose(sums, want_sums, rtol=1e-6)
    R = 2 * mask.sum()
    loss = E * float((counts.astype(np.float64) * sums).sum()) / R**2
    # transformers' formula: E · Σ_e (the fraction of routings to e) · (e's mean router probability)
    hf = E * float(((want_counts / R) * (want_sums / R)).sum())
    assert abs(loss - hf) <= 1e-6 * hf
    dprobs = np.zeros((N, E), f32)
    ops.moe_aux_dprobs(dprobs, counts, mask, E / float(R**2))
    np.testing.assert_allclose(dprobs, E / R**2 * np.outer(mask, counts), rtol=1e-6)
    with pytest.raises(moeforge.InvalidArgumentError, match="mask"):
        ops.moe_aux_stats(counts, sums, layers[0][1], layers[0][0], np.ones(N + 1, f32))
    with pytest.raises(moeforge.InvalidArgumentError, match="scale"):
        ops.moe_aux_dprobs(dprobs, counts, mask, float("nan"))

# --- the whole MoE block ---------------------------------------------------------------------------------

def test_moe_block_forward_backward_against_numpy():
    rng = np.random.default_rng(7)
    N, H, I, E, K = 10, 8, 4, 6, 2
    dims = dict(hidden=H, intermediate=I, num_experts=E, top_k=K, norm_topk_prob=True)
    x, router = rand(rng, N, H), rand(rng, E, H)
    gate_up, down = rand(rng, E, 2 * I, H, scale=0.5), rand(rng, E, H, I, scale=0.5)
    ws = np.zeros(ops.moe_block_workspace_bytes(dims, N) // 4 + 64, f32)
    ws = ws[(-ws.ctypes.data % 256) // 4:]  # 256-byte aligned
    y = np.zeros((N, H), f32)
    ops.moe_block_forward(dims, y, x, router, gate_up, down, workspace=ws)

    x64 = x.astype(np.float64)
    p = softmax64(x64 @ router.astype(np.float64).T)
    idx = np.argsort(-p, axis=1, kind="stable")[:, :K]
    wts = np.take_along_axis(p, idx, 1)
    wts /= wts.sum(1, keepdims=True)
    ref = np.zeros((N, H))
    for t in range(N):
        for k in range(K):
            e = idx[t, k]
            hh = gate_up[e].astype(np.float64) @ x64[t]
            g, u = hh[:I], hh[I:]
            ref[t] += wts[t, k] * (down[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)

    # Backward: the input gradient against finite differences of Σ dy·y through the op itself.
    dy = rand(rng, N, H)
    dx, drouter = np.zeros((N, H), f32), np.zeros((E, H), f32)
    dgu, ddown = np.zeros_like(gate_up), np.zeros_like(down)
    ops.moe_block_backward(dims, dx, drouter, dgu, ddown, dy, None, x, router, gate_up, down, workspace=ws,
                           accumulate_expert_grads=False)

    def objective(xs):
        out = np.zeros((N, H), f32)
        ops.moe_block_forward(dims, out, xs, router, gate_up, down, workspace=ws)
        return float((out.astype(np.float64) * dy).sum())

    eps = 1e-2
    for (t, c) in [(0, 0), (3, 5), (9, 7)]:
        plus, minus = x.copy(), x.copy()
        plus[t, c] += eps
        minus[t, c] -= eps
        fd = (objective(plus) - objective(minus)) / (2 * eps)
        assert abs(dx[t, c] - fd) <= 2e-2 * (1 + abs(fd)), (t, c, dx[t, c], fd)
    # The down gradient exactly as the formula: Σ_t w · dy[t] ⊗ a(t).
    ref_dd = np.zeros((E, H, I))
    for t in range(N):
        for k in range(K):
            e = idx[t, k]
            hh = gate_up[e].astype(np.float64) @ x64[t]
            a = hh[:I] / (1 + np.exp(-hh[:I])) * hh[I:]
            ref_dd[e] += wts[t, k] * np.outer(dy[t], a)
    np.testing.assert_allclose(ddown, ref_dd, rtol=1e-4, atol=1e-5)


def aligned_zeros(nbytes):
    buf = np.zeros(nbytes // 4 + 64, f32)
    return buf[(-buf.ctypes.data % 256) // 4:][: nbytes // 4]


def test_moe_block_activations_and_scratch_apart_equal_one_workspace():
    rng = np.random.default_rng(8)
    N, H, I, E, K = 9, 8, 4, 5, 2
    dims = dict(hidden=H, intermediate=I, num_experts=E, top_k=K)
    x, router = rand(rng, N, H), rand(rng, E, H)
    gate_up, down, dy = rand(rng, E, 2 * I, H, scale=0.5), rand(rng, E, H, I, scale=0.5), rand(rng, N, H)
    whole, acts = ops.moe_block_workspace_bytes(dims, N), ops.moe_block_activation_bytes(dims, N)
    assert 0 < acts < whole and acts % 256 == 0

    def run(workspace, scratch):
        y, dx, drouter = np.zeros((N, H), f32), np.zeros((N, H), f32), np.zeros((E, H), f32)
        dgu, ddown = np.zeros_like(gate_up), np.zeros_like(down)
        ops.moe_block_forward(dims, y, x, router, gate_up, down, workspace=workspace)
        ops.moe_block_backward(dims, dx, drouter, dgu, ddown, dy, None, x, router, gate_up, down, workspace=workspace,
                               scratch=scratch, accumulate_expert_grads=False)
        return y, dx, drouter, dgu, ddown

    for a, b in zip(run(aligned_zeros(whole), None), run(aligned_zeros(acts), aligned_zeros(whole - acts))):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(moeforge.InvalidArgumentError, match="scratch.*mf_moe_block_activation_bytes"):
        run(aligned_zeros(acts), aligned_zeros(whole - acts - 256))
    with pytest.raises(moeforge.InvalidArgumentError, match="workspace.*mf_moe_block_workspace_bytes"):
        run(aligned_zeros(acts), None)


# --- arrays read through their own methods (register_array_type) ---------------------------------------


class MethodArray:
    """An array type of the shape torch.Tensor has (data_ptr(), dtype, shape, stride(), is_cuda, is_cpu,
    get_device()) over a numpy array, and no DLPack: moeforge reads it only once its type is registered."""

    def __init__(self, a):
        self.a = a
        self.dtype = {np.dtype(np.float32): "F32", np.dtype(np.int32): "I32"}.get(a.dtype, str(a.dtype))
        self.shape = tuple(a.shape)
        self.is_cuda, self.is_cpu = False, True

    def data_ptr(self):
        return self.a.ctypes.data

    def stride(self):
        return tuple(s // self.a.itemsize for s in self.a.strides)

    def get_device(self):
        return -1


def test_registered_array_type_is_read_without_dlpack():
    rng = np.random.default_rng(9)
    h = rand(rng, 5, 8)
    want = np.zeros((5, 4), f32)
    ops.swiglu_forward(want, h)
    out = np.zeros((5, 4), f32)
    with pytest.raises(moeforge.InvalidArgumentError, match="neither a DLPack array"):
        ops.swiglu_forward(MethodArray(out), MethodArray(h))
    ops.register_array_type(MethodArray, {"F32": "float32", "I32": "int32"})
    ops.swiglu_forward(MethodArray(out), MethodArray(h))
    np.testing.assert_array_equal(out, want)
    # a dtype not registered, a strided view and another device are refused by name
    with pytest.raises(moeforge.InvalidArgumentError, match="inp: dtype float64"):
        ops.swiglu_forward(MethodArray(out), MethodArray(h.astype(np.float64)))
    with pytest.raises(moeforge.InvalidArgumentError, match="inp .* is not contiguous"):
        ops.swiglu_forward(MethodArray(np.zeros((5, 2), f32)), MethodArray(h[:, ::2]))
    elsewhere = MethodArray(h)
    elsewhere.is_cpu = False
    elsewhere.device = "meta"
    with pytest.raises(moeforge.InvalidArgumentError, match="inp: device meta"):
        ops.swiglu_forward(MethodArray(out), elsewhere)


# --- attention -------------------------------------------------------------------------------------------

def attention_ref(q, k, v, B, T, Hq, Hkv, docs, dtype=np.float64):
    D = q.shape[-1] // Hq
    q = q.reshape(B, T, Hq, D).astype(dtype)
    k = k.reshape(B, T, Hkv, D).astype(dtype)
    v = v.reshape(B, T, Hkv, D).astype(dtype)
    out = np.zeros((B, T, Hq, D), dtype)
    lse = np.zeros((B, Hq, T), dtype)
    d = docs.reshape(B, T)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            s = q[b, :, h] @ k[b, :, kh].T / dtype(math.sqrt(D))
            mask = np.tril(np.ones((T, T), bool)) & (d[b][:, None] == d[b][None, :])
            s = np.where(mask, s, -np.inf)
            m = s.max(1, keepdims=True)
            p = np.exp(s - m)
            lse[b, h] = (m[:, 0] + np.log(p.sum(1)))
            out[b, :, h] = (p / p.sum(1, keepdims=True)) @ v[b, :, kh]
    return out.reshape(B, T, Hq * D), lse


def test_attention_forward_backward_causal_gqa_packed():
    rng = np.random.default_rng(8)
    B, T, Hq, Hkv, D = 2, 7, 4, 2, 8
    q, k, v = rand(rng, B, T, Hq * D), rand(rng, B, T, Hkv * D), rand(rng, B, T, Hkv * D)
    docs = np.array([0, 0, 0, 1, 1, 2, 2, 0, 0, 0, 0, 0, 0, 0], i32)
    out, lse = np.zeros_like(q), np.zeros((B, Hq, T), f32)
    ops.attention_forward(out, lse, q, k, v, docs, B, T, Hq, Hkv)
    ref, ref_lse = attention_ref(q, k, v, B, T, Hq, Hkv, docs)
    naive, naive_lse = attention_ref(q, k, v, B, T, Hq, Hkv, docs, f32)
    close_by_rule(out, ref, naive, what="attention out")
    close_by_rule(lse, ref_lse, naive_lse, what="attention lse")
    dout = rand(rng, B, T, Hq * D)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    ops.attention_backward(dq, dk, dv, dout, q, k, v, out, lse, docs, B, T, Hq, Hkv)

    def objective(qq, kk, vv):
        return float((attention_ref(qq, kk, vv, B, T, Hq, Hkv, docs)[0] * dout).sum())

    h = 1e-5
    for name, arr, grad in (("q", q, dq), ("k", k, dk), ("v", v, dv)):
        for pos in [(0, 0, 0), (1, 6, 3), (0, 4, arr.shape[-1] - 1)]:
            plus, minus = [a.astype(np.float64) for a in (q, k, v)], [a.astype(np.float64) for a in (q, k, v)]
            which = "qkv".index(name)
            plus[which][pos] += h
            minus[which][pos] -= h
            fd = (objective(*plus) - objective(*minus)) / (2 * h)
            assert abs(grad[pos] - fd) <= 1e-4 * (1 + abs(fd)), (name, pos, grad[pos], fd)


# --- RMSNorm, LM head + CE, AdamW --------------------------------------------------------------------------

def test_rmsnorm_forward_backward():
    rng = np.random.default_rng(9)
    N, C, eps = 6, 16, 1e-6
    x, w, dy = rand(rng, N, C), rand(rng, C), rand(rng, N, C)
    out, rstd = np.zeros_like(x), np.zeros(N, f32)
    ops.rmsnorm_forward(out, rstd, x, w, eps)
    x64 = x.astype(np.float64)
    r = 1 / np.sqrt((x64 ** 2).mean(1) + eps)
    close_elementwise(rstd, r, rtol=1e-6)
    close_elementwise(out, x64 * r[:, None] * w, rtol=1e-5, atol=1e-6)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    ops.rmsnorm_backward(dx, dw, dy, x, w, rstd)
    xh = x64 * r[:, None]
    g = dy.astype(np.float64) * w
    want_dx = r[:, None] * (g - xh * (g * xh).mean(1, keepdims=True))
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, (dy.astype(np.float64) * xh).sum(0), rtol=1e-4, atol=1e-6)
    # accumulate_dinp=False writes dx (a NaN-filled buffer never read); the default adds into it.
    dx2, dw2 = np.full_like(x, np.nan), np.zeros_like(w)
    ops.rmsnorm_backward(dx2, dw2, dy, x, w, rstd, accumulate_dinp=False)
    np.testing.assert_array_equal(dx2, dx)
    np.testing.assert_array_equal(dw2, dw)
    ops.rmsnorm_backward(dx2, dw2, dy, x, w, rstd)
    np.testing.assert_allclose(dx2, 2 * dx, rtol=1e-6, atol=1e-7)


def test_embedding_forward_backward():
    rng = np.random.default_rng(13)
    V, C, N = 11, 8, 30
    wte, dy = rand(rng, V, C), rand(rng, N, C)
    ids = rng.integers(0, 5, N).astype(i32)  # (every id used repeats)
    out = np.full((N, C), np.nan, f32)
    ops.embedding_forward(out, ids, wte)
    np.testing.assert_array_equal(out, wte[ids])
    assert ops.embedding_backward_workspace_bytes(N, V) == 0  # (the CPU takes no scratch)
    dwte = np.ones((V, C), f32)  # (added into)
    ops.embedding_backward(dwte, dy, ids)
    want = np.ones((V, C))
    np.add.at(want, ids, dy.astype(np.float64))
    np.testing.assert_allclose(dwte, want, rtol=1e-6, atol=1e-6)
    bad = ids.copy()
    bad[7] = V
    with pytest.raises(moeforge.InvalidArgumentError, match=r"ids\[7\] = 11 is outside"):
        ops.embedding_forward(out, bad, wte)
    bad[7] = -1
    with pytest.raises(moeforge.InvalidArgumentError, match=r"ids\[7\] = -1"):
        ops.embedding_backward(dwte, dy, bad)
    with pytest.raises(moeforge.InvalidArgumentError, match="dout"):
        ops.embedding_backward(dwte, dy[:, :4].copy(), ids)
    with pytest.raises(moeforge.InvalidArgumentError, match="wte"):
        ops.embedding_forward(out, ids, wte.reshape(-1))


def _rotate(x, cos, sin):
    """transformers' x·cos + rotate_half(x)·sin over the last dim, cos/sin broadcast over heads."""
    h = x.shape[-1] // 2
    return x * cos[:, None, :] + np.concatenate([-x[..., h:], x[..., :h]], -1) * sin[:, None, :]


def test_qknorm_rope_forward_backward_against_numpy():
    rng = np.random.default_rng(10)
    N, Hq, Hkv, D, eps = 5, 4, 2, 16, 1e-6
    q, k = rand(rng, N, Hq, D), rand(rng, N, Hkv, D)
    qw, kw = (rng.uniform(0.5, 1.5, D).astype(f32) for _ in range(2))
    cos, sin = rand(rng, N, D), rand(rng, N, D)  # (halves that differ: the general table)
    q_out, k_out = np.zeros_like(q), np.zeros_like(k)
    q_rstd, k_rstd = np.zeros((N, Hq), f32), np.zeros((N, Hkv), f32)
    ops.qknorm_rope_forward(q_out, k_out, q_rstd, k_rstd, q, k, qw, kw, cos, sin, eps)
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)

    def forward64(x, w):
        x = x.astype(np.float64)
        r = 1 / np.sqrt((x ** 2).mean(-1) + eps)
        return _rotate(x * r[..., None] * w, c64, s64), r

    for got, rstd, x, w in ((q_out, q_rstd, q, qw), (k_out, k_rstd, k, kw)):
        want, r = forward64(x, w)
        close_elementwise(rstd, r, rtol=1e-6)
        close_elementwise(got, want, rtol=1e-5, atol=1e-6)

    # Backward against the transposed rotation and RMSNorm's gradient, in fp64.
    dq_out, dk_out = rand(rng, N, Hq, D), rand(rng, N, Hkv, D)
    dq, dk = np.full_like(q, 7.0), np.full_like(k, 7.0)  # (written, not accumulated)
    dqw, dkw = np.full(D, 0.5, f32), np.full(D, 0.5, f32)  # (accumulated)
    before = dq_out.copy()
    ops.qknorm_rope_backward(dq, dk, dqw, dkw, dq_out, dk_out, q, k, qw, kw, q_rstd, k_rstd, cos, sin)
    np.testing.assert_array_equal(dq_out, before)
    h = D // 2
    for got, got_w, dy, x, w, rstd in ((dq, dqw, dq_out, q, qw, q_rstd), (dk, dkw, dk_out, k, kw, k_rstd)):
        dy = dy.astype(np.float64)
        a, b = dy[..., :h], dy[..., h:]
        dn = np.concatenate([a * c64[:, None, :h] + b * s64[:, None, h:],
                             b * c64[:, None, h:] - a * s64[:, None, :h]], -1)
        r = rstd.astype(np.float64)[..., None]
        xh = x.astype(np.float64) * r
        g = dn * w
        want = r * (g - xh * (g * xh).mean(-1, keepdims=True))
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got_w, 0.5 + (dn * xh).sum((0, 1)), rtol=1e-4, atol=1e-5)

    with pytest.raises(moeforge.InvalidArgumentError, match="cos"):
        ops.qknorm_rope_forward(q_out, k_out, q_rstd, k_rstd, q, k, qw, kw, cos[:-1], sin[:-1], eps)
    with pytest.raises(moeforge.InvalidArgumentError, match="even"):
        odd = rand(rng, N, Hq, D - 1)
        ops.qknorm_rope_forward(odd, odd, q_rstd, q_rstd, odd, odd, qw[:-1], qw[:-1], np.ascontiguousarray(cos[:, :-1]),
                                np.ascontiguousarray(sin[:, :-1]), eps)


def test_lm_head_cross_entropy_workspace_bytes():
    assert ops.lm_head_cross_entropy_workspace_bytes(8192, 151936, "bfloat16", "cpu") == 0
    with pytest.raises(moeforge.InvalidArgumentError, match="num_rows = -1 is negative"):
        ops.lm_head_cross_entropy_workspace_bytes(-1, 16)


def test_permute_and_aux_stats_workspace_bytes():
    assert ops.moe_permute_indices_workspace_bytes(4096, 8, 128, "cpu") == 0
    assert ops.moe_aux_stats_workspace_bytes(4096, 128) == 0
    with pytest.raises(moeforge.InvalidArgumentError, match="num_rows = -1"):
        ops.moe_permute_indices_workspace_bytes(-1, 8, 128)
    with pytest.raises(moeforge.InvalidArgumentError, match="num_experts = 0"):
        ops.moe_aux_stats_workspace_bytes(4, 0)


def test_lm_head_cross_entropy_with_ignored_targets():
    rng = np.random.default_rng(10)
    N, C, V = 9, 12, 33
    h, w = rand(rng, N, C), rand(rng, V, C)
    targets = rng.integers(0, V, N).astype(i32)
    targets[[2, 7]] = -100
    losses, dh, dw = np.zeros(N, f32), np.zeros_like(h), np.zeros_like(w)
    ops.lm_head_cross_entropy(losses, dh, dw, h, w, targets, grad_scale=0.5)
    logits = h.astype(np.float64) @ w.astype(np.float64).T
    lse = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    want = np.where(targets >= 0, lse - logits[np.arange(N), np.clip(targets, 0, None)], 0)
    naive_logits = h @ w.T
    naive = np.log(np.exp(naive_logits).sum(1)) - naive_logits[np.arange(N), np.clip(targets, 0, None)]
    close_by_rule(losses, want, np.where(targets >= 0, naive, 0), what="losses")
    p = np.exp(logits - lse[:, None])
    p[np.arange(N), np.clip(targets, 0, None)] -= 1
    p[targets < 0] = 0
    np.testing.assert_allclose(dh, 0.5 * p @ w.astype(np.float64), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(dw, 0.5 * p.T @ h.astype(np.float64), rtol=1e-4, atol=1e-6)
    # accumulate=False writes the gradients: outputs full of NaN give what zeroed outputs added into.
    dh2, dw2 = np.full_like(h, np.nan), np.full_like(w, np.nan)
    ops.lm_head_cross_entropy(np.zeros(N, f32), dh2, dw2, h, w, targets, grad_scale=0.5, accumulate=False)
    np.testing.assert_array_equal(dh2, dh)
    np.testing.assert_array_equal(dw2, dw)
    # and accumulate=True adds into them.
    ops.lm_head_cross_entropy(np.zeros(N, f32), dh2, dw2, h, w, targets, grad_scale=0.5)
    np.testing.assert_allclose(dh2, 2 * dh, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(dw2, 2 * dw, rtol=1e-6, atol=1e-7)
    # No rows: the written dw is zero.
    dw3 = np.full_like(w, np.nan)
    ops.lm_head_cross_entropy(np.zeros(0, f32), np.zeros((0, C), f32), dw3, np.zeros((0, C), f32), w,
                              np.zeros(0, i32), grad_scale=0.5, accumulate=False)
    assert not dw3.any()


def test_lm_head_cross_entropy_grad_scale_by():
    """grad_scale_by (one f32 element on the op's device) multiplies grad_scale: the gradients are those
    of grad_scale · grad_scale_by[0] · Σ losses, bit for bit those of the host product; the losses are
    unscaled either way."""
    rng = np.random.default_rng(11)
    N, C, V = 7, 10, 29
    h, w = rand(rng, N, C), rand(rng, V, C)
    targets = rng.integers(0, V, N).astype(i32)
    targets[3] = -100
    count = np.array([N - 1], f32)
    by = (np.float32(1) / count).astype(f32)
    outs = []
    for kwargs in ({"grad_scale": 0.5 * by[0]}, {"grad_scale": 0.5, "grad_scale_by": by}):
        losses, dh, dw = np.zeros(N, f32), np.full_like(h, np.nan), np.full_like(w, np.nan)
        ops.lm_head_cross_entropy(losses, dh, dw, h, w, targets, accumulate=False, **kwargs)
        outs.append((losses, dh, dw))
    for got, want in zip(outs[1], outs[0]):
        np.testing.assert_array_equal(got, want)
    assert np.abs(outs[1][1]).max() > 0
    for bad, message in ((np.array([1.0, 2.0], f32), "grad_scale_by"), (np.array([2], i32), "grad_scale_by")):
        with pytest.raises(moeforge.InvalidArgumentError, match=message):
            ops.lm_head_cross_entropy(np.zeros(N, f32), None, None, h, w, targets, grad_scale=1.0, grad_scale_by=bad)


def test_scale_by():
    rng = np.random.default_rng(12)
    x = rand(rng, 37)
    for s in (0.5, -3.25, 0.0):
        y = x.copy()
        ops.scale_by(y, np.array([s], f32))
        np.testing.assert_array_equal(y, x * np.float32(s))
    # A scale of exactly 1 leaves x as it is, bit for bit (a NaN payload included).
    y = x.copy()
    y[3] = np.frombuffer(np.uint32(0x7FC01234).tobytes(), f32)[0]
    before = y.tobytes()
    ops.scale_by(y, np.array([1.0], f32))
    assert y.tobytes() == before
    with pytest.raises(moeforge.InvalidArgumentError, match="scale"):
        ops.scale_by(x, np.array([1.0, 2.0], f32))
    with pytest.raises(moeforge.InvalidArgumentError, match="scale"):
        ops.scale_by(x, np.array([1.0]))  # float64


def test_adamw_matches_torch_formula():
    rng = np.random.default_rng(11)
    n = 50
    p, g = rand(rng, n), rand(rng, n)
    m, v = rand(rng, n, scale=0.1), np.abs(rand(rng, n, scale=0.1))
    p64, m64, v64 = p.astype(np.float64), m.astype(np.float64), v.astype(np.float64)
    lr, b1, b2, eps, wd, step, scale = 1e-2, 0.9, 0.95, 1e-8, 0.1, 3, 0.5
    ops.adamw_update(p, None, m, v, g, lr, b1, b2, eps, wd, step, scale)
    g64 = g.astype(np.float64) * scale
    p64 *= 1 - lr * wd
    m64 = b1 * m64 + (1 - b1) * g64
    v64 = b2 * v64 + (1 - b2) * g64 ** 2
    p64 -= lr * (m64 / (1 - b1 ** step)) / (np.sqrt(v64 / (1 - b2 ** step)) + eps)
    close_elementwise(m, m64, rtol=1e-6, atol=1e-7)  # fp32 rounding of terms of size ~0.2
    close_elementwise(v, v64, rtol=1e-6, atol=1e-9)
    close_elementwise(p, p64, rtol=1e-5, atol=1e-7)
