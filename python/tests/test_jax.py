"""moeforge.jax (XLA FFI handlers over the C API) against its pure-JAX twins (moeforge.jax.reference)
and a per-expert float64 numpy reference, by CONVENTIONS.md's rule (error ≤ 2 × the naive error in
the same dtype + a rounding floor): on the CPU in float32, and on a GPU in bfloat16. Cases: ragged
groups, empty experts, a partial tail (rows past the groups: zero, and so is their gradient), skewed
routing, clamped sizes; inside jit, grad, checkpoint, scan and vmap; bitwise repeats; bad arguments.
Skips, saying why, without jax (CI), without the extension, or (the GPU cases) without a GPU.
float64 (jax_enable_x64) is on in this module for the exact references."""

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (moeforge.jax's tests run where it is)")
try:
    import moeforge.jax as mfj
    from moeforge.jax import reference
except ImportError as e:
    pytest.skip(f"moeforge.jax cannot be imported: {e}", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from conftest import close_by_rule  # noqa: E402

jax.config.update("jax_enable_x64", True)


# --- where a case runs ------------------------------------------------------------------------------

class Where:
    """A device and the dtype moeforge serves there, with the rounding floor of the tolerance rule."""

    def __init__(self, device, dtype, floor):
        self.device, self.dtype, self.floor = device, dtype, floor

    def put(self, a):
        """a (numpy) on the device in the dtype; and its rounded values as float64 numpy."""
        arr = jax.device_put(jnp.asarray(np.asarray(a, np.float32)).astype(self.dtype), self.device)
        return arr, np.asarray(arr.astype(jnp.float32), np.float64)

    def ints(self, a):
        return jax.device_put(jnp.asarray(np.asarray(a, np.int32)), self.device)


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(params=["cpu", "gpu"], ids=["cpu-f32", "gpu-bf16"])
def where(request):
    if request.param == "cpu":
        return Where(jax.devices("cpu")[0], jnp.float32, 1e-5)
    if not mfj.BUILT_WITH_CUDA:
        pytest.skip("moeforge was built without CUDA: no GPU handlers")
    gpus = _gpu_devices()
    if not gpus:
        pytest.skip("jax sees no GPU")
    return Where(gpus[0], jnp.bfloat16, 2.0 ** -7)


def f64(a):
    return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


def offsets64(group_sizes, M):
    """mf_group_offsets in numpy: the clamped running sum of the non-negative sizes."""
    ends = np.minimum(np.cumsum(np.maximum(np.asarray(group_sizes, np.int64), 0)), M)
    return np.concatenate([[0], ends]).astype(np.int64)


# group sizes over M rows: (name, M, sizes)
CASES = [
    ("ragged", 16, [3, 0, 5, 1, 7]),
    ("empty-and-tail", 13, [2, 0, 4, 0, 3]),  # 9 rows of 13 in groups: a partial tail
    ("skewed", 17, [0, 16, 0, 1, 0]),
    ("clamped", 12, [5, -2, 30, 4, 1]),  # a negative size counts 0; the running sum is clamped to M
]


# --- per-expert float64 references ------------------------------------------------------------------

def gmm64(x, w, sizes):
    """out[m] = x[m] · w[g] per group (ragged_dot); dx and dw of a cotangent as functions too."""
    off = offsets64(sizes, x.shape[0])
    out = np.zeros((x.shape[0], w.shape[2]))
    for g in range(w.shape[0]):
        out[off[g]:off[g + 1]] = x[off[g]:off[g + 1]] @ w[g]
    return out


def gmm64_grads(x, w, sizes, dout):
    off = offsets64(sizes, x.shape[0])
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    for g in range(w.shape[0]):
        rows = slice(off[g], off[g + 1])
        dx[rows] = dout[rows] @ w[g].T
        dw[g] = x[rows].T @ dout[rows]
    return dx, dw


def silu64(v):
    return v / (1.0 + np.exp(-v))


def mlp64(x, gu, dn, sizes, dy):
    """expert_mlp's y and (dx, dgu, ddn) at cotangent dy, per group in float64."""
    off = offsets64(sizes, x.shape[0])
    half = gu.shape[1] // 2
    y, dx, dgu, ddn = np.zeros((x.shape[0], gu.shape[2])), np.zeros_like(x), np.zeros_like(gu), np.zeros_like(dn)
    for e in range(gu.shape[0]):
        rows = slice(off[e], off[e + 1])
        h = x[rows] @ gu[e].T
        g, u = h[:, :half], h[:, half:]
        s = 1.0 / (1.0 + np.exp(-g))
        a = g * s * u
        y[rows] = a @ dn[e].T
        da = dy[rows] @ dn[e]
        ddn[e] = dy[rows].T @ a
        dh = np.concatenate([da * u * (s + g * s * (1 - s)), da * g * s], axis=1)
        dx[rows] = dh @ gu[e]
        dgu[e] = dh.T @ x[rows]
    return y, (dx, dgu, ddn)


# --- grouped_matmul ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name,M,sizes", CASES, ids=[c[0] for c in CASES])
def test_grouped_matmul_matches_the_references(where, name, M, sizes):
    rng = np.random.default_rng(1)
    G, K, N = len(sizes), 24, 40
    x, x64 = where.put(rng.standard_normal((M, K)))
    w, w64 = where.put(rng.standard_normal((G, K, N)) * 0.3)
    dout, dout64 = where.put(rng.standard_normal((M, N)))
    gs = where.ints(sizes)

    out, vjp = jax.vjp(lambda a, b: mfj.grouped_matmul(a, b, gs), x, w)
    dx, dw = vjp(dout)
    naive, naive_vjp = jax.vjp(lambda a, b: reference.grouped_matmul(a, b, gs), x, w)
    ndx, ndw = naive_vjp(dout)
    ref, (rdx, rdw) = gmm64(x64, w64, sizes), gmm64_grads(x64, w64, sizes, dout64)

    for what, got, r, n in (("out", out, ref, naive), ("dx", dx, rdx, ndx), ("dw", dw, rdw, ndw)):
        assert got.dtype == where.dtype, what
        close_by_rule(f64(got), r, f64(n), floor=where.floor, what=f"{name} {what}")
    end = offsets64(sizes, M)[-1]
    assert np.all(f64(out)[end:] == 0) and np.all(f64(dx)[end:] == 0), "rows past the last group"
    for g in range(G):
        if offsets64(sizes, M)[g + 1] == offsets64(sizes, M)[g]:
            assert np.all(f64(dw)[g] == 0), f"empty group {g}'s weight gradient"


def test_the_reference_twins_match_numpy():
    """The pure-JAX twins themselves (float64 on the CPU) against the numpy per-expert loops."""
    rng = np.random.default_rng(2)
    M, sizes = 13, [2, 0, 4, 0, 3]
    x, w = rng.standard_normal((M, 6)), rng.standard_normal((5, 6, 7))
    np.testing.assert_allclose(reference.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)),
                               gmm64(x, w, sizes), rtol=1e-12, atol=1e-12)
    gu, dn, dy = rng.standard_normal((5, 8, 6)), rng.standard_normal((5, 6, 4)), rng.standard_normal((M, 6))
    y, vjp = jax.vjp(lambda a, b, c: reference.expert_mlp(a, b, c, jnp.asarray(sizes)), *map(jnp.asarray, (x, gu, dn)))
    y64, grads64 = mlp64(x, gu, dn, sizes, dy)
    np.testing.assert_allclose(y, y64, rtol=1e-12, atol=1e-12)
    for got, want in zip(vjp(jnp.asarray(dy)), grads64):
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


# --- expert_mlp -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,M,sizes", CASES, ids=[c[0] for c in CASES])
def test_expert_mlp_matches_the_references(where, name, M, sizes):
    rng = np.random.default_rng(3)
    E, H, I = len(sizes), 32, 16
    x, x64 = where.put(rng.standard_normal((M, H)))
    gu, gu64 = where.put(rng.standard_normal((E, 2 * I, H)) * 0.2)
    dn, dn64 = where.put(rng.standard_normal((E, H, I)) * 0.2)
    dy, dy64 = where.put(rng.standard_normal((M, H)))
    gs = where.ints(sizes)

    y, vjp = jax.vjp(lambda a, b, c: mfj.expert_mlp(a, b, c, gs), x, gu, dn)
    grads = vjp(dy)
    naive, naive_vjp = jax.vjp(lambda a, b, c: reference.expert_mlp(a, b, c, gs), x, gu, dn)
    naive_grads = naive_vjp(dy)
    y64, grads64 = mlp64(x64, gu64, dn64, sizes, dy64)

    close_by_rule(f64(y), y64, f64(naive), floor=where.floor, what=f"{name} y")
    for what, got, r, n in zip(("dx", "dw_gate_up", "dw_down"), grads, grads64, naive_grads):
        assert got.dtype == where.dtype, what
        close_by_rule(f64(got), r, f64(n), floor=where.floor, what=f"{name} {what}")
    end = offsets64(sizes, M)[-1]
    assert np.all(f64(y)[end:] == 0) and np.all(f64(grads[0])[end:] == 0), "rows past the last group"


# --- moe_ffn ----------------------------------------------------------------------------------------

ROUTERS = {
    "softmax-norm": dict(top_k=2, norm_topk_prob=True),
    "softmax-raw": dict(top_k=3, norm_topk_prob=False),
    "sigmoid-bias-groups": dict(top_k=2, norm_topk_prob=True, router="sigmoid", n_group=4, topk_group=2,
                                routed_scaling_factor=2.5),
    "sigmoid-masked-zero": dict(top_k=3, norm_topk_prob=False, router="sigmoid", n_group=2, topk_group=1,
                                masked_score=0.0),
}


def _moe_inputs(where, N, H, I, E, seed=4):
    rng = np.random.default_rng(seed)
    x, x64 = where.put(rng.standard_normal((N, H)))
    rw, rw64 = where.put(rng.standard_normal((E, H)) * 0.5)  # well-separated logits: no near-ties
    gu, gu64 = where.put(rng.standard_normal((E, 2 * I, H)) * 0.2)
    dn, dn64 = where.put(rng.standard_normal((E, H, I)) * 0.2)
    bias = jax.device_put(jnp.asarray(rng.standard_normal(E) * 0.1, jnp.float32), where.device)
    return (x, rw, gu, dn), (x64, rw64, gu64, dn64), bias


@pytest.mark.parametrize("router", list(ROUTERS), ids=list(ROUTERS))
def test_moe_ffn_matches_the_references(where, router):
    kw = dict(ROUTERS[router])
    N, H, I, E = 24, 32, 16, 8
    (x, rw, gu, dn), args64, bias = _moe_inputs(where, N, H, I, E)
    if kw.get("router") == "sigmoid" and kw.get("masked_score") is None:
        kw["correction_bias"] = bias
    dy, dy64 = where.put(np.random.default_rng(5).standard_normal((N, H)))

    y, vjp = jax.vjp(lambda *a: mfj.moe_ffn(*a, **kw), x, rw, gu, dn)
    grads = vjp(dy)
    naive, naive_vjp = jax.vjp(lambda *a: reference.moe_ffn(*a, **kw), x, rw, gu, dn)
    naive_grads = naive_vjp(dy)
    kw64 = dict(kw)
    if "correction_bias" in kw64:
        kw64["correction_bias"] = jax.device_put(kw["correction_bias"], jax.devices("cpu")[0]).astype(jnp.float64)
    cpu64 = [jax.device_put(jnp.asarray(a), jax.devices("cpu")[0]) for a in (*args64, dy64)]
    y64, vjp64 = jax.vjp(lambda *a: reference.moe_ffn(*a, **kw64), *cpu64[:4])
    grads64 = vjp64(cpu64[4])

    close_by_rule(f64(y), np.asarray(y64), f64(naive), floor=where.floor, what=f"{router} y")
    for what, got, r, n in zip(("dx", "drouter_w", "dw_gate_up", "dw_down"), grads, grads64, naive_grads):
        assert got.dtype == where.dtype, what
        close_by_rule(f64(got), np.asarray(r), f64(n), floor=where.floor, what=f"{router} {what}")


def test_moe_ffn_keeps_leading_dimensions(where):
    (x, rw, gu, dn), _, _ = _moe_inputs(where, 12, 32, 16, 8)
    y = mfj.moe_ffn(x.reshape(3, 4, 32), rw, gu, dn, top_k=2)
    assert y.shape == (3, 4, 32)
    np.testing.assert_array_equal(f64(y).reshape(12, 32), f64(mfj.moe_ffn(x, rw, gu, dn, top_k=2)))


# --- transformations --------------------------------------------------------------------------------

def _gmm_setup(where, M=16, sizes=(3, 0, 5, 1, 7), K=24):
    rng = np.random.default_rng(6)
    x, _ = where.put(rng.standard_normal((M, K)))
    w, _ = where.put(rng.standard_normal((len(sizes), K, K)) * 0.2)
    return x, w, where.ints(list(sizes))


def _loss(f):
    return lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)


def test_under_jit_grad_and_checkpoint(where):
    x, w, gs = _gmm_setup(where)
    f = lambda a, b: mfj.grouped_matmul(a, b, gs)  # noqa: E731
    eager = f(x, w)
    np.testing.assert_array_equal(f64(jax.jit(f)(x, w)), f64(eager))
    g = jax.grad(_loss(f), argnums=(0, 1))(x, w)
    g_jit = jax.jit(jax.grad(_loss(f), argnums=(0, 1)))(x, w)
    g_ckpt = jax.jit(jax.grad(_loss(jax.checkpoint(f)), argnums=(0, 1)))(x, w)
    for a, b, c in zip(g, g_jit, g_ckpt):
        np.testing.assert_array_equal(f64(a), f64(b))
        np.testing.assert_array_equal(f64(a), f64(c))


def test_under_scan_equals_a_loop(where):
    x, w, gs = _gmm_setup(where)
    ws = jnp.stack([w, w * 0.5, w * -1.5])

    def scanned(a, stack):
        return lax.scan(lambda c, wl: (mfj.grouped_matmul(c, wl, gs), None), a, stack)[0]

    def looped(a, stack):
        for i in range(stack.shape[0]):
            a = mfj.grouped_matmul(a, stack[i], gs)
        return a

    np.testing.assert_array_equal(f64(jax.jit(scanned)(x, ws)), f64(jax.jit(looped)(x, ws)))
    gs_scan = jax.jit(jax.grad(_loss(scanned), argnums=(0, 1)))(x, ws)
    gs_loop = jax.jit(jax.grad(_loss(looped), argnums=(0, 1)))(x, ws)
    for a, b in zip(gs_scan, gs_loop):
        np.testing.assert_array_equal(f64(a), f64(b))


def test_under_vmap_equals_each_element(where):
    x, w, gs = _gmm_setup(where)
    xs = jnp.stack([x, x * 2.0])
    batched = jax.jit(jax.vmap(lambda a: mfj.grouped_matmul(a, w, gs)))(xs)
    for i in range(2):
        np.testing.assert_array_equal(f64(batched[i]), f64(mfj.grouped_matmul(xs[i], w, gs)))
    (x, rw, gu, dn), _, _ = _moe_inputs(where, 12, 32, 16, 8)
    xs = jnp.stack([x, -x])
    batched = jax.jit(jax.vmap(lambda a: mfj.moe_ffn(a, rw, gu, dn, top_k=2)))(xs)
    for i in range(2):
        np.testing.assert_array_equal(f64(batched[i]), f64(mfj.moe_ffn(xs[i], rw, gu, dn, top_k=2)))


def test_moe_ffn_and_expert_mlp_under_jit_checkpoint_scan(where):
    (x, rw, gu, dn), _, _ = _moe_inputs(where, 12, 32, 16, 8)
    layer = lambda a, r, g, d: mfj.moe_ffn(a, r, g, d, top_k=2)  # noqa: E731
    g_eager = jax.grad(_loss(layer), argnums=(0, 1, 2, 3))(x, rw, gu, dn)
    g_ckpt = jax.jit(jax.grad(_loss(jax.checkpoint(layer)), argnums=(0, 1, 2, 3)))(x, rw, gu, dn)
    for a, b in zip(g_eager, g_ckpt):
        np.testing.assert_array_equal(f64(a), f64(b))

    def two_layers(a, stack):
        return lax.scan(lambda c, p: (layer(c, *p), None), a, stack)[0]

    stack = (jnp.stack([rw, rw]), jnp.stack([gu, gu * 0.5]), jnp.stack([dn, dn]))
    looped = layer(layer(x, rw, gu, dn), rw, gu * 0.5, dn)
    np.testing.assert_array_equal(f64(jax.jit(two_layers)(x, stack)), f64(looped))

    sizes = where.ints([4, 0, 5, 0, 2, 0, 0, 1])
    mlp = lambda a, g, d: mfj.expert_mlp(a, g, d, sizes)  # noqa: E731
    g1 = jax.jit(jax.grad(_loss(mlp), argnums=(0, 1, 2)))(x, gu, dn)
    g2 = jax.jit(jax.grad(_loss(jax.checkpoint(mlp)), argnums=(0, 1, 2)))(x, gu, dn)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(f64(a), f64(b))


def test_repeated_calls_are_bitwise_equal(where):
    x, w, gs = _gmm_setup(where)
    (xm, rw, gu, dn), _, _ = _moe_inputs(where, 24, 32, 16, 8)
    sizes = where.ints([4, 0, 9, 0, 2, 0, 0, 1])
    fns = {
        "grouped_matmul": (jax.jit(jax.value_and_grad(_loss(lambda a, b: mfj.grouped_matmul(a, b, gs)),
                                                      argnums=(0, 1))), (x, w)),
        "expert_mlp": (jax.jit(jax.value_and_grad(_loss(lambda a, g, d: mfj.expert_mlp(a, g, d, sizes)),
                                                  argnums=(0, 1, 2))), (xm, gu, dn)),
        "moe_ffn": (jax.jit(jax.value_and_grad(_loss(lambda *a: mfj.moe_ffn(*a, top_k=2)), argnums=(0, 1, 2, 3))),
                    (xm, rw, gu, dn)),
    }
    for name, (f, args) in fns.items():
        first = jax.tree_util.tree_leaves(f(*args))
        for _ in range(3):
            for a, b in zip(first, jax.tree_util.tree_leaves(f(*args))):
                np.testing.assert_array_equal(f64(a), f64(b), err_msg=name)


# --- bad arguments ----------------------------------------------------------------------------------

def test_bad_arguments_raise_errors_naming_them():
    x, w, gs = jnp.ones((8, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32), jnp.asarray([4, 4], jnp.int32)
    with pytest.raises(TypeError, match="x is float16"):
        mfj.grouped_matmul(x.astype(jnp.float16), w, gs)
    with pytest.raises(TypeError, match="w is bfloat16 but x is float32"):
        mfj.grouped_matmul(x, w.astype(jnp.bfloat16), gs)
    with pytest.raises(ValueError, match="x's columns"):
        mfj.grouped_matmul(jnp.ones((8, 5), jnp.float32), w, gs)
    with pytest.raises(ValueError, match="group_sizes has 3 entries"):
        mfj.grouped_matmul(x, w, jnp.asarray([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes is float32"):
        mfj.grouped_matmul(x, w, jnp.asarray([4.0, 4.0], jnp.float32))
    with pytest.raises(ValueError, match="w has shape"):
        mfj.grouped_matmul(x, jnp.ones((4, 3), jnp.float32), gs)
    gu, dn = jnp.ones((2, 6, 4), jnp.float32), jnp.ones((2, 4, 3), jnp.float32)
    with pytest.raises(ValueError, match="w_down is"):
        mfj.expert_mlp(x, gu, jnp.ones((2, 3, 4), jnp.float32), gs)
    rw = jnp.ones((2, 4), jnp.float32)
    with pytest.raises(ValueError, match="top_k=3"):
        mfj.moe_ffn(x, rw, gu, dn, top_k=3)
    with pytest.raises(ValueError, match="router_w is"):
        mfj.moe_ffn(x, jnp.ones((3, 4), jnp.float32), gu, dn, top_k=1)
    with pytest.raises(ValueError, match="correction_bias is the sigmoid router's"):
        mfj.moe_ffn(x, rw, gu, dn, top_k=1, correction_bias=jnp.zeros(2, jnp.float32))
    with pytest.raises(ValueError, match="masked_score"):
        mfj.moe_ffn(x, rw, gu, dn, top_k=1, router="sigmoid", masked_score=-1.0)
    with pytest.raises(ValueError, match="router='tanh'"):
        mfj.moe_ffn(x, rw, gu, dn, top_k=1, router="tanh")


def test_a_bfloat16_array_on_the_cpu_is_refused_when_run():
    """bfloat16 is the GPU's dtype: the CPU handler refuses it with the C API's message, naming it."""
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones((8, 4), jnp.bfloat16), cpu)
    w = jax.device_put(jnp.ones((2, 4, 3), jnp.bfloat16), cpu)
    with pytest.raises(Exception, match="bf16"):
        jax.block_until_ready(mfj.grouped_matmul(x, w, jax.device_put(jnp.asarray([4, 4], jnp.int32), cpu)))


def test_an_older_jaxlib_is_refused(monkeypatch):
    from moeforge.jax import _ffi

    assert _ffi._version_tuple("0.11.2") == (0, 11, 2)
    assert _ffi._version_tuple("0.11.2.dev20261201+cuda") == (0, 11, 2)
    assert _ffi._version_tuple("0.12rc1") == (0, 12)
    monkeypatch.setattr(_ffi.jaxlib, "__version__", "0.4.1")
    with pytest.raises(ImportError, match="was built against jaxlib"):
        _ffi._check_jaxlib()
