#!/usr/bin/env python3
"""Writes demo/data/chat.jsonl: short chat conversations a tiny model learns within ~100 steps.

Each line is {"messages": [...]} (system/user/assistant), the format moeforge's SFT reader takes
(data.format: messages or auto). The tasks are patterned so most of an answer follows from its
question: capitals of a fixed set of countries (memorised), small additions answered as
"a + b = c." (the operands are copied, the sum is learned), repeating a word three times (copying),
greetings in English, Kazakh, Russian, Arabic and Chinese (fixed replies), and counting on from a
number. Some conversations open with a system message and some have two turns, so the
assistant-only loss mask has several spans to find. Deterministic (seeded); re-run to regenerate:

    python3 scripts/make_demo_chat.py            # writes demo/data/chat.jsonl
"""
import argparse
import json
import os
import random

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Japan", "Tokyo"),
    ("China", "Beijing"), ("Kazakhstan", "Astana"), ("Russia", "Moscow"), ("Egypt", "Cairo"),
    ("Canada", "Ottawa"), ("Brazil", "Brasilia"), ("India", "New Delhi"), ("Kenya", "Nairobi"),
    ("Norway", "Oslo"), ("Peru", "Lima"), ("Greece", "Athens"),
]
WORDS = ["apple", "river", "stone", "cloud", "tiger", "green", "music", "paper", "light", "ocean", "bread", "chair",
         "dream", "house", "night", "smile"]
GREETINGS = [
    ("Hello!", "Hello! How can I help you today?"),
    ("Hi there.", "Hi! What would you like to know?"),
    ("Сәлем!", "Сәлем! Қалың қалай?"),
    ("Привет!", "Привет! Чем могу помочь?"),
    ("مرحبا!", "مرحبا! كيف يمكنني مساعدتك؟"),
    ("你好！", "你好！有什么可以帮你的吗？"),
]
SYSTEMS = ["You are a helpful assistant.", "Answer briefly.", "You are a friendly tutor."]


def capital(rng):
    country, city = rng.choice(CAPITALS)
    q = rng.choice(["What is the capital of {}?", "Name the capital of {}.", "Capital of {}?"]).format(country)
    return q, f"The capital of {country} is {city}."


def addition(rng):
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    q = rng.choice(["What is {} + {}?", "Add {} and {}.", "Compute {} + {}."]).format(a, b)
    return q, f"{a} + {b} = {a + b}."


def repeat(rng):
    w = rng.choice(WORDS)
    return f"Repeat the word {w} three times.", f"{w} {w} {w}"


def greeting(rng):
    return rng.choice(GREETINGS)


def count_on(rng):
    n = rng.randint(1, 15)
    return f"Count from {n} to {n + 4}.", ", ".join(str(k) for k in range(n, n + 5)) + "."


TASKS = [capital, addition, repeat, greeting, count_on]


def conversation(rng):
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": rng.choice(SYSTEMS)})
    for _ in range(2 if rng.random() < 0.25 else 1):
        q, a = rng.choice(TASKS)(rng)
        msgs.append({"role": "user", "content": q})
        msgs.append({"role": "assistant", "content": a})
    return {"messages": msgs}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "demo", "data",
                                                  "chat.jsonl"))
    ap.add_argument("--count", type=int, default=300)
    ap.add_argument("--seed", type=int, default=2024)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.count):
            f.write(json.dumps(conversation(rng), ensure_ascii=False) + "\n")
    print(f"wrote {args.count} conversations to {args.out}")


if __name__ == "__main__":
    main()
