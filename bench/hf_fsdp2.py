#!/usr/bin/env python3
"""The HF Transformers v5 + FSDP2 side of BENCHMARKS.md workload P2 (run under
`torchrun --nproc-per-node N`): Qwen3MoeForCausalLM from the config, random-initialised in bf16
on each rank's GPU (same seed on every rank, so the replicas agree before sharding), sdpa
attention, the default experts implementation (grouped_mm), FSDP2 `fully_shard` on each decoder
layer and then the root model (NCCL, device = LOCAL_RANK), torch AdamW on the bf16 DTensor
parameters (fused if this PyTorch accepts DTensors there, else foreach; the JSON says which),
clip to norm 1.0, synthetic ids with labels = inputs, each rank its own rows (seeded by rank).
Rank 0 prints one JSON line on stdout; everything else goes to stderr.
tokens_per_s_per_gpu counts the tokens of one rank per step; step time is the mean over the timed
steps (max over ranks); peak_gib is the max over ranks of torch.cuda.max_memory_allocated."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def log(rank, *msg):
    print(f"[rank {rank}]", *msg, file=sys.stderr, flush=True)


def formula_flops_per_token(cfg, layers, seq_len):
    """BENCHMARKS.md: 6 x matmul parameters touched per token + 3 x causal attention forward."""
    h, heads, kv, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    experts = cfg["num_experts_per_tok"] * 3 * h * cfg["moe_intermediate_size"]
    router = h * cfg["num_experts"]
    lm_head = h * cfg["vocab_size"]
    matmul = layers * (attn + experts + router) + lm_head
    return 6.0 * matmul + 3.0 * layers * 4 * seq_len * heads * hd / 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--flops-per-token", type=float, default=None,
                    help="the same formula as moeforge (BENCHMARKS.md); computed from the config when left out")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")

    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()

    with open(args.config) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = args.layers
    cfg.pop("transformers_version", None)
    flops_per_token = args.flops_per_token
    if flops_per_token is None:
        flops_per_token = formula_flops_per_token(cfg, args.layers, args.seq_len)
    config = Qwen3MoeConfig(**cfg)
    config._attn_implementation = "sdpa"

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with device:
        model = Qwen3MoeForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    torch.cuda.empty_cache()
    log(rank, f"sharded over {world} ranks; experts_implementation="
              f"{getattr(config, '_experts_implementation', getattr(config, 'experts_implementation', '?'))}")

    def make_opt(fused):
        kw = {"fused": True} if fused else {"foreach": True}
        return torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, **kw)

    try:
        opt, optimizer = make_opt(True), "adamw_fused"
    except (RuntimeError, TypeError, ValueError) as e:
        log(rank, f"fused AdamW refused on DTensor params ({e}); using foreach")
        opt, optimizer = make_opt(False), "adamw_foreach"

    B, T = args.micro_batch, args.seq_len
    gen = torch.Generator(device=device)
    gen.manual_seed(1000 + rank)
    ids = torch.randint(0, config.vocab_size, (B, T), device=device, generator=gen)

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times, loss_t = [], None
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        try:
            opt.step()
        except RuntimeError as e:
            if optimizer != "adamw_fused" or i != 0:
                raise
            # Fused AdamW may accept DTensors at construction but fail at the first step; the first
            # step is a warm-up step (or the only one, in which case the run is redone below).
            log(rank, f"fused AdamW failed on DTensor params ({e}); using foreach")
            opt, optimizer = make_opt(False), "adamw_foreach"
            opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        loss_t = out.loss.detach().float()
        log(rank, f"step {i}: {dt * 1e3:.1f} ms, loss {float(loss_t):.4f}")
        if i >= args.warmup:
            times.append(dt)
    if optimizer == "adamw_foreach" and args.warmup == 0:
        log(rank, "note: the first timed step included the fused->foreach switch")

    step_s = sum(times) / len(times)
    stats = torch.tensor([step_s, torch.cuda.max_memory_allocated() / 2**30], dtype=torch.float64, device=device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    dist.all_reduce(loss_t, op=dist.ReduceOp.AVG)
    step_s, peak_gib = float(stats[0]), float(stats[1])
    tps = B * T / step_s
    if rank == 0:
        print(json.dumps({
            "system": "hf_v5_fsdp2",
            "transformers": transformers.__version__, "torch": torch.__version__,
            "world_size": world, "layers": args.layers, "micro_batch": B, "seq_len": T,
            "optimizer": optimizer, "flops_per_token": flops_per_token,
            "flops_per_token_given": args.flops_per_token is not None,
            "step_ms": step_s * 1e3, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": tps * flops_per_token / 1e12,
            "peak_gib": peak_gib, "last_loss": float(loss_t),
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
