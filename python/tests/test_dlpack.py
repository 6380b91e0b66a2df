"""DLPack zero-copy both ways with numpy: the engine reads and writes the caller's arrays in place
(capsules, __dlpack__ objects and raw pointers alike), and numpy views of the engine's parameters
share its memory (checked by writing through one view and reading through another)."""

import numpy as np

import moeforge
from moeforge import ops


def test_ops_write_into_the_callers_arrays_in_place():
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((3, 8)).astype(np.float32)
    out = np.full((3, 4), 7.0, np.float32)
    before = out.ctypes.data
    ops.swiglu_forward(out, inp)  # __dlpack__ objects
    assert out.ctypes.data == before
    g, u = inp[:, :4].astype(np.float64), inp[:, 4:].astype(np.float64)
    np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=1e-7)
    # A raw capsule, and a raw pointer, reach the same memory.
    out2 = np.zeros_like(out)
    ops.swiglu_forward(out2.__dlpack__(), inp.__dlpack__())
    np.testing.assert_array_equal(out2, out)
    out3 = np.zeros_like(out)
    raw = moeforge.RawTensor(out3.ctypes.data, "float32", list(out3.shape))
    ops.swiglu_forward(raw, moeforge.RawTensor(inp.ctypes.data, "float32", list(inp.shape)))
    np.testing.assert_array_equal(out3, out)
    # A view with an offset (a row slice) is read where it starts.
    out4 = np.zeros((2, 4), np.float32)
    ops.swiglu_forward(out4, inp[1:])
    np.testing.assert_array_equal(out4, out[1:])


def test_parameter_views_share_the_engines_memory(tiny_model, tmp_path):
    recipe = moeforge.Recipe.from_file(f"{moeforge_repo()}/demo/tiny_tokens.yaml", model=tiny_model,
                                       data__train=f"{moeforge_repo()}/demo/data/tokens.jsonl", out=str(tmp_path / "o"),
                                       train__steps=2, train__seq_len=32, train__micro_batch=2,
                                       optim__warmup_steps=0, device="cpu")  # numpy views: host memory
    with moeforge.Engine(recipe) as engine:
        names = engine.parameter_names()
        assert "model.embed_tokens.weight" in names
        a = np.asarray(engine.parameter("model.embed_tokens.weight"))  # writable (buffer protocol)
        b = np.from_dlpack(engine.parameter("model.embed_tokens.weight"))  # DLPack (read-only in numpy)
        assert a.dtype == b.dtype == np.float32 and a.ndim == 2
        assert a.ctypes.data == b.ctypes.data
        a[1, 2] = 1234.5  # written through one view ...
        assert b[1, 2] == 1234.5  # ... read through the other
        params = engine.parameters()
        assert params["model.embed_tokens.weight"][1, 2] == 1234.5
        snapshot = a.copy()
        engine.step()
        assert not np.array_equal(a, snapshot), "the view follows the engine's update"
    # The views keep the engine's memory alive after the engine is closed.
    assert a[1, 2] != 0 and np.isfinite(a).all()


def moeforge_repo():
    from conftest import REPO

    return REPO
