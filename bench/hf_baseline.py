#!/usr/bin/env python3
"""The HF Transformers v5 side of a BENCHMARKS.md workload: the config's model class (Qwen3-MoE for P1,
Nemotron-H for P4; its first --layers layers, a hybrid's layer pattern cut to them), random-initialised
in bf16 on the GPU, sdpa attention, the default experts implementation (grouped_mm), fused torch AdamW
on bf16 parameters, synthetic ids with labels = inputs, the same step as moeforge bench (forward,
backward, clip to norm 1.0, AdamW). --moeforge-hf: the same loop after `import moeforge.hf` (benchmark
D1: the model's experts on moeforge's kernels; --fused-loss adds the fused linear cross-entropy). Prints one
JSON line."""
import argparse
import json
import time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def idle_table(prof, top=30, min_us=5.0):
    """The profiled step's GPU idle time: the time from the step's start (the record_function
    "hf_baseline_step") to its first kernel, with the longest CPU ops that ran in it; then the gaps
    between one kernel's end and the next's start (over all streams), their sum, and the longest, each
    with the kernels around it and the CPU ops in progress when it ended (what the GPU waited for)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        prof.export_chrome_trace(tmp.name)
        with open(tmp.name) as f:
            events = json.load(f)["traceEvents"]
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
                     if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    ops = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events if e.get("cat") == "cpu_op"]
    gaps, end, prev = [], None, None
    for s, e, name in kernels:
        if end is not None and s - end > min_us:
            gaps.append((s - end, end, s, prev, name))
        if end is None or e > end:
            end, prev = e, name
    if not kernels:
        return "\nno kernels recorded\n"
    span = kernels[-1][1] - kernels[0][0]
    lines = []
    steps = [(e["ts"], e["ts"] + e.get("dur", 0), e["name"]) for e in events
             if e.get("name") == "hf_baseline_step" and e.get("cat") in ("user_annotation", "cpu_op")]
    if steps:
        t0, t1, first = steps[0][0], steps[0][1], kernels[0][0]
        lines.append(f"\nstep {(t1 - t0) / 1e3:.3f} ms (profiled); its first kernel starts {(first - t0) / 1e3:.3f} ms "
                     f"in, its last kernel ends {(t1 - kernels[-1][1]) / 1e3:.3f} ms before its end\n"
                     "  the longest CPU ops that started before the first kernel:\n")
        before = sorted((o for o in ops if t0 <= o[0] < first and o[2] != "hf_baseline_step"),
                        key=lambda o: o[0] - min(o[1], first))[:12]
        lines += [f"  {(min(e, first) - s) / 1e3:9.3f} ms  {name[:80]}\n" for s, e, name in before]
    lines.append(f"\nGPU idle (gaps > {min_us} us): {sum(g[0] for g in gaps) / 1e3:.3f} ms in {len(gaps)} gaps "
                 f"over a {span / 1e3:.3f} ms span of kernels\n")
    for gap, s, e, before, after in sorted(gaps, reverse=True)[:top]:
        busy = sorted((o for o in ops if o[0] <= e <= o[1]), key=lambda o: o[1] - o[0], reverse=True)
        lines.append(f"{gap:9.1f} us  after {before[:60]}\n            before {after[:60]}\n"
                     f"            cpu: {' > '.join(o[2][:40] for o in busy[:4])}\n")
    return "".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--moeforge-hf", action="store_true", help="import moeforge.hf before the model is made")
    ap.add_argument("--fused-loss", action="store_true", help="with --moeforge-hf: enable(model, fused_loss=True)")
    eager = ap.add_mutually_exclusive_group()
    eager.add_argument("--eager-twins", action="store_true",
                       help="with --moeforge-hf: eager op calls through the ops' twins (whatever the default)")
    eager.add_argument("--eager-dispatcher", action="store_true",
                       help="with --moeforge-hf: every eager op call through torch's dispatcher (no eager twins)")
    ap.add_argument("--profile", help="write a torch.profiler table of one more step (CUDA time per kernel) here")
    ap.add_argument("--flops-per-token", type=float, required=True, help="the same formula as moeforge (BENCHMARKS.md)")
    args = ap.parse_args()
    mhf = None
    if args.moeforge_hf:
        import moeforge.hf as mhf  # (the one line a user adds)
        if args.eager_twins or args.eager_dispatcher:  # (else moeforge.hf's default)
            mhf.EAGER_FAST_PATH = args.eager_twins

    with open(args.config) as f:
        cfg = json.load(f)
    cfg.pop("transformers_version", None)
    if "hybrid_override_pattern" in cfg:  # Nemotron-H: the plan's first N layers
        cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"][: args.layers]
        cfg.pop("num_hidden_layers", None)
    else:
        cfg["num_hidden_layers"] = args.layers
    config = AutoConfig.for_model(cfg.pop("model_type", "qwen3_moe"), **cfg)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config)
    torch.set_default_dtype(torch.float32)
    model.train()
    if args.fused_loss:
        if mhf is None:
            ap.error("--fused-loss needs --moeforge-hf")
        mhf.enable(model, fused_loss=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    step_model = torch.compile(model) if args.compile else model
    B, T = args.micro_batch, args.seq_len
    ids = torch.randint(0, config.vocab_size, (B, T), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times, loss = [], float("nan")

    def step():
        """One training step (forward, backward, clip, AdamW), finished on the GPU; returns the loss."""
        out = step_model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return out.loss

    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_loss = step()
        dt = time.perf_counter() - t0
        loss = float(step_loss.detach())
        if i >= args.warmup:
            times.append(dt)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile, record_function
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("hf_baseline_step"):
                step()
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=60, max_name_column_width=90))
            f.write(idle_table(prof))
    step_s = sum(times) / len(times)
    tps = B * T / step_s
    system = "hf_v5_moeforge_hf" if mhf is not None else "hf_v5"
    if args.fused_loss:
        system += "_fused_loss"
    if args.eager_twins or args.eager_dispatcher:
        system += "_twins" if args.eager_twins else "_dispatcher"
    if args.compile:
        system += "_compile"
    extra = {} if mhf is None else {"moeforge_hf_status": mhf.status(model)}
    print(json.dumps({
        "system": system,
        "transformers": transformers.__version__, "torch": torch.__version__,
        "layers": args.layers, "micro_batch": B, "seq_len": T,
        "step_ms": step_s * 1e3, "tokens_per_s_per_gpu": tps, "tflops_per_gpu": tps * args.flops_per_token / 1e12,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30, "last_loss": loss, **extra,
    }), flush=True)


if __name__ == "__main__":
    main()
