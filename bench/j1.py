"""Benchmark J1 (BENCHMARKS.md): one P1 MoE layer's expert MLP (gate_up -> SwiGLU -> down) forward +
backward under jax.jit at the Qwen3-30B-A3B geometry (E 128, top-8, H 2048, I 768), rows = tokens · 8
grouped by a random, moderately skewed routing, for 512 / 2048 / 8192 tokens; systems side by side:
  moeforge      moeforge.jax.expert_mlp (weights [E, 2I, H] and [E, H, I])
  ragged_dot    jax.lax.ragged_dot with its gradients (weights pre-transposed to [E, H, 2I], [E, I, H])
  pallas        JAX's Pallas Mosaic-GPU ragged_dot / transposed_ragged_dot in a custom_vjp ("unavailable"
                when it cannot be imported or compiled here)
  moe_ffn       moeforge.jax.moe_ffn: the whole layer (router, top-8, permute, experts, unpermute)
Each (system, tokens) runs in a fresh process so that its peak memory is its own. Time: WARMUP calls,
then the median over REPEATS of INNER back-to-back calls (block_until_ready after each batch).
TFLOP/s are model FLOPs: 3 × 2 · rows · H · (2I + I) for the expert MLP forward + backward (moe_ffn adds
its router's 3 × 2 · tokens · H · E). Peak temporary memory, from the first call only (the step compiled
beforehand): the device's peak bytes in use during it minus the bytes live before it and minus its
results' bytes (later calls would count the previous call's results, still held while the next one
runs); beside it XLA's own figure for the compiled step (memory_analysis().temp_size_in_bytes: the
buffers that are neither arguments nor results, the FFI handlers' scratch results included). One
JSON line per (system, tokens), then one line of ratios.
Usage (GPU machine): PYTHONPATH=build/python python3 bench/j1.py [--tokens 512,2048,8192] [--systems ...]"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

E, TOP_K, H, I = 128, 8, 2048, 768
SYSTEMS = ("moeforge", "ragged_dot", "pallas", "moe_ffn")
# Pallas blocks (block_m, block_n, block_k, max_concurrent_steps, grid_block_n); J1_PALLAS_BLOCKS overrides.
PALLAS_BLOCKS = tuple(int(v) for v in os.environ.get("J1_PALLAS_BLOCKS", "128,128,64,4,1").split(","))


def routing_sizes(tokens: int, seed: int = 0):
    """Group sizes of tokens · 8 rows: each token's 8 distinct experts drawn by top-8 of random logits
    plus a per-expert skew (a few experts get several times the mean load)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    skew = rng.standard_normal(E) * 0.7
    logits = rng.standard_normal((tokens, E)) + skew
    top = np.argpartition(-logits, TOP_K, axis=1)[:, :TOP_K]
    return np.bincount(top.ravel(), minlength=E).astype(np.int32)


def pallas_expert_mlp():
    """The expert MLP on Pallas Mosaic-GPU grouped matmuls: x · w[g]ᵀ for w [E, OC, C]."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

    bm, bn, bk, steps, gbn = PALLAS_BLOCKS
    blocks = dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=steps, grid_block_n=gbn)

    @jax.custom_vjp
    def gmm_t(x, w, gs):
        return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=gs, transpose_rhs=True, **blocks)

    def fwd(x, w, gs):
        return gmm_t(x, w, gs), (x, w, gs)

    def bwd(res, dout):
        x, w, gs = res
        dx = ragged_dot_mgpu.ragged_dot(dout, w, group_sizes=gs, transpose_rhs=False, **blocks)
        dw = transposed_ragged_dot_mgpu.transposed_ragged_dot(dout, x, group_sizes=gs, **blocks)
        return dx, dw.astype(w.dtype), None

    gmm_t.defvjp(fwd, bwd)

    @jax.jit
    def mlp(x, gu, dn, gs):
        h = gmm_t(x, gu, gs)
        a = (jax.nn.silu(h[:, :I].astype(jnp.float32)) * h[:, I:].astype(jnp.float32)).astype(x.dtype)
        return gmm_t(a, dn, gs)

    return mlp


def forward_and_backward(f, cotangent, *args):
    """(f(*args), its gradients at `cotangent`): the output is returned so that no system's last
    forward product is dead code."""
    import jax

    y, vjp = jax.vjp(f, *args)
    return y, vjp(cotangent)


def build(system: str, tokens: int):
    """(step function, its arguments, model FLOPs per step)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = tokens * TOP_K
    key = jax.random.key(0)
    kx, kg, kd, kr, ky = jax.random.split(key, 5)
    bf16 = jnp.bfloat16
    gu = (jax.random.normal(kg, (E, 2 * I, H), jnp.float32) * 0.02).astype(bf16)
    dn = (jax.random.normal(kd, (E, H, I), jnp.float32) * 0.02).astype(bf16)
    flops = 3 * 2 * rows * H * (2 * I + I)
    if system in ("moeforge", "moe_ffn"):
        import moeforge.jax as mfj
    if system == "moe_ffn":
        x = jax.random.normal(kx, (tokens, H), jnp.float32).astype(bf16)
        router = (jax.random.normal(kr, (E, H), jnp.float32) * 0.02).astype(bf16)
        dy = jax.random.normal(ky, (tokens, H), jnp.float32).astype(bf16)
        layer = lambda a, r, g, d: mfj.moe_ffn(a, r, g, d, top_k=TOP_K, norm_topk_prob=True)  # noqa: E731
        step = jax.jit(lambda a, r, g, d, c: forward_and_backward(layer, c, a, r, g, d))
        return step, (x, router, gu, dn, dy), flops + 3 * 2 * tokens * H * E
    gs = jnp.asarray(routing_sizes(tokens))
    assert int(np.sum(gs)) == rows
    x = jax.random.normal(kx, (rows, H), jnp.float32).astype(bf16)
    dy = jax.random.normal(ky, (rows, H), jnp.float32).astype(bf16)
    if system == "moeforge":
        mlp = lambda a, g, d: mfj.expert_mlp(a, g, d, gs)  # noqa: E731
        weights = (gu, dn)
    elif system == "ragged_dot":
        def mlp(a, g, d):  # g [E, H, 2I], d [E, I, H]
            h = jax.lax.ragged_dot(a, g, gs)
            act = (jax.nn.silu(h[:, :I].astype(jnp.float32)) * h[:, I:].astype(jnp.float32)).astype(a.dtype)
            return jax.lax.ragged_dot(act, d, gs)

        weights = (jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2))  # (outside the timed step)
    elif system == "pallas":
        pallas = pallas_expert_mlp()
        mlp = lambda a, g, d: pallas(a, g, d, gs)  # noqa: E731
        weights = (gu, dn)
    else:
        raise ValueError(f"unknown system {system!r} (expected one of {SYSTEMS})")
    step = jax.jit(lambda a, g, d, c: forward_and_backward(mlp, c, a, g, d))
    return step, (x, *weights, dy), flops


def measure(system: str, tokens: int, warmup: int, repeats: int, inner: int) -> dict:
    import jax

    record = dict(bench="J1", system=system, tokens=tokens, rows=tokens * TOP_K, E=E, top_k=TOP_K, H=H, I=I,
                  dtype="bfloat16", jax=jax.__version__)
    try:
        step, args, flops = build(system, tokens)
    except ImportError as e:
        return dict(record, status="unavailable", error=f"{type(e).__name__}: {e}")
    device = jax.devices()[0]
    record["device"] = device.device_kind
    args = jax.block_until_ready(jax.device_put(args, device))
    try:
        compiled = step.lower(*args).compile()
        analysis = compiled.memory_analysis()
        stats = device.memory_stats() or {}
        live_before, peak_before = stats.get("bytes_in_use", 0), stats.get("peak_bytes_in_use", 0)
        out = jax.block_until_ready(compiled(*args))
        stats = device.memory_stats() or {}
        peak = stats.get("peak_bytes_in_use", 0)
        result_bytes = sum(a.nbytes for a in jax.tree_util.tree_leaves(out))
        del out
        for _ in range(warmup):
            jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(inner):
                out = compiled(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / inner)
    except Exception as e:  # noqa: BLE001  (an OOM or a kernel that does not compile here is a result)
        text = f"{type(e).__name__}: {e}"
        oom = "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
        status = "oom" if oom else ("unavailable" if system == "pallas" else "error")
        return dict(record, status=status, error=text[:600])
    seconds = statistics.median(times)
    gib = lambda b: round(b / 2**30, 3)  # noqa: E731
    return dict(record, status="ok", ms=round(seconds * 1e3, 4), tflops=round(flops / seconds / 1e12, 2),
                model_flops=flops, peak_temp_gib=gib(peak - live_before - result_bytes),
                peak_set_by_first_call=peak > peak_before, result_gib=gib(result_bytes),
                xla_temp_gib=gib(analysis.temp_size_in_bytes) if analysis is not None else None,
                pallas_blocks=list(PALLAS_BLOCKS) if system == "pallas" else None)


def drive(args) -> int:
    """Every (system, tokens) in its own process; the JSON lines, then the ratios to moeforge."""
    results = []
    for tokens in args.tokens:
        for system in args.systems:
            cmd = [sys.executable, __file__, "--worker", "--systems", system, "--tokens", str(tokens),
                   "--warmup", str(args.warmup), "--repeats", str(args.repeats), "--inner", str(args.inner)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.worker_timeout)
            except subprocess.TimeoutExpired:
                rec = dict(bench="J1", system=system, tokens=tokens, status="error",
                           error=f"the worker did not finish in {args.worker_timeout} s (killed)")
                results.append(rec)
                print(json.dumps(rec), flush=True)
                continue
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            if proc.returncode != 0 or not lines:
                rec = dict(bench="J1", system=system, tokens=tokens, status="error",
                           error=(proc.stderr.strip().splitlines() or ["(no output)"])[-1][:600])
            else:
                rec = json.loads(lines[-1])
            results.append(rec)
            print(json.dumps(rec), flush=True)
    ratios = {}
    for tokens in args.tokens:
        by = {r["system"]: r for r in results if r["tokens"] == tokens and r.get("status") == "ok"}
        if "moeforge" in by:
            ratios[str(tokens)] = {f"moeforge/{s}": round(by["moeforge"]["tflops"] / r["tflops"], 2)
                                   for s, r in by.items() if s != "moeforge"}
    print(json.dumps(dict(bench="J1", summary="ratios of moeforge's TFLOP/s", ratios=ratios)), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,2048,8192", type=lambda s: [int(v) for v in s.split(",")])
    p.add_argument("--systems", default=",".join(SYSTEMS), type=lambda s: s.split(","))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--inner", type=int, default=5)
    p.add_argument("--worker-timeout", type=float, default=300.0,
                   help="seconds a (system, tokens) worker may run before it is killed and recorded as an error")
    p.add_argument("--worker", action="store_true", help="(internal) measure one system at one size here")
    args = p.parse_args()
    for s in args.systems:
        if s not in SYSTEMS:
            p.error(f"--systems: {s!r} is not one of {', '.join(SYSTEMS)}")
    if args.worker:
        print(json.dumps(measure(args.systems[0], args.tokens[0], args.warmup, args.repeats, args.inner)), flush=True)
        return 0
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())
