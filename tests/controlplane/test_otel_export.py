"""OpenTelemetry export (workers/tracing.py): with an OTLP endpoint configured, a real run against the simulator
sends chunk, rollout, request and verify spans to an in-process OTLP/HTTP collector; each rollout's trace id is
its stored trace_id, each request span's id is the one its model request carried in `traceparent`, and the
chunk span hangs under the job span's ids. Off (the default), nothing is made."""
from __future__ import annotations

import re

import pytest
from django.core.management import call_command

from controlplane.jobs.models import CollectionJob, Rollout
from controlplane.jobs.runtime import build_spec, job_trace_key
from tests.controlplane.test_collect_rollouts import cli_args, write_math
from tests.otlp_collector import start_collector
from workers.tracing import job_span_ids

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


@pytest.fixture
def collector():
    col = start_collector()
    yield col
    col.close()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_spans_of_a_real_run_reach_an_otlp_collector(simulator_factory, tmp_path, settings, collector):
    settings.TRACING_MODE = "otlp"
    settings.TRACING_OTLP_ENDPOINT = collector.url
    sim = simulator_factory(seed=5, fault_rates={"500": 0.2})  # some requests retried: two request spans
    inp = write_math(tmp_path / "tasks.jsonl", 10)
    call_command("collect_rollouts", *cli_args(inp, tmp_path / "out.jsonl", sim.url, "+max_retries=5"))
    job = CollectionJob.objects.get()
    rows = {t: (ti, ri, a) for t, ti, ri, a in
            Rollout.objects.filter(job=job).values_list("trace_id", "task_index", "rollout_index", "attempts")}
    assert len(rows) == 20

    # the chunk: a child of the job's span (ids derived from the job), handed over last at the run's end: once it
    # has arrived, so has every span before it (one exporter process, sending in order)
    job_trace, job_span = job_span_ids(job_trace_key(job))
    chunks = collector.wait_for("chunk")
    assert len(chunks) == 1 and (chunks[0].trace_id, chunks[0].parent_span_id) == (job_trace, job_span)
    assert chunks[0].attributes["job.id"] == job.pk and chunks[0].attributes["run.completed"] == 20
    assert chunks[0].service == "rollout-control-plane"

    # a rollout span per stored rollout, in the rollout's own trace, linked to the chunk
    rollouts = {s.trace_id: s for s in collector.by_name("rollout")}
    assert set(rollouts) == set(rows)
    for trace, span in rollouts.items():
        task, repeat, attempts = rows[trace]
        assert span.parent_span_id == ""  # the root of its trace
        assert span.links == [(chunks[0].trace_id, chunks[0].span_id)]
        assert (span.attributes["rollout.task_index"], span.attributes["rollout.rollout_index"]) == (task, repeat)
        assert span.attributes["rollout.attempts"] == attempts and span.attributes["rollout.ok"] is True
        assert span.attributes["gen_ai.usage.output_tokens"] > 0 and "rollout.reward" in span.attributes
        assert chunks[0].start_ns <= span.start_ns <= span.end_ns <= chunks[0].end_ns

    # a request span per attempt, the same span id as the traceparent the simulator received
    requests = collector.by_name("request")
    seen = {m.group(2): m.group(1) for m in map(TRACEPARENT.fullmatch, sim.get_json("/admin/traceparents")["traceparents"])}
    assert {s.span_id: s.trace_id for s in requests} == seen
    for s in requests:
        assert s.parent_span_id == rollouts[s.trace_id].span_id
    failed = [s for s in requests if s.status_code == 2]  # STATUS_CODE_ERROR: the 500s that were retried
    assert failed and all(s.attributes["error.type"] == "http_5xx" for s in failed)
    assert len(requests) == sum(a for _, _, a in rows.values())

    # the job's own span, sent when the job ended (controlplane/exports), with the ids its chunks named
    from controlplane.exports.tasks import export_job_task

    assert not collector.by_name("job")
    assert export_job_task(job.pk)["job_span"] is True
    (job_span_seen,) = collector.wait_for("job")
    assert (job_span_seen.trace_id, job_span_seen.span_id, job_span_seen.parent_span_id) == (job_trace, job_span, "")
    assert job_span_seen.attributes["job.completed"] == 20 and job_span_seen.attributes["job.state"] == "completed"
    assert job_span_seen.start_ns <= chunks[0].start_ns and chunks[0].end_ns <= job_span_seen.end_ns + 10**9

    # the verification of each rollout
    verifies = collector.by_name("verify")
    assert sorted(s.trace_id for s in verifies) == sorted(rows)
    assert all(s.parent_span_id == rollouts[s.trace_id].span_id for s in verifies)


@pytest.mark.django_db
def test_tracing_is_off_by_default(settings):
    from tests.factories import make_user, service_job

    assert settings.TRACING_MODE == "off"
    assert build_spec(service_job(make_user("quiet"))).tracing is None
