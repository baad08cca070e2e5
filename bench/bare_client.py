"""The bare client: the yardstick for "the control plane adds no overhead".

A short asyncio + aiohttp loop that sends N chat completions at concurrency C to an OpenAI-compatible
server (vLLM, the simulator, anything), optionally scores each answer with the product's verifier
(`workers.verifiers.verify_row`) in a ProcessPoolExecutor, and reports requests/s and latency
percentiles. Nothing else: no retries, no database, no queue. Whatever the product measures on the same
server at the same concurrency, it can be compared with this.

    python -m bench.bare_client --url http://127.0.0.1:8011 --model tiny -n 500 -c 1,64 --verify
    python -m bench.bare_client --url ... --data data/demo_math.jsonl --limit 200 --json

From code (another benchmark):

    from bench.bare_client import run_bare, synthetic_rows
    result = await run_bare("http://127.0.0.1:8011", "tiny", synthetic_rows(100), concurrency=64,
                            max_tokens=32, verify=True)
    result["rps"], result["latency_ms"]["p99"]
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import random
import sys
import time
from collections import Counter
from typing import Any, Iterable

import aiohttp

# ---------------------------------------------------------------------------------------------- rows


def load_rows(path: str, limit: int | None = None) -> list[dict]:
    """Rows of a NeMo Gym JSONL task file (each has `responses_create_params`)."""
    rows: list[dict] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e}") from None
            if "responses_create_params" not in row:
                raise ValueError(f"{path}:{lineno}: no responses_create_params (not a NeMo Gym row)")
            rows.append(row)
            if limit and len(rows) >= limit:
                break
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def synthetic_rows(n: int = 256, seed: int = 0) -> list[dict]:
    """Math rows in NeMo Gym shape with a known answer, for when no data file is given."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randint(1, 999), rng.randint(1, 999)
        q = f"What is {a} + {b}?"
        rows.append({
            "responses_create_params": {"input": [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}]},
            "question": q,
            "expected_answer": str(a + b),
            "_ng_task_index": i,
        })
    return rows


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # Responses / chat content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return str(content)


def row_to_messages(row: dict) -> list[dict]:
    """Responses-API `input` (string or message list) -> chat messages."""
    inp = row.get("responses_create_params", {}).get("input", "")
    if isinstance(inp, str):
        return [{"role": "user", "content": inp}]
    messages = []
    for m in inp:
        role = m.get("role", "user")
        messages.append({"role": "system" if role == "developer" else role, "content": _content_text(m.get("content", ""))})
    return messages


# ------------------------------------------------------------------------------------------- verify


def _warm_verifier(name: str) -> int:
    """Import the verifier (math-verify, sympy) in a pool worker before the clock starts."""
    from workers.verifiers import verify_row

    verify_row(name, {"expected_answer": "2"}, "\\boxed{2}")
    return os.getpid()


def _verify(name: str, row: dict, text: str) -> float:
    from workers.verifiers import verify_row

    return float(verify_row(name, row, text).reward)


def make_verify_pool(workers: int | None = None, verifier: str = "math") -> concurrent.futures.ProcessPoolExecutor:
    """A warmed process pool (spawned, so it is safe next to a running event loop)."""
    workers = workers or max(1, min(4, os.cpu_count() or 1))
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(_warm_verifier, [verifier] * workers))
    return pool


# ------------------------------------------------------------------------------------------- stats


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of an already sorted list."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


# ---------------------------------------------------------------------------------------------- run


async def run_bare(
    base_url: str,
    model: str,
    rows: list[dict],
    concurrency: int,
    max_tokens: int = 32,
    verify: bool = False,
    *,
    n: int | None = None,
    timeout: float = 120.0,
    verifier: str = "math",
    verify_pool: concurrent.futures.Executor | None = None,
    temperature: float | None = None,
    extra_body: dict | None = None,
) -> dict:
    """Send `n` chat completions (default: one per row, rows cycled if n is larger) with at most
    `concurrency` in flight; return counts, requests/s and latency percentiles (ms).

    Latency is per HTTP request (send to full body). Wall time includes verification, which runs in
    `verify_pool` (a warmed ProcessPoolExecutor made here if not given) while other requests fly.
    """
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    if not rows:
        raise ValueError("no rows")
    total = n if n is not None else len(rows)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    bodies = []
    for row in rows:
        body: dict[str, Any] = {"model": model, "messages": row_to_messages(row), "max_tokens": max_tokens}
        if temperature is not None:
            body["temperature"] = temperature
        if extra_body:
            body.update(extra_body)
        bodies.append(json.dumps(body).encode())

    own_pool = None
    if verify and verify_pool is None:
        own_pool = verify_pool = make_verify_pool(verifier=verifier)

    latencies: list[float] = []
    errors: Counter[str] = Counter()
    rewards: list[float] = []
    tokens = {"prompt": 0, "completion": 0}
    next_i = 0
    loop = asyncio.get_running_loop()
    req_timeout = aiohttp.ClientTimeout(total=timeout)
    headers = {"Content-Type": "application/json"}

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        row = rows[i % len(rows)]
        t0 = time.perf_counter()
        try:
            async with session.post(url, data=bodies[i % len(rows)], headers=headers, timeout=req_timeout) as resp:
                raw = await resp.read()
                status = resp.status
        except asyncio.TimeoutError:
            errors["timeout"] += 1
            return
        except aiohttp.ClientError as e:
            errors[type(e).__name__] += 1
            return
        latencies.append(time.perf_counter() - t0)
        if status != 200:
            errors[f"http_{status}"] += 1
            latencies.pop()
            return
        try:
            data = json.loads(raw)
            text = data["choices"][0]["message"].get("content") or ""
            usage = data.get("usage") or {}
        except (ValueError, KeyError, IndexError, TypeError):
            errors["bad_response"] += 1
            latencies.pop()
            return
        tokens["prompt"] += usage.get("prompt_tokens", 0) or 0
        tokens["completion"] += usage.get("completion_tokens", 0) or 0
        if verify:
            try:
                rewards.append(await loop.run_in_executor(verify_pool, _verify, verifier, row, text))
            except Exception as e:  # noqa: BLE001  (a verifier error is counted, the run goes on)
                errors[f"verifier_{type(e).__name__}"] += 1

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < total:
            i = next_i
            next_i += 1
            await one(session, i)

    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency, force_close=False)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            t_start = time.perf_counter()
            await asyncio.gather(*(worker(session) for _ in range(min(concurrency, total))))
            wall = time.perf_counter() - t_start
    finally:
        if own_pool is not None:
            own_pool.shutdown(wait=True, cancel_futures=True)

    lat = sorted(latencies)
    ok = len(lat)
    result: dict[str, Any] = {
        "url": base_url,
        "model": model,
        "n": total,
        "concurrency": concurrency,
        "max_tokens": max_tokens,
        "ok": ok,
        "errors": dict(errors),
        "wall_s": wall,
        "rps": ok / wall if wall > 0 else 0.0,
        "prompt_tokens": tokens["prompt"],
        "completion_tokens": tokens["completion"],
        "output_tok_s": tokens["completion"] / wall if wall > 0 else 0.0,
        "latency_ms": {
            "p50": percentile(lat, 50) * 1000,
            "p90": percentile(lat, 90) * 1000,
            "p99": percentile(lat, 99) * 1000,
            "mean": (sum(lat) / ok * 1000) if ok else float("nan"),
            "max": (lat[-1] * 1000) if ok else float("nan"),
        },
        "verify": verify,
    }
    if verify:
        result["mean_reward"] = (sum(rewards) / len(rewards)) if rewards else float("nan")
        result["verified"] = len(rewards)
    return result


# --------------------------------------------------------------------------------------------- table


def format_table(results: Iterable[dict], label_key: str | None = None) -> str:
    """A plain-text table, one line per result."""
    results = list(results)
    head = ["conc", "n", "ok", "err", "req/s", "tok/s", "p50 ms", "p90 ms", "p99 ms"]
    if label_key:
        head.insert(0, label_key)
    if any(r.get("verify") for r in results):
        head.append("reward")
    lines = []
    for r in results:
        lm = r["latency_ms"]
        cells = [str(r["concurrency"]), str(r["n"]), str(r["ok"]), str(sum(r["errors"].values())),
                 f"{r['rps']:.1f}", f"{r['output_tok_s']:.0f}", f"{lm['p50']:.1f}", f"{lm['p90']:.1f}", f"{lm['p99']:.1f}"]
        if label_key:
            cells.insert(0, str(r.get(label_key, "")))
        if "reward" in head:
            cells.append(f"{r['mean_reward']:.3f}" if r.get("verify") else "-")
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    out = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(c) for c in lines]
    errs = [(r["concurrency"], r["errors"]) for r in results if r["errors"]]
    for conc, e in errs:
        out.append(f"errors at concurrency {conc}: {e}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------- CLI


def _parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of integers: {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError("concurrency values must be integers >= 1")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.bare_client",
        description="Send N chat completions at concurrency C to an OpenAI-compatible server and report "
        "requests/s and latency percentiles (p50/p90/p99). The baseline the control plane is compared with.",
    )
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8011 (/v1/chat/completions is appended)")
    p.add_argument("--model", default="tiny", help="model name sent in each request (default: tiny)")
    p.add_argument("-n", "--requests", type=int, default=None,
                   help="requests per concurrency level (default: one per row; rows are cycled if larger)")
    p.add_argument("-c", "--concurrency", type=_parse_concurrency, default=[16],
                   help="requests in flight, or a comma-separated list to run several levels, e.g. 1,64,512 (default 16)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens per request (default 32)")
    p.add_argument("--temperature", type=float, default=None, help="temperature (default: the server's)")
    p.add_argument("--data", default=None, help="NeMo Gym JSONL task file (default: synthetic math prompts)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N rows of --data")
    p.add_argument("--synthetic", type=int, default=256, help="number of synthetic rows when no --data (default 256)")
    p.add_argument("--verify", action="store_true", help="score each answer with workers.verifiers (math) in a process pool")
    p.add_argument("--verifier", default="math", help="verifier name for --verify (default: math)")
    p.add_argument("--verify-workers", type=int, default=None, help="process-pool size for --verify (default: min(4, CPUs))")
    p.add_argument("--timeout", type=float, default=120.0, help="timeout per request in seconds (default 120)")
    p.add_argument("--extra-body", default=None, help='JSON merged into each request body, e.g. \'{"ignore_eos": true}\'')
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    args = p.parse_args(argv)

    if args.requests is not None and args.requests < 1:
        p.error("--requests must be >= 1")
    if args.max_tokens < 1:
        p.error("--max-tokens must be >= 1")
    if args.timeout <= 0:
        p.error("--timeout must be > 0")
    try:
        extra = json.loads(args.extra_body) if args.extra_body else None
    except json.JSONDecodeError as e:
        p.error(f"--extra-body is not JSON: {e}")
    try:
        rows = load_rows(args.data, args.limit) if args.data else synthetic_rows(args.synthetic)
    except (OSError, ValueError) as e:
        p.error(str(e))

    async def go() -> list[dict]:
        pool = make_verify_pool(args.verify_workers, args.verifier) if args.verify else None
        try:
            out = []
            for c in args.concurrency:
                out.append(await run_bare(args.url, args.model, rows, c, args.max_tokens, args.verify, n=args.requests,
                                          timeout=args.timeout, verifier=args.verifier, verify_pool=pool,
                                          temperature=args.temperature, extra_body=extra))
            return out
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)

    results = asyncio.run(go())
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"bare client -> {args.url}  model={args.model}  max_tokens={args.max_tokens}  "
              f"rows={len(rows)} ({args.data or 'synthetic'})")
        print(format_table(results))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
