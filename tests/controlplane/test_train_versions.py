"""Versions on both ends: each rollout's weight version at dispatch and at completion; a rollout that ran
across a weight update is marked (spans_update)."""
from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from controlplane.endpoints.models import WeightVersion
from controlplane.jobs.versions import VersionTagger, after_update, backfill
from controlplane.jobs import services
from controlplane.jobs.models import Rollout
from controlplane.jobs.sink import _rollout_values, insert_rollouts
from workers.engine.types import RolloutResult


def _history(ep, *ago):
    now = timezone.now()
    for n, s in enumerate(ago, start=1):
        WeightVersion.objects.create(endpoint=ep, version=str(n), previous_version=str(n - 1) if n > 1 else "",
                                     trace_id=f"t{n}", started_at=now - timedelta(seconds=s),
                                     applied_at=now - timedelta(seconds=s - 1))


def test_a_rollout_dispatched_before_an_update_and_completed_after_is_marked(user, sim_endpoint, math_dataset):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    _history(ep, 100, 10)  # version 1 from 100 s ago, version 2 from 10 s ago
    tagger = VersionTagger(ep.pk, job.pk)
    batch = []
    for i, wall_s in enumerate([200, 50, 5]):
        r = RolloutResult(task_index=i, rollout_index=0, ok=True, output_row={}, reward=1.0, wall_ms=wall_s * 1000)
        tagger.stamp(r)
        batch.append(r)
    tagger.tag(batch)
    assert [(r.weight_version, r.completed_version) for r in batch] == [("0", "2"), ("1", "2"), ("2", "2")]
    insert_rollouts([_rollout_values(job.pk, "w", r, timezone.now()) for r in batch])
    got = {t: (v, c, s) for t, v, c, s in Rollout.objects.filter(job=job).values_list(
        "task_index", "weight_version", "completed_version", "spans_update")}
    assert got == {0: ("0", "2", True), 1: ("1", "2", True), 2: ("2", "2", False)}


def test_a_reported_version_is_kept_and_completion_is_read_from_the_history(user, sim_endpoint):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    _history(ep, 100, 10)
    tagger = VersionTagger(ep.pk)
    r = RolloutResult(task_index=0, rollout_index=0, ok=True, output_row={}, wall_ms=50_000, weight_version="1")
    tagger.stamp(r)
    tagger.tag([r])
    assert (r.weight_version, r.completed_version) == ("1", "2")


def test_no_history_means_one_version_for_both_ends(user, sim_endpoint, math_dataset):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(2), endpoint=ep, launch=False)
    r = RolloutResult(task_index=0, rollout_index=0, ok=True, output_row={}, wall_ms=5, weight_version="3")
    tagger = VersionTagger(ep.pk, job.pk)
    tagger.stamp(r)
    tagger.tag([r])
    insert_rollouts([_rollout_values(job.pk, "w", r, timezone.now())])
    row = Rollout.objects.get(job=job)
    assert (row.weight_version, row.completed_version, row.spans_update) == ("3", "3", False)


def test_rows_written_while_an_update_ran_are_fixed_at_both_ends(user, sim_endpoint, math_dataset):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    _history(ep, 100)
    since = Rollout.objects.order_by("-id").values_list("id", flat=True).first() or 0
    now = timezone.now()
    # stored 1 s ago with the previous version by their sink; the update's pause went out 5 s ago.
    # (wall s): 20 -> dispatched before the pause (spans it); 2 -> dispatched after it (the new version)
    for i, wall in enumerate([20, 2]):
        Rollout.objects.create(job=job, task_index=i, rollout_index=0, status="ok", data={}, wall_ms=wall * 1000,
                               created_at=now - timedelta(seconds=1), weight_version="1", completed_version="1")
    WeightVersion.objects.create(endpoint=ep, version="2", previous_version="1", trace_id="t2",
                                 started_at=now - timedelta(seconds=5), applied_at=now)
    assert after_update(ep.pk, since) == 1
    got = {t: (v, c, s) for t, v, c, s in Rollout.objects.filter(job=job).values_list(
        "task_index", "weight_version", "completed_version", "spans_update")}
    assert got == {0: ("1", "2", True), 1: ("2", "2", False)}


def test_backfill_sets_both_ends(user, sim_endpoint, math_dataset):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    now = timezone.now()
    for i, (ago, wall) in enumerate([(50, 10), (3, 10), (3, 1)]):
        Rollout.objects.create(job=job, task_index=i, rollout_index=0, status="ok", data={}, wall_ms=wall * 1000,
                               created_at=now - timedelta(seconds=ago))
    WeightVersion.objects.create(endpoint=ep, version="1", trace_id="t", started_at=now - timedelta(seconds=5),
                                 applied_at=now)
    assert backfill(ep.pk) == 3
    got = {t: (v, c, s) for t, v, c, s in Rollout.objects.filter(job=job).values_list(
        "task_index", "weight_version", "completed_version", "spans_update")}
    assert got == {0: ("0", "0", False), 1: ("0", "1", True), 2: ("1", "1", False)}


def _first_update(ep):
    now = timezone.now()
    WeightVersion.objects.create(endpoint=ep, version="1", trace_id="t1", started_at=now - timedelta(seconds=30),
                                 applied_at=now - timedelta(seconds=29))
    backfill(ep.pk)  # what recording the endpoint's first update runs on commit


def _vllm_batch(tagger, n):
    batch = [RolloutResult(task_index=i, rollout_index=0, ok=True, output_row={}, wall_ms=1000) for i in range(n)]
    for r in batch:
        tagger.stamp(r)
    return batch


def test_a_batch_written_again_after_the_first_update_landed_is_tagged(user, sim_endpoint, math_dataset):
    """The sink tags a batch, its write fails (a deadlock with the first update's backfill) and is retried
    once the update is recorded: the retry tags the batch, not only the rows stored before it."""
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    tagger = VersionTagger(ep.pk, job.pk)
    batch = _vllm_batch(tagger, 3)
    tagger.tag(batch)  # no history yet: no version
    assert {r.weight_version for r in batch} == {""}
    _first_update(ep)
    tagger.tag(batch)  # the retried write
    assert {r.weight_version for r in batch} == {"1"}
    insert_rollouts([_rollout_values(job.pk, "w", r, timezone.now()) for r in batch])
    tagger.written(batch)
    assert set(Rollout.objects.filter(job=job).values_list("weight_version", flat=True)) == {"1"}


def test_a_batch_committed_after_the_first_updates_backfill_is_tagged(user, sim_endpoint, math_dataset):
    """The first update is recorded (and its backfill runs) between the sink's tagging of a batch and the
    batch's commit: the backfill cannot see those rows, so the sink fixes them once they are stored."""
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    tagger = VersionTagger(ep.pk, job.pk)
    batch = _vllm_batch(tagger, 3)
    tagger.tag(batch)
    _first_update(ep)
    insert_rollouts([_rollout_values(job.pk, "w", r, timezone.now()) for r in batch])
    assert set(Rollout.objects.filter(job=job).values_list("weight_version", flat=True)) == {""}
    tagger.written(batch)
    assert set(Rollout.objects.filter(job=job).values_list("weight_version", flat=True)) == {"1"}
    assert not tagger._arrived


def test_a_row_committed_after_the_pause_but_received_before_it_keeps_the_old_version(user, sim_endpoint,
                                                                                     math_dataset):
    """The first update's backfill dates a row by its arrival at the sink (arrived_at), not by its batch's commit
    (created_at, up to a flush interval later): a rollout dispatched and answered just before the pause is the
    old version's, though its batch committed after the pause went out."""
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    now = timezone.now()
    pause = now - timedelta(seconds=5)
    common = dict(job=job, rollout_index=0, status="ok", data={}, wall_ms=100, created_at=pause + timedelta(seconds=1))
    Rollout.objects.create(task_index=0, arrived_at=pause - timedelta(seconds=0.2), **common)  # answered before
    Rollout.objects.create(task_index=1, arrived_at=pause + timedelta(seconds=0.5), **common)  # dispatched after
    Rollout.objects.create(task_index=2, **common)  # stored by an older sink: dated by its commit, as before
    WeightVersion.objects.create(endpoint=ep, version="1", previous_version="", trace_id="t1", started_at=pause,
                                 applied_at=now)
    after_update(ep.pk, 0)
    got = {t: (v, c, s) for t, v, c, s in Rollout.objects.filter(job=job).values_list(
        "task_index", "weight_version", "completed_version", "spans_update")}
    assert got == {0: ("0", "0", False), 1: ("1", "1", False), 2: ("1", "1", False)}


def test_the_sink_stores_when_each_rollout_arrived(user, sim_endpoint, math_dataset):
    from controlplane.jobs.sink import DbSink

    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(2), endpoint=ep, launch=False)
    sink = DbSink(job=job, chunk=job.chunks.get(), lease_owner="w#1", worker_name="w", db=None, channel_layer=False)
    r = RolloutResult(task_index=0, rollout_index=0, ok=True, output_row={}, reward=1.0, wall_ms=5)
    before = timezone.now()
    sink.versions.stamp(r)
    arrived = sink.versions.arrived_at(r)
    sink._write_batch([r])
    row = Rollout.objects.get(job=job)
    assert before <= row.arrived_at == arrived <= row.created_at
