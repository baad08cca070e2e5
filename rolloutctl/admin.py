"""Admin operations on model servers and weight versions, over the REST API.

    rolloutctl endpoint-op ENDPOINT_ID health|prewarm|reset_prefix_cache|pause|resume|sleep|wake_up
                           [--mode keep|wait|abort] [--level 1|2] [--count N]
    rolloutctl update-weights ENDPOINT_ID (--path DIR | --checkpoint-id ID) [--weight-version N]
    rolloutctl admin-stats ENDPOINT_ID            p50/p95/p99 of queue/rpc/wall per operation kind
    rolloutctl weight-versions JOB_ID             rollouts per weight version and their lag

An operation that failed on a replica exits 5 (the report, with its trace id, is printed as JSON).
"""
from __future__ import annotations

import json
import sys

from . import EXIT_API, EXIT_OK

COMMANDS = ("endpoint-op", "update-weights", "admin-stats", "weight-versions")
OPS = ("health", "prewarm", "reset_prefix_cache", "pause", "resume", "sleep", "wake_up")


def add_parsers(sub, add_connection) -> None:
    p = sub.add_parser("endpoint-op", help="run an admin operation on every replica of an endpoint")
    add_connection(p)
    p.add_argument("endpoint", type=int)
    p.add_argument("operation", choices=OPS)
    p.add_argument("--mode", choices=["keep", "wait", "abort"], help="pause mode (default keep)")
    p.add_argument("--level", type=int, choices=[1, 2], help="sleep level (default 1)")
    p.add_argument("--count", type=int, help="pre-warm: how many tiny requests")

    p = sub.add_parser("update-weights", help="pause(keep) -> update -> resume on every replica of an endpoint")
    add_connection(p)
    p.add_argument("endpoint", type=int)
    p.add_argument("--path", default="", help="directory of the new weights, as the model server sees it")
    p.add_argument("--checkpoint-id", default="")
    p.add_argument("--weight-version", dest="weight_version", type=int, help="version to tag rollouts with (default last + 1)")
    p.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep")

    p = sub.add_parser("admin-stats", help="timings of an endpoint's admin operations (p50/p95/p99)")
    add_connection(p)
    p.add_argument("endpoint", type=int)

    p = sub.add_parser("weight-versions", help="a job's rollouts per weight version and their version lag")
    add_connection(p)
    p.add_argument("job", type=int)


def _print(obj) -> None:
    print(json.dumps(obj, indent=1), flush=True)


def run(client, args) -> int:
    if args.command == "endpoint-op":
        body = {k: v for k, v in (("mode", args.mode), ("level", args.level), ("count", args.count)) if v is not None}
        _, out = client.post_json(f"endpoints/{args.endpoint}/admin/{args.operation}/", body)
        _print(out)
        return EXIT_OK if out.get("ok") else EXIT_API
    if args.command == "update-weights":
        if not args.path and not args.checkpoint_id:
            print("rolloutctl: update-weights needs --path or --checkpoint-id", file=sys.stderr)
            return 2
        body = {"path": args.path, "checkpoint_id": args.checkpoint_id, "pause_mode": args.pause_mode}
        if args.weight_version is not None:
            body["version"] = args.weight_version
        resp = client.request("POST", f"endpoints/{args.endpoint}/weights/", json=body, retry=False, expect=(200, 502))
        out = resp.json()
        _print(out)
        return EXIT_OK if resp.status_code == 200 else EXIT_API
    if args.command == "admin-stats":
        _print(client.get_json(f"endpoints/{args.endpoint}/admin/stats/"))
        return EXIT_OK
    if args.command == "weight-versions":
        _print(client.get_json(f"jobs/{args.job}/weight-versions/"))
        return EXIT_OK
    raise ValueError(args.command)
