"""Open-ended collection from the command line: a job that keeps collecting, pass after pass over its dataset,
never more than a buffer ahead of what a trainer's stream consumer acknowledged, until it is stopped.

    rolloutctl submit --dataset tasks.jsonl --endpoint N --num-repeats 4 \\
        --open-ended --buffer 512 [--shuffle --seed 7] --consumer grpo       # prints the job id
    # the trainer takes from the job with rolloutctl.stream.RolloutStream(url, token, JOB, "grpo")
    rolloutctl stop JOB      # the chunks in flight finish, no more start, then the job completes

`stop` is not `cancel` (POST /api/jobs/<id>/cancel/, which stops the chunks at once): every rollout stored
stays in the stream, and the trainer drains them (RolloutStream.batches() ends when the job has completed).
"""

from __future__ import annotations

import sys

from . import EXIT_OK

COMMANDS = ("stop",)


def add_submit_args(p) -> None:
    g = p.add_argument_group(
        "open-ended collection (submit only)",
        "keep collecting, pass after pass, until `rolloutctl stop JOB`, holding at most --buffer rollouts ahead "
        "of what the trainer's stream consumer (--consumer) has acknowledged (rolloutctl.stream.RolloutStream)",
    )
    g.add_argument("--open-ended", action="store_true", help="an open-ended job (needs --buffer)")
    g.add_argument(
        "--buffer",
        type=int,
        metavar="N",
        help="at most N rollouts stored ahead of the consumer's acknowledgements (plus one chunk in "
        "flight: never more than N + chunk rows x num_repeats - 1)",
    )
    g.add_argument("--shuffle", action="store_true", help="each pass over the dataset in its own shuffled order")
    g.add_argument("--seed", type=int, metavar="S", help="the shuffles' seed (default 0; needs --shuffle)")
    g.add_argument(
        "--consumer",
        metavar="NAME",
        help="the trainer's stream consumer whose acknowledgements free the buffer (default: trainer)",
    )


def job_option(args) -> dict | None:
    """The job's `open_ended` option from the command's arguments; None when not asked for. SystemExit (a usage
    error) for options that do not fit together."""
    given = [f"--{n.replace('_', '-')}" for n in ("buffer", "seed", "consumer") if getattr(args, n, None) is not None]
    given += ["--shuffle"] if getattr(args, "shuffle", False) else []
    if not getattr(args, "open_ended", False):
        if given:
            raise SystemExit(f"{', '.join(given)}: only with --open-ended")
        return None
    if args.command != "submit":
        raise SystemExit(
            "an open-ended job runs until it is stopped: submit it with `rolloutctl submit "
            "--open-ended ...`, then `rolloutctl stop JOB` (run would wait for its end)"
        )
    if args.buffer is None:
        raise SystemExit("--open-ended needs --buffer N (rollouts stored ahead of the trainer)")
    if args.seed is not None and not args.shuffle:
        raise SystemExit("--seed needs --shuffle")
    out = {"buffer": args.buffer, "shuffle": bool(args.shuffle)}
    if args.seed is not None:
        out["seed"] = args.seed
    if args.consumer is not None:
        out["consumer"] = args.consumer
    return out


def add_parsers(sub, add_connection) -> None:
    p = sub.add_parser(
        "stop",
        help="stop an open-ended job: the chunks in flight finish, no more start, then it completes",
        description="Stop an open-ended job (POST /api/jobs/<id>/stop/): the chunks in flight finish, no more "
        "start, then the job completes; every stored rollout stays in the stream for the trainer to "
        "drain. (`cancel` in the API stops the chunks at once.) Prints the job's state.",
    )
    add_connection(p)
    p.add_argument("job", type=int)


def run(client, args) -> int:
    _, job = client.post_json(f"jobs/{args.job}/stop/")
    oe = job.get("open_ended") or {}
    figures = f", {oe['stored']} rollouts stored, {oe['unconsumed']} not yet consumed" if "stored" in oe else ""
    print(
        f"job {job['id']}: {job['state']}{' (stopping)' if oe.get('stopping') else ''}{figures}",
        file=sys.stderr,
        flush=True,
    )
    print(job["state"], flush=True)
    return EXIT_OK
