"""Model-server operations ("ops") and weight versions, over the REST API.

    rolloutctl endpoint-op ENDPOINT_ID health|prewarm|reset_prefix_cache|pause|resume|sleep|wake_up
                           [--mode keep|wait|abort] [--level 1|2] [--count N]
    rolloutctl update-weights ENDPOINT_ID (--path DIR | --checkpoint-id ID) [--weight-version N]
    rolloutctl ops-stats ENDPOINT_ID              p50/p95/p99 of queue/rpc/wall per operation kind
    rolloutctl weight-versions JOB_ID             rollouts per weight version and their lag

Operations run in a worker: the POST asks the API to answer when the action ends (`?wait=`, up to 60 s at a
time); an action still unfinished then is polled (every --poll-interval seconds, for at most --wait seconds)
until it has finished; its report, with its trace id (--trace-id: yours, sent on to the model servers), is
printed as JSON. An operation that failed on a replica exits 5; one still unfinished after
--wait exits 4 (it keeps running; `rolloutctl` prints its URL).

`admin-stats`, the old name of `ops-stats`, still works (hidden from --help; a deprecation note on stderr).
"""
from __future__ import annotations

import json
import sys
import time

from . import EXIT_API, EXIT_OK, EXIT_TIMEOUT

COMMANDS = ("endpoint-op", "update-weights", "ops-stats", "weight-versions", "admin-stats")
HIDDEN = {"admin-stats": "ops-stats"}  # deprecated name -> its successor; parsed, not listed in --help
OPS = ("health", "prewarm", "reset_prefix_cache", "pause", "resume", "sleep", "wake_up")


def add_parsers(sub, add_connection) -> None:
    p = sub.add_parser("endpoint-op", help="run an operation on every replica of an endpoint")
    add_connection(p)
    p.add_argument("endpoint", type=int)
    p.add_argument("operation", choices=OPS)
    p.add_argument("--mode", choices=["keep", "wait", "abort"], help="pause mode (default keep)")
    p.add_argument("--level", type=int, choices=[1, 2], help="sleep level (default 1)")
    p.add_argument("--count", type=int, help="pre-warm: how many tiny requests")
    _add_wait(p)

    p = sub.add_parser("update-weights", help="pause(keep) -> update -> resume on every replica of an endpoint")
    add_connection(p)
    p.add_argument("endpoint", type=int)
    p.add_argument("--path", default="", help="directory of the new weights, as the model server sees it")
    p.add_argument("--checkpoint-id", default="")
    p.add_argument("--weight-version", dest="weight_version", type=int, help="version to tag rollouts with (default last + 1)")
    p.add_argument("--pause-mode", choices=["keep", "wait", "abort"], default="keep")
    _add_wait(p)

    for name in ("ops-stats", *HIDDEN):
        kw = {"help": "timings of an endpoint's operations (p50/p95/p99)"} if name not in HIDDEN else {}
        p = sub.add_parser(name, **kw)
        add_connection(p)
        p.add_argument("endpoint", type=int)

    p = sub.add_parser("weight-versions", help="a job's rollouts per weight version and their version lag")
    add_connection(p)
    p.add_argument("job", type=int)


def hide_deprecated(sub, parser):
    """Leave the deprecated names (HIDDEN: still parsed) out of the subcommand list in usage and --help."""
    sub.metavar = "{" + ",".join(c for c in sub.choices if c not in HIDDEN) + "}"
    return parser


def _add_wait(p) -> None:
    p.add_argument("--wait", type=float, default=900.0, help="seconds to wait for the action to finish (default 900)")
    p.add_argument("--poll-interval", type=float, default=0.5, help="seconds between polls (default 0.5)")
    p.add_argument("--trace-id", default=None, help="your trace id (8-64 hex digits or dashes): kept on the action, "
                                                    "sent to the model servers in X-Trace-Id and logged")


FINISHED = ("succeeded", "failed")


def wait_for_action(client, action: dict, *, wait_s: float, poll_s: float) -> dict:
    """Poll a queued ops action until it has finished or `wait_s` has passed; returns its latest state."""
    deadline = time.monotonic() + wait_s
    while action.get("state") not in FINISHED and time.monotonic() < deadline:
        time.sleep(max(0.05, min(poll_s, deadline - time.monotonic())))
        action = client.get_json(action["url"])
    return action


def _finish(client, args, action: dict) -> int:
    action = wait_for_action(client, action, wait_s=args.wait, poll_s=args.poll_interval)
    if action.get("state") not in FINISHED:
        _print(action)
        print(f"rolloutctl: the action is still {action.get('state')} after {args.wait:g} s; follow it at "
              f"{action['url']}", file=sys.stderr)
        return EXIT_TIMEOUT
    _print(action["result"] if action.get("result") is not None else action)
    if action.get("error"):
        print(f"rolloutctl: {action['error']}", file=sys.stderr)
    return EXIT_OK if action["state"] == "succeeded" else EXIT_API


SERVER_WAIT_MAX_S = 60.0


def _post_action(client, args, path: str, body: dict) -> dict:
    """POST the action and let the API hold the answer until it ends (?wait=), at most --wait seconds."""
    wait = max(0.0, min(float(args.wait), SERVER_WAIT_MAX_S))
    headers = {"X-Trace-Id": args.trace_id} if getattr(args, "trace_id", None) else {}
    query = f"?wait={wait:g}" if wait > 0 else ""
    old_timeout = client.timeout
    connect_s, read_s = old_timeout if isinstance(old_timeout, tuple) else (old_timeout, old_timeout)
    client.timeout = (connect_s, max(float(read_s or 0), wait + 30.0))  # the server holds the answer this long
    try:
        resp = client.request("POST", f"{path}{query}", json=body, retry=False, expect=(200, 202), headers=headers)
    finally:
        client.timeout = old_timeout
    return resp.json()


def _print(obj) -> None:
    print(json.dumps(obj, indent=1), flush=True)


def run(client, args) -> int:
    if args.command == "endpoint-op":
        body = {k: v for k, v in (("mode", args.mode), ("level", args.level), ("count", args.count)) if v is not None}
        return _finish(client, args, _post_action(client, args, f"endpoints/{args.endpoint}/ops/{args.operation}/",
                                                  body))
    if args.command == "update-weights":
        if not args.path and not args.checkpoint_id:
            print("rolloutctl: update-weights needs --path or --checkpoint-id", file=sys.stderr)
            return 2
        body = {"pause_mode": args.pause_mode, **({"path": args.path} if args.path else {}),
                **({"checkpoint_id": args.checkpoint_id} if args.checkpoint_id else {})}
        if args.weight_version is not None:
            body["version"] = args.weight_version
        return _finish(client, args, _post_action(client, args, f"endpoints/{args.endpoint}/weights/", body))
    if args.command in HIDDEN:
        print(f"rolloutctl: '{args.command}' is deprecated; use '{HIDDEN[args.command]}'", file=sys.stderr)
    if args.command in ("ops-stats", *HIDDEN):
        _print(client.get_json(f"endpoints/{args.endpoint}/ops/stats/"))
        return EXIT_OK
    if args.command == "weight-versions":
        _print(client.get_json(f"jobs/{args.job}/weight-versions/"))
        return EXIT_OK
    raise ValueError(args.command)
