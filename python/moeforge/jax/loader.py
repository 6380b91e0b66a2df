"""Qwen3-MoE weights from a Hugging Face model directory for moeforge.jax, read through moeforge's
validating safetensors reader (moeforge.Weights).

    arrays = load_qwen3_moe_layer("path/to/model", 0)           # {"router", "gate_up", "down"}: numpy float32
    load_qwen3_moe_layer("path/to/model", 0, module)           # or fill a moeforge.jax.flax.MoEFFN

Both checkpoint layouts of a layer L's MoE block (prefix model.layers.{L}.mlp):
  router:   {prefix}.gate.weight [E, H]
  stacked (transformers v5):  {prefix}.experts.gate_up_proj [E, 2I, H], {prefix}.experts.down_proj [E, H, I]
  per expert (the hub's):     {prefix}.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H],
                              .down_proj.weight [H, I] for e in 0..E-1
gate_up is each expert's gate rows followed by its up rows (expert_mlp's layout). A missing or
mis-shaped tensor is refused (moeforge.InvalidArgumentError) by its name; the reader's own errors
(moeforge.Error subclasses) name the file and tensor."""

import os
from typing import Dict, Optional, Union

import numpy as np

from ..errors import InvalidArgumentError
from ..weights import Weights


def _prefix(layer: int) -> str:
    return f"model.layers.{layer}.mlp"


def _check(w: Weights, name: str, shape: tuple, where: str) -> None:
    if name not in w:
        raise InvalidArgumentError(f"{where}: tensor {name} is missing")
    got = tuple(w.shape(name))
    if got != tuple(shape):
        raise InvalidArgumentError(f"{where}: tensor {name} has shape {list(got)}, expected {list(shape)}")


def _tensor(w: Weights, name: str, shape: tuple, where: str) -> np.ndarray:
    _check(w, name, shape, where)
    return w.read(name)


def _stacked(w: Weights, p: str, E: int, H: int, where: str) -> Dict[str, np.ndarray]:
    name = f"{p}.experts.gate_up_proj"
    shape = tuple(w.shape(name))
    if len(shape) != 3 or shape[0] != E or shape[2] != H or shape[1] % 2:
        raise InvalidArgumentError(f"{where}: tensor {name} has shape {list(shape)}, expected [E, 2I, H] with "
                                   f"E = {E}, H = {H} (the router's)")
    I = shape[1] // 2
    return {"gate_up": w.read(name), "down": _tensor(w, f"{p}.experts.down_proj", (E, H, I), where)}


def _per_expert(w: Weights, p: str, E: int, H: int, where: str) -> Dict[str, np.ndarray]:
    first = f"{p}.experts.0.gate_proj.weight"
    if first not in w:
        raise InvalidArgumentError(f"{where}: neither {p}.experts.gate_up_proj (the stacked layout) nor {first} "
                                   "(the per-expert layout) is there")
    shape = tuple(w.shape(first))
    if len(shape) != 2 or shape[1] != H:
        raise InvalidArgumentError(f"{where}: tensor {first} has shape {list(shape)}, expected [I, {H}]")
    I = shape[0]
    expected = [(f"{p}.experts.{e}.{proj}.weight", dims) for e in range(E)
                for proj, dims in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))]
    for name, dims in expected:  # every tensor there and shaped before anything is allocated: the
        _check(w, name, dims, where)  # stacked arrays are then no larger than the files' own data
    gate_up, down = np.empty((E, 2 * I, H), np.float32), np.empty((E, H, I), np.float32)
    for e in range(E):
        q = f"{p}.experts.{e}"
        gate_up[e, :I] = w.read(f"{q}.gate_proj.weight")
        gate_up[e, I:] = w.read(f"{q}.up_proj.weight")
        down[e] = w.read(f"{q}.down_proj.weight")
    return {"gate_up": gate_up, "down": down}


def read_qwen3_moe_layer(w: Weights, layer: int, where: str = "") -> Dict[str, np.ndarray]:
    """Layer `layer`'s router [E, H], gate_up [E, 2I, H] and down [E, H, I] (numpy float32) from open
    weights, in either layout (the stacked one where its gate_up_proj is there)."""
    where = where or f"Qwen3-MoE layer {layer}"
    p = _prefix(layer)
    name = f"{p}.gate.weight"
    if name not in w:
        raise InvalidArgumentError(f"{where}: tensor {name} is missing")
    shape = tuple(w.shape(name))
    if len(shape) != 2:
        raise InvalidArgumentError(f"{where}: tensor {name} has shape {list(shape)}, expected [E, H]")
    E, H = shape
    experts = _stacked if f"{p}.experts.gate_up_proj" in w else _per_expert
    return {"router": w.read(name), **experts(w, p, E, H, where)}


def _assign(module, arrays: Dict[str, np.ndarray], where: str) -> None:
    """Sets the module's router, gate_up and down (nnx.Param) to the arrays, in the params' dtypes,
    after checking every shape (so a mismatch changes nothing)."""
    import jax.numpy as jnp

    params = {key: getattr(module, key, None) for key in ("router", "gate_up", "down")}
    for key, param in params.items():
        if param is None:
            raise InvalidArgumentError(f"{where}: the module has no parameter {key!r} (expected a "
                                       "moeforge.jax.flax.MoEFFN)")
        if tuple(param[...].shape) != arrays[key].shape:
            raise InvalidArgumentError(f"{where}: the checkpoint's {key} is {list(arrays[key].shape)}, the module's "
                                       f"{list(param[...].shape)}")
    for key, param in params.items():
        value = jnp.asarray(arrays[key], param[...].dtype)
        if hasattr(param, "set_value"):
            param.set_value(value)
        else:
            param.value = value


def load_qwen3_moe_layer(model_dir: Union[str, os.PathLike], layer: int,
                         module: Optional[object] = None) -> Dict[str, np.ndarray]:
    """Reads Qwen3-MoE layer `layer`'s MoE block from the HF directory model_dir (read_qwen3_moe_layer)
    and, when module (a moeforge.jax.flax.MoEFFN) is given, fills its parameters. Returns the arrays
    {"router", "gate_up", "down"} as numpy float32."""
    where = f"{os.fspath(model_dir)}: Qwen3-MoE layer {layer}"
    with Weights(model_dir) as w:
        arrays = read_qwen3_moe_layer(w, layer, where)
    if module is not None:
        _assign(module, arrays, where)
    return arrays
