"""Evidence for the bottleneck classifier, built from plain data.

`build_evidence(ticks, config=..., rollout_stats=..., sweep=...)` takes:

- ticks: progress ticks as dicts (`workers.telemetry.tick_to_dict`, or JobMetricSample rows turned into the
  same shape): elapsed_s, completed, failed, in_flight, parallelism, samples_per_s, errors {class: n} and
  extra {"telemetry": {...}} as written by `TelemetrySink`.
- config: what the job asked for and what we know of the endpoint: parallelism, rpm_limit, max_num_seqs,
  max_model_len, max_output_tokens, request_timeout_s, verifier, verify_mode, gpu_memory_utilization.
- rollout_stats: optional exact timing means from the stored rollouts ({"n", "ok", "failed",
  "queue_ms", "ttft_ms", "generation_ms", "verify_ms", "wall_ms"} means, "failure_classes": {...}); they win
  over the per-tick summaries.
- sweep: optional `SweepResult.to_dict()` of a parallelism sweep on the same endpoint.

Every field may be None: the classifier only uses what is there.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Iterable

from workers.engine.types import TIMING_FIELDS

REQUEST_ERROR_CLASSES = ("http_429", "http_5xx", "http_4xx", "timeout", "connection", "bad_response")
TICK_SPAN_MAX_S = 5.0  # the most seconds one tick speaks for (a stalled run's next tick does not fill its gap)


@dataclass
class Evidence:
    # volume
    n_rollouts: int = 0
    n_ok: int = 0
    n_failed: int = 0
    duration_s: float | None = None
    n_ticks: int = 0
    # throughput and concurrency
    throughput_rps: float | None = None  # successful rollouts per second while running
    throughput_cv: float | None = None  # coefficient of variation of per-tick throughput (steady part)
    parallelism: float | None = None  # mean configured parallelism
    in_flight_mean: float | None = None
    slot_utilization: float | None = None  # in_flight / parallelism
    # timing breakdown (means, ms) and shares of a slot's time
    queue_ms: float | None = None
    ttft_ms: float | None = None
    generation_ms: float | None = None
    verify_ms: float | None = None
    wall_ms: float | None = None
    model_share: float | None = None  # (ttft + generation) / wall
    verify_share: float | None = None  # verify / wall
    overhead_share: float | None = None  # 1 - model - verify: retries, backoff, our own overhead
    cold_start_ratio: float | None = None  # TTFT of the first ticks / TTFT afterwards
    # worker host
    cpu_main_pct: float | None = None  # event-loop process, % of one core
    cpu_children_pct: float | None = None  # verification pool, % of one core
    cpu_total_pct: float | None = None
    cpu_cores: int | None = None
    cpu_machine_pct: float | None = None  # whole machine 0..100
    loop_lag_mean_ms: float | None = None
    loop_lag_p99_ms: float | None = None
    # errors (per request attempt)
    attempts: int = 0
    error_counts: dict = field(default_factory=dict)
    rate_429: float | None = None
    rate_5xx: float | None = None
    rate_4xx: float | None = None
    rate_timeout: float | None = None
    rate_connection: float | None = None
    # model server (/metrics)
    vllm_scrapes: int = 0
    vllm_running_mean: float | None = None
    vllm_running_max: float | None = None
    vllm_waiting_mean: float | None = None
    vllm_waiting_frac: float | None = None  # share of scrapes with a waiting queue
    vllm_kv_mean: float | None = None
    vllm_kv_max: float | None = None
    vllm_preemptions: float | None = None  # during the run
    vllm_queue_mean_s: float | None = None
    vllm_ttft_p50_s: float | None = None
    vllm_itl_p50_s: float | None = None
    vllm_e2e_p50_s: float | None = None
    # GPU (NVML, worker host)
    gpu_count: int = 0
    gpu_util_mean: float | None = None
    gpu_mem_frac_max: float | None = None
    gpu_temp_max: float | None = None
    # configuration
    rpm_limit: float | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    max_output_tokens: int | None = None
    request_timeout_s: float | None = None
    verify_mode: str | None = None
    verifier: str | None = None
    output_tokens_mean: float | None = None
    # verification (the engine's ticks: workers.verifiers.execution stats)
    verify_pool_utilization: float | None = None  # busy pool processes / pool size (CPU verifiers)
    verify_queue_mean: float | None = None  # verifications waiting for the pool or a slot
    verify_cache_hit_rate: float | None = None
    # parallelism sweep
    sweep: dict | None = None
    # server capacity (what the server can run at once, summed over its replicas) and its stated settings
    replicas: int | None = None  # replicas behind the endpoint
    replicas_answering: int | None = None  # replicas whose /metrics answered (the fewest seen)
    server_slots: int | None = None  # requests the server runs at once, over all replicas
    server_slots_bound: str = ""  # which bound gave server_slots, in words
    kv_max_concurrency: float | None = None  # requests of max_model_len the KV caches hold (summed)
    server_gpu_memory_utilization: float | None = None  # as the server reports it
    server_max_model_len: int | None = None  # as the server reports it
    truncated_share: float | None = None  # finished requests stopped by the token limit
    replica_errors: dict = field(default_factory=dict)  # replica URL -> connection errors / timeouts / failed scrapes
    replica_error_top: str | None = None  # the replica with most of them
    replica_error_top_share: float | None = None
    # replicas the engine's circuit breaker holds out of rotation at the latest tick: [{url, reason, since}]
    replicas_out: list = field(default_factory=list)
    profile_top: dict | None = None  # the job's profile: {function, module, line, share, flag, advice}
    # NeMo Gym agent jobs (ticks' extra["agent_timing"]): each rollout is one POST /run; its time splits into
    # the model server's (its /metrics) and the agent's own (its work, tools and its /verify call)
    agent_job: bool = False
    failure_reason: str | None = None  # why the job failed, when it did (its error message)
    agent_run_ms: float | None = None  # mean /run time per rollout
    agent_model_ms: float | None = None  # model server time per rollout (all its calls)
    agent_model_calls: float | None = None  # model requests per rollout
    agent_own_ms: float | None = None  # /run time - model time
    agent_share: float | None = None  # agent_own_ms / agent_run_ms

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def request_latency_s(self) -> float | None:
        """Mean model request latency (TTFT + generation), seconds; falls back to the slot time."""
        if self.ttft_ms is not None:
            return (self.ttft_ms + (self.generation_ms or 0.0)) / 1000.0
        if self.wall_ms is not None:
            return self.wall_ms / 1000.0
        return None


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _wmean(pairs: Iterable[tuple[float | None, float]]) -> float | None:
    num = den = 0.0
    for v, w in pairs:
        if v is None or w <= 0:
            continue
        num += float(v) * w
        den += w
    return num / den if den > 0 else None


def _stamp(t) -> float | None:
    """A tick's wall-clock time in seconds (datetime from the database, or a number), else None."""
    if t is None:
        return None
    if isinstance(t, (int, float)):
        return float(t)
    ts = getattr(t, "timestamp", None)
    return ts() if callable(ts) else None


def _union_s(spans: list[tuple[float, float]]) -> float:
    """Seconds covered by the union of [start, end] stretches."""
    total = 0.0
    cur_lo = cur_hi = None
    for lo, hi in sorted(spans):
        if cur_hi is None or lo > cur_hi:
            if cur_hi is not None:
                total += cur_hi - cur_lo
            cur_lo, cur_hi = lo, hi
        else:
            cur_hi = max(cur_hi, hi)
    if cur_hi is not None:
        total += cur_hi - cur_lo
    return total


def build_evidence(ticks: list[dict], config: dict | None = None, rollout_stats: dict | None = None,
                   sweep: dict | None = None) -> Evidence:
    config = config or {}
    ev = Evidence()
    ticks = list(ticks or [])
    ev.n_ticks = len(ticks)
    groups: dict[str, list[dict]] = {}
    for t in ticks:  # one cumulative series per worker (a job may run on several)
        groups.setdefault(str(t.get("worker") or ""), []).append(t)
    for g in groups.values():
        g.sort(key=lambda t: t.get("elapsed_s") or 0.0)
    ticks = [t for g in groups.values() for t in g]

    # ---- volume and throughput (ticks carry cumulative completed / failed per run)
    per_tick_rps: list[float] = []
    in_flight_w: list[tuple[float, float]] = []
    par_w: list[tuple[float, float]] = []
    throughput = 0.0
    longest = 0.0
    ok_all = 0
    spans: list[tuple[float, float]] = []  # wall-clock stretches when a run had work (runs may overlap)
    # second -> series -> (in_flight, parallelism): concurrent series (several workers, or several chunks
    # on one worker) add up to the job's in-flight count and parallelism
    active_by_second: dict[int, dict[str, tuple[float, float]]] = {}
    for gid, g in groups.items():
        prev_ok = prev_done = 0
        prev_elapsed = 0.0
        active_time = 0.0
        ok_total = 0
        for t in g:
            completed = int(t.get("completed") or 0)
            failed = int(t.get("failed") or 0)
            elapsed = float(t.get("elapsed_s") or 0.0)
            if completed < prev_ok or completed + failed < prev_done:  # a new run (another chunk / resume)
                prev_done = prev_ok = 0
                prev_elapsed = 0.0
            dt = max(0.0, elapsed - prev_elapsed)
            d_ok = completed - prev_ok
            if ((t.get("in_flight") or 0) > 0 or d_ok > 0) and dt > 0:
                active_time += dt
                ok_total += d_ok
                per_tick_rps.append(d_ok / dt)
                in_flight_w.append((t.get("in_flight") or 0, dt))
                par_w.append((t.get("parallelism") or 0, dt))
                stamp = _stamp(t.get("t"))
                if stamp is not None:
                    spans.append((stamp - dt, stamp))
                if stamp is not None and (t.get("in_flight") or 0) > 0:  # a finished run holds no slots
                    # a tick tells of the seconds since its run's previous one: a run whose ticks drift past a
                    # second boundary (a loaded worker) still counts in the second it skipped
                    for second in range(int(stamp - min(dt, TICK_SPAN_MAX_S)) + 1, int(stamp) + 1):
                        active_by_second.setdefault(second, {})[gid] = (t.get("in_flight") or 0,
                                                                        t.get("parallelism") or 0)
            prev_ok, prev_done, prev_elapsed = completed, completed + failed, elapsed
        if active_time > 0:
            throughput += ok_total / active_time
            longest = max(longest, active_time)
            ok_all += ok_total
        ok, failed = _run_totals(g)
        ev.n_ok += ok
        ev.n_failed += failed
    ev.n_rollouts = ev.n_ok + ev.n_failed
    ev.duration_s = round(longest, 3) if longest else None
    if longest > 0:
        ev.throughput_rps = throughput
    union = _union_s(spans)
    if union > 0 and len(spans) == len(per_tick_rps):  # all ticks stamped: runs one after another add no rates
        ev.duration_s = round(union, 3)
        ev.throughput_rps = ok_all / union
    if rollout_stats and rollout_stats.get("n") is not None:
        # the stored rows win over the runs' own counters (a killed run's unstored results, resumed runs)
        ev.n_ok = int(rollout_stats.get("ok") or 0)
        ev.n_failed = int(rollout_stats.get("failed") or 0)
        ev.n_rollouts = int(rollout_stats["n"])
    if rollout_stats and rollout_stats.get("running_s"):
        # the job's figure (controlplane.jobs.figures): stored ok rows over its running time, pauses excluded
        ev.duration_s = round(float(rollout_stats["running_s"]), 3)
        ev.throughput_rps = ev.n_ok / float(rollout_stats["running_s"])
    steady = per_tick_rps[1:-1] if len(per_tick_rps) >= 5 and len(groups) == 1 else []  # drop ramp-up and tail
    if len(steady) >= 3:
        m = statistics.fmean(steady)
        if m > 0:
            ev.throughput_cv = statistics.pstdev(steady) / m
    if len(groups) > 1 and active_by_second:
        seconds = active_by_second.values()
        ev.in_flight_mean = statistics.fmean(sum(v[0] for v in sec.values()) for sec in seconds)
        ev.parallelism = statistics.fmean(sum(v[1] for v in sec.values()) for sec in seconds) or None
    else:
        ev.in_flight_mean = _wmean(in_flight_w)
        ev.parallelism = _wmean(par_w)
    ev.parallelism = ev.parallelism or (float(config["parallelism"]) if config.get("parallelism") else None)
    if ev.in_flight_mean is not None and ev.parallelism:
        ev.slot_utilization = min(1.5, ev.in_flight_mean / ev.parallelism)

    # ---- errors per attempt
    counts: dict[str, int] = {}
    for t in ticks:
        for k, v in (t.get("errors") or {}).items():
            counts[k] = counts.get(k, 0) + int(v or 0)
    if rollout_stats and rollout_stats.get("error_counts"):
        for k, v in rollout_stats["error_counts"].items():
            counts[k] = max(counts.get(k, 0), int(v))
    if rollout_stats and rollout_stats.get("failure_classes"):  # rows that failed: at least one attempt each
        for k, v in rollout_stats["failure_classes"].items():
            if k in REQUEST_ERROR_CLASSES:
                counts[k] = max(counts.get(k, 0), int(v))
    ev.error_counts = counts
    request_errors = sum(counts.get(k, 0) for k in REQUEST_ERROR_CLASSES)
    ev.attempts = ev.n_ok + request_errors
    if ev.attempts > 0:
        ev.rate_429 = counts.get("http_429", 0) / ev.attempts
        ev.rate_5xx = counts.get("http_5xx", 0) / ev.attempts
        ev.rate_4xx = counts.get("http_4xx", 0) / ev.attempts
        ev.rate_timeout = counts.get("timeout", 0) / ev.attempts
        ev.rate_connection = counts.get("connection", 0) / ev.attempts

    # ---- telemetry
    tel = [((t.get("extra") or {}).get("telemetry") or {}) for t in ticks]
    timings = [x.get("timing") or {} for x in tel]
    for f in TIMING_FIELDS:
        setattr(ev, f, _wmean(((tm.get(f) or {}).get("mean"), tm.get("n") or 0) for tm in timings))
    ev.output_tokens_mean = _wmean(((tm.get("output_tokens") or {}).get("mean"), tm.get("n") or 0) for tm in timings)
    if rollout_stats:
        for f in (*TIMING_FIELDS, "output_tokens_mean"):
            if rollout_stats.get(f) is not None:
                setattr(ev, f, float(rollout_stats[f]))
        if rollout_stats.get("n") and not ev.n_rollouts:
            ev.n_ok = int(rollout_stats.get("ok") or 0)
            ev.n_failed = int(rollout_stats.get("failed") or 0)
            ev.n_rollouts = int(rollout_stats["n"])
    if ev.wall_ms:
        model = (ev.ttft_ms or 0.0) + (ev.generation_ms or 0.0)
        ev.model_share = min(1.0, model / ev.wall_ms)
        ev.verify_share = min(1.0, (ev.verify_ms or 0.0) / ev.wall_ms)
        ev.overhead_share = max(0.0, 1.0 - ev.model_share - ev.verify_share)
    _verification_evidence(ev, ticks)
    _agent_evidence(ev, groups)
    ttfts = [((tm.get("ttft_ms") or {}).get("mean"), tm.get("n") or 0) for tm in timings if tm.get("n")]
    if len(ttfts) >= 6:
        head = _wmean(ttfts[:2])
        rest = _wmean(ttfts[len(ttfts) // 3:])
        if head and rest:
            ev.cold_start_ratio = head / rest

    workers = [x.get("worker") or {} for x in tel if x.get("worker")]
    ev.cpu_main_pct = _mean(w.get("cpu_main") for w in workers)
    ev.cpu_children_pct = _mean(w.get("cpu_children") for w in workers)
    ev.cpu_total_pct = _mean(w.get("cpu_total") for w in workers)
    ev.cpu_machine_pct = _mean(w.get("cpu_machine") for w in workers)
    cores = [w.get("cpu_cores") for w in workers if w.get("cpu_cores")]
    ev.cpu_cores = int(cores[-1]) if cores else None
    lags = [w.get("loop_lag") for w in workers if w.get("loop_lag")]
    if lags:
        ev.loop_lag_mean_ms = _wmean((lg.get("mean_ms"), lg.get("n") or 1) for lg in lags)
        p99s = sorted(lg.get("p99_ms") or 0.0 for lg in lags)
        ev.loop_lag_p99_ms = p99s[len(p99s) // 2]  # the median interval's p99: robust to one hiccup

    vl_all = [x["vllm"] for x in tel if isinstance(x.get("vllm"), dict) and x["vllm"].get("ok")]
    vl = [v for v in vl_all if not v.get("baseline")]  # a baseline scrape's counters cover the server's life
    ev.vllm_scrapes = len(vl_all)
    if vl_all:
        running = [v.get("running") for v in vl_all if v.get("running") is not None]
        waiting = [v.get("waiting") for v in vl_all if v.get("waiting") is not None]
        kv = [v.get("kv_usage") for v in vl_all if v.get("kv_usage") is not None]
        ev.vllm_running_mean = _mean(running)
        ev.vllm_running_max = max(running) if running else None
        ev.vllm_waiting_mean = _mean(waiting)
        ev.vllm_waiting_frac = (sum(1 for w in waiting if w > 0) / len(waiting)) if waiting else None
        ev.vllm_kv_mean = _mean(kv)
        ev.vllm_kv_max = max(kv) if kv else None
    if vl:
        pre = [v.get("preemptions_delta") for v in vl if v.get("preemptions_delta") is not None]
        ev.vllm_preemptions = sum(pre) if pre else None
        ev.vllm_queue_mean_s = _wmean(((v.get("queue") or {}).get("mean"), (v.get("queue") or {}).get("count") or 0) for v in vl)
        ev.vllm_ttft_p50_s = _mean((v.get("ttft") or {}).get("p50") for v in vl)
        ev.vllm_itl_p50_s = _mean((v.get("itl") or {}).get("p50") for v in vl)
        ev.vllm_e2e_p50_s = _mean((v.get("e2e") or {}).get("p50") for v in vl)

    gpus = [x.get("gpu") for x in tel if x.get("gpu")]
    if gpus:
        ev.gpu_count = max(len(g) for g in gpus)
        ev.gpu_util_mean = _mean(d.get("util") for g in gpus for d in g)
        fracs = [d["mem_used_mb"] / d["mem_total_mb"] for g in gpus for d in g if d.get("mem_total_mb")]
        ev.gpu_mem_frac_max = max(fracs) if fracs else None
        temps = [d.get("temp_c") for g in gpus for d in g if d.get("temp_c") is not None]
        ev.gpu_temp_max = max(temps) if temps else None

    # ---- configuration
    for key, attr, cast in (("rpm_limit", "rpm_limit", float), ("max_num_seqs", "max_num_seqs", int),
                            ("max_model_len", "max_model_len", int), ("max_output_tokens", "max_output_tokens", int),
                            ("request_timeout_s", "request_timeout_s", float), ("verify_mode", "verify_mode", str),
                            ("verifier", "verifier", str)):
        if config.get(key) not in (None, "", 0):
            setattr(ev, attr, cast(config[key]))
    ev.failure_reason = config.get("failure_reason") or None
    ev.sweep = sweep
    _capacity(ev, vl_all, vl, ticks, config)
    return ev


def _agent_evidence(ev: Evidence, groups: dict[str, list[dict]]) -> None:
    """Agent jobs: sum the last cumulative `agent_timing` of each run (a count that goes down starts another
    run: a chunk or a resume) and split /run time into model and agent. The model server's figures cover every
    client it had: the split is exact when the job's runs are its only clients one at a time (the drop-in, one
    worker); runs of one job at the same time each count the others' model requests too (model time too high)."""
    totals = {"rollouts": 0.0, "run_ms": 0.0, "model_requests": 0.0, "model_ms": 0.0, "rollouts_at_model": 0.0,
              "model_scrapes": 0.0}
    runs = 0
    for g in groups.values():
        last = None
        for t in g:
            at = (t.get("extra") or {}).get("agent_timing")
            if not isinstance(at, dict):
                continue
            if last is not None and (at.get("rollouts") or 0) < (last.get("rollouts") or 0):
                for k in totals:
                    totals[k] += float(last.get(k) or 0)
                runs += 1
            last = at
        if last is not None:
            for k in totals:
                totals[k] += float(last.get(k) or 0)
            runs += 1
    if not runs:
        return
    ev.agent_job = True
    if totals["rollouts"]:
        ev.agent_run_ms = totals["run_ms"] / totals["rollouts"]
        ev.wall_ms = ev.agent_run_ms if ev.wall_ms is None else ev.wall_ms
    if totals["model_scrapes"] and totals["rollouts_at_model"]:
        ev.agent_model_ms = totals["model_ms"] / totals["rollouts_at_model"]
        ev.agent_model_calls = totals["model_requests"] / totals["rollouts_at_model"]
    if ev.agent_run_ms and ev.agent_model_ms is not None:
        model = min(ev.agent_model_ms, ev.agent_run_ms)
        ev.agent_own_ms = ev.agent_run_ms - model
        ev.agent_share = ev.agent_own_ms / ev.agent_run_ms
        ev.model_share = model / ev.agent_run_ms
    else:
        ev.model_share = None
    ev.verify_share = None  # the agent calls /verify itself: its time is in the agent's share
    ev.overhead_share = None  # no engine-side stages to subtract: the slot time is the /run call


def _verification_evidence(ev: Evidence, ticks: list[dict]) -> None:
    extras = [t.get("extra") or {} for t in ticks]
    pool = [min(1.0, x["verify_pool_inflight"] / x["verify_pool_size"]) for x in extras
            if x.get("verify_pool_size") and x.get("verify_pool_inflight") is not None]
    ev.verify_pool_utilization = _mean(pool)
    ev.verify_queue_mean = _mean([(x.get("verify_queue") or 0) + (x.get("verify_pool_pending") or 0)
                                  for x in extras if "verify_queue" in x])
    last: dict = {}
    for t in ticks:  # cumulative per run: the last tick of each series
        x = t.get("extra") or {}
        if "verify_cache_lookups" in x:
            last[t.get("worker") or ""] = (x.get("verify_cache_hits") or 0, x["verify_cache_lookups"] or 0)
    lookups = sum(n for _, n in last.values())
    ev.verify_cache_hit_rate = (sum(h for h, _ in last.values()) / lookups) if lookups else None


def _capacity(ev: Evidence, vl_all: list[dict], vl: list[dict], ticks: list[dict], config: dict) -> None:
    """What the server can run at once, over all its replicas, and which bound says so:
    1. the user's statement (the endpoint's max_num_seqs per replica x replicas);
    2. measured: the most requests running in a scrape that also had requests waiting (the server was full);
    3. the KV cache: how many max_model_len requests it holds (vllm:cache_config_info), a floor for short ones.
    Plus the server's own settings, truncation (finish reason `length`) and errors by replica."""
    replicas = int(config.get("replicas") or 0) or max((v.get("replicas_total") or v.get("replicas") or 1 for v in vl_all), default=0) or None
    ev.replicas = replicas
    answering = [v.get("replicas") for v in vl_all if v.get("replicas")]
    ev.replicas_answering = min(answering) if answering else None
    caps = [v.get("capacity") for v in vl_all if v.get("capacity")]
    cap = caps[-1] if caps else {}
    ev.kv_max_concurrency = cap.get("kv_cache_max_concurrency")
    ev.server_gpu_memory_utilization = cap.get("gpu_memory_utilization")
    if cap.get("max_model_len"):
        ev.server_max_model_len = int(cap["max_model_len"])
    full = [v.get("running") for v in vl_all if (v.get("waiting") or 0) > 0 and v.get("running")]
    if ev.max_num_seqs:
        n = replicas or 1
        ev.server_slots = ev.max_num_seqs * n
        ev.server_slots_bound = (f"max_num_seqs {ev.max_num_seqs}" + (f" x {n} replicas" if n > 1 else "")
                                 + " (the endpoint's stated setting)")
    elif cap.get("max_num_seqs"):
        ev.server_slots = int(cap["max_num_seqs"])
        ev.server_slots_bound = f"max_num_seqs {ev.server_slots} (the server's /metrics, summed over replicas)"
    elif full:
        ev.server_slots = int(max(full))
        ev.server_slots_bound = (f"{ev.server_slots} requests running while others waited (measured on the server's "
                                 f"/metrics{', ' + str(ev.replicas_answering) + ' replicas' if (ev.replicas_answering or 0) > 1 else ''})")
    elif ev.kv_max_concurrency:
        ev.server_slots = int(ev.kv_max_concurrency)
        ev.server_slots_bound = (f"the KV cache holds {ev.kv_max_concurrency:.0f} requests of max_model_len"
                                 + (f" {ev.server_max_model_len}" if ev.server_max_model_len else "") + " (vllm:cache_config_info)")
    # truncation: vLLM's finish reasons, else output lengths at the requested limit
    fin: dict[str, float] = {}
    for v in vl:
        for k, n in (v.get("finished_delta") or {}).items():
            fin[k] = fin.get(k, 0.0) + n
    done = sum(n for k, n in fin.items() if k in ("stop", "length"))
    shares = []
    if done >= 10:
        shares.append(fin.get("length", 0.0) / done)
    if ev.max_output_tokens and ev.output_tokens_mean is not None:  # the client's view: outputs at the limit
        shares.append(1.0 if ev.output_tokens_mean >= 0.98 * ev.max_output_tokens else 0.0)
    ev.truncated_share = max(shares) if shares else None
    # errors by replica: the engine's connection errors / timeouts per replica, and failed scrapes
    by: dict[str, float] = {}
    for t in ticks:
        for url, n in (((t.get("extra") or {}).get("replica_errors")) or {}).items():
            by[url.rstrip("/")] = by.get(url.rstrip("/"), 0) + int(n or 0)
    if not by:
        for v in vl_all:
            for url in (v.get("replica_errors") or {}):
                key = url.removesuffix("/metrics").rstrip("/")
                by[key] = by.get(key, 0) + 1
    ev.replica_errors = by
    # the breaker's view (ticks' extra["replicas"]): out of rotation at the latest tick that reports replicas. A dead
    # replica then gets almost no attempts, so error counts alone (and endpoints without /metrics) would miss it.
    latest = next((t["extra"]["replicas"] for t in reversed(ticks) if (t.get("extra") or {}).get("replicas")), [])
    ev.replicas_out = [{"url": r.get("url", "").rstrip("/"), "reason": r.get("reason") or r.get("last_error") or "",
                        "times_out": r.get("times_out", 0)} for r in latest if r.get("state") == "out"]
    total = sum(by.values())
    if total and (replicas or 0) > 1:
        top = max(by, key=by.get)
        ev.replica_error_top, ev.replica_error_top_share = top, by[top] / total


def _run_totals(ticks: list[dict]) -> tuple[int, int]:
    """Sum the final cumulative (completed, failed) of each run found in the tick series (a counter that goes
    down starts a new run: another chunk or a resume)."""
    ok = failed = 0
    last_ok = last_failed = 0
    for t in ticks:
        c, f = int(t.get("completed") or 0), int(t.get("failed") or 0)
        if c < last_ok or f < last_failed:
            ok += last_ok
            failed += last_failed
        last_ok, last_failed = c, f
    return ok + last_ok, failed + last_failed
