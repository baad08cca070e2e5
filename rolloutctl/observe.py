"""A job's bottleneck diagnosis and parallelism sweeps, over the REST API.

    rolloutctl diagnose JOB_ID [--json]         verdict, evidence and what to change (the job page's panel)
    rolloutctl sweep --endpoint N (--dataset N | --job N) [--levels 1,4,16] [--max-parallelism 64]
                     [--sample-size 64] [--no-wait] [--json]
                                                a parallelism sweep: rollouts/s per level, the knee and the
                                                recommended parallelism (waits for it; Ctrl-C cancels it)
    rolloutctl sweep --show SWEEP_ID            one sweep's curve

Exit codes: 0 ok; 3 the sweep failed or was cancelled; 4 timed out waiting (the sweep keeps running).
"""
from __future__ import annotations

import json
import sys
import time

from . import EXIT_JOB, EXIT_OK, EXIT_TIMEOUT

COMMANDS = ("diagnose", "sweep")
SWEEP_ENDED = {"completed", "failed", "cancelled"}


def _levels(text: str) -> list[int]:
    import argparse

    try:
        levels = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("levels are integers >= 1")
    return levels


def add_parsers(sub, add_connection) -> None:
    p = sub.add_parser("diagnose", help="a job's bottleneck diagnosis: verdict, evidence and what to change")
    add_connection(p)
    p.add_argument("job", type=int)
    p.add_argument("--json", action="store_true", help="print the API's payload as JSON")

    p = sub.add_parser("sweep", help="run a parallelism sweep against an endpoint and print its curve")
    add_connection(p)
    p.add_argument("--endpoint", type=int, help="endpoint id")
    p.add_argument("--dataset", type=int, help="dataset id whose rows are sent")
    p.add_argument("--job", type=int, help="take the dataset (and its settings) from this job")
    p.add_argument("--levels", type=_levels, help="parallelism levels, e.g. 1,4,16,64 (default: doubling from "
                                                  "--start-parallelism up to --max-parallelism)")
    p.add_argument("--start-parallelism", type=int, default=1)
    p.add_argument("--max-parallelism", type=int, default=64)
    p.add_argument("--sample-size", type=int, default=64, help="rollouts per level")
    p.add_argument("--show", type=int, metavar="SWEEP_ID", help="print an existing sweep instead of starting one")
    p.add_argument("--no-wait", action="store_true", help="start it and return (prints its id)")
    p.add_argument("--timeout", type=float, default=None, help="give up waiting after this many seconds (exit 4)")
    p.add_argument("--poll-interval", type=float, default=2.0)
    p.add_argument("--json", action="store_true")


def _num(x, fmt="{:.2f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def print_diagnosis(payload: dict, out=sys.stdout) -> None:
    d = payload.get("diagnosis") or {}
    print(f"job {payload.get('job')} ({payload.get('state')}): {d.get('label') or d.get('verdict')}"
          f" (confidence {_num(d.get('confidence'))})", file=out)
    if d.get("summary"):
        print(d["summary"], file=out)
    held = [i for i in d.get("evidence_items") or [] if i.get("holds")]
    if held:
        print("evidence:", file=out)
        for i in held:
            print(f"  {i.get('name')} = {i.get('value')} ({i.get('meaning')})", file=out)
    for r in d.get("recommendations") or []:
        setting = f" [{r['setting']} = {r['value']}]" if r.get("setting") and r.get("value") is not None else ""
        print(f"-> {r.get('action')}{setting}: {r.get('why')}", file=out)
    for c in d.get("conditions") or []:
        print(f"[{c.get('name')}] {c.get('title')}: {c.get('evidence')}", file=out)
        for fix in c.get("fixes") or []:
            print(f"    fix: {fix}", file=out)


def print_sweep(s: dict, out=sys.stdout) -> None:
    print(f"sweep {s['id']} ({s['state']}): endpoint {s['endpoint']}, {s['sample_size']} rollouts per level", file=out)
    print(f"{'parallelism':>11} {'rollouts/s':>11} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}", file=out)
    for p in s.get("points") or []:
        print(f"{p.get('parallelism', '-'):>11} {_num(p.get('rollouts_per_s')):>11} {_num(p.get('p50_ms'), '{:.0f}'):>9} "
              f"{_num(p.get('p99_ms'), '{:.0f}'):>9} {_num(p.get('error_rate'), '{:.1%}'):>7}", file=out)
    if s.get("recommended") is not None:
        print(f"knee {s.get('knee')}, recommended num_samples_in_parallel = {s['recommended']} "
              f"(best {_num(s.get('best_rollouts_per_s'))} rollouts/s, {_num(s.get('speedup'))} x the first level)",
              file=out)
    for key in ("interpretation", "hint", "stopped_reason", "error"):
        if s.get(key):
            print(f"{key}: {s[key]}", file=out)


def run(client, args) -> int:
    if args.command == "diagnose":
        payload = client.get_json(f"jobs/{args.job}/diagnosis/")
        print(json.dumps(payload, indent=2)) if args.json else print_diagnosis(payload)
        return EXIT_OK
    if args.show is not None:
        sweep = client.get_json(f"sweeps/{args.show}/")
    else:
        if not args.endpoint or not (args.dataset or args.job):
            raise SystemExit("sweep needs --endpoint N and --dataset N or --job N (or --show SWEEP_ID)")
        body = {"endpoint": args.endpoint, "sample_size": args.sample_size,
                "start_parallelism": args.start_parallelism, "max_parallelism": args.max_parallelism,
                **({"levels": args.levels} if args.levels else {}),
                **({"dataset": args.dataset} if args.dataset else {}), **({"job": args.job} if args.job else {})}
        _, sweep = client.post_json("sweeps/", body)
        print(f"started sweep {sweep['id']}", file=sys.stderr, flush=True)
        if args.no_wait:
            print(sweep["id"])
            return EXIT_OK
        deadline = None if not args.timeout else time.monotonic() + args.timeout
        try:
            while sweep["state"] not in SWEEP_ENDED:
                if deadline is not None and time.monotonic() >= deadline:
                    print(f"timed out waiting for sweep {sweep['id']} ({len(sweep.get('points') or [])} levels done); "
                          "it keeps running", file=sys.stderr)
                    return EXIT_TIMEOUT
                time.sleep(args.poll_interval)
                sweep = client.get_json(f"sweeps/{sweep['id']}/")
        except KeyboardInterrupt:
            client.post_json(f"sweeps/{sweep['id']}/cancel/")
            print(f"sweep {sweep['id']} cancelled", file=sys.stderr)
            return 130
    print(json.dumps(sweep, indent=2)) if args.json else print_sweep(sweep)
    return EXIT_OK if sweep["state"] in ("completed", "running", "queued") else EXIT_JOB
