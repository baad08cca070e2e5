"""Command line: submit, wait, gate, export, and run (all four). See the package docstring."""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
import time

from . import EXIT_API, EXIT_GATE, EXIT_JOB, EXIT_OK, EXIT_TIMEOUT, EXIT_USAGE, __version__, auth, observe, openended, ops
from .client import ApiError, Client

TERMINAL_STATES = {"completed", "failed", "cancelled"}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- gates
class GateAction(argparse.Action):
    """`--metric NAME` starts a gate; the `--min`/`--max` after it belong to it (repeatable):
    --metric mean/reward --min 0.7 --metric mean/output_tokens --max 512"""

    def __call__(self, parser, namespace, values, option_string=None):
        gates = getattr(namespace, "gates", None) or []
        if option_string in ("--metric", "--gate"):
            gates.append({"metric": values, "min": None, "max": None})
        else:
            if not gates:
                parser.error(f"{option_string} must follow --metric NAME")
            key = option_string.lstrip("-")
            if gates[-1][key] is not None:
                parser.error(f"{option_string} given twice for --metric {gates[-1]['metric']}")
            gates[-1][key] = values
        namespace.gates = gates


def _fmt_pair(a: float, b: float) -> tuple[str, str]:
    """Format two numbers with enough digits to tell them apart (0.41 vs 0.70; 0.6999 vs 0.7000)."""
    for digits in range(2, 10):
        sa, sb = f"{a:.{digits}f}", f"{b:.{digits}f}"
        if sa != sb or a == b:
            if abs(a) >= 1e6 or abs(b) >= 1e6 or (0 < abs(a) < 1e-2 and 0 < abs(b) < 1e-2):
                return f"{a:.6g}", f"{b:.6g}"
            return sa, sb
    return repr(a), repr(b)


def lookup_metric(job: dict, name: str):
    """A gate's metric: a key of the job's aggregate_metrics (e.g. mean/reward, pass@4/reward), or one of
    the job-level numbers: failed_fraction, completed, failed, total."""
    agg = job.get("aggregate_metrics") or {}
    if name in agg:
        return agg[name]
    progress = job.get("progress") or {}
    derived = {
        "completed": progress.get("completed"), "failed": progress.get("failed"), "total": progress.get("total"),
        "failed_fraction": (progress.get("failed", 0) / progress["total"]) if progress.get("total") else None,
    }
    return derived.get(name)


def evaluate_gates(job: dict, gates: list[dict]) -> list[str]:
    """Return one message per failed gate (empty: all passed)."""
    failures = []
    for gate in gates:
        name = gate["metric"]
        value = lookup_metric(job, name)
        if value is None or not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value):
            known = sorted(k for k, v in (job.get("aggregate_metrics") or {}).items() if isinstance(v, (int, float)))
            failures.append(f"gate failed: metric {name} is not available for job {job['id']} "
                            f"(known: {', '.join(known[:30]) or 'none'})")
            continue
        if gate["min"] is not None and value < gate["min"]:
            v, t = _fmt_pair(value, gate["min"])
            failures.append(f"gate failed: {name} = {v} < min {t}")
        if gate["max"] is not None and value > gate["max"]:
            v, t = _fmt_pair(value, gate["max"])
            failures.append(f"gate failed: {name} = {v} > max {t}")
    return failures


def _gate_ok_line(job: dict, gate: dict) -> str:
    value = lookup_metric(job, gate["metric"])
    bounds = []
    if gate["min"] is not None:
        bounds.append(f">= min {_fmt_pair(value, gate['min'])[1]}")
    if gate["max"] is not None:
        bounds.append(f"<= max {_fmt_pair(value, gate['max'])[1]}")
    return f"gate passed: {gate['metric']} = {_fmt_pair(value, value)[0]} {' and '.join(bounds) or '(no bound)'}"


# ---------------------------------------------------------------------------------------------- steps
def _sha256_of(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _parse_kv(items: list[str], what: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"{what} needs key=value, got {item!r}")
        key, raw = item.split("=", 1)
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        out[key.strip()] = value
    return out


def do_submit(client: Client, args) -> dict:
    open_ended = openended.job_option(args)  # a usage error before anything is uploaded
    if args.dataset_id:
        dataset_id = args.dataset_id
    else:
        if not args.dataset:
            raise SystemExit("give --dataset FILE or --dataset-id ID")
        found = None if args.no_reuse_dataset else client.find_dataset(_sha256_of(args.dataset))
        if found:
            log(f"dataset {found['id']} ({found['row_count']} rows) already uploaded; reusing it")
            dataset_id = found["id"]
        else:
            ds = client.upload_dataset(args.dataset, name=args.dataset_name, accept_partial=args.accept_partial)
            log(f"uploaded dataset {ds['id']}: {ds['row_count']} rows"
                + (f", {ds['bad_line_count']} bad line(s) skipped" if ds.get("bad_line_count") else ""))
            dataset_id = ds["id"]
    # endpoint
    if args.endpoint:
        endpoint_id = args.endpoint
    elif args.endpoint_url and args.model:
        api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
        ep, created = client.find_or_create_endpoint(base_url=args.endpoint_url, model=args.model,
                                                     api_flavor=args.api_flavor, api_key=api_key)
        log(f"{'created' if created else 'using'} endpoint {ep['id']} ({ep['model_name']} @ {ep['base_url']})")
        endpoint_id = ep["id"]
    else:
        raise SystemExit("give --endpoint ID, or --endpoint-url URL and --model NAME")

    rcp = _parse_kv(args.param, "--param")
    for key in ("temperature", "top_p", "max_output_tokens"):
        if getattr(args, key) is not None:
            rcp[key] = getattr(args, key)
    body = {"dataset": dataset_id, "endpoint": endpoint_id, "responses_create_params": rcp,
            "num_repeats": args.num_repeats, "num_samples_in_parallel": args.num_samples_in_parallel,
            "parallelism_auto": args.parallelism_auto, "verifier": args.verifier,
            "verifier_options": _parse_kv(args.verifier_option, "--verifier-option"), "verify_mode": args.verify_mode,
            "profiling_enabled": args.profiling, "verify_cache": args.verify_cache}
    if args.profile_servers:  # only when asked: a server before profile_servers takes the job as it was
        body["profile_servers"] = True
    if args.name:
        body["name"] = args.name
    if args.limit is not None:
        body["limit"] = args.limit
    if args.chunk_size is not None:
        body["chunk_size"] = args.chunk_size
    if args.mlflow:
        body["mlflow_tracking_uri"] = args.mlflow
    if open_ended is not None:  # dataset: reused above when an identical upload (same sha256) is there
        body["open_ended"] = open_ended
    job, created = client.create_job(body, idempotency_key=args.idempotency_key)
    log(f"{'submitted' if created else 'already submitted (same Idempotency-Key)'}: job {job['id']}, "
        f"{job['progress']['total']} rollouts")
    return job


def _rate_words(job: dict) -> str:
    """", 41.3 rollouts/s over 2:15 running" from the job's figures (the dashboard's avg it/s and elapsed)."""
    f = job.get("figures") or {}
    rate, running = f.get("average_rollouts_per_s"), f.get("running_s")
    if rate is None or running is None:
        return ""
    m, sec = divmod(int(round(running)), 60)
    tokens, out = f.get("average_tokens_per_s"), f.get("average_output_tokens_per_s")
    tok = f", {tokens:.1f} tokens/s ({out:.1f} output)" if tokens is not None and out is not None else ""
    return f", {rate:.1f} rollouts/s{tok} over {m}:{sec:02d} running (pauses excluded)"


def do_wait(client: Client, job_id: int, *, timeout_s: float | None, poll_s: float, progress: bool = True) -> tuple[dict, int]:
    """Poll the job until it ends; a tqdm bar on stderr. Returns (job, exit code)."""
    from tqdm import tqdm

    deadline = None if not timeout_s else time.monotonic() + timeout_s
    job = client.job(job_id)
    bar = tqdm(total=job["progress"]["total"] or None, unit="rollout", desc=f"job {job_id}", file=sys.stderr,
               disable=not progress, dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 5.0)
    shown = 0
    try:
        while True:
            p = job["progress"]
            if bar.total != p["total"] and p["total"]:
                bar.total = p["total"]
            if p["done"] > shown:
                bar.update(p["done"] - shown)
                shown = p["done"]
            bar.set_postfix(state=job["state"], failed=p["failed"], refresh=False)
            if job["state"] in TERMINAL_STATES:
                break
            if deadline is not None and time.monotonic() >= deadline:
                bar.close()
                log(f"timed out after {timeout_s:g} s waiting for job {job_id} (state {job['state']}, "
                    f"{p['done']}/{p['total']} done)")
                return job, EXIT_TIMEOUT
            time.sleep(poll_s if deadline is None else max(0.05, min(poll_s, deadline - time.monotonic())))
            job = client.job(job_id)
    finally:
        bar.close()
    p = job["progress"]
    if job["state"] == "completed" and job.get("verify_mode") == "fast":
        return _wait_exact_pass(client, job, deadline, poll_s)
    if job["state"] == "completed":
        log(f"job {job_id} completed: {p['completed']} ok, {p['failed']} failed{_rate_words(job)}")
        return job, EXIT_OK
    log(f"job {job_id} {job['state']}: {p['completed']} ok, {p['failed']} failed{_rate_words(job)}"
        + (f" — {job['error_message']}" if job.get("error_message") else ""))
    return job, EXIT_JOB


def _wait_exact_pass(client: Client, job: dict, deadline, poll_s: float) -> tuple[dict, int]:
    """A fast job's rewards are the heuristic's until its exact pass (started when collection ended) is done:
    gates and exports wait for it."""
    job_id = job["id"]
    log(f"job {job_id} collected ({job['progress']['completed']} ok); waiting for the exact verifier's pass")
    while True:
        run = job.get("verification") or {}
        if run.get("state") in ("done", "failed"):
            break
        if deadline is not None and time.monotonic() >= deadline:
            log(f"timed out waiting for job {job_id}'s exact pass ({run.get('verified')}/{run.get('total')} verified)")
            return job, EXIT_TIMEOUT
        time.sleep(poll_s)
        job = client.job(job_id)
    if run["state"] != "done":
        log(f"job {job_id}: the exact pass failed: {run.get('error')}")
        return job, EXIT_JOB
    job = client.job(job_id)  # again: the reply saying "done" read the job row first, maybe before the metrics
    agree = (run.get("info") or {}).get("fast_agreement") or {}
    same = f"; fast and exact agree on {agree['same']}/{agree['compared']}" if agree.get("compared") else ""
    log(f"job {job_id} completed and verified exactly: {run['verified']} rollouts, {run['errors']} verifier errors{same}")
    return job, EXIT_OK


def do_export(client: Client, job_id: int, path: str, which: str = "ok") -> int:
    """Stream the export into `path` (through a temporary file renamed into place). Returns the row count."""
    directory = os.path.dirname(os.path.abspath(path)) or "."
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".rolloutctl-", suffix=".jsonl", dir=directory)
    lines = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in client.iter_export(job_id, which):
                out.write(chunk)
                lines += chunk.count(b"\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    log(f"wrote {lines} {which} rollout(s) of job {job_id} to {path}")
    return lines


def do_verify(client: Client, args) -> tuple[dict, int]:
    """Start the batch verification of a finished job, then (unless --no-wait) follow it to its end."""
    options = _parse_kv(args.verifier_option, "--verifier-option") if args.verifier_option else None
    job = client.verify_job(args.job, args.verifier, options)
    run = job.get("verification") or {}
    log(f"verifying job {args.job} with {run.get('verifier')}: {run.get('total')} rollouts (run {run.get('id')})")
    if args.no_wait:
        return job, EXIT_OK
    deadline = None if not args.timeout else time.monotonic() + args.timeout
    while run.get("state") in ("pending", "running"):
        if deadline is not None and time.monotonic() >= deadline:
            log(f"timed out: {run.get('verified')}/{run.get('total')} verified")
            return job, EXIT_TIMEOUT
        time.sleep(args.poll_interval)
        job = client.job(args.job)
        run = job.get("verification") or {}
    if run.get("state") != "done":
        log(f"verification of job {args.job} {run.get('state')}: {run.get('error')}")
        return job, EXIT_JOB
    job = client.job(args.job)  # again: the reply saying "done" read the job row first, maybe before the metrics
    rate = run.get("cache_hit_rate")
    log(f"job {args.job} verified: {run['verified']} rollouts, {run['errors']} verifier errors, "
        f"mean/reward {job['aggregate_metrics'].get('mean/reward')}"
        + (f", cache hit rate {rate:.0%}" if rate is not None else ""))
    return job, EXIT_OK


def jsonl_path(path: str) -> str:
    """`out/rollouts` -> `out/rollouts.jsonl`; a name with an extension is kept as it is."""
    return path if os.path.splitext(os.path.basename(path))[1] else path + ".jsonl"


def _sidecar(path: str, suffix: str, ext: str) -> str:
    return f"{path[:-6] if path.endswith('.jsonl') else path}{suffix}{ext}"


def do_run_exports(client: Client, job: dict, path: str) -> None:
    """NeMo Gym's trio: <out>.jsonl, <out>_failures.jsonl, <out>_aggregate_metrics.json."""
    do_export(client, job["id"], path, "ok")
    if job["progress"]["failed"]:
        do_export(client, job["id"], _sidecar(path, "_failures", ".jsonl"), "failed")
    with open(_sidecar(path, "_aggregate_metrics", ".json"), "w") as fh:
        json.dump(job.get("aggregate_metrics") or {}, fh, indent=2, sort_keys=True)


DEFAULT_MAX_FAILED_FRACTION = 0.05


def failed_rows_gate(job: dict, max_failed_fraction: float) -> list[str]:
    """Aggregates such as mean/reward are over the successful rows only: a gate on them fails when more than
    `max_failed_fraction` of the job's rows failed (1 turns this off)."""
    fraction = lookup_metric(job, "failed_fraction")
    if fraction is None or fraction <= max_failed_fraction:
        return []
    v, t = _fmt_pair(fraction, max_failed_fraction)
    return [f"gate failed: failed_fraction = {v} > max {t} ({job['progress'].get('failed')} of "
            f"{job['progress'].get('total')} rows failed and are not in the aggregates; --max-failed-fraction 1 "
            "ignores them)"]


THROUGHPUT_FIGURES = {  # --throughput-figure: the job figure (controlplane.jobs.figures) compared, and its unit
    "rollouts": ("average_rollouts_per_s", "rollouts/s"),
    "tokens": ("average_tokens_per_s", "tokens/s"),
    "output_tokens": ("average_output_tokens_per_s", "output tokens/s"),
}


def parse_ratio(text: str) -> tuple[str, float]:
    """`--min-metric-ratio mean/reward=0.95` -> ("mean/reward", 0.95)."""
    name, sep, raw = text.rpartition("=")
    try:
        ratio = float(raw)
    except ValueError:
        ratio = math.nan
    if not sep or not name or not math.isfinite(ratio) or ratio <= 0:
        raise argparse.ArgumentTypeError(f"expected METRIC=RATIO with a ratio > 0 (e.g. mean/reward=0.95), got {text!r}")
    return name, ratio


def _metric_of(job: dict, name: str):
    """A metric by its name, or `reward` for mean/reward (any aggregate name without its mean/ prefix)."""
    value = lookup_metric(job, name)
    return lookup_metric(job, f"mean/{name}") if value is None and "/" not in name else value


def baseline_gate(job: dict, base: dict, *, min_throughput_ratio: float | None = None,
                  throughput_figure: str = "rollouts", metric_ratios: list[tuple[str, float]] = ()) -> tuple[list[str], list[str]]:
    """Compare `job` with a baseline job: (failures, passes), one line each. Throughput: the job's average rate
    over its running time (pauses excluded) against the baseline's; a metric: its value against the baseline's
    (higher is better)."""
    failures, passes = [], []
    checks = []
    if min_throughput_ratio is not None:
        key, unit = THROUGHPUT_FIGURES[throughput_figure]
        checks.append((f"throughput ({unit})", (job.get("figures") or {}).get(key),
                       (base.get("figures") or {}).get(key), min_throughput_ratio))
    for name, ratio in metric_ratios:
        checks.append((name, _metric_of(job, name), _metric_of(base, name), ratio))
    for label, value, ref, ratio in checks:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in (value, ref)):
            failures.append(f"gate failed: {label} is not available for job {job['id']} ({value}) or baseline job "
                            f"{base['id']} ({ref})")
            continue
        if ref <= 0:
            passes.append(f"gate passed: {label} = {value:.4g}; baseline job {base['id']} has {ref:.4g}, nothing to fall below")
            continue
        v, r = _fmt_pair(value, ref)
        words = f"{label} = {v} is {value / ref:.3f} x baseline job {base['id']}'s {r}"
        if value < ratio * ref:
            failures.append(f"gate failed: {words} < min ratio {ratio:g}")
        else:
            passes.append(f"gate passed: {words} >= min ratio {ratio:g}")
    return failures, passes


def do_gate(job: dict, gates: list[dict], max_failed_fraction: float = DEFAULT_MAX_FAILED_FRACTION,
            baseline: dict | None = None, failed_lines: list | None = None, **ratios) -> int:
    """The metric gates, the failed-rows gate and, with a baseline job, the ratio gates (baseline_gate).
    `failed_lines`: a list the failure lines are added to."""
    if job["state"] != "completed":
        log(f"gate failed: job {job['id']} is {job['state']}, not completed")
        return EXIT_GATE
    failures = evaluate_gates(job, gates)
    if baseline is not None:
        failed, passed = baseline_gate(job, baseline, **ratios)
        failures += failed
        for line in passed:
            log(line)
    if not any(g["metric"] == "failed_fraction" for g in gates):  # an explicit failed_fraction gate decides alone
        failures += failed_rows_gate(job, max_failed_fraction)
    for gate in gates:
        if not any(f" {gate['metric']} " in msg for msg in failures):
            log(_gate_ok_line(job, gate))
    for msg in failures:
        log(msg)
    if failed_lines is not None:
        failed_lines.extend(failures)
    return EXIT_GATE if failures else EXIT_OK


# ---------------------------------------------------------------------------------------------- parser
def _add_connection(p):
    p.add_argument("--url", default=os.environ.get("ROLLOUTCTL_URL"), help="API base URL (env ROLLOUTCTL_URL)")
    p.add_argument("--token", default=os.environ.get("ROLLOUTCTL_TOKEN"), help="API token (env ROLLOUTCTL_TOKEN)")
    p.add_argument("--request-timeout", type=float, default=60.0, help="seconds per HTTP request (default 60)")
    p.add_argument("--retries", type=int, default=4, help="retries on connection errors, 429 and 5xx (default 4)")


def _add_submit(p):
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", help="NeMo Gym JSONL file to upload (reused if already uploaded)")
    g.add_argument("--dataset-id", type=int, help="an uploaded dataset's id instead of a file")
    g.add_argument("--dataset-name", help="name for the upload (default: the file name)")
    g.add_argument("--accept-partial", action="store_true", help="keep the good lines of a file with bad lines")
    g.add_argument("--no-reuse-dataset", action="store_true", help="upload even if the same file is already there")
    g = p.add_argument_group("endpoint")
    g.add_argument("--endpoint", type=int, help="endpoint id")
    g.add_argument("--endpoint-url", help="model server base URL (finds or creates an endpoint)")
    g.add_argument("--model", help="model name served at --endpoint-url")
    g.add_argument("--api-flavor", choices=["chat_completions", "completions", "responses"])
    g.add_argument("--api-key-env", metavar="VAR", help="environment variable holding the endpoint's API key")
    g = p.add_argument_group("job (ng_collect_rollouts parameters)")
    g.add_argument("--name", default="")
    g.add_argument("--limit", type=int)
    g.add_argument("--num-repeats", type=int, default=1)
    g.add_argument("--num-samples-in-parallel", "--parallelism", type=int, default=16)
    g.add_argument("--parallelism-auto", action="store_true")
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--max-output-tokens", type=int)
    g.add_argument("--param", action="append", metavar="KEY=JSON",
                   help="responses_create_params override (repeatable), e.g. --param service_tier=\"flex\"")
    g.add_argument("--verifier", default="math",
                   help="a registered name, an installed entry point, or your own by dotted path 'pkg.mod:fn'")
    g.add_argument("--verifier-option", action="append", metavar="KEY=JSON")
    g.add_argument("--verify-mode", default="inline", choices=["inline", "fast", "deferred"])
    g.add_argument("--verify-cache", default="job", choices=["off", "job", "global"])
    g.add_argument("--mlflow", metavar="NAME", default="",
                   help="export the job as an MLflow run to this tracking server of the deployment (its name or URI)")
    g.add_argument("--chunk-size", type=int)
    g.add_argument("--profiling", action="store_true")
    g.add_argument("--profile-servers", action="store_true", help="profile the NeMo Gym endpoint's own servers "
                   "(found through its head server) while the job runs; `rolloutctl profile JOB` shows them")
    g.add_argument("--idempotency-key", default=os.environ.get("ROLLOUTCTL_IDEMPOTENCY_KEY"),
                   help="retrying with the same key returns the same job (env ROLLOUTCTL_IDEMPOTENCY_KEY; "
                        "default: a fresh key per invocation)")
    openended.add_submit_args(p)  # --open-ended --buffer N [--shuffle --seed S] --consumer NAME


def _add_wait(p):
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit 4)")
    p.add_argument("--poll-interval", type=float, default=2.0)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_gates(p):
    p.add_argument("--metric", "--gate", action=GateAction, dest="gates", metavar="NAME",
                   help="metric to gate on, e.g. mean/reward (repeatable; each followed by --min and/or --max)")
    p.add_argument("--min", action=GateAction, dest="gates", type=float, metavar="VALUE", help="fail when the metric is below")
    p.add_argument("--max", action=GateAction, dest="gates", type=float, metavar="VALUE", help="fail when the metric is above")
    p.add_argument("--max-failed-fraction", type=float, default=DEFAULT_MAX_FAILED_FRACTION, metavar="F",
                   help="the gates also fail when more than this fraction of rows failed (failed rows are not in "
                        f"mean/reward and the other aggregates; default {DEFAULT_MAX_FAILED_FRACTION}, 1 turns it off)")
    g = p.add_argument_group("regression against a baseline job (exit 1 on a regression)")
    g.add_argument("--baseline-job", type=int, metavar="N", help="compare with this earlier job")
    g.add_argument("--min-throughput-ratio", type=float, metavar="R",
                   help="fail when the job's throughput (over its running time, pauses excluded) is below R x the "
                        "baseline's, e.g. 0.9")
    g.add_argument("--throughput-figure", choices=sorted(THROUGHPUT_FIGURES), default="rollouts",
                   help="the throughput compared: rollouts/s (default), tokens/s (input + output) or output tokens/s")
    g.add_argument("--min-metric-ratio", type=parse_ratio, action="append", default=[], metavar="METRIC=R",
                   help="fail when the metric is below R x the baseline's, e.g. mean/reward=0.95 (reward means "
                        "mean/reward; repeatable)")


def do_profile(client, args) -> int:
    path = f"jobs/{args.job}/profile/"
    if args.off:
        client.request("DELETE", path)
        log(f"profiling off for job {args.job}")
        return EXIT_OK
    if not args.show:
        _, s = client.post_json(path, {"seconds": args.seconds, "scope": args.scope, "clock": args.clock,
                                       "budget_pct": args.budget_pct})
        log(f"profiling on for job {args.job}: session {s['id']} ({s['scope']}, {s['clock']} clock) for {args.seconds:.0f} s")
        if args.no_wait:
            return EXIT_OK
        deadline = time.monotonic() + args.seconds + 15
        while time.monotonic() < deadline:
            time.sleep(min(5.0, max(1.0, args.seconds / 10)))
            prof = client.get_json(path)
            if prof["active"] is None:
                time.sleep(6)  # the workers' last windows
                break
    prof = client.get_json(path)
    if not prof["snapshots"]:
        print("no snapshot yet")
        return EXIT_OK
    over = f", measured overhead {prof['overhead_pct']:.2f}%" if prof["overhead_pct"] is not None else ""
    print(f"{prof['snapshots']} snapshots from {len(prof['workers'])} worker(s), {prof['verifications']} verifications"
          f" ({prof['profiled']} profiled){over}")
    if prof.get("few_samples"):
        print(f"note: figures are scaled from only {prof['profiled']} profiled verifications and may be far off; "
              "profile longer, or with --budget-pct 100 for exact counts")
    print(f"{'name':<70} {'ncall':>9} {'tsub':>10} {'ttot':>10} {'tavg':>10}")
    for r in prof["rows"][:args.top]:
        name = f"{r['module']}:{r['line']} {r['name']}"
        print(f"{name[-70:]:<70} {r['ncall']:>9} {r['tsub']:>10.6f} {r['ttot']:>10.6f} {r['tavg']:>10.6f}")
    for f in prof["red_flags"]:
        print(f"[{f['kind']}] {f['label']}: {f['figure']}\n    -> {f['advice']}")
    for srv in prof.get("servers") or []:  # NeMo Gym servers' own profiles (collect_rollouts +profiling_enabled)
        print(f"\nNeMo Gym server {srv['name']} ({srv['functions']} functions, {srv['total_s']:.6f} s):")
        print(f"{'name':<70} {'ncall':>9} {'tsub':>10} {'ttot':>10} {'tavg':>10}")
        for r in srv["rows"][:args.top]:
            name = f"{r['module']}:{r['line']} {r['name']}"
            print(f"{name[-70:]:<70} {r['ncall']:>9} {r['tsub']:>10.6f} {r['ttot']:>10.6f} {r['tavg']:>10.6f}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    import rolloutctl

    parser = argparse.ArgumentParser(prog="rolloutctl", description=rolloutctl.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"rolloutctl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="upload a dataset (if needed) and start a job; prints the job id")
    _add_connection(p)
    _add_submit(p)

    p = sub.add_parser("wait", help="wait for a job with a progress bar; non-zero if it fails or times out")
    _add_connection(p)
    p.add_argument("job", type=int)
    _add_wait(p)

    p = sub.add_parser("gate", help="exit non-zero when a job's metric is outside its bounds")
    _add_connection(p)
    p.add_argument("job", type=int)
    _add_gates(p)

    p = sub.add_parser("export", help="write a job's rollouts (NeMo Gym JSONL) to a file, streamed")
    _add_connection(p)
    p.add_argument("job", type=int)
    p.add_argument("-o", "--output", required=True, type=jsonl_path, help="output file (.jsonl added when the name "
                                                                          "has no extension)")
    p.add_argument("--which", choices=["ok", "failed", "all"], default="ok")

    p = sub.add_parser("verify", help="verify this job: a batch run over its stored rollouts (deferred / fast jobs)")
    _add_connection(p)
    p.add_argument("job", type=int)
    p.add_argument("--verifier", help="verify with this verifier instead of the job's own")
    p.add_argument("--verifier-option", action="append", metavar="KEY=JSON")
    p.add_argument("--no-wait", action="store_true", help="start it and return")
    _add_wait(p)
    _add_gates(p)
    p = sub.add_parser("profile", help="profile a running job's verification for N seconds (it keeps running); "
                                       "print the profile and its red flags")
    _add_connection(p)
    p.add_argument("job", type=int)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--scope", choices=["verify", "worker"], default="verify",
                   help="verify: the job's verifier calls; worker: the whole worker process (staff only)")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    p.add_argument("--budget-pct", type=float, default=2.0,
                   help="verify scope: throughput cost aimed at, in %% (default 2); 100 profiles every verification "
                        "(exact call counts, the highest cost)")
    p.add_argument("--off", action="store_true", help="switch profiling off")
    p.add_argument("--show", action="store_true", help="print the newest profile without switching anything")
    p.add_argument("--no-wait", action="store_true", help="switch it on and return")
    p.add_argument("--top", type=int, default=20)

    p = sub.add_parser("run", help="submit, wait, export and gate in one command")
    _add_connection(p)
    _add_submit(p)
    _add_wait(p)
    _add_gates(p)
    p.add_argument("-o", "--output", type=jsonl_path,
                   help="write <out>.jsonl, <out>_failures.jsonl, <out>_aggregate_metrics.json (.jsonl is added "
                        "when the name has no extension)")
    ops.add_parsers(sub, _add_connection)  # endpoint-op, update-weights, ops-stats, weight-versions
    auth.add_parsers(sub, _add_connection)  # login, logout
    observe.add_parsers(sub, _add_connection)  # diagnose, sweep
    openended.add_parsers(sub, _add_connection)  # stop
    return ops.hide_deprecated(sub, parser)  # --help lists the subcommands without the deprecated names


def _check_gates(parser, args):
    for gate in getattr(args, "gates", None) or []:
        if gate["min"] is None and gate["max"] is None:
            parser.error(f"--metric {gate['metric']} needs --min and/or --max")
    if not hasattr(args, "baseline_job"):
        return
    ratios = args.min_throughput_ratio is not None or args.min_metric_ratio
    if ratios and args.baseline_job is None:
        parser.error("--min-throughput-ratio / --min-metric-ratio need --baseline-job N")
    if args.baseline_job is not None and not ratios:
        parser.error("--baseline-job needs --min-throughput-ratio and/or --min-metric-ratio")
    if args.command == "gate" and not args.gates and args.baseline_job is None:
        parser.error("give --metric NAME with --min/--max, or --baseline-job N with a ratio")


def _wants_gate(args) -> bool:
    return bool(args.gates) or args.baseline_job is not None


def _gate(client: Client, job: dict, args) -> int:
    """do_gate with the command's options (the baseline job read from the API when one is named)."""
    baseline = None
    if args.baseline_job is not None:
        baseline = client.job(args.baseline_job)
        if baseline["state"] != "completed":
            log(f"gate failed: baseline job {baseline['id']} is {baseline['state']}, not completed")
            return EXIT_GATE
    failed: list[str] = []
    code = do_gate(job, args.gates or [], args.max_failed_fraction, baseline, failed_lines=failed,
                   min_throughput_ratio=args.min_throughput_ratio, throughput_figure=args.throughput_figure,
                   metric_ratios=args.min_metric_ratio)
    if failed:  # the job's webhooks hear of it (alerts); a server without them, or an error, changes nothing
        try:
            client.request("POST", f"jobs/{job['id']}/gate-failed/", json={"reason": "; ".join(failed)[:2000]},
                           retry=False, expect=(202,))
        except ApiError as exc:
            log(f"rolloutctl: could not report the gate failure to the server: {exc}")
    return code


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_gates(parser, args)
    try:
        client = Client(args.url, args.token, timeout_s=args.request_timeout, retries=args.retries)
    except ValueError as exc:
        log(f"rolloutctl: {exc}")
        return EXIT_USAGE
    if not args.token and args.command != "login":
        log("rolloutctl: warning: no token (--token or ROLLOUTCTL_TOKEN); the API will answer 401")
    try:
        for commands in (ops, auth, observe, openended):  # each module's own subcommands
            if args.command in commands.COMMANDS:
                return commands.run(client, args)
        if args.command == "submit":
            job = do_submit(client, args)
            print(job["id"], flush=True)
            return EXIT_OK
        if args.command == "wait":
            _, code = do_wait(client, args.job, timeout_s=args.timeout, poll_s=args.poll_interval,
                              progress=not args.no_progress)
            return code
        if args.command == "gate":
            return _gate(client, client.job(args.job), args)
        if args.command == "export":
            do_export(client, args.job, args.output, args.which)
            return EXIT_OK
        if args.command == "verify":
            job, code = do_verify(client, args)
            if code != EXIT_OK or args.no_wait:
                return code
            return _gate(client, job, args) if _wants_gate(args) else EXIT_OK
        if args.command == "profile":
            return do_profile(client, args)
        if args.command == "run":
            job = do_submit(client, args)
            print(job["id"], flush=True)
            job, code = do_wait(client, job["id"], timeout_s=args.timeout, poll_s=args.poll_interval,
                                progress=not args.no_progress)
            if args.output and code != EXIT_TIMEOUT:
                do_run_exports(client, job, args.output)  # what was collected, even when the job failed
            if code != EXIT_OK:
                return code
            return _gate(client, job, args) if _wants_gate(args) else EXIT_OK
    except ApiError as exc:
        log(f"rolloutctl: API error: {exc}")
        return EXIT_API
    except SystemExit as exc:
        if isinstance(exc.code, str):
            log(f"rolloutctl: {exc.code}")
            return EXIT_USAGE
        raise
    except KeyboardInterrupt:
        log("rolloutctl: interrupted")
        return 130
    except OSError as exc:
        log(f"rolloutctl: {exc}")
        return EXIT_USAGE
    parser.error(f"unknown command {args.command}")
    return EXIT_USAGE
