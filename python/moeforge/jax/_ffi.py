"""The extension moeforge._jax_ffi (XLA FFI handlers over moeforge's C API): loaded, checked against
the running jaxlib, and registered with XLA once, for the CPU and (where built with CUDA) for CUDA
under the same target names. `call` issues one handler through jax.ffi.ffi_call."""

import re

import jax
import jaxlib
import numpy as np

try:
    from .. import _jax_ffi
except ImportError as e:  # the package was built without it (no jax where it was built)
    raise ImportError(
        "moeforge.jax needs moeforge's JAX extension (moeforge._jax_ffi), which this build of moeforge does not "
        "have: it is built where the build's interpreter imports jax (cmake -DMOEFORGE_JAX=ON "
        f"-DMOEFORGE_PYTHON_EXECUTABLE=<python with jax>); the import failed with: {e}") from e

_TARGET_PREFIX = "moeforge_"


def _version_tuple(version: str) -> tuple:
    """The leading numeric fields of a version string ("0.11.2.dev20261201" -> (0, 11, 2))."""
    parts = []
    for field in version.split("."):
        m = re.match(r"\d+", field)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() != len(field):
            break
    return tuple(parts)


def _check_jaxlib() -> None:
    built, running = _jax_ffi.JAXLIB_VERSION, jaxlib.__version__
    if _version_tuple(running) < _version_tuple(built):
        raise ImportError(
            f"moeforge.jax was built against jaxlib {built} (XLA FFI API {_jax_ffi.FFI_API_VERSION[0]}."
            f"{_jax_ffi.FFI_API_VERSION[1]}) but jaxlib {running} is installed: an older jaxlib may lack what the "
            "handlers use; upgrade jaxlib to at least the built version, or rebuild moeforge against this one")


_check_jaxlib()

# Handler names (the extension's dict keys) and the XLA target each is registered as.
HANDLERS = ("grouped_matmul", "grouped_matmul_bwd", "expert_mlp", "expert_mlp_bwd", "moe_ffn", "moe_ffn_bwd",
            "route_softmax", "route_softmax_bwd", "route_sigmoid", "route_sigmoid_bwd", "aux_stats", "aux_dprobs",
            "permute", "permute_bwd", "unpermute", "unpermute_bwd")
for _name in HANDLERS:
    jax.ffi.register_ffi_target(_TARGET_PREFIX + _name, _jax_ffi.CPU_HANDLERS[_name], platform="cpu", api_version=1)
    if _name in _jax_ffi.CUDA_HANDLERS:
        jax.ffi.register_ffi_target(_TARGET_PREFIX + _name, _jax_ffi.CUDA_HANDLERS[_name], platform="CUDA",
                                    api_version=1)

BUILT_WITH_CUDA = bool(_jax_ffi.BUILT_WITH_CUDA)
FFI_API_VERSION = tuple(_jax_ffi.FFI_API_VERSION)
JAXLIB_VERSION = _jax_ffi.JAXLIB_VERSION


def call(name: str, results, *args, **attrs):
    """The handler `name` on args, returning arrays shaped as `results` (jax.ShapeDtypeStruct each).
    Integer attributes are passed as int64, floats as float32 (the handlers' attribute types). Under
    vmap the call runs once per batch element (sequential)."""
    assert name in HANDLERS, name
    typed = {}
    for key, value in attrs.items():
        if isinstance(value, (bool, np.bool_)):
            typed[key] = np.int64(int(value))
        elif isinstance(value, (int, np.integer)):
            typed[key] = np.int64(value)
        elif isinstance(value, (float, np.floating)):
            typed[key] = np.float32(value)
        else:
            raise TypeError(f"moeforge.jax: attribute {key}={value!r} is neither an int nor a float")
    return jax.ffi.ffi_call(_TARGET_PREFIX + name, results, vmap_method="sequential")(*args, **typed)
