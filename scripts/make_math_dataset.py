#!/usr/bin/env python3
"""Deterministic generator of NeMo Gym-format integer arithmetic tasks the simulator can answer.

    python scripts/make_math_dataset.py --n 200 --seed 0 --out data/demo_math.jsonl

Each line:
    {"responses_create_params": {"input": [{"role": "user", "content":
        "What is 17 + 25? Put the final answer in \\boxed{}."}]},
     "question": "What is 17 + 25?", "expected_answer": "42"}

Questions follow the simulator's grammar ("What is A op B?", op in + - *), so it answers them with
`\\boxed{N}`, right with probability --math-accuracy. Same --n and --seed -> byte-identical file.
"""
from __future__ import annotations

import argparse
import json
import random
import sys

INSTRUCTION = "Put the final answer in \\boxed{}."


def make_rows(n: int, seed: int):
    rng = random.Random(seed)
    for _ in range(n):
        op = rng.choice("+-*")
        if op == "*":
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            ans = a * b
        else:
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            ans = a + b if op == "+" else a - b
        question = f"What is {a} {op} {b}?"
        yield {
            "responses_create_params": {"input": [{"role": "user", "content": f"{question} {INSTRUCTION}"}]},
            "question": question,
            "expected_answer": str(ans),
        }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=200, help="number of rows (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--out", default="-", help="output JSONL path, '-' for stdout (default: %(default)s)")
    args = p.parse_args(argv)
    if args.n < 0:
        p.error("--n must be >= 0")
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    try:
        for row in make_rows(args.n, args.seed):
            out.write(json.dumps(row) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
