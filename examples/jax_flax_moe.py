"""A tiny Qwen3-MoE-shaped decoder in Flax NNX on moeforge's MoE layer, trained a few steps with optax
on the token data the repo ships (demo/data/tokens.jsonl).

    PYTHONPATH=build/python python examples/jax_flax_moe.py                 # CPU, float32, 20 steps
    PYTHONPATH=build/python python examples/jax_flax_moe.py --device gpu    # bfloat16 on the first GPU

The model: token embedding; per layer RMSNorm -> causal multi-head attention (rotary positions, written
in JAX) -> residual, RMSNorm -> moeforge.jax.flax.MoEFFN (softmax top-k router, dropless) -> residual;
final RMSNorm and an LM head. Parameters are float32; the layer computes in the device's dtype
(float32 on the CPU, bfloat16 on a GPU). Prints the next-token loss of every step."""

import argparse
import json
import os
from typing import List

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from moeforge.jax.flax import MoEFFN

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
TOKENS = os.path.join(REPO, "demo", "data", "tokens.jsonl")


# --- the model ----------------------------------------------------------------------------------------

def _normal(rngs, shape, std=0.02):
    return std * jax.random.normal(rngs.params(), shape, jnp.float32)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.weight[...]).astype(x.dtype)


def _rotate(x, theta: float = 10000.0):
    """Rotary positions on x [B, T, heads, D] (the half-split form Qwen uses)."""
    T, D = x.shape[1], x.shape[-1]
    freq = theta ** (-jnp.arange(0, D // 2, dtype=jnp.float32) / (D // 2))
    angle = jnp.arange(T, dtype=jnp.float32)[:, None] * freq[None, :]            # [T, D/2]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :D // 2].astype(jnp.float32), x[..., D // 2:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class CausalAttention(nnx.Module):
    def __init__(self, hidden: int, heads: int, *, rngs: nnx.Rngs):
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nnx.Param(_normal(rngs, (hidden, 3 * hidden)))
        self.out = nnx.Param(_normal(rngs, (hidden, hidden)))

    def __call__(self, x):
        B, T, H = x.shape
        q, k, v = jnp.split(x @ self.qkv[...].astype(x.dtype), 3, axis=-1)
        q, k, v = (a.reshape(B, T, self.heads, self.head_dim) for a in (q, k, v))
        q, k = _rotate(q), _rotate(k)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / np.sqrt(self.head_dim)
        causal = jnp.tril(jnp.ones((T, T), bool))
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1).astype(x.dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(B, T, H)
        return y @ self.out[...].astype(x.dtype)


class DecoderLayer(nnx.Module):
    def __init__(self, hidden, heads, intermediate, num_experts, top_k, compute_dtype, *, rngs):
        self.attn_norm, self.ffn_norm = RMSNorm(hidden), RMSNorm(hidden)
        self.attn = CausalAttention(hidden, heads, rngs=rngs)
        self.moe = MoEFFN(hidden, intermediate, num_experts, top_k, rngs=rngs, compute_dtype=compute_dtype)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.moe(self.ffn_norm(x))


class TinyQwen3Moe(nnx.Module):
    def __init__(self, vocab: int, hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 32,
                 num_experts: int = 8, top_k: int = 2, compute_dtype=jnp.float32, *, rngs: nnx.Rngs):
        self.compute_dtype = compute_dtype
        self.embed = nnx.Param(_normal(rngs, (vocab, hidden)))
        self.layers = nnx.List([DecoderLayer(hidden, heads, intermediate, num_experts, top_k, compute_dtype,
                                             rngs=rngs) for _ in range(layers)])
        self.norm = RMSNorm(hidden)
        self.lm_head = nnx.Param(_normal(rngs, (hidden, vocab)))

    def __call__(self, tokens):
        x = self.embed[...][tokens].astype(self.compute_dtype)
        for layer in self.layers:
            x = layer(x)
        return jnp.einsum("bth,hv->btv", self.norm(x), self.lm_head[...].astype(x.dtype),
                          preferred_element_type=jnp.float32)


# --- data and training ----------------------------------------------------------------------------------

def token_stream(path: str = TOKENS) -> np.ndarray:
    """Every sequence of the jsonl file ({"input_ids": [...]} a line), concatenated."""
    with open(path) as f:
        return np.array([t for line in f if line.strip() for t in json.loads(line)["input_ids"]], np.int32)


def batches(stream: np.ndarray, batch: int, seq_len: int, seed: int):
    """Random windows of seq_len + 1 tokens: (inputs, next-token targets), each [batch, seq_len]."""
    rng = np.random.default_rng(seed)
    while True:
        start = rng.integers(0, len(stream) - seq_len - 1, size=batch)
        window = np.stack([stream[s:s + seq_len + 1] for s in start])
        yield window[:, :-1], window[:, 1:]


def loss_fn(model, inputs, targets):
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


@nnx.jit
def train_step(model, optimizer, inputs, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    optimizer.update(model, grads)
    return loss


def main(steps: int = 20, device: str = "cpu", batch: int = 4, seq_len: int = 64, lr: float = 1e-2,
         seed: int = 0) -> List[float]:
    """Trains `steps` steps on `device` ("cpu": float32, "gpu": bfloat16) and returns the losses."""
    target = jax.devices(device)[0]
    compute_dtype = jnp.bfloat16 if target.platform == "gpu" else jnp.float32
    stream = token_stream()
    losses = []
    with jax.default_device(target):
        model = TinyQwen3Moe(int(stream.max()) + 1, compute_dtype=compute_dtype, rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=0.01), wrt=nnx.Param)
        data = batches(stream, batch, seq_len, seed)
        for step in range(steps):
            inputs, targets = next(data)
            loss = float(train_step(model, optimizer, jnp.asarray(inputs), jnp.asarray(targets)))
            losses.append(loss)
            print(f"step {step + 1:3d}  loss {loss:.4f}", flush=True)
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    losses = main(args.steps, args.device, lr=args.lr)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
