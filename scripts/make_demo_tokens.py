#!/usr/bin/env python3
"""Writes demo/data/tokens.jsonl: token documents a tiny model learns within a minute on a CPU.

Most documents are walks through a fixed "grammar" (each of 300 word ids has three likely
successors, with probabilities 0.6 / 0.3 / 0.1), so the achievable loss is far below ln(vocab);
every fourth document is a copy task whose prompt is masked with -100 labels (loss only on the
copy). Ids stay below 2048, the tiny preset's vocabulary."""
import json
import random

rng = random.Random(1234)
WORDS = list(range(10, 310))
succ = {w: rng.sample(WORDS, 3) for w in WORDS}


def walk(n):
    w = rng.choice(WORDS)
    out = [w]
    for _ in range(n - 1):
        r = rng.random()
        w = succ[w][0 if r < 0.6 else 1 if r < 0.9 else 2]
        out.append(w)
    return out


docs = []
for i in range(600):
    if i % 4 == 3:
        prompt = walk(rng.randint(8, 24))
        ids = [1] + prompt + [2] + prompt + [3]
        labels = [-100] * (len(prompt) + 2) + prompt + [3]
        docs.append({"input_ids": ids, "labels": labels})
    else:
        docs.append({"input_ids": [1] + walk(rng.randint(24, 100)) + [3]})
with open("demo/data/tokens.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps(d, separators=(",", ":")) + "\n")
print(len(docs), "documents")
