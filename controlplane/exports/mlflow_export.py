"""MLflow export: per job a run with its parameters, its metric series (samples/s, output tokens/s, errors, reward,
in flight, one point per second of the job), aggregate metrics and figures, the diagnosis and a sampled rollout
table as artifacts.

A job asks for it with the option `mlflow_tracking_uri` (job form, API, `rolloutctl run --mlflow`). The value
names one of the deployment's tracking servers (setting MLFLOW_TRACKING_URIS, name -> URI), by its name or its
exact URI; anything else is refused: a user-supplied URI would let a user make the workers write files where
they please or call any address. The job stores the name, resolved to the URI only when the run is exported.

Live: while the job runs, a beat task on the control lane (every MLFLOW_LIVE_INTERVAL_S; one query) queues a tick
per live job on the work queue (`live_tick_job`: it calls the tracking server, which must never hold a control
slot), which opens the run and appends each second of the series once every sample of that second is stored (MLFLOW_LIVE_LAG_S later);
the job's end appends the rest, the aggregates and the artifacts, and closes the run. Each second is written
exactly once: a writer first moves the job's cursor (`mlflow_live.until`, the first second not yet written) with
a conditional UPDATE, and writes only the seconds it moved past.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from collections import defaultdict
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from controlplane.diagnostics.services import diagnosis_payload, job_config
from controlplane.jobs.figures import job_figures
from controlplane.jobs.models import CollectionJob, JobMetricSample, JobState, Rollout
from controlplane.jobs.services import mlflow_targets

log = logging.getLogger(__name__)

OPTION = "mlflow"  # collection_options key: the tracking server's name
RUN_ID = "mlflow_run_id"  # collection_options key: the run, once exported
LIVE = "mlflow_live"  # collection_options key while the run is open: {"run_id", "until": first second not written}
FINAL = "final"  # the cursor's value once the job's end has taken the rest


def targets() -> dict[str, str]:
    return mlflow_targets()


def artifact_location(name: str, uri: str) -> str | None:
    """Where a new experiment keeps its artifacts: MLFLOW_ARTIFACT_LOCATIONS[name], else beside a local SQLite
    store (never MLflow's default ./mlruns in the worker's working directory), else the server's choice."""
    configured = (getattr(settings, "MLFLOW_ARTIFACT_LOCATIONS", {}) or {}).get(name)
    if configured:
        return configured
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).resolve().parent.joinpath("mlflow-artifacts").as_uri()
    return None


def job_wants(job_id) -> bool:
    if not targets() or not job_id:
        return False
    opts = CollectionJob.objects.filter(pk=job_id).values_list("collection_options", flat=True).first() or {}
    return bool(opts.get(OPTION)) and not opts.get(RUN_ID)


def _flat(prefix: str, value, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        if math.isfinite(value):
            out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _flat(f"{prefix}.{k}" if prefix else str(k), v, out)


def _key(name: str) -> str:
    """MLflow's keys: alphanumerics, _ - . space : / only, at most 250 characters."""
    return "".join(c if c.isalnum() or c in "_-. :/" else "_" for c in name)[:250]


def series(job, since: int = 0, until: int | None = None) -> dict[str, list[tuple[int, int, float]]]:
    """metric -> [(step = second of the job, timestamp ms, value)]: rates summed over the job's workers in each
    second, errors summed, reward the mean of the rollouts stored in that second. Seconds since <= s < until
    (until None: to the end); second 0 takes anything stamped before the job's start."""
    t0 = job.started_at or job.created_at
    window = {}
    if since > 0:
        window["gte"] = t0 + timedelta(seconds=since)
    if until is not None:
        window["lt"] = t0 + timedelta(seconds=until)
    buckets: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    stamp: dict[int, int] = {}
    samples = JobMetricSample.objects.filter(job_id=job.pk, **{f"t__{k}": v for k, v in window.items()})
    for t, sps, tps, in_flight, errors in (samples.order_by("t")
                                           .values_list("t", "samples_per_s", "output_tokens_per_s", "in_flight", "errors")
                                           .iterator(chunk_size=2000)):
        sec = max(0, int((t - t0).total_seconds()))
        b = buckets[sec]
        b["samples_per_s"] += sps or 0.0
        b["output_tokens_per_s"] += tps or 0.0
        b["in_flight"] += in_flight or 0
        b["errors"] += sum(v for v in (errors or {}).values() if isinstance(v, (int, float)))
        stamp.setdefault(sec, int(t.timestamp() * 1000))
    rewards: dict[int, list[float]] = defaultdict(list)
    rows = Rollout.objects.filter(job_id=job.pk, reward__isnull=False, **{f"created_at__{k}": v for k, v in window.items()})
    for t, reward in (rows.values_list("created_at", "reward")
                      .iterator(chunk_size=5000)):
        sec = max(0, int((t - t0).total_seconds()))
        rewards[sec].append(reward)
        stamp.setdefault(sec, int(t.timestamp() * 1000))
    out: dict[str, list] = defaultdict(list)
    for sec in sorted(set(buckets) | set(rewards)):
        for name, value in buckets.get(sec, {}).items():
            out[name].append((sec, stamp[sec], float(value)))
        if rewards.get(sec):
            out["reward"].append((sec, stamp[sec], sum(rewards[sec]) / len(rewards[sec])))
    return out


def rollout_table(job, rows: int) -> dict:
    """A sample of the job's rollouts spread over the whole job (every k-th by id), in MLflow's table layout."""
    qs = Rollout.objects.filter(job_id=job.pk)
    total = qs.count()
    step = max(1, total // max(1, rows))
    columns = ["task_index", "rollout_index", "status", "reward", "failure_class", "input_tokens", "output_tokens",
               "ttft_ms", "wall_ms", "trace_id", "output"]
    data = []
    for i, r in enumerate(qs.order_by("id").only(*columns[:-1], "data").iterator(chunk_size=500)):
        if i % step:
            continue
        data.append([r.task_index, r.rollout_index, r.status, r.reward, r.failure_class, r.input_tokens, r.output_tokens,
                     r.ttft_ms, r.wall_ms, r.trace_id, _output_text(r.data)[:2000]])
        if len(data) >= rows:
            break
    return {"columns": columns, "data": data}


def _output_text(data) -> str:
    resp = (data or {}).get("response") if isinstance(data, dict) else None
    if not isinstance(resp, dict):
        return ""
    parts = []
    for item in resp.get("output") or []:
        for c in (item.get("content") or []) if isinstance(item, dict) else []:
            if isinstance(c, dict) and isinstance(c.get("text"), str):
                parts.append(c["text"])
    return "\n".join(parts)


def _client(uri):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _open_run(client, job, name: str, uri: str) -> str:
    """A new run for the job, with its tags and parameters."""
    from mlflow.entities import Param, RunTag

    exp_name = getattr(settings, "MLFLOW_EXPERIMENT_NAME", "rollout-collection")
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(exp_name, artifact_location=artifact_location(name, uri))
    start = job.started_at or job.created_at
    run = client.create_run(exp_id, start_time=int(start.timestamp() * 1000), run_name=f"job {job.pk} {job.name}".strip(),
                            tags={"rollouts.job_id": str(job.pk), "rollouts.state": str(job.state),
                                  "rollouts.endpoint": job.endpoint.name if job.endpoint_id else "",
                                  "rollouts.dataset": job.dataset.name if job.dataset_id else ""})
    rid = run.info.run_id
    params = {"model": getattr(job.endpoint, "model", ""), "num_repeats": job.num_repeats,
              "num_samples_in_parallel": job.num_samples_in_parallel, "parallelism_auto": job.parallelism_auto,
              "total_rollouts": job.total_rollouts, "verifier_options": job.verifier_options or {},
              "responses_create_params": job.responses_create_params or {}, **job_config(job)}
    client.log_batch(rid, params=[Param(_key(k), str(v)[:6000]) for k, v in params.items() if v not in (None, "")],
                     tags=[RunTag("mlflow.note.content", f"Rollout collection job {job.pk}")])
    return rid


def _options(job_id) -> dict:
    return CollectionJob.objects.filter(pk=job_id).values_list("collection_options", flat=True).first() or {}


def _move_cursor(job_id, to) -> tuple[str, int] | None:
    """Move the live run's cursor to `to` (a second, or FINAL): (run id, the second it was at) for the caller to
    write from there, or None when there is no live run or nothing to write. Conditional on the cursor's value,
    so two writers (a tick and the job's end) never write the same second."""
    for _ in range(5):
        opts = _options(job_id)
        live = opts.get(LIVE)
        if not isinstance(live, dict) or live.get("until") == FINAL:
            return None
        at = int(live.get("until") or 0)
        if to != FINAL and to <= at:
            return None
        # collection_options is written whole; nothing else writes it while the job runs (the drop-in command
        # sets it before the first chunk)
        moved = CollectionJob.objects.filter(pk=job_id, **{f"collection_options__{LIVE}__until": live.get("until")}).update(
            collection_options={**opts, LIVE: {**live, "until": to}})
        if moved:
            return live["run_id"], at
    return None


def _log_series(client, rid: str, job, since: int, until: int | None) -> int:
    from mlflow.entities import Metric

    metrics = [Metric(_key(name_), value, ts, step) for name_, points in series(job, since, until).items()
               for step, ts, value in points]
    for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
        client.log_batch(rid, metrics=metrics[i:i + 1000])
    return len(metrics)


def live_jobs():
    """The running jobs that asked for MLflow and whose run is not closed; none (and no query) when no tracking
    server is configured."""
    if not targets():
        return CollectionJob.objects.none()
    return (CollectionJob.objects.filter(state=JobState.RUNNING, collection_options__has_key=OPTION)
            .exclude(collection_options__has_key=RUN_ID).select_related("endpoint", "dataset"))


def live_tick_job(job, now=None) -> int:
    """Open the job's run (first tick) and append the seconds whose samples are all stored; the points written.
    Calls the tracking server: run off the control lane (exports.tasks.mlflow_live_job_task)."""
    known = targets()
    name = (job.collection_options or {}).get(OPTION)
    uri = known.get(name)
    if not uri or (job.collection_options or {}).get(RUN_ID) or str(job.state) != JobState.RUNNING:
        return 0
    now = now or timezone.now()
    lag = float(getattr(settings, "MLFLOW_LIVE_LAG_S", 5.0))
    try:
        client = _client(uri)
        if LIVE not in (job.collection_options or {}):
            rid = _open_run(client, job, name, uri)
            opened = CollectionJob.objects.filter(pk=job.pk).exclude(collection_options__has_key=LIVE).update(
                collection_options={**job.collection_options, LIVE: {"run_id": rid, "until": 0}})
            if not opened:  # another tick opened one first
                client.delete_run(rid)
        t0 = job.started_at or job.created_at
        until = int((now - t0).total_seconds() - lag)
        claim = _move_cursor(job.pk, until) if until > 0 else None
        if claim:
            rid, since = claim
            return _log_series(client, rid, job, since, until)
    except Exception:  # noqa: BLE001 - a tracker being down never fails the job; the end writes what is left
        log.exception("job %s: live MLflow metrics failed", job.pk)
    return 0


def live_tick(now=None) -> dict:
    """Every live job's tick in this process, one after the other: {"jobs": ticked with points, "points"}."""
    done = {"jobs": 0, "points": 0}
    for job in live_jobs():
        points = live_tick_job(job, now)
        done["jobs"] += bool(points)
        done["points"] += points
    return done


def export_job(job) -> str | None:
    """Close the job's MLflow run (or write it whole when no live tick opened it): the series' remaining seconds,
    aggregates, figures, artifacts. Once: the run id is kept in collection_options. Returns the run id, or None
    when the job asked for none."""
    opts = job.collection_options or {}
    name = opts.get(OPTION)
    if not name or opts.get(RUN_ID):
        return opts.get(RUN_ID)
    uri = targets().get(name)
    if not uri:
        log.warning("job %s: MLflow server %r is no longer configured", job.pk, name)
        return None
    from mlflow.entities import Metric, RunTag

    client = _client(uri)
    claim = _move_cursor(job.pk, FINAL) if LIVE in opts else None
    if claim:
        rid, since = claim
    else:
        if LIVE in opts and (_options(job.pk).get(LIVE) or {}).get("until") == FINAL:
            return None  # another export is closing this run
        rid, since = _open_run(client, job, name, uri), 0
    start = job.started_at or job.created_at
    end_ms = int((job.finished_at or start).timestamp() * 1000)
    try:
        client.set_tag(rid, "rollouts.state", str(job.state))
        client.log_batch(rid, tags=[RunTag("mlflow.note.content", f"Rollout collection job {job.pk}: {job.state}")])
        _log_series(client, rid, job, since, None)
        finals: dict[str, float] = {}
        _flat("", job.aggregate_metrics or {}, finals)
        summary: dict[str, float] = {}
        _flat("", job_figures(job), summary)
        _flat("timing", job.timing_summary or {}, summary)
        metrics = [Metric(_key(f"aggregate.{k}"), v, end_ms, 0) for k, v in finals.items()]
        metrics += [Metric(_key(f"job.{k}"), v, end_ms, 0) for k, v in summary.items()]
        for i in range(0, len(metrics), 1000):
            client.log_batch(rid, metrics=metrics[i:i + 1000])
        diagnosis = diagnosis_payload(job)
        client.log_dict(rid, diagnosis, "diagnosis.json")
        client.log_dict(rid, rollout_table(job, int(getattr(settings, "MLFLOW_TABLE_ROWS", 100))), "rollouts_sample.json")
    except Exception:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid, status="FINISHED" if str(job.state) == "completed" else "FAILED", end_time=end_ms)
    latest = _options(job.pk)
    latest.pop(LIVE, None)
    job.collection_options = {**latest, RUN_ID: rid}
    CollectionJob.objects.filter(pk=job.pk).update(collection_options=job.collection_options)
    return rid
