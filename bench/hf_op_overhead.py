#!/usr/bin/env python3
"""The host time per call of moeforge.hf's ops in eager mode, for benchmark D1 (issue 23): at the start
of each step the GPU waits for the CPU, so every microsecond an op spends in Python there shows in the
step time. On tiny GPU tensors (kernels of a few microseconds, so that the loop is bound by the host),
the mean time per call over --calls calls, for RMSNorm (rows x 2048, bf16) each way:
  stock       transformers' Qwen3MoeRMSNorm forward (eager torch ops)
  custom_op   moeforge.hf.rms_norm (torch.library.custom_op with register_autograd), through the dispatcher
  eager_twin  moeforge.hf's eager call of it with the twins on (the same implementation under a plain
              torch.autograd.Function: no dispatcher round trip)
  native      ops.rmsnorm_forward alone (pybind11, the C API and the launch; forward only)
forward only, then forward + backward (y.sum().backward(), whose own cost every row shares).
Prints one JSON line per (way, pass). Usage (GPU machine): PYTHONPATH=build-gpu/python bench/hf_op_overhead.py
"""
import argparse
import json
import time

import torch

import moeforge.hf as mhf
from moeforge import ops


def per_call_us(fn, calls: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    C = 2048
    x = torch.randn(args.rows, C, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    norm = Qwen3MoeRMSNorm(C, eps=1e-6).to(device="cuda", dtype=torch.bfloat16)
    weight, eps = norm.weight, norm.variance_epsilon
    stock_forward = mhf._stock_norm_forwards.get(Qwen3MoeRMSNorm, Qwen3MoeRMSNorm.forward)
    out = torch.empty_like(x)
    rstd = torch.empty(args.rows, dtype=torch.float32, device="cuda")
    ways = {
        "stock": lambda: stock_forward(norm, x),
        "custom_op": lambda: mhf.rms_norm(x, weight, eps)[0],
        "eager_twin": lambda: mhf._call(mhf.rms_norm, x, weight, eps)[0],
    }
    native = lambda: ops.rmsnorm_forward(out, rstd, x.detach(), weight.detach(), eps=eps,  # noqa: E731
                                         ctx=mhf._context(x))
    for name, fn in ways.items():
        mhf.EAGER_FAST_PATH = name == "eager_twin"  # (_call takes the twin only with it on)
        fwd = per_call_us(fn, args.calls)
        both = per_call_us(lambda: fn().sum().backward(), args.calls // 4)
        print(json.dumps({"op": "rms_norm", "way": name, "rows": args.rows, "forward_us": round(fwd, 2),
                          "forward_backward_us": round(both, 2)}), flush=True)
    print(json.dumps({"op": "rms_norm", "way": "native", "rows": args.rows,
                      "forward_us": round(per_call_us(native, args.calls), 2)}), flush=True)
    if mhf.rms_norm not in mhf._eager:
        print(json.dumps({"note": "torch's CustomOpDef has no _init_fn here: eager_twin timed the op itself"}))


if __name__ == "__main__":
    main()
