"""One truth for a job's live numbers: the progress message is built once (events.progress_payload) from
the job's stored rows and every chunk's stored samples, so a multi-chunk job on several workers shows job-wide in-flight, rate and
ETA, and a page reload shows what the live stream showed."""
from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.dashboard.live import job_snapshot
from controlplane.jobs.events import RATE_WINDOW_S, job_progress, live_figures
from controlplane.jobs.models import JobMetricSample, Rollout

from tests.factories import make_dataset, make_endpoint, make_job

pytestmark = pytest.mark.django_db


def _series(job, name, start, now, rate, in_flight, parallelism, until=None, step=0.5):
    """A chunk run's cumulative samples: `rate` rollouts/s from `start` (seconds before now) to `until`,
    and the rows it stored as it went (the figures count stored rows)."""
    k = 0
    stored = 0
    while True:
        age = start - k * step
        if age < (until or 0.0):
            break
        elapsed = k * step
        t = now - timezone.timedelta(seconds=age)
        n = int(rate * elapsed) - stored
        base = Rollout.objects.filter(job=job).count()
        Rollout.objects.bulk_create([Rollout(job=job, task_index=base + i, rollout_index=0, data={}, output_tokens=9,
                                             worker=name.split(" chunk ")[0], created_at=t) for i in range(n)])
        stored += n
        JobMetricSample.objects.create(
            job=job, worker=name, t=now - timezone.timedelta(seconds=age), elapsed_s=elapsed,
            completed=int(rate * elapsed), failed=0, samples_per_s=rate, output_tokens_per_s=rate * 9,
            in_flight=0 if until and age - step < until else in_flight, parallelism=parallelism)
        k += 1


def test_four_chunks_on_two_workers_sum_to_the_job(alice):
    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=0, state="running")
    job.total_rollouts, job.completed_count, job.num_samples_in_parallel = 1000, 400, 16
    job.save()
    JobMetricSample.objects.filter(job=job).delete()
    now = timezone.now()
    # 4 chunks, 2 per worker, each 4 in flight at 6.25/s (25/s together) for the last 30 s
    for w in ("w1", "w2"):
        for c in (0, 1):
            _series(job, f"{w} chunk {c}", 30.0, now, 6.25, 4, 4)
    live = live_figures(job.pk, now)
    assert live.in_flight == 16 and live.parallelism == 16 and live.chunks == 4
    assert live.done_per_s == pytest.approx(25.0, rel=0.1)
    msg = job_progress(job, now)
    assert msg["in_flight"] == 16
    assert msg["samples_per_s"] == pytest.approx(25.0, rel=0.1)
    assert msg["eta_s"] == pytest.approx(600 / 25.0, rel=0.1)
    # the reload (page / state.json) is the same message plus display fields
    snap = job_snapshot(job, now)
    for key in ("in_flight", "parallelism", "done", "total", "state"):
        assert snap[key] == msg[key]
    assert snap["samples_per_s"] == pytest.approx(msg["samples_per_s"], rel=0.02)


def test_a_finished_chunk_counts_only_what_it_did_in_the_window(alice):
    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=0, state="running")
    job.total_rollouts, job.completed_count = 1000, 300
    job.save()
    JobMetricSample.objects.filter(job=job).delete()
    now = timezone.now()
    _series(job, "w1 chunk 0", 30.0, now, 10.0, 8, 8)  # running
    _series(job, "w2 chunk 1", 30.0, now, 10.0, 8, 8, until=RATE_WINDOW_S / 2)  # finished 5 s ago
    live = live_figures(job.pk, now)
    assert live.in_flight == 8 and live.parallelism == 8  # the finished chunk holds no slots
    # 10/s over the whole window + 10/s over its first half = 15/s, not 20/s
    assert live.done_per_s == pytest.approx(15.0, rel=0.1)


def test_no_live_chunk_shows_the_overridden_parallelism(alice):
    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=0, state="running")
    job.num_samples_in_parallel, job.parallelism_override = 4, 12
    job.save()
    JobMetricSample.objects.filter(job=job).delete()
    msg = job_progress(job)
    assert msg["parallelism"] == 12 and msg["in_flight"] == 0 and msg["eta_s"] is None
    assert job_snapshot(job)["parallelism"] == 12


def test_history_shows_the_parallelism_an_adaptive_job_ran_at(alice, client):
    from django.urls import reverse

    from controlplane.dashboard.live import parallelism_run

    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=10, state="completed", name="adaptive")
    job.num_samples_in_parallel, job.parallelism_auto = 4, True
    job.save()
    JobMetricSample.objects.filter(job=job).delete()
    now = timezone.now().replace(microsecond=0)  # two ticks inside each whole second
    # two chunks whose adaptive controller moved from 10 to 32 each: the job ran at 20..64
    for k, p in enumerate((10, 16, 24, 32)):
        for w in ("w1 chunk 0", "w2 chunk 1"):
            for half in (0.0, 0.5):  # two ticks a second: counted once per series and second
                JobMetricSample.objects.create(job=job, worker=w, t=now - timezone.timedelta(seconds=10 - k - half - 0.25),
                                               elapsed_s=k + half, completed=k, in_flight=p, parallelism=p)
    ran = parallelism_run([job.pk])[job.pk]
    assert (ran["min"], ran["max"]) == (20, 64) and ran["mean"] == pytest.approx(41.0)
    client.force_login(alice)
    html = client.get(reverse("dashboard:history")).content.decode()
    assert "20–64" in html and "configured 4" in html
    csv = client.get(reverse("dashboard:history") + "?format=csv").content.decode()
    assert csv.splitlines()[0].endswith("parallelism_run_mean,parallelism_run_min,parallelism_run_max")
    assert csv.splitlines()[1].endswith("41.0,20,64")


def test_history_shows_a_fixed_job_at_its_parallelism(alice, client):
    from django.urls import reverse

    job = make_job(alice, make_dataset(alice), make_endpoint(alice), n_rollouts=10, state="completed", name="fixed")
    job.num_samples_in_parallel = 32
    job.save()
    JobMetricSample.objects.filter(job=job).delete()
    now = timezone.now()
    # two chunks of 16 each; for a second the first is still draining while the second has finished
    for k in range(5):
        for w, p in (("w1 chunk 0", 16), ("w2 chunk 1", 16 if k < 4 else 0)):
            JobMetricSample.objects.create(job=job, worker=w, t=now - timezone.timedelta(seconds=10 - k),
                                           elapsed_s=k, completed=k, in_flight=p, parallelism=16)
    client.force_login(alice)
    html = client.get(reverse("dashboard:history")).content.decode()
    assert "16–32" not in html and '<td class="parallel">32</td>' in html
