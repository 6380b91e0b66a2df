#!/usr/bin/env python3
"""HF `tokenizers` encoding speed on the same documents as bench_tokenizer (one JSON line).

Builds the documents exactly as bench/bench_tokenizer.cpp does (same LCG, same seed text) and times
Tokenizer.encode on each, one thread (RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false), first
pass cold, then the median of --reps passes. Prints {"skipped": ...} where `tokenizers` is not installed.

  python3 bench/bench_tokenizer_hf.py [--tokenizer DIR] [--mb N] [--reps N] [--text FILE]
"""
import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MASK = (1 << 64) - 1


def make_documents(seed_text, target_bytes):
    """Keep in step with make_documents in bench_tokenizer.cpp."""
    lines = [line for line in seed_text.split("\n") if line]
    x = 0x9E3779B97F4A7C15

    def nxt():
        nonlocal x
        x = (x * 6364136223846793005 + 1442695040888963407) & MASK
        return x

    docs, total = [], 0
    while total < target_bytes:
        parts = []
        for _ in range(1 + (nxt() >> 33) % 6):
            parts.append(lines[(nxt() >> 33) % len(lines)] + " " + str((nxt() >> 40) % 100000) + "\n")
        doc = "".join(parts)
        total += len(doc.encode("utf-8"))
        docs.append(doc)
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", default=os.path.join(ROOT, "tests", "fixtures", "tokenizer"))
    ap.add_argument("--text", default=os.path.join(ROOT, "bench", "tokenizer_bench_text.txt"))
    ap.add_argument("--mb", type=float, default=8)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    try:
        from tokenizers import Tokenizer
    except ImportError:
        print(json.dumps({"bench": "tokenizer_encode", "impl": "hf_tokenizers", "skipped": "tokenizers not installed"}))
        return 0
    import tokenizers
    with open(args.text, encoding="utf-8", newline="") as f:
        docs = make_documents(f.read(), int(args.mb * 1e6))
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    path = args.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    tok = Tokenizer.from_file(path)
    seconds, tokens = [], 0
    for _ in range(args.reps + 1):
        t0 = time.perf_counter()
        n = 0
        for d in docs:
            n += len(tok.encode(d, add_special_tokens=False).ids)
        seconds.append(time.perf_counter() - t0)
        tokens = n
    median = statistics.median(seconds[1:])
    print(json.dumps({"bench": "tokenizer_encode", "impl": "hf_tokenizers", "version": tokenizers.__version__,
                      "tokenizer": args.tokenizer, "documents": len(docs), "bytes": nbytes, "tokens": tokens,
                      "reps": args.reps, "median_s": round(median, 4), "mb_per_s": round(nbytes / 1e6 / median, 2),
                      "cold_mb_per_s": round(nbytes / 1e6 / seconds[0], 2), "tokens_per_s": round(tokens / median),
                      "threads": 1}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
