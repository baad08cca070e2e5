"""A bare command line around the engine (no database, no resume): JSONL in, NeMo Gym JSONL out.

    python -m workers.engine --input tasks.jsonl --output out.jsonl --base-url http://127.0.0.1:8000 \\
        --model sim-model --num-repeats 2 --parallelism 64 --verifier math --max-output-tokens 256

Writes `out.jsonl` (successful rollouts), `out_failures.jsonl` (failed rows with `_failure_class` and
`_error`) and `out_aggregate_metrics.json`. The product's resumable, database-backed command is
`python manage.py collect_rollouts`; this one is for quick checks and benchmarks.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from .aggregate import AggregateAccumulator, TimingAccumulator
from workers.task_index import TaskIndexer

from .materialize import materialize_tasks
from .runner import run_collection
from .types import CollectionSpec, EndpointSpec
from .verify_pool import shutdown_verify_pool


class JsonlSink:
    def __init__(self, output: Path, show_progress: bool):
        self.out = output.open("w")
        self.fail = output.with_name(output.stem + "_failures" + output.suffix).open("w")
        self.agg = AggregateAccumulator()
        self.timing = TimingAccumulator()
        self.show = show_progress

    async def rollout(self, r):
        self.timing.add(r)
        if r.ok:
            self.agg.add(r.output_row)
            self.out.write(json.dumps(r.output_row) + "\n")
        else:
            row = dict(r.output_row, _failure_class=r.failure_class, _error=r.error)
            self.fail.write(json.dumps(row) + "\n")

    async def progress(self, t):
        if self.show:
            errs = " ".join(f"{k}={v}" for k, v in sorted(t.errors.items()))
            print(f"\r{t.elapsed_s:7.1f}s  ok {t.completed}  failed {t.failed}  in flight {t.in_flight}  "
                  f"{t.samples_per_s:7.1f}/s  {t.output_tokens_per_s:9.0f} tok/s  {errs}   ", end="", file=sys.stderr, flush=True)

    async def close(self):
        self.out.close()
        self.fail.close()


def _rows(path: Path, limit: int | None):
    """(task index, occurrence, row) per non-blank line, numbered as ng_collect_rollouts does."""
    indexer = TaskIndexer()
    with path.open() as f:
        n = 0
        for line in f:
            if not line.strip():
                continue
            if limit is not None and n >= limit:
                return
            n += 1
            row = json.loads(line)
            yield (*indexer.assign(row, line.rstrip("\r\n")), row)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--input", required=True, type=Path, help="NeMo Gym task JSONL")
    ap.add_argument("--output", required=True, type=Path, help="rollouts JSONL (failures and metrics go beside it)")
    ap.add_argument("--base-url", required=True, action="append", help="model server base URL (repeat for replicas)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--api-flavor", default="chat_completions", choices=["chat_completions", "completions", "responses"])
    ap.add_argument("--api-key")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--num-repeats", type=int, default=1)
    ap.add_argument("--parallelism", type=int, default=16, help="num_samples_in_parallel")
    ap.add_argument("--verifier", default="math")
    ap.add_argument("--verify-mode", default="inline", choices=["inline", "fast", "deferred"])
    ap.add_argument("--max-output-tokens", type=int)
    ap.add_argument("--temperature", type=float)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--no-stream", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--max-retries", type=int, default=5)
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    overrides = {k: v for k, v in (("max_output_tokens", args.max_output_tokens), ("temperature", args.temperature),
                                   ("top_p", args.top_p)) if v is not None}
    spec = CollectionSpec(
        endpoint=EndpointSpec(base_urls=args.base_url, model=args.model, api_flavor=args.api_flavor, api_key=args.api_key,
                              request_timeout_s=args.request_timeout, max_retries=args.max_retries),
        parallelism=args.parallelism, responses_create_params=overrides, verifier=args.verifier,
        verify_mode=args.verify_mode, stream=not args.no_stream,
    )
    sink = JsonlSink(args.output, not args.quiet)
    try:
        summary = asyncio.run(run_collection(spec, materialize_tasks(_rows(args.input, args.limit), args.num_repeats), sink))
    finally:
        shutdown_verify_pool()
    if not args.quiet:
        print(file=sys.stderr)
    metrics = sink.agg.result()
    metrics["timing"] = sink.timing.result()
    metrics_path = args.output.with_name(args.output.stem + "_aggregate_metrics.json")
    metrics_path.write_text(json.dumps(metrics, indent=2))
    print(f"{summary.completed} ok, {summary.failed} failed in {summary.elapsed_s:.1f}s -> {args.output}")
    if summary.fatal_error:
        print(f"error: {summary.fatal_error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
