"""The progress message has one typed shape (events.ProgressMessage): every way it is built — a running job with
live samples, a reload of a finished or failed job, a chunk's sink before its first sample — gives exactly
those fields with those types, after the JSON trip to the browser."""
from __future__ import annotations

import json
import types
import typing

import pytest
from django.utils import timezone

from controlplane.jobs.events import MESSAGE_TYPE, LiveFigures, ProgressMessage, job_progress, progress_payload
from controlplane.jobs.models import JobMetricSample
from tests.factories import make_dataset, make_endpoint, make_job

pytestmark = pytest.mark.django_db


def _matches(value, hint) -> bool:
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return value in typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if origin is dict:
        kt, vt = typing.get_args(hint)
        return isinstance(value, dict) and all(_matches(k, kt) and _matches(v, vt) for k, v in value.items())
    if hint is type(None):
        return value is None
    if hint is float:  # JSON has one number type; an int where a float is declared is fine
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def assert_shape(msg) -> None:
    hints = typing.get_type_hints(ProgressMessage)
    wire = json.loads(json.dumps(msg))  # what the browser gets
    assert set(wire) == set(hints), f"extra {set(wire) - set(hints)}, missing {set(hints) - set(wire)}"
    wrong = {k: (wire[k], hints[k]) for k in hints if not _matches(wire[k], hints[k])}
    assert not wrong, f"fields of the wrong type: {wrong}"


def test_every_builder_gives_the_typed_shape(alice):
    now = timezone.now()
    running = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=30, state="running", fail_every=7)
    JobMetricSample.objects.filter(job=running).delete()
    for k in range(3):
        JobMetricSample.objects.create(job=running, worker="w1 chunk 0", t=now - timezone.timedelta(seconds=2 - k),
                                       in_flight=4, parallelism=8, errors={"http_429": 1})
    msg = job_progress(running, now)
    assert_shape(msg)
    assert msg["type"] == MESSAGE_TYPE and msg["in_flight"] == 4 and msg["errors"] == {"http_429": 3}
    assert msg["done"] == msg["completed"] + msg["failed"] == 30

    failed = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=3, state="failed")
    failed.error_message = "model server refused every request"
    failed.save(update_fields=["error_message"])
    msg = job_progress(failed)
    assert_shape(msg)
    assert msg["error_message"] == "model server refused every request" and msg["state"] == "failed"

    queued = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=0, state="queued")
    assert_shape(job_progress(queued))
    # a chunk's sink before its first sample: its own figures, no rate yet, the running time it passes
    assert_shape(progress_payload(running, live=LiveFigures(in_flight=2, parallelism=4), running_s=1.5, completed=5,
                                  failed=0, state="running"))


def test_the_shape_check_catches_a_wrong_message(alice):
    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=1)
    good = job_progress(job)
    for bad in ({**good, "extra": 1}, {k: v for k, v in good.items() if k != "eta_s"}, {**good, "done": "1"},
                {**good, "type": "job.other"}, {**good, "errors": {"http_429": "3"}}):
        with pytest.raises(AssertionError):
            assert_shape(bad)


def test_a_sinks_message_is_dated_when_its_figures_were_read(django_user_model):
    """A chunk's sink reads the job's figures when it stores a sample and publishes them up to a tick later:
    the message's t is when they were read (its rate and running time are of that moment), and the sample
    carries how long the run had been at work, the write's wait included."""
    import time

    from controlplane.jobs.models import JobChunk
    from controlplane.jobs.sink import DbSink, DbThread
    from workers.engine.types import ProgressTick

    alice = django_user_model.objects.create_user(username="alice", password="alice-pw-123")
    job = make_job(alice, make_dataset(alice, n=5), make_endpoint(alice), n_rollouts=0, state="running")
    JobMetricSample.objects.filter(job=job).delete()
    chunk = JobChunk.objects.create(job=job, index=0, start_row=0, end_row=5, state="running", lease_owner="w#1")
    sink = DbSink(job=job, chunk=chunk, lease_owner="w#1", worker_name="w", db=DbThread())
    tick = ProgressTick(elapsed_s=3.0, completed=0, failed=0, in_flight=4, parallelism=4, samples_per_s=0.0,
                        output_tokens_per_s=0.0, extra={"busy_s": 2.0})
    sink.last_tick = tick
    sink._write_sample(tick, time.monotonic() - 0.5)  # the write waited half a second for the database
    sample = JobMetricSample.objects.get(job=job)
    assert 2.5 <= sample.extra["busy_s"] < 3.5
    time.sleep(0.3)
    msg = sink.payload()
    assert msg["t"] == pytest.approx(sample.t.timestamp(), abs=0.05)  # not the publish time, 0.3 s later
    assert msg["elapsed_s"] == pytest.approx(sample.extra["busy_s"], abs=0.05)  # the run's first request on


@pytest.mark.django_db(transaction=True)  # the sink reads on its own thread and connection
def test_a_new_chunks_first_message_carries_the_jobs_rate(django_user_model):
    """A chunk that starts while the job's other chunks run publishes before its first sample is stored: its
    message says the job's rate and in flight (theirs plus its own), not a rate of 0 (the page's chart would
    drop to 0 and back each time a chunk starts)."""
    import asyncio

    from controlplane.jobs.models import JobChunk
    from controlplane.jobs.sink import DbSink, DbThread
    from workers.engine.types import ProgressTick

    alice = django_user_model.objects.create_user(username="alice", password="alice-pw-123")
    job = make_job(alice, make_dataset(alice, n=40), make_endpoint(alice), n_rollouts=30, state="running")
    job_now = job_progress(job)
    assert job_now["samples_per_s"] > 0 and job_now["in_flight"] == 4  # the other chunk's rows and samples
    chunk = JobChunk.objects.create(job=job, index=1, start_row=30, end_row=40, state="running", lease_owner="w#2")
    sent = []
    db = DbThread()
    sink = DbSink(job=job, chunk=chunk, lease_owner="w#2", worker_name="w2", db=db, channel_layer=False,
                  on_progress=sent.append)
    sink.last_tick = ProgressTick(elapsed_s=0.2, completed=0, failed=0, in_flight=3, parallelism=3, samples_per_s=0.0,
                                  output_tokens_per_s=0.0, errors={"http_429": 1})
    try:
        asyncio.run(sink._publish())
    finally:
        db.close()
    (msg,) = sent
    assert_shape(msg)
    assert msg["state"] == "running"
    assert msg["samples_per_s"] == pytest.approx(job_now["samples_per_s"], rel=0.05)
    assert msg["in_flight"] == 4 + 3
    assert msg["errors"]["http_429"] == job_now["errors"]["http_429"] + 1
    assert msg["elapsed_s"] == pytest.approx(job_now["elapsed_s"], abs=1.0)
