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
    """A device and the dtype moeforge serves there, with the rounding floors of the tolerance rule: of
    that dtype, and of the float32 router and loss math (on a GPU its fast exp/σ)."""

    def __init__(self, device, dtype, floor, router_floor):
        self.device, self.dtype, self.floor, self.router_floor = device, dtype, floor, router_floor

    def put(self, a):
        """a (numpy) on the device in the dtype; and its rounded values as float64 numpy."""
        arr = jax.device_put(jnp.asarray(np.asarray(a, np.float32)).astype(self.dtype), self.device)
        return arr, np.asarray(arr.astype(jnp.float32), np.float64)

    def ints(self, a):
        return jax.device_put(jnp.asarray(np.asarray(a, np.int32)), self.device)

    def f32(self, a):
        """a as float32 on the device (router and loss math is float32 everywhere)."""
        return jax.device_put(jnp.asarray(np.asarray(a, np.float32)), self.device)


def _gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


@pytest.fixture(params=["cpu", "gpu"], ids=["cpu-f32", "gpu-bf16"])
def where(request):
    if request.param == "cpu":
        return Where(jax.devices("cpu")[0], jnp.float32, 1e-5, 1e-6)
    if not mfj.BUILT_WITH_CUDA:
        pytest.skip("moeforge was built without CUDA: no GPU handlers")
    gpus = _gpu_devices()
    if not gpus:
        pytest.skip("jax sees no GPU")
    return Where(gpus[0], jnp.bfloat16, 2.0 ** -7, 1e-5)


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

# (H, I): narrow widths, and widths the Hopper kernels serve (the gate_up product with the SwiGLU in
# its epilogue, and its gradient's), with a case of a few hundred rows per group.
MLP_WIDTHS = [(32, 16), (128, 64)]
MLP_CASES = CASES + [("long-groups", 1500, [611, 0, 129, 1, 700])]


@pytest.mark.parametrize("H,I", MLP_WIDTHS, ids=[f"h{h}i{i}" for h, i in MLP_WIDTHS])
@pytest.mark.parametrize("name,M,sizes", MLP_CASES, ids=[c[0] for c in MLP_CASES])
def test_expert_mlp_matches_the_references(where, name, M, sizes, H, I):
    rng = np.random.default_rng(3)
    E = len(sizes)
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


# --- route ------------------------------------------------------------------------------------------

def _cpu(a):
    return jax.device_put(jnp.asarray(a), jax.devices("cpu")[0])


def _route_kw(router, bias):
    """ROUTERS[router], with the correction bias for the sigmoid router that takes one."""
    kw = dict(ROUTERS[router])
    if kw.get("router") == "sigmoid" and kw.get("masked_score") is None:
        kw["correction_bias"] = bias
    return kw


def _kw64(kw):
    kw64 = dict(kw)
    if "correction_bias" in kw64:
        kw64["correction_bias"] = _cpu(kw["correction_bias"]).astype(jnp.float64)
    return kw64


@pytest.mark.parametrize("router", list(ROUTERS), ids=list(ROUTERS))
def test_route_matches_the_reference(where, router):
    rng = np.random.default_rng(7)
    N, E = 37, 8
    logits = where.f32(rng.standard_normal((N, E)) * 2.0)  # well separated: no near-ties
    kw = _route_kw(router, where.f32(rng.standard_normal(E) * 0.1))
    K = kw["top_k"]
    dw, dp = where.f32(rng.standard_normal((N, K))), where.f32(rng.standard_normal((N, E)))

    idx, w, p = mfj.route(logits, **kw)
    _, vjp = jax.vjp(lambda a: mfj.route(a, **kw)[1:], logits)
    (dl,) = vjp((dw, dp))
    ridx, rw, rp = reference.route(logits, **kw)
    _, naive_vjp = jax.vjp(lambda a: reference.route(a, **kw)[1:], logits)
    (ndl,) = naive_vjp((dw, dp))
    kw64 = _kw64(kw)
    l64 = _cpu(f64(logits))
    i64, w64, p64 = reference.route(l64, **kw64)
    _, vjp64 = jax.vjp(lambda a: reference.route(a, **kw64)[1:], l64)
    (dl64,) = vjp64((_cpu(f64(dw)), _cpu(f64(dp))))

    assert (idx.dtype, w.dtype, p.dtype, dl.dtype) == (jnp.int32, jnp.float32, jnp.float32, jnp.float32)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(i64), err_msg=f"{router} topk_idx")
    np.testing.assert_array_equal(np.asarray(ridx), np.asarray(i64), err_msg=f"{router} the twin's topk_idx")
    for what, got, ref, naive in (("topk_weight", w, w64, rw), ("probs", p, p64, rp), ("dlogits", dl, dl64, ndl)):
        close_by_rule(f64(got), np.asarray(ref), f64(naive), floor=where.router_floor, what=f"{router} {what}")


def test_route_keeps_leading_dimensions_and_ties_go_to_the_lower_index(where):
    rows = [[1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.0, 0.0], [0.0] * 8, [-2.0, 0.5, 0.5, 0.5, 0.5, 4.0, 0.5, 0.5]]
    logits = where.f32(rows)
    for kw in (dict(top_k=3), dict(top_k=3, norm_topk_prob=False, router="sigmoid")):
        idx = mfj.route(logits, **kw)[0]
        np.testing.assert_array_equal(np.asarray(idx), [[1, 2, 4], [0, 1, 2], [5, 1, 2]], err_msg=str(kw))
        idx3, w3, p3 = mfj.route(logits.reshape(3, 1, 8), **kw)
        assert idx3.shape == (3, 1, 3) and w3.shape == (3, 1, 3) and p3.shape == (3, 1, 8)
        np.testing.assert_array_equal(np.asarray(idx3).reshape(3, 3), np.asarray(idx))


# --- load_balancing_loss ----------------------------------------------------------------------------

AUX_CASES = ["one-layer", "one-layer-masked", "layers", "layers-masked-sentinels"]


@pytest.mark.parametrize("case", AUX_CASES)
def test_load_balancing_loss_matches_the_reference(where, case):
    rng = np.random.default_rng(8)
    B, S, E, K = 3, 7, 8, 2
    L = 3 if case.startswith("layers") else 1
    logits = [rng.standard_normal((B, S, E)) for _ in range(L)]
    probs64 = [np.exp(a) / np.exp(a).sum(-1, keepdims=True) for a in logits]
    idx = [np.argsort(-p, axis=-1, kind="stable")[..., :K].astype(np.int32) for p in probs64]
    if "sentinels" in case:  # other ranks' experts count nothing
        idx[0][0, :3, 0] = E
        idx[1][1, 2, 1] = E + 5
        idx[2][2, 0, 0] = -1
    mask = mask64 = None
    if "masked" in case:
        m = np.ones((B, S))
        m[0, 5:], m[2, 3:] = 0, 0
        mask, mask64 = where.f32(m), _cpu(m)
    probs = [where.f32(p) for p in probs64]
    idx_dev = [where.ints(i) for i in idx]
    idx_cpu = [_cpu(i) for i in idx]
    probs_cpu = [_cpu(f64(p)) for p in probs]
    one = L == 1

    def run(fn, ids, ps, m, ct):
        arg = ps[0] if one else ps
        loss, vjp = jax.vjp(lambda a: fn(ids[0] if one else ids, a, m, num_experts=E), arg)
        (d,) = vjp(ct)
        return loss, [d] if one else d

    loss, dprobs = run(mfj.load_balancing_loss, idx_dev, probs, mask, where.f32(1.7))
    naive, ndprobs = run(reference.load_balancing_loss, idx_dev, probs, mask, where.f32(1.7))
    loss64, dprobs64 = run(reference.load_balancing_loss, idx_cpu, probs_cpu, mask64, _cpu(np.float64(1.7)))

    assert loss.shape == () and loss.dtype == jnp.float32
    close_by_rule(f64(loss), np.asarray(loss64), f64(naive), floor=where.router_floor, what=f"{case} loss")
    for layer, (got, ref, n) in enumerate(zip(dprobs, dprobs64, ndprobs)):
        assert got.dtype == jnp.float32 and got.shape == (B, S, E)
        close_by_rule(f64(got), np.asarray(ref), f64(n), floor=where.router_floor, what=f"{case} dprobs {layer}")


def test_load_balancing_loss_without_counted_tokens_is_zero():
    with jax.default_device(jax.devices("cpu")[0]):
        idx, probs, mask = jnp.zeros((4, 2), jnp.int32), jnp.full((4, 6), 1 / 6, jnp.float32), jnp.zeros((4,))
        loss, grad = jax.value_and_grad(lambda p: mfj.load_balancing_loss(idx, p, mask, num_experts=6))(probs)
        assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0.0)
        assert float(reference.load_balancing_loss(idx, probs, mask, num_experts=6)) == 0.0


def test_the_aux_loss_gradient_reaches_the_logits_through_route(where):
    """route's backward takes the aux loss's dprobs (the C API's softmax backward input) with topk_weight's."""
    rng = np.random.default_rng(10)
    N, E, K = 40, 8, 2
    logits, c = where.f32(rng.standard_normal((N, E)) * 2.0), where.f32(rng.standard_normal((N, K)))

    def loss(route, aux, a, weights):
        idx, w, p = route(a, top_k=K)
        return jnp.sum(w * weights) + 0.5 * aux(idx, p, num_experts=E)

    g = jax.grad(lambda a: loss(mfj.route, mfj.load_balancing_loss, a, c))(logits)
    naive = jax.grad(lambda a: loss(reference.route, reference.load_balancing_loss, a, c))(logits)
    g64 = jax.grad(lambda a: loss(reference.route, reference.load_balancing_loss, a, _cpu(f64(c))))(_cpu(f64(logits)))
    close_by_rule(f64(g), np.asarray(g64), f64(naive), floor=where.router_floor, what="dlogits")
    aux_only = jax.grad(lambda a: mfj.load_balancing_loss(*mfj.route(a, top_k=K)[::2], num_experts=E))(logits)
    assert np.any(f64(aux_only) != 0), "the aux loss alone moves the logits"


# --- permute / unpermute ----------------------------------------------------------------------------

PERMUTE_CASES = {
    "plain": lambda rng, N, K, E: rng.integers(0, E, (N, K)),
    "empty-experts": lambda rng, N, K, E: rng.choice([1, 4, 5], (N, K)),  # experts 0, 2, 3 get no row
    "ep-sentinels": lambda rng, N, K, E: rng.integers(-1, E + 3, (N, K)),  # -1 and >= E: dropped
}


@pytest.mark.parametrize("case", list(PERMUTE_CASES))
def test_permute_and_unpermute_match_the_reference(where, case):
    rng = np.random.default_rng(9)
    N, K, E, H = 29, 3, 6, 40
    idx_np = PERMUTE_CASES[case](rng, N, K, E).astype(np.int32)
    x, x64 = where.put(rng.standard_normal((N, H)))
    idx = where.ints(idx_np)

    x_perm, gs, routing = mfj.permute(x, idx, E)
    rx, rgs, rr = reference.permute(x, idx, E)
    assert isinstance(routing, mfj.Routing) and x_perm.shape == (N * K, H) and x_perm.dtype == where.dtype
    for name, got, want in (("group_sizes", gs, rgs), *zip(mfj.Routing._fields, routing, rr)):
        assert got.dtype == jnp.int32, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{case} {name}")
    np.testing.assert_array_equal(f64(x_perm), f64(rx), err_msg=f"{case} x_perm (a permutation: exact)")
    kept = int(np.sum((idx_np >= 0) & (idx_np < E)))
    assert int(routing.expert_offsets[-1]) == kept
    assert np.all(f64(x_perm)[kept:] == 0) and np.all(np.asarray(routing.sorted_pair)[kept:] == -1)
    assert np.all((np.asarray(routing.pair_row) == -1) == ((idx_np < 0) | (idx_np >= E)).reshape(-1))

    # permute's gradient: each token's rows summed back
    dxp, dxp64 = where.put(rng.standard_normal((N * K, H)))
    (dx,) = jax.vjp(lambda a: mfj.permute(a, idx, E)[0], x)[1](dxp)
    (ndx,) = jax.vjp(lambda a: reference.permute(a, idx, E)[0], x)[1](dxp)
    (dx64,) = jax.vjp(lambda a: reference.permute(a, _cpu(idx_np), E)[0], _cpu(x64))[1](_cpu(dxp64))
    assert dx.dtype == where.dtype
    close_by_rule(f64(dx), np.asarray(dx64), f64(ndx), floor=where.floor, what=f"{case} permute dx")

    # unpermute and its gradients
    y_perm, yp64 = where.put(rng.standard_normal((N * K, H)))
    dy, dy64 = where.put(rng.standard_normal((N, H)))
    w = where.f32(rng.standard_normal((N, K)))
    y, vjp = jax.vjp(lambda a, b: mfj.unpermute(a, b, routing), y_perm, w)
    dyp, dw = vjp(dy)
    ny, nvjp = jax.vjp(lambda a, b: reference.unpermute(a, b, routing), y_perm, w)
    ndyp, ndw = nvjp(dy)
    r64 = mfj.Routing(*(_cpu(a) for a in routing))
    y64, vjp64 = jax.vjp(lambda a, b: reference.unpermute(a, b, r64), _cpu(yp64), _cpu(f64(w)))
    dyp64, dw64 = vjp64(_cpu(dy64))
    assert y.dtype == where.dtype and dyp.dtype == where.dtype and dw.dtype == jnp.float32
    close_by_rule(f64(y), np.asarray(y64), f64(ny), floor=where.floor, what=f"{case} unpermute y")
    close_by_rule(f64(dyp), np.asarray(dyp64), f64(ndyp), floor=where.floor, what=f"{case} dy_perm")
    close_by_rule(f64(dw), np.asarray(dw64), f64(ndw), floor=where.router_floor, what=f"{case} dtopk_weight")
    assert np.all(f64(dyp)[kept:] == 0), "the dropped pairs' rows get no gradient"
    assert np.all(f64(dw)[(idx_np < 0) | (idx_np >= E)] == 0), "a dropped pair's weight gets no gradient"


@pytest.mark.parametrize("router", list(ROUTERS), ids=list(ROUTERS))
def test_route_permute_expert_mlp_unpermute_is_moe_ffn(where, router):
    """moe_ffn taken apart: the same routed output and gradients, against the same float64 reference."""
    N, H, I, E = 24, 32, 16, 8
    (x, rw, gu, dn), args64, bias = _moe_inputs(where, N, H, I, E)
    kw = _route_kw(router, bias)
    dy, dy64 = where.put(np.random.default_rng(5).standard_normal((N, H)))

    def composed(a, r, g, d):
        logits = jnp.einsum("th,eh->te", a, r, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        idx, w, _ = mfj.route(logits, **kw)
        x_perm, group_sizes, routing = mfj.permute(a, idx, E)
        return mfj.unpermute(mfj.expert_mlp(x_perm, g, d, group_sizes), w, routing)

    y, vjp = jax.vjp(composed, x, rw, gu, dn)
    grads = vjp(dy)
    ym, vjpm = jax.vjp(lambda *a: mfj.moe_ffn(*a, **kw), x, rw, gu, dn)
    grads_m = vjpm(dy)
    naive, naive_vjp = jax.vjp(lambda *a: reference.moe_ffn(*a, **kw), x, rw, gu, dn)
    naive_grads = naive_vjp(dy)
    cpu64 = [_cpu(a) for a in (*args64, dy64)]
    y64, vjp64 = jax.vjp(lambda *a: reference.moe_ffn(*a, **_kw64(kw)), *cpu64[:4])
    grads64 = vjp64(cpu64[4])

    scale = max(1.0, float(np.max(np.abs(np.asarray(y64)))))
    np.testing.assert_allclose(f64(y), f64(ym), rtol=0, atol=2 * where.floor * scale, err_msg=f"{router} y vs moe_ffn")
    close_by_rule(f64(y), np.asarray(y64), f64(naive), floor=where.floor, what=f"{router} composed y")
    names = ("dx", "drouter_w", "dw_gate_up", "dw_down")
    for what, got, m, r, n in zip(names, grads, grads_m, grads64, naive_grads):
        assert got.dtype == where.dtype, what
        close_by_rule(f64(got), np.asarray(r), f64(n), floor=where.floor, what=f"{router} composed {what}")
        close_by_rule(f64(m), np.asarray(r), f64(n), floor=where.floor, what=f"{router} moe_ffn {what}")


# --- the routing functions under transformations -----------------------------------------------------

def test_routing_functions_under_jit_grad_and_vmap(where):
    rng = np.random.default_rng(11)
    N, E, K, H = 16, 8, 2, 24
    logits = where.f32(rng.standard_normal((2, N, E)) * 2.0)
    x, _ = where.put(rng.standard_normal((2, N, H)))

    def pieces(a, b):
        idx, w, p = mfj.route(a, top_k=K)
        x_perm, gs, routing = mfj.permute(b, idx, E)
        return idx, w, p, x_perm, gs, routing, mfj.unpermute(x_perm, w, routing)

    def layer(a, b):
        idx, w, p, x_perm, _, routing, y = pieces(a, b)
        return jnp.sum(y.astype(jnp.float32) ** 2) + mfj.load_balancing_loss(idx, p, num_experts=E)

    def same(got, want, exact=True, what=""):
        for g, e in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            if exact:
                np.testing.assert_array_equal(f64(g), f64(e), err_msg=what)
            else:
                np.testing.assert_allclose(f64(g), f64(e), rtol=where.floor, atol=where.floor, err_msg=what)

    eager = pieces(logits[0], x[0])
    same(jax.jit(pieces)(logits[0], x[0]), eager, what="jit")
    batched = jax.jit(jax.vmap(pieces))(logits, x)
    for i in range(2):
        same(jax.tree_util.tree_map(lambda a: a[i], batched), pieces(logits[i], x[i]), what=f"vmap {i}")
    grad = jax.grad(layer, argnums=(0, 1))
    g_eager = grad(logits[0], x[0])
    same(jax.jit(grad)(logits[0], x[0]), g_eager, exact=False, what="jit(grad)")
    g_batched = jax.jit(jax.vmap(grad))(logits, x)
    for i in range(2):
        same(jax.tree_util.tree_map(lambda a: a[i], g_batched), grad(logits[i], x[i]), exact=False,
             what=f"vmap(grad) {i}")
    g_ckpt = jax.jit(jax.grad(jax.checkpoint(layer), argnums=(0, 1)))(logits[0], x[0])
    same(g_ckpt, g_eager, exact=False, what="checkpoint")


def test_the_routing_twins_match_numpy():
    """reference.permute / unpermute / load_balancing_loss (float64 on the CPU) against numpy loops."""
    rng = np.random.default_rng(12)
    N, K, E, H = 11, 3, 5, 4
    idx = rng.integers(-1, E + 2, (N, K)).astype(np.int32)
    flat = idx.reshape(-1)
    x, y_perm, w = rng.standard_normal((N, H)), rng.standard_normal((N * K, H)), rng.standard_normal((N, K))
    with jax.default_device(jax.devices("cpu")[0]):
        x_perm, gs, routing = reference.permute(jnp.asarray(x), jnp.asarray(idx), E)
        order = [p for e in range(E) for p in range(N * K) if flat[p] == e]  # stable: pair order within an expert
        pair_row = np.full(N * K, -1)
        pair_row[order] = np.arange(len(order))
        np.testing.assert_array_equal(np.asarray(gs), [np.sum(flat == e) for e in range(E)])
        np.testing.assert_array_equal(np.asarray(routing.sorted_pair), order + [-1] * (N * K - len(order)))
        np.testing.assert_array_equal(np.asarray(routing.pair_row), pair_row)
        want = np.zeros((N * K, H))
        want[:len(order)] = x[np.asarray(order) // K]
        np.testing.assert_array_equal(np.asarray(x_perm), want)
        y = np.zeros((N, H))
        for p in range(N * K):
            if pair_row[p] >= 0:
                y[p // K] += w[p // K, p % K] * y_perm[pair_row[p]]
        np.testing.assert_allclose(reference.unpermute(jnp.asarray(y_perm), jnp.asarray(w), routing), y, rtol=1e-12,
                                   atol=1e-12)
        probs = rng.dirichlet(np.ones(E), size=(2, N))
        mask = (rng.random(N) > 0.3).astype(np.float64)
        counts, prob_sums = np.zeros(E), np.zeros(E)
        for layer in range(2):
            for t in range(N):
                prob_sums += mask[t] * probs[layer, t]
                for k in range(K):
                    if 0 <= idx[t, k] < E:
                        counts[idx[t, k]] += mask[t]
        want = E * np.sum(counts * prob_sums) / (2 * mask.sum()) ** 2
        got = reference.load_balancing_loss([jnp.asarray(idx)] * 2, [jnp.asarray(p) for p in probs], jnp.asarray(mask),
                                            num_experts=E)
        np.testing.assert_allclose(float(got), want, rtol=1e-12)


def test_routing_bad_arguments_raise_errors_naming_them():
    with jax.default_device(jax.devices("cpu")[0]):
        logits = jnp.ones((4, 6), jnp.float32)
        with pytest.raises(ValueError, match="route: top_k=7"):
            mfj.route(logits, top_k=7)
        with pytest.raises(TypeError, match="logits is int32"):
            mfj.route(jnp.ones((4, 6), jnp.int32), top_k=2)
        with pytest.raises(ValueError, match="route: correction_bias is the sigmoid router's"):
            mfj.route(logits, top_k=2, correction_bias=jnp.zeros(6, jnp.float32))
        with pytest.raises(ValueError, match=r"correction_bias is float32\[5\]"):
            mfj.route(logits, top_k=2, router="sigmoid", correction_bias=jnp.zeros(5, jnp.float32))
        with pytest.raises(ValueError, match="n_group=4"):
            mfj.route(logits, top_k=2, router="sigmoid", n_group=4)
        idx, probs = jnp.zeros((4, 2), jnp.int32), jnp.full((4, 6), 1 / 6, jnp.float32)
        with pytest.raises(ValueError, match="probs has shape"):
            mfj.load_balancing_loss(idx, probs, num_experts=5)
        with pytest.raises(TypeError, match="topk_idx is float32"):
            mfj.load_balancing_loss(idx.astype(jnp.float32), probs, num_experts=6)
        with pytest.raises(ValueError, match="mask has shape"):
            mfj.load_balancing_loss(idx, probs, jnp.ones(5), num_experts=6)
        with pytest.raises(ValueError, match="topk_idx has 2 layers and probs 1"):
            mfj.load_balancing_loss([idx, idx], [probs], num_experts=6)
        with pytest.raises(TypeError, match="both lists"):
            mfj.load_balancing_loss([idx], probs, num_experts=6)
        with pytest.raises(ValueError, match="num_experts=0"):
            mfj.load_balancing_loss(idx, probs, num_experts=0)
        x = jnp.ones((4, 8), jnp.float32)
        with pytest.raises(ValueError, match=r"topk_idx has shape \(3, 2\)"):
            mfj.permute(x, jnp.zeros((3, 2), jnp.int32), 6)
        with pytest.raises(ValueError, match="num_experts=0"):
            mfj.permute(x, idx, 0)
        with pytest.raises(TypeError, match="x is float16"):
            mfj.permute(x.astype(jnp.float16), idx, 6)
        with pytest.raises(TypeError, match="topk_idx is float32"):
            mfj.permute(x, idx.astype(jnp.float32), 6)
        x_perm, _, routing = mfj.permute(x, idx, 6)
        w = jnp.ones((4, 2), jnp.float32)
        with pytest.raises(TypeError, match="routing is tuple"):
            mfj.unpermute(x_perm, w, tuple(routing))
        with pytest.raises(ValueError, match="y_perm has shape"):
            mfj.unpermute(x_perm[:7], w, routing)
        with pytest.raises(ValueError, match="routing.pair_row has 8 pairs"):
            mfj.unpermute(x_perm, jnp.ones((4, 3), jnp.float32), routing)
