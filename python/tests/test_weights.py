"""moeforge.Weights on model directories written here byte by byte (the safetensors layout: an
8-byte little-endian header length, the JSON header, the data): one file and an index with shards,
bf16 and f32 tensors read as float32, names sorted, and bad inputs refused naming the file or the
tensor (a truncated file, an unknown name, a shard outside the directory, a missing directory)."""

import json
import struct

import numpy as np
import pytest

import moeforge


def bf16_bytes(a: np.ndarray) -> bytes:
    """a (float32) rounded to bf16 (nearest even), as the format stores it."""
    bits = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return rounded.tobytes()


def bf16_values(a: np.ndarray) -> np.ndarray:
    return (np.frombuffer(bf16_bytes(a), np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(a.shape)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype, shape, raw bytes)."""
    header, offset, data = {}, 0, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.fixture
def arrays():
    rng = np.random.default_rng(3)
    return {"model.embed_tokens.weight": rng.standard_normal((6, 4)).astype(np.float32),
            "model.layers.0.mlp.gate.weight": rng.standard_normal((3, 4)).astype(np.float32),
            "lm_head.weight": rng.standard_normal((6, 4)).astype(np.float32)}


def test_one_file_bf16_and_f32(tmp_path, arrays):
    write_safetensors(tmp_path / "model.safetensors", {
        "model.embed_tokens.weight": ("BF16", (6, 4), bf16_bytes(arrays["model.embed_tokens.weight"])),
        "model.layers.0.mlp.gate.weight": ("F32", (3, 4), arrays["model.layers.0.mlp.gate.weight"].tobytes()),
        "lm_head.weight": ("F32", (6, 4), arrays["lm_head.weight"].tobytes())})
    with moeforge.Weights(tmp_path) as w:
        assert w.names() == sorted(arrays) and len(w) == 3 and "lm_head.weight" in w and "nope" not in w
        assert w.dtype("model.embed_tokens.weight") == "BF16" and w.shape("model.embed_tokens.weight") == (6, 4)
        got = w.read("model.embed_tokens.weight")
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, bf16_values(arrays["model.embed_tokens.weight"]))
        np.testing.assert_array_equal(w.read("lm_head.weight"), arrays["lm_head.weight"])
        with pytest.raises(moeforge.InvalidArgumentError, match="no tensor named 'model.norm.weight'"):
            w.read("model.norm.weight")


def test_sharded_index(tmp_path, arrays):
    names = sorted(arrays)
    write_safetensors(tmp_path / "a.safetensors", {n: ("F32", arrays[n].shape, arrays[n].tobytes())
                                                   for n in names[:2]})
    write_safetensors(tmp_path / "b.safetensors", {names[2]: ("F32", arrays[names[2]].shape,
                                                              arrays[names[2]].tobytes())})
    index = {"metadata": {}, "weight_map": {n: ("a" if i < 2 else "b") + ".safetensors" for i, n in enumerate(names)}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    w = moeforge.Weights(str(tmp_path))
    for n in names:
        np.testing.assert_array_equal(w.read(n), arrays[n])
    w.close()
    with pytest.raises(moeforge.Error, match="closed"):
        w.names()


def test_bad_inputs_are_refused_by_name(tmp_path, arrays):
    with pytest.raises(moeforge.Error, match="missing_dir"):
        moeforge.Weights(tmp_path / "missing_dir")
    path = tmp_path / "model.safetensors"
    write_safetensors(path, {"lm_head.weight": ("F32", (6, 4), arrays["lm_head.weight"].tobytes())})
    path.write_bytes(path.read_bytes()[:-8])  # the data section a row short
    with pytest.raises(moeforge.Error, match="model.safetensors"):
        moeforge.Weights(tmp_path)
    path.unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    with pytest.raises(moeforge.Error, match="outside"):
        moeforge.Weights(tmp_path)
