"""moeforge.jax's Flax side: the NNX MoEFFN (and the Linen one) equal moeforge.jax.moe_ffn on their
parameters; moeforge.jax.loader fills a Qwen3-MoE layer from a tiny HF directory written here
(safetensors by hand: an 8-byte little-endian header length, the JSON header, the raw data; both
the stacked and the per-expert layouts, F32 and BF16) with exactly the arrays written, and refuses
a missing or mis-shaped tensor by name; examples/jax_flax_moe.py's loss falls over a few steps.
Skips, saying why, without jax, flax or optax (CI), moeforge.jax, or (the loader) moeforge.Weights."""

import importlib.util
import json
import os
import struct

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed (moeforge.jax's tests run where it is)")
pytest.importorskip("flax", reason="flax is not installed (moeforge.jax.flax's tests run where it is)")
pytest.importorskip("optax", reason="optax is not installed (the example's training test needs it)")
try:
    import moeforge.jax as mfj
    from moeforge.jax import flax as mff
    from moeforge.jax import loader
except ImportError as e:
    pytest.skip(f"moeforge.jax cannot be imported: {e}", allow_module_level=True)

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import moeforge  # noqa: E402
from conftest import REPO  # noqa: E402

CPU = jax.devices("cpu")[0]
needs_weights = pytest.mark.skipif(not hasattr(moeforge, "Weights"), reason="moeforge.Weights is not built here")


# --- the modules ------------------------------------------------------------------------------------

def test_nnx_moeffn_equals_moe_ffn():
    with jax.default_device(CPU):
        ffn = mff.MoEFFN(16, 8, 6, 2, rngs=nnx.Rngs(0), compute_dtype=jnp.float32, init_std=0.3)
        x = jax.random.normal(jax.random.key(1), (2, 5, 16), jnp.float32)
        got = ffn(x)
        want = mfj.moe_ffn(x, ffn.router[...], ffn.gate_up[...], ffn.down[...], top_k=2)
        assert got.shape == x.shape and got.dtype == x.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # gradients reach the parameters
        grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(ffn)
        for key in ("router", "gate_up", "down"):
            assert float(jnp.max(jnp.abs(grads[key][...]))) > 0, key


def test_nnx_moeffn_bf16_params_compute_f32_on_cpu():
    with jax.default_device(CPU):
        ffn = mff.MoEFFN(16, 8, 4, 2, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16, compute_dtype=jnp.float32,
                         init_std=0.3)
        assert ffn.gate_up[...].dtype == jnp.bfloat16
        x = jax.random.normal(jax.random.key(2), (7, 16), jnp.float32)
        want = mfj.moe_ffn(x, *(p[...].astype(jnp.float32) for p in (ffn.router, ffn.gate_up, ffn.down)), top_k=2)
        np.testing.assert_array_equal(np.asarray(ffn(x)), np.asarray(want))


def test_linen_moeffn_equals_moe_ffn():
    with jax.default_device(CPU):
        layer = mff.LinenMoEFFN(hidden=16, intermediate=8, num_experts=6, top_k=3, compute_dtype=jnp.float32,
                                init_std=0.3)
        x = jax.random.normal(jax.random.key(3), (9, 16), jnp.float32)
        params = layer.init(jax.random.key(0), x)["params"]
        want = mfj.moe_ffn(x, params["router"], params["gate_up"], params["down"], top_k=3)
        np.testing.assert_array_equal(np.asarray(layer.apply({"params": params}, x)), np.asarray(want))


# --- the loader -------------------------------------------------------------------------------------

def _bf16_bits(a):
    """bf16 as stored: the upper 16 bits of each float32 (the values written are bf16-exact)."""
    return (np.ascontiguousarray(a, np.float32).view(np.uint32) >> 16).astype("<u2")


def _bf16_exact(a):
    return (_bf16_bits(a).astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path, tensors):
    """tensors: {name: (dtype "F32" or "BF16", float32 array)}."""
    header, blobs, offset = {}, [], 0
    for name, (dtype, a) in tensors.items():
        raw = (_bf16_bits(a) if dtype == "BF16" else np.ascontiguousarray(a, "<f4")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


E, H, I = 4, 8, 6


def _layer_arrays(rng):
    return {"router": _bf16_exact(rng.normal(size=(E, H))),
            "gate_up": _bf16_exact(rng.normal(size=(E, 2 * I, H))),
            "down": _bf16_exact(rng.normal(size=(E, H, I)))}


def _tensors(arrays, layout, layer, dtype):
    p = f"model.layers.{layer}.mlp"
    out = {f"{p}.gate.weight": (dtype, arrays["router"]),
           "model.embed_tokens.weight": (dtype, np.ones((3, H), np.float32))}  # (another tensor: ignored)
    if layout == "stacked":
        out[f"{p}.experts.gate_up_proj"] = (dtype, arrays["gate_up"])
        out[f"{p}.experts.down_proj"] = (dtype, arrays["down"])
    else:
        for e in range(E):
            out[f"{p}.experts.{e}.gate_proj.weight"] = (dtype, arrays["gate_up"][e, :I])
            out[f"{p}.experts.{e}.up_proj.weight"] = (dtype, arrays["gate_up"][e, I:])
            out[f"{p}.experts.{e}.down_proj.weight"] = (dtype, arrays["down"][e])
    return out


def _model_dir(tmp_path, tensors):
    d = tmp_path / "model"
    d.mkdir()
    write_safetensors(d / "model.safetensors", tensors)
    return str(d)


@needs_weights
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
@pytest.mark.parametrize("dtype", ["BF16", "F32"])
def test_loader_fills_exactly_what_was_written(tmp_path, layout, dtype):
    arrays = _layer_arrays(np.random.default_rng(0))
    model_dir = _model_dir(tmp_path, _tensors(arrays, layout, 1, dtype))
    with jax.default_device(CPU):
        ffn = mff.MoEFFN(H, I, E, 2, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
        got = loader.load_qwen3_moe_layer(model_dir, 1, ffn)
        for key, want in arrays.items():
            np.testing.assert_array_equal(got[key], want, err_msg=key)
            np.testing.assert_array_equal(np.asarray(getattr(ffn, key)[...]), want, err_msg=key)
        y = ffn(jnp.ones((3, H), jnp.float32))  # the filled module runs
        assert y.shape == (3, H)


@needs_weights
@pytest.mark.parametrize("layout", ["stacked", "per-expert"])
def test_loader_refuses_a_missing_tensor_by_name(tmp_path, layout):
    tensors = _tensors(_layer_arrays(np.random.default_rng(1)), layout, 0, "F32")
    gone = ("model.layers.0.mlp.experts.down_proj" if layout == "stacked"
            else "model.layers.0.mlp.experts.2.up_proj.weight")
    del tensors[gone]
    with pytest.raises(moeforge.Error, match=gone.replace(".", r"\.")):
        loader.load_qwen3_moe_layer(_model_dir(tmp_path, tensors), 0)


@needs_weights
def test_loader_refuses_a_missing_router_and_a_misshaped_tensor(tmp_path):
    tensors = _tensors(_layer_arrays(np.random.default_rng(2)), "per-expert", 0, "F32")
    tensors["model.layers.0.mlp.experts.1.down_proj.weight"] = ("F32", np.zeros((H, I + 1), np.float32))
    model_dir = _model_dir(tmp_path, tensors)
    with pytest.raises(moeforge.Error, match=r"experts\.1\.down_proj\.weight has shape"):
        loader.load_qwen3_moe_layer(model_dir, 0)
    with pytest.raises(moeforge.Error, match=r"model\.layers\.3\.mlp\.gate\.weight is missing"):
        loader.load_qwen3_moe_layer(model_dir, 3)


@needs_weights
def test_loader_refuses_a_module_of_other_shapes(tmp_path):
    model_dir = _model_dir(tmp_path, _tensors(_layer_arrays(np.random.default_rng(3)), "stacked", 0, "F32"))
    with jax.default_device(CPU):
        ffn = mff.MoEFFN(H, I + 2, E, 2, rngs=nnx.Rngs(0), compute_dtype=jnp.float32)
        before = np.asarray(ffn.router[...])
        with pytest.raises(moeforge.Error, match="gate_up"):
            loader.load_qwen3_moe_layer(model_dir, 0, ffn)
        np.testing.assert_array_equal(np.asarray(ffn.router[...]), before)  # nothing changed


# --- the example ------------------------------------------------------------------------------------

def test_example_loss_falls():
    path = os.path.join(REPO, "examples", "jax_flax_moe.py")
    spec = importlib.util.spec_from_file_location("jax_flax_moe", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    losses = example.main(steps=8, device="cpu")
    assert len(losses) == 8 and all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.3, f"the loss did not fall: {losses}"
