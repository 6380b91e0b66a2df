"""moeforge.jax: dropless MoE for JAX on moeforge's kernels, through XLA FFI.

    import moeforge.jax as mfj
    out = mfj.grouped_matmul(x, w, group_sizes)                 # jax.lax.ragged_dot's semantics
    y = mfj.expert_mlp(x_sorted, w_gate_up, w_down, group_sizes)  # gate_up -> SwiGLU -> down per group
    y = mfj.moe_ffn(x, router_w, w_gate_up, w_down, top_k=8)    # the whole layer: router ... unpermute

and the layer taken apart (the same routed output, logits = x · router_wᵀ in float32):
    idx, w, probs = mfj.route(logits, top_k=8)                  # softmax or sigmoid router
    aux = mfj.load_balancing_loss(idx, probs, num_experts=E)    # transformers' load_balancing_loss_func
    x_perm, group_sizes, routing = mfj.permute(x, idx, E)       # the pairs grouped by expert (mfj.Routing)
    y = mfj.unpermute(mfj.expert_mlp(x_perm, w_gate_up, w_down, group_sizes), w, routing)

expert parallelism (inside jax.shard_map(..., check_vma=False), experts sharded on the axis):
    y = mfj.moe_ffn(x, router_w, w_gate_up_local, w_down_local, top_k=8, ep_axis="ep")

and Flax (moeforge.jax.flax: nnx MoEFFN, Linen LinenMoEFFN; moeforge.jax.loader fills a Qwen3-MoE
layer from a Hugging Face directory through moeforge.Weights).

Every function is pure, with a jax.custom_vjp over moeforge's explicit backward kernels, and works
inside jax.jit, jax.grad, jax.checkpoint, lax.scan and jax.vmap (sequentially per batch element).
Group sizes stay on the device (no host sync); workspaces are XLA buffers sized at trace time.
Activations and weights are bfloat16 on a GPU and float32 on the CPU (the C API's reference kernels).
moeforge.jax.reference holds pure-JAX twins of each function.

Importing this module imports jax and registers moeforge's FFI targets with XLA (once); `import
moeforge` alone never imports jax. It raises ImportError, saying why, when jax is missing, when this
moeforge was built without its JAX extension, or when the installed jaxlib is older than the one it
was built against."""

import importlib.util

if importlib.util.find_spec("jax") is None:
    raise ImportError("moeforge.jax needs jax, which this interpreter does not have (pip install jax; jax[cuda13] "
                      "for NVIDIA GPUs)")

from . import _ffi  # noqa: E402  (loads the extension, checks jaxlib, registers the targets)
from ._functions import expert_mlp, grouped_matmul, moe_ffn  # noqa: E402
from ._routing import Routing, load_balancing_loss, permute, route, unpermute  # noqa: E402
from .ep import moe_ffn_ep  # noqa: E402

BUILT_WITH_CUDA = _ffi.BUILT_WITH_CUDA
FFI_API_VERSION = _ffi.FFI_API_VERSION
JAXLIB_VERSION = _ffi.JAXLIB_VERSION

__all__ = ["BUILT_WITH_CUDA", "FFI_API_VERSION", "JAXLIB_VERSION", "Routing", "expert_mlp", "grouped_matmul",
           "load_balancing_loss", "moe_ffn", "moe_ffn_ep", "permute", "route", "unpermute"]
