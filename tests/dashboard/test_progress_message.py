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
