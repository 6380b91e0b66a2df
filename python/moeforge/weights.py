"""moeforge.Weights: the tensors of a Hugging Face model directory (model.safetensors, or the shards
that model.safetensors.index.json names), read through the engine's validating safetensors reader
(the C API's mf_weights_*): every header checked on open, errors naming the file and the tensor.
For bindings that fill their own parameters (moeforge.jax's Flax loader)."""

import os
from typing import Dict, List, Tuple, Union

from . import _native
from .errors import InvalidArgumentError


class Weights:
    """Weights(model_dir): `names()` (sorted), `shape(name)`, `dtype(name)` (as stored: "BF16",
    "F32", ...), `read(name)` (a numpy float32 array, converted from F32, BF16, F16 or F64),
    `name in weights`; `close()` or a `with` block releases the mapped files."""

    def __init__(self, model_dir: Union[str, os.PathLike]):
        self._dir = os.fspath(model_dir)
        self._native = _native.Weights(self._dir)
        self._closed = False
        self._names: List[str] = self._native.names()
        self._known = set(self._names)
        self._info: Dict[str, Tuple[str, tuple]] = {}

    def _open(self) -> None:
        if self._closed:
            raise InvalidArgumentError(f"moeforge.Weights({self._dir!r}): the weights are closed")

    def names(self) -> List[str]:
        self._open()
        return list(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._known

    def __len__(self) -> int:
        return len(self._names)

    def _described(self, name: str) -> Tuple[str, tuple]:
        self._open()
        if name not in self._info:
            self._info[name] = self._native.info(name)
        return self._info[name]

    def dtype(self, name: str) -> str:
        return self._described(name)[0]

    def shape(self, name: str) -> tuple:
        return tuple(self._described(name)[1])

    def read(self, name: str):
        import numpy as np

        out = np.empty(self.shape(name), np.float32)
        self._native.read_f32(name, out)
        return out

    def close(self) -> None:
        self._closed = True
        self._native.close()

    def __enter__(self) -> "Weights":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
