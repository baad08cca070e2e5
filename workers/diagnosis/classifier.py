"""The bottleneck classifier: `diagnose(evidence) -> Diagnosis`. Pure: no I/O, no clock.

Each rule looks at one number of the evidence, compares it with a named threshold, and when it holds adds
a weight to one verdict. The verdict with the highest score wins when it reaches MIN_SCORE; otherwise the
evidence is not enough. Every number consulted is reported (name, value, threshold, meaning, and which
verdict it supports), so the job page, the API and the CLI can show *why*.

Verdicts (the profiling guide's three bottlenecks, plus our own overhead):
  model_inference_bound      time goes to the model server (TTFT + generation)
  verification_bound         time goes to the verifier (CPU-heavy, or slow external calls)
  network_rate_limit_bound   429s / timeouts / connection errors, or throughput pinned at the RPM limit
  control_plane_bound        our own worker can't keep up: event loop lagging, slots not kept full
  agent_server_bound         NeMo Gym agent jobs: /run time goes to the agent server itself (its own work,
                             tools, its /verify call), not to the model server
  insufficient_evidence
"""
from __future__ import annotations

import math
import re

from .evidence import Evidence
from .report import Condition, Diagnosis, EvidenceItem, Recommendation

MODEL = "model_inference_bound"
VERIFICATION = "verification_bound"
NETWORK = "network_rate_limit_bound"
CONTROL_PLANE = "control_plane_bound"
AGENT = "agent_server_bound"
INSUFFICIENT = "insufficient_evidence"
VERDICTS = (MODEL, VERIFICATION, NETWORK, CONTROL_PLANE, AGENT, INSUFFICIENT)

VERDICT_LABELS = {
    MODEL: "Model inference",
    VERIFICATION: "Verification",
    NETWORK: "Network / API rate limits",
    CONTROL_PLANE: "Control plane (our own overhead)",
    AGENT: "NeMo Gym agent server",
    INSUFFICIENT: "Not enough evidence",
}

# ------------------------------------------------------------------------------------ thresholds
MIN_ROLLOUTS = 20  # fewer finished rollouts than this: no verdict
MIN_SCORE = 2.0  # the winning verdict needs at least this much weight
# timing breakdown (shares of a slot's wall time)
MODEL_SHARE_BOUND = 0.60
VERIFY_SHARE_BOUND = 0.40
VERIFY_SHARE_DOMINANT = 0.60
VERIFY_SHARE_SUPPORT = 0.20
OVERHEAD_SHARE_BOUND = 0.30
AGENT_SHARE_BOUND = 0.50  # agent jobs: share of /run time outside the model server
# worker host
CPU_MAIN_SATURATED_PCT = 85.0  # % of one core: the event loop process is busy all the time
CPU_POOL_SATURATED_FRAC = 0.75  # verification pool CPU / all cores
CPU_MACHINE_BUSY_PCT = 90.0
LOOP_LAG_P99_MS = 100.0
LOOP_LAG_MEAN_MS = 20.0
VERIFY_LOOP_OCCUPANCY = 0.5  # verifier seconds per second of run
SLOT_UTILIZATION_LOW = 0.70  # in flight / parallelism
# errors (per request attempt)
RATE_429 = 0.02
RATE_TIMEOUT = 0.01
RATE_CONNECTION = 0.02
RATE_5XX = 0.02
RATE_4XX = 0.01
RPM_UTILIZATION = 0.85  # throughput * 60 / RPM limit
# model server
SERVER_WAITING_FRAC = 0.50  # share of scrapes with requests waiting
RUNNING_NEAR_CAP = 0.90  # running / max_num_seqs
KV_HIGH = 0.90
KV_CRITICAL = 0.95
VLLM_QUEUE_MEAN_S = 0.10
GPU_BUSY_PCT = 90.0
GPU_LOW_PCT = 50.0
GPU_HOT_C = 85.0
# run shape
THROUGHPUT_CV = 0.35
COLD_START_RATIO = 3.0
# sweep
SWEEP_SCALED = 2.0  # best / first-level throughput: "time fell a lot"
SWEEP_FLAT = 1.5  # below this: "time similar"
# recommendations
RATE_LIMIT_HEADROOM = 1.0  # parallelism <= RPM/60 * latency * headroom
GPU_MEMORY_UTILIZATION_TRAINING = 0.95
TRUNCATED_SHARE = 0.5  # share of outputs stopped by the token limit: a truncation warning
UNREACHABLE_SHARE = 0.90  # connection errors + timeouts on this share of attempts, none succeeded: unreachable
RATE_CONNECTION_HEAVY = 0.20  # connection errors / timeouts on this share of attempts: a replica is down or hung
REPLICA_CONCENTRATED = 0.70  # share of those errors on one replica: name it


def _fmt_pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


class _Rules:
    def __init__(self):
        self.items: list[EvidenceItem] = []
        self.scores = {MODEL: 0.0, VERIFICATION: 0.0, NETWORK: 0.0, CONTROL_PLANE: 0.0, AGENT: 0.0}

    def check(self, name: str, value, threshold, meaning: str, supports: str | None = None, weight: float = 0.0,
              op: str = ">=") -> bool:
        if value is None:
            return False
        if op == ">=":
            holds = value >= threshold
        elif op == "<":
            holds = value < threshold
        else:
            raise ValueError(op)
        if isinstance(value, float):
            value = round(value, 4)
        self.items.append(EvidenceItem(name, value, f"{op} {threshold}", meaning, supports, holds, weight if holds else 0.0))
        if holds and supports:
            self.scores[supports] += weight
        return holds

    def note(self, name: str, value, meaning: str) -> None:
        if value is None:
            return
        if isinstance(value, float):
            value = round(value, 4)
        self.items.append(EvidenceItem(name, value, None, meaning))


def diagnose(ev: Evidence) -> Diagnosis:
    r = _Rules()
    r.note("rollouts", ev.n_rollouts, "finished rollouts the evidence covers")
    r.note("throughput_rps", ev.throughput_rps, "successful rollouts per second while running")
    r.note("parallelism", ev.parallelism, "mean configured parallelism (num_samples_in_parallel)")

    # ---- network / rate limits ------------------------------------------------------------------
    r.check("rate_429", ev.rate_429, RATE_429, "share of request attempts answered 429 Too Many Requests", NETWORK, 3.0)
    r.check("rate_timeout", ev.rate_timeout, RATE_TIMEOUT, "share of request attempts that timed out", NETWORK, 1.5)
    r.check("rate_connection", ev.rate_connection, RATE_CONNECTION, "share of request attempts with connection errors", NETWORK, 1.5)
    r.check("connection_or_timeout_heavy", (ev.rate_connection or 0) + (ev.rate_timeout or 0) if ev.attempts else None,
            RATE_CONNECTION_HEAVY, "connection errors + timeouts on this share of attempts: a replica is down or hung", NETWORK, 2.0)
    if ev.replica_error_top_share is not None:
        r.check("replica_errors_concentrated", ev.replica_error_top_share, REPLICA_CONCENTRATED,
                f"share of connection errors / timeouts on one replica ({ev.replica_error_top})", NETWORK, 1.0)
    r.note("server_slots", ev.server_slots, "requests the server runs at once: " + (ev.server_slots_bound or "unknown"))
    r.note("truncated_share", ev.truncated_share, "share of outputs stopped by the token limit")
    rpm_util = None
    if ev.rpm_limit and ev.throughput_rps is not None:
        rpm_util = ev.throughput_rps * 60.0 / ev.rpm_limit
        r.check("rpm_utilization", rpm_util, RPM_UTILIZATION, "throughput x 60 / the endpoint's RPM limit: pinned at the limit", NETWORK, 3.0)

    # ---- verification ---------------------------------------------------------------------------
    r.check("verify_share", ev.verify_share, VERIFY_SHARE_BOUND, "share of each rollout's time spent in the verifier", VERIFICATION, 3.0)
    r.check("verify_share_dominant", ev.verify_share, VERIFY_SHARE_DOMINANT, "verification takes most of each rollout's time", VERIFICATION, 1.0)
    pool_frac = None
    if ev.cpu_children_pct is not None and ev.cpu_cores:
        pool_frac = ev.cpu_children_pct / (100.0 * ev.cpu_cores)
    if ev.verify_share is not None and ev.verify_share >= VERIFY_SHARE_SUPPORT:
        r.check("verify_pool_cpu", pool_frac, CPU_POOL_SATURATED_FRAC, "CPU of the verification processes / all cores (CPU usage high during collection)", VERIFICATION, 1.5)

    # ---- NeMo Gym agent server (agent jobs) -------------------------------------------------------
    if ev.agent_job:
        r.note("agent_run_ms_mean", ev.agent_run_ms, "mean /run time per rollout (ms): the agent's whole answer")
        r.note("agent_model_ms_mean", ev.agent_model_ms, "model server time per rollout (ms, its /metrics e2e latency)")
        r.note("agent_model_calls", ev.agent_model_calls, "model requests per rollout")
        r.note("agent_own_ms_mean", ev.agent_own_ms, "/run time outside the model server per rollout (ms): the agent's "
                                                     "work, tools and its /verify call")
        r.check("agent_share", ev.agent_share, AGENT_SHARE_BOUND, "share of each rollout's /run time spent in the agent "
                "server itself (its work, tools, its call to the resources server's /verify), not the model", AGENT, 3.0)

    # ---- model inference ------------------------------------------------------------------------
    lagging = (ev.loop_lag_p99_ms or 0) >= LOOP_LAG_P99_MS
    r.check("model_share", ev.model_share, MODEL_SHARE_BOUND,
            "share of each rollout's time spent waiting for the model (TTFT + generation)"
            + (" -- inflated: the event loop lags, so responses wait for it" if lagging else ""), MODEL, 1.0 if lagging else 2.0)
    saturated = False
    saturated |= r.check("server_waiting_frac", ev.vllm_waiting_frac, SERVER_WAITING_FRAC, "share of /metrics scrapes with requests waiting in vLLM's queue", MODEL, 1.5)
    if ev.max_num_seqs and ev.vllm_running_max is not None:
        saturated |= r.check("running_vs_max_num_seqs", ev.vllm_running_max / ev.max_num_seqs, RUNNING_NEAR_CAP,
                             "peak running requests / max_num_seqs", MODEL, 1.5)
    saturated |= r.check("kv_cache_usage_max", ev.vllm_kv_max, KV_HIGH, "peak KV-cache usage (vllm:kv_cache_usage_perc)", MODEL, 1.0)
    saturated |= r.check("vllm_preemptions", ev.vllm_preemptions, 1, "sequences preempted (KV cache exhausted) during the run", MODEL, 1.0)
    saturated |= r.check("vllm_queue_time_mean_s", ev.vllm_queue_mean_s, VLLM_QUEUE_MEAN_S, "mean time requests waited in vLLM's queue (s)", MODEL, 1.0)
    gpu_busy = r.check("gpu_utilization", ev.gpu_util_mean, GPU_BUSY_PCT, "mean GPU utilization (NVML)", MODEL, 1.5)
    saturated |= gpu_busy
    sweep_ratio = None
    if ev.sweep and ev.sweep.get("hint") == "verification":
        r.check("sweep_queued_in_verification", 1.0, 1.0, "the sweep saw requests pile up in verification past its knee",
                VERIFICATION, 1.5)
    elif ev.sweep and ev.sweep.get("points"):
        pts = [p for p in ev.sweep["points"] if p.get("rollouts_per_s")]
        if pts:
            best = max(p["rollouts_per_s"] for p in pts)
            first = pts[0]["rollouts_per_s"]
            sweep_ratio = best / first if first > 0 else None
            r.check("sweep_speedup", sweep_ratio, SWEEP_SCALED, "best / lowest-parallelism throughput in the sweep: time fell a lot -> model", MODEL, 1.5)

    # ---- control plane ----------------------------------------------------------------------------
    # A lagging loop while verification dominates: the verifier runs on the loop (not in the process pool),
    # so the lag is verification's, not our overhead's.
    # Verification seconds per second of run: >= VERIFY_LOOP_OCCUPANCY with a lagging loop means the verifier
    # itself occupies the loop (a pool verifier's time does not block it).
    occupancy = None
    if ev.verify_ms is not None and ev.throughput_rps:
        occupancy = ev.verify_ms * ev.throughput_rps / 1000.0
    lag_owner = CONTROL_PLANE
    if (ev.verify_share or 0) >= VERIFY_SHARE_BOUND or (lagging and (occupancy or 0) >= VERIFY_LOOP_OCCUPANCY):
        lag_owner = VERIFICATION
    lag_note = " (verification runs on the loop)" if lag_owner == VERIFICATION else ""
    if lagging:
        r.check("verify_loop_occupancy", occupancy, VERIFY_LOOP_OCCUPANCY,
                "verifier seconds per second of run while the loop lags: the verifier blocks the event loop", VERIFICATION, 1.5)
    r.check("loop_lag_p99_ms", ev.loop_lag_p99_ms, LOOP_LAG_P99_MS, "event-loop lag p99 (ms): the worker's loop is blocked" + lag_note, lag_owner, 3.0)
    r.check("loop_lag_mean_ms", ev.loop_lag_mean_ms, LOOP_LAG_MEAN_MS, "event-loop lag mean (ms)" + lag_note, lag_owner, 1.0)
    r.check("cpu_main_pct", ev.cpu_main_pct, CPU_MAIN_SATURATED_PCT, "CPU of the worker's event-loop process, % of one core" + lag_note, lag_owner, 1.0)
    retrying = ((ev.rate_429 or 0) >= RATE_429 or (ev.rate_timeout or 0) >= RATE_TIMEOUT
                or (ev.rate_connection or 0) >= RATE_CONNECTION)
    if (ev.verify_share or 0) < VERIFY_SHARE_SUPPORT:
        # time outside model and verifier: retries and backoff when requests fail, else our own overhead
        r.check("overhead_share", ev.overhead_share, OVERHEAD_SHARE_BOUND,
                "share of each rollout's time outside model and verifier"
                + (" (retries and backoff after failed requests)" if retrying else " (our own overhead)"),
                NETWORK if retrying else CONTROL_PLANE, 1.5)
    if not (ev.rate_429 or 0) >= RATE_429:
        # A rollout being verified holds no request slot (the engine runs twice the parallelism in workers): where
        # verification takes a real share of each rollout, empty slots are rollouts waiting on the verifier.
        waits_on_verifier = (ev.verify_share or 0) >= VERIFY_SHARE_SUPPORT
        r.check("slot_utilization_low", ev.slot_utilization, SLOT_UTILIZATION_LOW,
                "in-flight requests / parallelism: slots not kept full"
                + (" (rollouts wait on the verifier)" if waits_on_verifier else ""),
                VERIFICATION if waits_on_verifier else CONTROL_PLANE, 1.0, op="<")

    # ---- extra context (not scored)
    r.note("queue_ms_mean", ev.queue_ms, "mean wait for a parallelism slot (ms)")
    r.note("ttft_ms_mean", ev.ttft_ms, "mean time to first token (ms)")
    r.note("generation_ms_mean", ev.generation_ms, "mean generation time (ms)")
    r.note("verify_ms_mean", ev.verify_ms, "mean verification time (ms)")
    r.note("verify_pool_utilization", ev.verify_pool_utilization, "busy verification processes / pool size")
    r.note("verify_queue_mean", ev.verify_queue_mean, "verifications waiting for the pool or a slot (mean)")
    r.note("verify_cache_hit_rate", ev.verify_cache_hit_rate, "verifications answered by the cache")
    if ev.profile_top:
        r.note("profile_top_function", ev.profile_top["function"],
               f"the function holding most verification time in the job's profile ({ev.profile_top['figure']})")
    r.note("wall_ms_mean", ev.wall_ms, "mean slot time per rollout (ms)")
    r.note("vllm_running_mean", ev.vllm_running_mean, "mean running requests in vLLM")
    r.note("vllm_waiting_mean", ev.vllm_waiting_mean, "mean waiting requests in vLLM")
    r.note("cpu_total_pct", ev.cpu_total_pct, "CPU of worker + verification pool, % of one core")
    r.note("cpu_cores", ev.cpu_cores, "cores on the worker host")

    # ---- an endpoint that never answered: a verdict of its own, whatever the volume
    conn_share = ((ev.rate_connection or 0) + (ev.rate_timeout or 0)) if ev.attempts else None
    unreachable = not ev.n_ok and (
        (conn_share is not None and conn_share >= UNREACHABLE_SHARE)
        or "cannot reach" in (ev.failure_reason or "").lower())
    if unreachable:
        r.check("endpoint_unreachable", 1.0, 1.0,
                "no request succeeded and they failed to connect or timed out (or the job failed: cannot reach)",
                NETWORK, 10.0)

    # ---- verdict -----------------------------------------------------------------------------------
    scores = r.scores
    ranked = sorted(scores.items(), key=lambda kv: kv[1], reverse=True)
    (top, top_score), (_, second_score) = ranked[0], ranked[1]
    verdict = top
    if unreachable:
        verdict = NETWORK
    elif ev.n_rollouts < MIN_ROLLOUTS or top_score < MIN_SCORE:
        verdict = INSUFFICIENT
    elif top_score == second_score:
        verdict = INSUFFICIENT
    if verdict == INSUFFICIENT:
        confidence = 0.0
    else:
        margin = (top_score - second_score) / top_score
        coverage = min(1.0, top_score / 6.0)
        confidence = round(min(0.97, 0.35 + 0.4 * margin + 0.25 * coverage), 2)

    subtype = ""
    par = int(round(ev.parallelism)) if ev.parallelism else None
    if unreachable:
        subtype, confidence = "unreachable", 0.95
    elif verdict == MODEL:
        subtype = "server_saturated" if saturated else ("client_parallelism" if ev.vllm_scrapes or ev.gpu_count else "model_latency")
        if subtype != "server_saturated" and par and ev.server_slots and par >= ev.server_slots:
            subtype = "server_full"  # the server has no free slot for more requests: the capacity it prints
    diag = Diagnosis(verdict=verdict, confidence=confidence, summary="", evidence_items=r.items,
                     scores={k: round(v, 2) for k, v in scores.items()}, label=VERDICT_LABELS[verdict], subtype=subtype,
                     server_slots=ev.server_slots, server_slots_bound=ev.server_slots_bound)
    diag.recommendations = _replica_recommendations(ev) + _recommendations(verdict, subtype, ev, sweep_ratio)
    diag.conditions = _conditions(ev)
    _agree(diag, ev)
    diag.summary = _summary(diag, ev)
    return diag


RAISE_PARALLELISM = re.compile(r"(?<!not )\b(raise|increase) parallelism", re.I)


def raises_parallelism(text: str) -> bool:
    """Advice to run more requests at once ("Raise parallelism ...", "Increase parallelism ...")."""
    return bool(RAISE_PARALLELISM.search(text or ""))


def _room_for_more(diag: Diagnosis, ev: Evidence) -> bool:
    """Whether the diagnosis's own verdict and capacity leave room to run more requests at once."""
    if diag.verdict != MODEL or diag.subtype in ("server_saturated", "server_full"):
        return False
    par = int(round(ev.parallelism)) if ev.parallelism else None
    return not (par and ev.server_slots and par >= ev.server_slots)


def _agree(diag: Diagnosis, ev: Evidence) -> None:
    """One voice: no next step or condition fix advises more parallelism when the verdict or the capacity
    the diagnosis prints says it would not help (the verdict's own advice stands; a generic fix goes)."""
    if _room_for_more(diag, ev):
        return
    diag.recommendations = [r for r in diag.recommendations if not raises_parallelism(r.action)]
    for c in diag.conditions:
        c.fixes = [f for f in c.fixes if not raises_parallelism(f)]


# ------------------------------------------------------------------------------------ recommendations
def rate_limit_parallelism(rpm: float, latency_s: float, headroom: float = RATE_LIMIT_HEADROOM) -> int:
    """Seed 001: keep parallelism <= RPM/60 x mean request latency (s). At least 1."""
    return max(1, int(math.floor(rpm / 60.0 * latency_s * headroom)))


def _bounded(target: int, ev: Evidence) -> tuple[int, str]:
    """A parallelism figure bounded by what the server can run at once; returns (figure, the bound in words)."""
    if ev.server_slots:
        if target >= ev.server_slots:
            return ev.server_slots, f"capped at the server's capacity: {ev.server_slots_bound}"
        return target, f"within the server's capacity: {ev.server_slots_bound}"
    return target, "no server capacity known (state max_num_seqs on the endpoint, or point telemetry at /metrics)"


def _kv_pressure(ev: Evidence) -> bool:
    return (ev.vllm_preemptions or 0) >= 1 or (ev.vllm_kv_max or 0) >= KV_HIGH


def _truncated(ev: Evidence) -> bool:
    return (ev.truncated_share or 0) >= TRUNCATED_SHARE


def _replica_recommendations(ev: Evidence) -> list[Recommendation]:
    """Replicas out of rotation, whatever bounds the job: the engine already routes around them, the user
    restarts them."""
    recs = []
    live = (ev.replicas or 0) - len(ev.replicas_out)
    for r in ev.replicas_out:
        recs.append(Recommendation(
            f"Restart or fix replica {r['url']}: it is out of rotation ({r['reason'] or 'failing'})",
            "The job runs on the " + (f"{live} other replica{'s' if live != 1 else ''}" if live > 0 else "others")
            + "; the replica comes back into rotation by itself once its health check answers"
            + (f" (taken out {r['times_out']} time{'s' if r['times_out'] != 1 else ''} so far)." if r.get("times_out") else "."),
            "replicas", r["url"]))
    return recs


def _recommendations(verdict: str, subtype: str, ev: Evidence, sweep_ratio: float | None) -> list[Recommendation]:
    recs: list[Recommendation] = []
    par = int(round(ev.parallelism)) if ev.parallelism else None
    sweep_rec = (ev.sweep or {}).get("recommended")
    if verdict == MODEL:
        if subtype != "server_saturated":
            raw = sweep_rec or (par * 2 if par else None)
            if raw:
                target, bound = _bounded(int(raw), ev)
                if par and target <= par:  # already at what the server can run
                    recs.append(Recommendation(
                        f"Add model-server replicas or raise max_num_seqs: parallelism {par} already fills the server",
                        f"Bound: {bound}. More requests in flight would only wait in its queue.", "replicas", None))
                else:
                    recs.append(Recommendation(
                        f"Raise parallelism (num_samples_in_parallel) to {target}",
                        "Time goes to the model but the server shows room (no waiting queue, KV cache not full): more "
                        f"requests in flight fill its batches. {'From the sweep. ' if sweep_rec else ''}Bound: {bound}.",
                        "num_samples_in_parallel", target))
        elif _kv_pressure(ev):
            gmu = ev.server_gpu_memory_utilization
            mml = ev.server_max_model_len or ev.max_model_len
            if gmu is None or gmu < GPU_MEMORY_UTILIZATION_TRAINING:
                recs.append(Recommendation(
                    (f"Raise gpu_memory_utilization from {gmu:g} to {GPU_MEMORY_UTILIZATION_TRAINING}" if gmu is not None
                     else f"Raise gpu_memory_utilization to {GPU_MEMORY_UTILIZATION_TRAINING}"),
                    f"The KV cache is full (peak {_fmt_pct(ev.vllm_kv_max)}, {ev.vllm_preemptions or 0:.0f} preemptions): "
                    "a larger cache admits more sequences without recomputing them (watch for OOM).",
                    "gpu_memory_utilization", GPU_MEMORY_UTILIZATION_TRAINING))
            need = None
            if ev.max_output_tokens:
                need = ev.max_output_tokens * 2  # prompt + output with room; the tasks' real need is below it
            if mml and (need is None or need < mml):
                to = need if need else min(mml // 2, 8192)
                recs.append(Recommendation(
                    f"Lower max_model_len from {mml} to what the tasks need (about {to})",
                    "The KV cache holds {} requests of the full context; a shorter context holds more.".format(
                        f"{ev.kv_max_concurrency:.0f}" if ev.kv_max_concurrency else "few"),
                    "max_model_len", to))
            elif not mml:
                recs.append(Recommendation("Lower max_model_len to what your tasks need (e.g. 4096-8192)",
                                           "A shorter context leaves KV cache for more concurrent sequences.", "max_model_len", None))
            recs.append(Recommendation(
                "Spread the model over more GPUs (tensor_parallel_size = GPU count) or add replicas",
                "More GPU memory per copy of the weights leaves more for the KV cache.", "tensor_parallel_size", None))
            slots = ev.server_slots
            if par and slots and par > slots:
                recs.append(Recommendation(f"Lower parallelism to {slots} until the cache grows",
                                           f"Bound: {ev.server_slots_bound}. Requests past it wait or get preempted.",
                                           "num_samples_in_parallel", slots))
        else:
            # slots full: the server runs all it can; more of it, not KV tuning
            slots = ev.server_slots
            per = None
            if slots and ev.replicas:
                per = max(1, slots // ev.replicas)
            recs.append(Recommendation(
                "Add model-server replicas" + (f" (now {ev.replicas}, {slots} requests at once in all)" if ev.replicas and slots else "")
                + " or raise max_num_seqs" + (f" above {per} per replica" if per else ""),
                "Every request slot is busy and requests wait in the server's queue"
                + (f" (bound: {ev.server_slots_bound})" if slots else "")
                + "; the KV cache is not the limit" + (f" (peak {_fmt_pct(ev.vllm_kv_max)})" if ev.vllm_kv_max is not None else "")
                + ". More slots run more requests at once.", "max_num_seqs", None))
            if ev.max_model_len or ev.server_max_model_len:
                mbt = ev.server_max_model_len or ev.max_model_len
                recs.append(Recommendation(f"Set max_num_batched_tokens >= max_model_len ({mbt})",
                                           "Larger scheduler steps batch more tokens per step.", "max_num_batched_tokens", mbt))
            else:
                recs.append(Recommendation("Raise max_num_batched_tokens (at least max_model_len)",
                                           "Larger scheduler steps batch more tokens per step.", "max_num_batched_tokens", None))
            if par and slots and par > slots:
                target = sweep_rec if sweep_rec and sweep_rec <= slots else slots
                recs.append(Recommendation(
                    f"Keep parallelism near {target}: more only waits in the server's queue",
                    f"Bound: {ev.server_slots_bound}.", "num_samples_in_parallel", target))
        if _truncated(ev):
            recs.append(Recommendation(
                f"Outputs stop at the token limit ({_fmt_pct(ev.truncated_share)} of them"
                + (f", max_output_tokens {ev.max_output_tokens}" if ev.max_output_tokens else "") + "): they are truncated",
                "Truncated answers score badly and teach the model to stop mid-answer; raise the limit if the tasks need "
                "it, do not lower it for speed.", "max_output_tokens", None))
        elif ev.output_tokens_mean and ev.max_output_tokens and ev.output_tokens_mean < 0.5 * ev.max_output_tokens:
            recs.append(Recommendation(
                f"Lower max_output_tokens from {ev.max_output_tokens} toward what outputs use (mean {ev.output_tokens_mean:.0f})",
                "A smaller limit reserves less KV cache per request.", "max_output_tokens", None))
    elif verdict == VERIFICATION:
        if (ev.loop_lag_p99_ms or 0) >= LOOP_LAG_P99_MS:
            recs.insert(0, Recommendation("Run the verifier in the process pool (mark it cpu_bound = True)",
                                       "It runs on the worker's event loop and blocks it ({:.0f} ms lag p99): requests and "
                                       "results wait behind every verification.".format(ev.loop_lag_p99_ms), None, None))
        recs.append(Recommendation("Cache expensive computations in the verifier (functools.lru_cache on repeated lookups / parsing)",
                                   "Verification takes {} of each rollout's time.".format(_fmt_pct(ev.verify_share)), None, None))
        recs.append(Recommendation("Use fast mode for training data (verify_mode = fast), exact verification for final evaluation",
                                   "A quick heuristic reward is usually enough for RL training data.", "verify_mode", "fast"))
        recs.append(Recommendation("Defer verification: collect now (verify_mode = deferred), verify in batch later at high parallelism",
                                   "Collection stops waiting on the verifier; batch verification scales without model inference. "
                                   "Trade-off: no real-time reward feedback.", "verify_mode", "deferred"))
        if ev.cpu_cores:
            recs.append(Recommendation(f"Give verification more CPU (verify_processes, more workers); this host has {ev.cpu_cores} cores",
                                       "CPU-bound verifiers run in a process pool bounded by the cores.", "verify_processes", None))
        top = ev.profile_top
        if top:
            recs.insert(0, Recommendation(f"Fix {top['function']} ({top['module']}:{top['line']}) first: {top['figure']}",
                                          f"The job's profile names it{' (' + top['flag'] + ')' if top.get('flag') else ''}: "
                                          f"{top['advice']}.", None, None))
        else:
            recs.append(Recommendation("Profile verification for 60 s (the job keeps running) and fix the function with the "
                                       "highest ttot", "Look for high tsub, high tavg x ncall, synchronous external calls.",
                                       "profile_seconds", 60))
        recs.append(Recommendation("Do not raise parallelism: the model is not the limit",
                                   "More requests in flight only wait for the verifier.", None, None))
    elif verdict == NETWORK and subtype == "unreachable":
        recs.append(Recommendation(
            "Start the model server (or fix the endpoint's URL), check its health on the endpoint's page, then resume "
            "the job",
            "No request reached it: "
            + (f"{_fmt_pct((ev.rate_connection or 0) + (ev.rate_timeout or 0))} of {ev.attempts} request attempts "
               "could not connect or timed out" if ev.attempts else "the job stopped because it cannot reach it")
            + ". Nothing about the job's settings can be judged until it answers.", None, None))
        recs.append(Recommendation(
            "Do not change parallelism for this: no request got through",
            "Throughput, timing and capacity figures mean nothing while the server is down.", None, None))
    elif verdict == NETWORK:
        conn = (ev.rate_connection or 0) + (ev.rate_timeout or 0)
        limited = (ev.rate_429 or 0) >= RATE_429 or (ev.rpm_limit and ev.throughput_rps
                                                     and ev.throughput_rps * 60.0 / ev.rpm_limit >= RPM_UTILIZATION)
        out = {r["url"] for r in ev.replicas_out}
        if (ev.replica_error_top and (ev.replica_error_top_share or 0) >= REPLICA_CONCENTRATED
                and ev.replica_error_top not in out):  # one the breaker already took out is named above
            n = ev.replica_errors.get(ev.replica_error_top, 0)
            recs.append(Recommendation(
                f"Take replica {ev.replica_error_top} out of the endpoint (or restart it)",
                f"{_fmt_pct(ev.replica_error_top_share)} of the connection errors / timeouts ({n:.0f}) come from it; "
                f"{_fmt_pct(conn)} of request attempts failed that way"
                + (f", {ev.n_failed} rollouts failed" if ev.n_failed else "") + ". The other replicas answer.",
                "replicas", ev.replica_error_top))
        if limited:
            latency = ev.request_latency_s
            rpm = ev.rpm_limit
            estimated = False
            if not rpm and ev.throughput_rps:
                rpm = ev.throughput_rps * 60.0  # what the endpoint actually accepted while throttling
                estimated = True
            if rpm and latency:
                p = rate_limit_parallelism(rpm, latency)
                p, bound = _bounded(p, ev)
                recs.append(Recommendation(
                    f"Set parallelism <= RPM/60 x mean latency = {rpm:.0f}/60 x {latency:.2f} s = {p}",
                    ("RPM estimated from the accepted request rate while throttled. " if estimated else "")
                    + f"Latency measured on this job's successful requests. Bound: {bound}. "
                    "More requests in flight than the rate allows only collect 429s and backoff.",
                    "num_samples_in_parallel", p))
            else:
                recs.append(Recommendation("Set parallelism below RPM/60 x mean latency (e.g. 500 RPM, 1 s -> 8)",
                                           "Respect the tier's requests-per-minute limit.", "num_samples_in_parallel", None))
            recs.append(Recommendation("Use adaptive parallelism (parallelism: auto)",
                                       "It backs off on 429s and settles just under the limit.", "parallelism_auto", True))
            recs.append(Recommendation("Choose a higher service tier (e.g. service_tier: scale) for large generation runs",
                                       "Higher throughput limits, higher cost.", "service_tier", "scale"))
        if conn >= RATE_CONNECTION and not recs:
            recs.append(Recommendation(
                "Check the model server and the network between the worker and it"
                + (f" (timeouts: client timeout {ev.request_timeout_s:.0f} s)" if (ev.rate_timeout or 0) >= RATE_TIMEOUT and ev.request_timeout_s else ""),
                f"{_fmt_pct(ev.rate_connection)} of attempts had connection errors, {_fmt_pct(ev.rate_timeout)} timed out.",
                None, None))
        if not recs:
            recs.append(Recommendation("Check the endpoint's errors (5xx / 4xx) in the failed rollouts",
                                       "Request errors dominate the run.", None, None))
    elif verdict == AGENT:
        own = f"{ev.agent_own_ms:.0f} ms" if ev.agent_own_ms is not None else "most"
        run = f" of {ev.agent_run_ms:.0f} ms" if ev.agent_run_ms is not None else ""
        recs.append(Recommendation(
            "Give the agent server more workers: set num_workers on the agent's config "
            "(e.g. +<agent_name>.responses_api_agents.<impl>.num_workers=4 on ng_run), and on its resources server",
            f"{own}{run} of each /run is spent in the agent, not the model server: one uvicorn worker runs the agent's "
            "Python (tool calls, parsing, its /verify call) on one core.", "num_workers", None))
        recs.append(Recommendation(
            "Profile the resources server's verify() (start ng_run with +profiling_enabled=true; the job's profiling panel "
            "pulls it)", "The agent waits for /verify inside each /run; a verifier that forks a process or calls out per "
            "row shows up there.", "profile_seconds", 60))
        recs.append(Recommendation(
            "Do not raise parallelism to fix this: the model server is not the limit",
            "More requests in flight queue in the agent server." + (
                f" The model takes {ev.agent_model_ms:.0f} ms per rollout ({ev.agent_model_calls:.1f} calls)."
                if ev.agent_model_ms is not None and ev.agent_model_calls is not None else ""), None, None))
    elif verdict == CONTROL_PLANE:
        recs.append(Recommendation("Move blocking work off the event loop (sink writes to a thread, CPU-heavy verifiers to the process pool: cpu_bound = True)",
                                   "The worker's event loop lags by {:.0f} ms (p99): requests and results wait for it.".format(ev.loop_lag_p99_ms or 0), None, None))
        recs.append(Recommendation("Spread the job over more workers (smaller chunks)",
                                   "One worker process cannot feed the endpoint at this rate.", "chunk_size", None))
        recs.append(Recommendation("Do not raise parallelism until the overhead is fixed",
                                   "More concurrency adds load to the already saturated loop.", None, None))
    else:
        recs.append(Recommendation("Run a parallelism sweep (e.g. 1, 2, 4 ... 64) on a sample of tasks",
                                   "How throughput scales with parallelism separates model from verification / network bottlenecks.", None, None))
        if ev.n_rollouts < MIN_ROLLOUTS:
            recs.append(Recommendation(f"Collect at least {MIN_ROLLOUTS} rollouts before diagnosing",
                                       f"Only {ev.n_rollouts} finished so far.", None, None))
        if not ev.vllm_scrapes:
            recs.append(Recommendation("Point telemetry at the model server's /metrics (vLLM) if it has one",
                                       "Running / waiting requests and KV-cache usage tell whether the server is saturated.", None, None))
    return recs


def _conditions(ev: Evidence) -> list[Condition]:
    out: list[Condition] = []
    if (ev.vllm_preemptions or 0) >= 1 or (ev.vllm_kv_max or 0) >= KV_CRITICAL:
        out.append(Condition(
            "oom_preemption", "Out of memory / preemptions",
            f"preemptions during the run: {ev.vllm_preemptions or 0:.0f}; peak KV-cache usage {_fmt_pct(ev.vllm_kv_max)} (threshold {_fmt_pct(KV_CRITICAL)})",
            ["Reduce parallelism (num_samples_in_parallel) to what the KV cache holds"
             + (f" ({ev.kv_max_concurrency:.0f} requests of max_model_len)" if ev.kv_max_concurrency else ""),
             "Reduce context length: lower max_model_len in the vLLM config"
             + (f" (now {ev.server_max_model_len})" if ev.server_max_model_len else ""),
             "If the server itself runs out of GPU memory (crashes, not preemptions): lower gpu_memory_utilization to 0.85-0.90"
             + (f" (now {ev.server_gpu_memory_utilization:g})" if ev.server_gpu_memory_utilization else ""),
             "Use a smaller model (8B instead of 70B) if acceptable"]))
    if _truncated(ev):
        out.append(Condition(
            "truncated_outputs", "Outputs truncated at the token limit",
            f"{_fmt_pct(ev.truncated_share)} of outputs stopped at the limit (threshold {_fmt_pct(TRUNCATED_SHARE)})"
            + (f"; max_output_tokens {ev.max_output_tokens}" if ev.max_output_tokens else ""),
            ["Raise max_output_tokens if the tasks need longer answers (check a few outputs)",
             "Do not lower it for speed: truncated answers get low rewards"]))
    if (ev.rate_timeout or 0) >= RATE_TIMEOUT:
        out.append(Condition(
            "timeouts", "Timeouts",
            f"{_fmt_pct(ev.rate_timeout)} of request attempts timed out (threshold {_fmt_pct(RATE_TIMEOUT)})"
            + (f"; client timeout {ev.request_timeout_s:.0f} s" if ev.request_timeout_s else ""),
            ["Increase the client timeout (the endpoint's request timeout)", "Reduce output length: lower max_output_tokens",
             "Check verification time: profile the verification function", "Increase the model server's timeout"]))
    inconsistent = (ev.throughput_cv or 0) >= THROUGHPUT_CV
    contention = (ev.cpu_machine_pct or 0) >= CPU_MACHINE_BUSY_PCT and (ev.cpu_total_pct or 0) < 0.5 * (ev.cpu_machine_pct or 0) * (ev.cpu_cores or 1)
    if inconsistent or contention:
        bits = []
        if inconsistent:
            bits.append(f"throughput varies by {_fmt_pct(ev.throughput_cv)} (coefficient of variation, threshold {_fmt_pct(THROUGHPUT_CV)})")
        if contention:
            bits.append(f"the machine is {ev.cpu_machine_pct:.0f}% busy while this worker uses {ev.cpu_total_pct:.0f}% of one core")
        if ev.gpu_temp_max and ev.gpu_temp_max >= GPU_HOT_C:
            bits.append(f"GPU at {ev.gpu_temp_max:.0f} C")
        out.append(Condition(
            "inconsistent_speeds", "Inconsistent speeds", "; ".join(bits),
            ["Check resource contention: other processes using GPU/CPU", "Monitor thermal throttling: GPU temperatures causing slowdowns",
             "Check network stability (hosted APIs)", "Use dedicated resources for benchmarking"]))
    if ev.gpu_util_mean is not None and ev.gpu_util_mean < GPU_LOW_PCT:
        out.append(Condition(
            "low_gpu_utilization", "Low GPU utilization",
            f"mean GPU utilization {ev.gpu_util_mean:.0f}% (threshold {GPU_LOW_PCT:.0f}%)",
            ["Increase parallelism: more concurrent requests to fill batches", "Check verification bottleneck: CPU-bound verification limiting throughput",
             "Reduce batch waiting time: adjust vLLM batching parameters", "Pre-warm model: send dummy requests before starting"]))
    if (ev.rate_5xx or 0) >= RATE_5XX:
        out.append(Condition(
            "server_errors", "Server errors (infrastructure overloaded)",
            f"{_fmt_pct(ev.rate_5xx)} of request attempts got HTTP 5xx (threshold {_fmt_pct(RATE_5XX)})",
            ["Reduce parallelism", "Check the model server's health and logs (OOM, crashes)"]))
    if (ev.rate_4xx or 0) >= RATE_4XX:
        out.append(Condition(
            "request_errors", "Requests rejected (HTTP 4xx)",
            f"{_fmt_pct(ev.rate_4xx)} of request attempts got HTTP 4xx (threshold {_fmt_pct(RATE_4XX)}), e.g. prompt + max tokens above max_model_len",
            ["Lower max_output_tokens", "Raise the server's max_model_len if tasks need it", "Check the API key and model name"]))
    if ev.cold_start_ratio is not None and ev.cold_start_ratio >= COLD_START_RATIO:
        out.append(Condition(
            "cold_start", "Slow start (cold model server)",
            f"time to first token at the start was {ev.cold_start_ratio:.1f}x later values (threshold {COLD_START_RATIO}x)",
            ["Pre-warm the model server: send a few dummy requests before a large collection"]))
    return out


def _summary(d: Diagnosis, ev: Evidence) -> str:
    if d.verdict == INSUFFICIENT:
        if ev.n_rollouts < MIN_ROLLOUTS:
            return f"Not enough evidence: {ev.n_rollouts} rollouts finished (need {MIN_ROLLOUTS})."
        return "Not enough evidence: no signal stands out (scores " + ", ".join(f"{k} {v}" for k, v in d.scores.items()) + ")."
    held = [i.name for i in d.held() if i.supports == d.verdict]
    text = f"{d.label} bound ({int(d.confidence * 100)}% confidence): " + ", ".join(held) + "."
    if d.subtype == "unreachable":
        text = ("The endpoint is unreachable: no request succeeded"
                + (f"; {_fmt_pct((ev.rate_connection or 0) + (ev.rate_timeout or 0))} of {ev.attempts} attempts could "
                   "not connect or timed out." if ev.attempts else "; the job failed: cannot reach it."))
    elif d.verdict == MODEL and d.subtype == "server_saturated":
        text += " The model server is saturated."
    elif d.verdict == MODEL and d.subtype == "server_full":
        text += (f" Parallelism {int(round(ev.parallelism))} already fills the server ({ev.server_slots_bound}): "
                 "add replicas or raise max_num_seqs.")
    elif d.verdict == MODEL and d.subtype == "client_parallelism":
        text += " The server has room: raise parallelism."
    return text
