"""MLflow export: per job a run with its parameters, its metric series (samples/s, output tokens/s, errors, reward,
in flight, one point per second of the job), aggregate metrics and figures, the diagnosis and a sampled rollout
table as artifacts.

A job asks for it with the option `mlflow_tracking_uri` (job form, API, `rolloutctl run --mlflow`). The value
names one of the deployment's tracking servers (setting MLFLOW_TRACKING_URIS, name -> URI), by its name or its
exact URI; anything else is refused: a user-supplied URI would let a user make the workers write files where
they please or call any address. The job stores the name, resolved to the URI only when the run is exported.

The series are written when the job ends, from the stored samples (timestamps as they were recorded), not
streamed while it runs.
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from collections import defaultdict

from django.conf import settings

from controlplane.diagnostics.services import diagnosis_payload, job_config
from controlplane.jobs.figures import job_figures
from controlplane.jobs.models import CollectionJob, JobMetricSample, Rollout
from controlplane.jobs.services import mlflow_targets

log = logging.getLogger(__name__)

OPTION = "mlflow"  # collection_options key: the tracking server's name
RUN_ID = "mlflow_run_id"  # collection_options key: the run, once exported


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


def series(job) -> dict[str, list[tuple[int, int, float]]]:
    """metric -> [(step = second of the job, timestamp ms, value)]: rates summed over the job's workers in each
    second, errors summed, reward the mean of the rollouts stored in that second."""
    t0 = job.started_at or job.created_at
    buckets: dict[int, dict] = defaultdict(lambda: defaultdict(float))
    stamp: dict[int, int] = {}
    for t, sps, tps, in_flight, errors in (JobMetricSample.objects.filter(job_id=job.pk).order_by("t")
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
    for t, reward in (Rollout.objects.filter(job_id=job.pk, reward__isnull=False).values_list("created_at", "reward")
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


def export_job(job) -> str | None:
    """Write the job's MLflow run (once: the run id is kept in collection_options). Returns the run id, or None
    when the job asked for none."""
    opts = job.collection_options or {}
    name = opts.get(OPTION)
    if not name or opts.get(RUN_ID):
        return opts.get(RUN_ID)
    uri = targets().get(name)
    if not uri:
        log.warning("job %s: MLflow server %r is no longer configured", job.pk, name)
        return None
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp_name = getattr(settings, "MLFLOW_EXPERIMENT_NAME", "rollout-collection")
    exp = client.get_experiment_by_name(exp_name)
    exp_id = exp.experiment_id if exp else client.create_experiment(exp_name, artifact_location=artifact_location(name, uri))
    start = job.started_at or job.created_at
    run = client.create_run(exp_id, start_time=int(start.timestamp() * 1000), run_name=f"job {job.pk} {job.name}".strip(),
                            tags={"rollouts.job_id": str(job.pk), "rollouts.state": str(job.state),
                                  "rollouts.endpoint": job.endpoint.name if job.endpoint_id else "",
                                  "rollouts.dataset": job.dataset.name if job.dataset_id else ""})
    rid = run.info.run_id
    try:
        params = {"model": getattr(job.endpoint, "model", ""), "num_repeats": job.num_repeats,
                  "num_samples_in_parallel": job.num_samples_in_parallel, "parallelism_auto": job.parallelism_auto,
                  "total_rollouts": job.total_rollouts, "verifier_options": job.verifier_options or {},
                  "responses_create_params": job.responses_create_params or {}, **job_config(job)}
        client.log_batch(rid, params=[Param(_key(k), str(v)[:6000]) for k, v in params.items() if v not in (None, "")],
                         tags=[RunTag("mlflow.note.content", f"Rollout collection job {job.pk}: {job.state}")])
        metrics = []
        for name_, points in series(job).items():
            metrics += [Metric(_key(name_), value, ts, step) for step, ts, value in points]
        end_ms = int((job.finished_at or start).timestamp() * 1000)
        finals: dict[str, float] = {}
        _flat("", job.aggregate_metrics or {}, finals)
        summary: dict[str, float] = {}
        _flat("", job_figures(job), summary)
        _flat("timing", job.timing_summary or {}, summary)
        metrics += [Metric(_key(f"aggregate.{k}"), v, end_ms, 0) for k, v in finals.items()]
        metrics += [Metric(_key(f"job.{k}"), v, end_ms, 0) for k, v in summary.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            client.log_batch(rid, metrics=metrics[i:i + 1000])
        diagnosis = diagnosis_payload(job)
        client.log_dict(rid, diagnosis, "diagnosis.json")
        client.log_dict(rid, rollout_table(job, int(getattr(settings, "MLFLOW_TABLE_ROWS", 100))), "rollouts_sample.json")
    except Exception:
        client.set_terminated(rid, status="FAILED")
        raise
    client.set_terminated(rid, status="FINISHED" if str(job.state) == "completed" else "FAILED", end_time=end_ms)
    job.collection_options = {**opts, RUN_ID: rid}
    CollectionJob.objects.filter(pk=job.pk).update(collection_options=job.collection_options)
    return rid
