#!/usr/bin/env python3
"""Per-step GPU timeline tables from bench/trace/gpu_trace.cpp's files.

Usage: summary.py TRACE_DIR [--steps N] [--top K]
A step starts at each embedding_forward kernel (the first kernel of Qwen3Moe::step); the last N
complete steps of every process (rank) are averaged. Per rank it prints: the step wall time, the
time any compute (non-NCCL) kernel runs, the time NCCL kernels run and the part of it no compute
kernel overlaps, the idle time (nothing at all on the GPU), and the K kernels (by name, shortened)
with the most time per step.
"""
import argparse
import collections
import glob
import os
import re


def union_length(intervals):
    total, end = 0, None
    start_cur = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start_cur
            start_cur, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start_cur
    return total


def subtract_length(a, b):
    """Length of union(a) minus its overlap with union(b)."""
    events = []
    for s, e in a:
        events += [(s, 0, 1), (e, 0, -1)]
    for s, e in b:
        events += [(s, 1, 1), (e, 1, -1)]
    events.sort()
    depth = [0, 0]
    last, total = None, 0
    for t, which, d in events:
        if last is not None and depth[0] > 0 and depth[1] == 0:
            total += t - last
        depth[which] += d
        last = t
    return total


def short(name):
    name = re.sub(r"<.*", "", name)
    name = re.sub(r"\(.*", "", name)
    return name[:70]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    for path in sorted(glob.glob(os.path.join(args.dir, "trace_*.tsv"))):
        recs = []
        with open(path) as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) < 6:
                    continue
                recs.append((parts[0], int(parts[1]), int(parts[2]), int(parts[4]), parts[5]))
        if not recs:
            continue
        recs.sort(key=lambda r: r[1])
        starts = [r[1] for r in recs if r[0] == "K" and "embedding_forward" in r[4]]
        if len(starts) < 2:
            print(f"{os.path.basename(path)}: fewer than 2 steps found")
            continue
        windows = list(zip(starts[:-1], starts[1:]))[-args.steps:]
        n = len(windows)
        wall = sum(b - a for a, b in windows) / n
        by_name = collections.Counter()
        compute_busy = nccl_busy = nccl_alone = any_busy = 0
        for a, b in windows:
            inside = [r for r in recs if r[1] >= a and r[1] < b]
            comp = [(r[1], min(r[2], b)) for r in inside if not (r[0] == "K" and "ncclDevKernel" in r[4])]
            nccl = [(r[1], min(r[2], b)) for r in inside if r[0] == "K" and "ncclDevKernel" in r[4]]
            compute_busy += union_length(comp)
            nccl_busy += union_length(nccl)
            nccl_alone += subtract_length(nccl, comp)
            any_busy += union_length(comp + nccl)
            for r in inside:
                by_name[short(r[4]) if r[0] == "K" else ("memcpy" if r[0] == "C" else "memset")] += r[2] - r[1]
        ms = lambda v: v / n / 1e6
        print(f"== {os.path.basename(path)}: {n} steps")
        print(f"step {wall / 1e6:8.2f} ms | compute kernels busy {ms(compute_busy):8.2f} | NCCL busy {ms(nccl_busy):7.2f}"
              f" (not overlapped by compute {ms(nccl_alone):6.2f}) | GPU idle {wall / 1e6 - ms(any_busy):6.2f}")
        for name, t in by_name.most_common(args.top):
            print(f"  {ms(t):8.3f} ms  {name}")


if __name__ == "__main__":
    main()
