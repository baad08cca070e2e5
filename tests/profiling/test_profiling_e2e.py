"""Profiling through a REAL Celery worker (threads pool) on the simulator, driven through the API:
* a verifier with planted slow functions is flagged by name with the right red flag, and after switching
  to the fixed verifier the comparison shows the functions' tavg falling and the throughput rising;
  the profile exports as a pstats file pstats loads and a callgrind file with the functions' names;
* profiling is switched on for a running job, a live snapshot read while it runs, switched off, and the
  job never stops.
"""
from __future__ import annotations

import os
import pstats
import re
import sys
import time
import uuid

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from controlplane.jobs import services as job_services
from controlplane.jobs.models import CollectionJob, JobChunk, JobState, Rollout

from ..controlplane.test_jobs_e2e import Proc, _database_url
from . import planted_fixed, planted_slow  # noqa: F401  (registered here too: job validation)
from tests.lanes import serve_control

PLUGINS = "tests.profiling.planted_slow,tests.profiling.planted_fixed"


@pytest.fixture
def worker(tmp_path):
    queue = f"profiling-e2e-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
           "PYTHONUNBUFFERED": "1", "DJANGO_SETTINGS_MODULE": "controlplane.settings", "VERIFIER_PLUGINS": PLUGINS}
    proc = Proc("worker", [sys.executable, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "2",
                           "-Q", serve_control(queue), "-n", f"w-{queue}@%h", "--without-gossip", "--without-mingle", "-l", "info"],
                env, tmp_path)
    proc.queue = queue
    yield proc
    proc.stop()


def _launch(job, queue):
    from celery import Celery

    from controlplane.settings import CELERY_BROKER_URL

    sender = Celery("profiling-e2e-sender", broker=CELERY_BROKER_URL, set_as_current=False)
    with sender.connection_for_write() as conn:
        for chunk_id in job.chunks.values_list("pk", flat=True):
            sender.send_task("controlplane.jobs.tasks.run_chunk_task", args=[chunk_id], queue=queue, connection=conn)
    JobChunk.objects.filter(job=job).update(dispatched_at=job.created_at)


def _wait_done(job, worker, timeout=240):
    deadline = time.monotonic() + timeout
    while True:
        job.refresh_from_db()
        if job.state not in (JobState.QUEUED, JobState.RUNNING):
            return job
        assert time.monotonic() < deadline, "job did not finish:\n" + worker.tail()
        assert worker.popen.poll() is None, "worker exited:\n" + worker.tail()
        time.sleep(0.3)


def _job(user, dataset, endpoint, verifier, n, num_repeats=1):
    return job_services.create_job(owner=user, dataset=dataset, endpoint=endpoint, num_repeats=num_repeats,
                                   chunk_size=n,
                                   num_samples_in_parallel=32, verifier=verifier, launch=False,
                                   responses_create_params={"max_output_tokens": 12})


@pytest.fixture
def api(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True)
def test_planted_slow_verifier_flagged_then_fixed_one_compared(user, api, math_dataset, sim_endpoint,
                                                                simulator_factory, worker, tmp_path):
    sim = simulator_factory(seed=3, ttft_ms=2, itl_ms=0.2, output_len_min=8, output_len_max=12)
    endpoint = sim_endpoint(sim.url)
    # 60 tasks x 10 repeats, as RL collection runs them: each expected answer comes back 10 times, which
    # is what the fixed verifier's lru_cache saves
    dataset = math_dataset(60)
    jobs = {}
    for verifier in ("planted_slow", "planted_fixed"):
        job = jobs[verifier] = _job(user, dataset, endpoint, verifier, 600, num_repeats=10)
        # started with profiling on: the session exists before the worker takes the chunk. CPU clock: the two
        # jobs run one after the other on a shared machine, and wall time per call moves with its load
        # jobs run one after the other on a shared machine, and wall time per call moves with its load. The slow
        # verifier is sampled (a budget of 50 %), its figures scaled to all calls; the fixed one is so fast that
        # any budget samples only a handful of its 600 verifications, too few to count what its cache saves:
        # 100 profiles every one
        budget = 50 if verifier == "planted_slow" else 100
        r = api.post(f"/api/jobs/{job.pk}/profile/", {"scope": "verify", "clock": "cpu", "budget_pct": budget,
                                                      "window_s": 1}, format="json")
        assert r.status_code == 201, r.content
        _launch(job, worker.queue)
        job = _wait_done(job, worker)
        assert job.state == JobState.COMPLETED, job.error_message
        assert Rollout.objects.filter(job=job).count() == 600

    slow = api.get(f"/api/jobs/{jobs['planted_slow'].pk}/profile/").json()
    assert slow["snapshots"] >= 1 and slow["verifications"] == 600 and 0 < slow["profiled"] <= 600
    assert slow["overhead_pct"] is not None
    by_name = {r["name"]: r for r in slow["rows"]}
    assert by_name["is_known_answer"]["ncall"] == pytest.approx(600, rel=0.35)  # scaled from the sample
    flags = {(f["kind"], f["function"]) for f in slow["red_flags"]}
    print("\nred flags of the slow verifier:\n" + "\n".join(f"  {f['kind']}: {f['label']}: {f['figure']}"
                                                          for f in slow["red_flags"]))
    assert ("self_time", "is_known_answer") in flags  # the list scan: a better data structure
    assert ("over_half", "is_known_answer") in flags
    assert ("hot_repeated", "normalize_answer") in flags  # twice per verification, no cache
    advice = {f["function"]: f["advice"] for f in slow["red_flags"] if f["kind"] == "self_time"}
    assert "set or dict" in advice["is_known_answer"]
    assert "lru_cache" in next(f["advice"] for f in slow["red_flags"] if f["kind"] == "hot_repeated")

    cmp = api.get("/api/profiles/compare/", {"a": jobs["planted_slow"].pk, "b": jobs["planted_fixed"].pk}).json()
    fn = {f["name"]: f for f in cmp["functions"]}
    assert cmp["b"]["profiled"] == 600 and cmp["a"]["profiled"] >= 30 and cmp["warning"] == "", cmp
    # the set lookup makes each call cheap: its verdict and tavg fall
    assert fn["is_known_answer"]["verdict"] == "faster", fn["is_known_answer"]
    assert fn["is_known_answer"]["b"]["tavg"] < fn["is_known_answer"]["a"]["tavg"] / 5
    # the cache makes fewer calls (each call that remains costs what it did): here it saves the expected
    # answer's normalization, which the 10 repeats of a task bring back; the response's, different on every
    # rollout, remains, so its time per verification falls less than its call count
    norm = fn["normalize_answer"]
    assert norm["b"]["ncall"] < 0.8 * norm["a"]["ncall"], norm
    assert fn["is_known_answer"]["d_tavg"] < 0
    assert cmp["throughput_ratio"] > 1.2, (cmp["a"], cmp["b"])
    print(f"throughput {cmp['a']['throughput']:.0f} -> {cmp['b']['throughput']:.0f} rollouts/s; "
          f"is_known_answer tavg {fn['is_known_answer']['a']['tavg'] * 1e3:.3f} -> "
          f"{fn['is_known_answer']['b']['tavg'] * 1e3:.4f} ms")

    # the same comparison on the dashboard's compare page, where a user picks the two jobs
    page = Client()
    page.force_login(user)
    html = page.get(reverse("dashboard:compare"),
                    {"jobs": [jobs["planted_slow"].pk, jobs["planted_fixed"].pk]}).content.decode()
    section = html[html.index('id="compare-profiles"'):]
    for name in ("is_known_answer", "normalize_answer"):
        row = re.search(rf'<tr data-function="{name}" data-verdict="(\w+)">(.*?)</tr>', section, re.S)
        assert row and row.group(1) == "faster", (name, row and row.group(0))
        ncall_b = re.search(r'class="ncall-b">(\d+)<', row.group(2)).group(1)
        assert int(ncall_b) == fn[name]["b"]["ncall"]
    assert "600 of 600 verifications profiled" in section and 'class="warning"' not in section

    # exports
    r = api.get(f"/api/jobs/{jobs['planted_slow'].pk}/profile/export/", {"type": "pstats"})
    assert r.status_code == 200
    path = tmp_path / "slow.pstats"
    path.write_bytes(r.content)
    st = pstats.Stats(str(path))
    names = {k[2]: v for k, v in st.stats.items()}
    assert "is_known_answer" in names and "normalize_answer" in names
    assert names["is_known_answer"][1] == by_name["is_known_answer"]["ncall"]
    assert st.total_tt > 0
    st.sort_stats("cumulative").print_stats(5)  # what snakeviz / a user does with it
    cg = api.get(f"/api/jobs/{jobs['planted_slow'].pk}/profile/export/", {"type": "callgrind"}).content.decode()
    assert cg.startswith("# callgrind format") and "events: Microseconds" in cg
    assert "\nfn=is_known_answer\n" in cg and "\nfn=normalize_answer\n" in cg
    assert "\ncfn=is_known_answer\n" in cg  # the verifier's call to it, with its inclusive cost
    assert api.get(f"/api/jobs/{jobs['planted_slow'].pk}/profile/export/", {"type": "x"}).status_code == 400


@pytest.mark.e2e
@pytest.mark.timeout(600)
@pytest.mark.django_db(transaction=True)
def test_profiling_switched_on_and_off_while_the_job_runs(user, api, math_dataset, sim_endpoint, simulator_factory,
                                                          worker):
    sim = simulator_factory(seed=5, ttft_ms=2, itl_ms=0.2, output_len_min=8, output_len_max=12)
    n = 3000
    job = _job(user, math_dataset(n), sim_endpoint(sim.url), "planted_slow", n)
    _launch(job, worker.queue)
    deadline = time.monotonic() + 120
    while Rollout.objects.filter(job=job).count() < 100:
        assert time.monotonic() < deadline and worker.popen.poll() is None, worker.tail()
        time.sleep(0.2)

    r = api.post(f"/api/jobs/{job.pk}/profile/", {"seconds": 60, "window_s": 1, "budget_pct": 20}, format="json")
    assert r.status_code == 201, r.content
    assert api.get(f"/api/jobs/{job.pk}/profile/").json()["active"]["seconds"] == 60

    deadline = time.monotonic() + 60
    while True:  # the live snapshot, read while the job runs
        live = api.get(f"/api/jobs/{job.pk}/profile/").json()
        if live["rows"] and any(r["name"] == "is_known_answer" for r in live["rows"]):
            break
        assert time.monotonic() < deadline, worker.tail()
        time.sleep(0.5)
    job.refresh_from_db()
    stored = Rollout.objects.filter(job=job).count()
    assert job.state == JobState.RUNNING and stored < n, "the job finished before the live snapshot"
    assert live["active"] is not None and live["workers"]
    print(f"\nlive snapshot at {stored}/{n} rollouts: {live['snapshots']} snapshots, top "
          f"{live['rows'][0]['name']} ttot {live['rows'][0]['ttot']:.3f}s")

    r = api.delete(f"/api/jobs/{job.pk}/profile/")
    assert r.status_code == 200 and r.json()["stopped"] == 1
    off = api.get(f"/api/jobs/{job.pk}/profile/").json()
    assert off["active"] is None
    # the worker ends the session at its next control poll and sends its last window
    deadline = time.monotonic() + 30
    from controlplane.profiling.models import ProfileSnapshot

    while not ProfileSnapshot.objects.filter(job=job, final=True).exists():
        assert time.monotonic() < deadline, worker.tail()
        time.sleep(0.3)
    frozen = ProfileSnapshot.objects.filter(job=job).count()
    job.refresh_from_db()
    assert job.state == JobState.RUNNING  # never stopped
    job = _wait_done(job, worker)
    assert job.state == JobState.COMPLETED and Rollout.objects.filter(job=job).count() == n
    assert ProfileSnapshot.objects.filter(job=job).count() == frozen  # nothing more after it was switched off
    assert CollectionJob.objects.get(pk=job.pk).completed_count + job.failed_count == n
