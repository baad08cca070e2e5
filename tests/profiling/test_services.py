"""Profiling in Django from stored snapshots: sessions on / off through the API and the command, several
workers merged into one profile, red flags computed from real yappi rows (blocking calls, growth with the
dataset size), exports, comparison."""
from __future__ import annotations

import io
import pstats
import socket
import time

import pytest
import yappi
from django.core.management import call_command
from rest_framework.test import APIClient

from controlplane.jobs import services as job_services
from controlplane.profiling import comparison, services
from controlplane.profiling.models import ProfileSession
from workers.profiling.core import ProfileSnapshot as Snap, rows_from_yappi


def blocking_lookup(n):
    """A 'verifier' that calls a remote service synchronously, and sleeps between retries."""
    a, b = socket.socketpair()
    try:
        for _ in range(n):
            a.sendall(b"x" * 64)
            b.recv(64)
            time.sleep(0.002)
    finally:
        a.close()
        b.close()


def scan(items, needle):
    return needle in items


def profiled_rows(fn, *args):
    yappi.stop()
    yappi.clear_stats()
    yappi.set_clock_type("wall")
    yappi.start(builtins=True, profile_threads=False)
    try:
        fn(*args)
    finally:
        yappi.stop()
    rows = rows_from_yappi(yappi.get_func_stats())
    yappi.clear_stats()
    return rows


def snap(session, rows, worker="host-a", verifications=10, profiled=10, t=None):
    t = t or time.time()
    return Snap(session=session.key, scope="verify", clock="wall", worker=worker, window_start=t - 1, window_end=t,
                rows=rows, verifications=verifications, profiled=profiled, overhead_pct=1.5)


@pytest.fixture
def job(user, math_dataset, sim_endpoint):
    return job_services.create_job(owner=user, dataset=math_dataset(20), endpoint=sim_endpoint("http://127.0.0.1:9"),
                                   launch=False)


@pytest.fixture
def api(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


def test_on_off_through_the_api_with_clear_errors(api, job, django_user_model, settings):
    settings.PROFILING_STATS_LOG_DIR = "/tmp"  # the operator's: logs are read only under it
    url = f"/api/jobs/{job.pk}/profile/"
    assert api.get(url).json()["active"] is None
    assert api.post(url, {"seconds": 0}, format="json").status_code == 400
    assert api.post(url, {"scope": "everything"}, format="json").status_code == 400
    assert api.post(url, {"stats_urls": ["ftp://x"]}, format="json").status_code == 400
    # a server of the job's own deployment (its endpoint, 127.0.0.1:9): tests/security/test_stats_urls_scope.py
    r = api.post(url, {"seconds": 60, "clock": "cpu", "stats_urls": [{"url": "http://127.0.0.1:9/stats",
                                                                      "log": "/tmp/x.log"}]}, format="json")
    assert r.status_code == 201 and r.json()["seconds"] == 60 and r.json()["clock"] == "cpu"
    active = api.get(url).json()["active"]
    assert active["id"] == r.json()["id"] and active["until"]
    cfg = services.config_for(services.active_session(job.pk))
    assert cfg.session == f"job{job.pk}-p{active['id']}" and cfg.clock == "cpu" and cfg.scope == "verify"
    # a second request replaces the first (scope "worker" is staff-only: tests/security/test_worker_profiling.py)
    r2 = api.post(url, {"scope": "verify", "clock": "wall"}, format="json")
    assert ProfileSession.objects.filter(job=job, stopped_at__isnull=True).count() == 1
    assert api.get(url).json()["active"]["id"] == r2.json()["id"]
    assert api.delete(url).json() == {"stopped": 1}
    assert api.get(url).json()["active"] is None and services.active_session(job.pk) is None
    # another user's job is invisible
    other = APIClient()
    other.force_authenticate(django_user_model.objects.create_user("someone-else", password="x"))
    assert other.post(url, {}, format="json").status_code == 404
    # a finished job cannot be profiled
    job.state = "completed"
    job.save(update_fields=["state"])
    assert api.post(url, {}, format="json").status_code == 409


def test_expiry_after_the_seconds(job):
    s = services.start(job, seconds=5)
    assert services.active_session(job.pk) == s
    ProfileSession.objects.filter(pk=s.pk).update(until=s.started_at)
    assert services.active_session(job.pk) is None


def test_workers_merge_and_blocking_calls_are_flagged(api, job, tmp_path):
    s = services.start(job, seconds=60)
    rows = profiled_rows(blocking_lookup, 30)
    services.record(job.pk, [snap(s, rows, "host-a"), snap(s, rows, "host-b")])
    prof = api.get(f"/api/jobs/{job.pk}/profile/").json()
    assert prof["snapshots"] == 2 and prof["workers"] == ["host-a", "host-b"] and prof["verifications"] == 20
    top = {r["name"]: r for r in prof["rows"]}["blocking_lookup"]
    assert top["ncall"] == 2  # one per worker, summed
    assert {"module", "line", "name", "ncall", "tsub", "ttot", "tavg", "share"} <= set(top)
    flags = [f for f in prof["red_flags"] if f["kind"] == "sync_external"]
    names = {f["function"] for f in flags}
    assert "time.sleep" in names or "sleep" in names, prof["red_flags"]
    # the socket calls are recognized too (here they are fast: under the 1 % share that makes them a flag)
    low = {f["function"] for f in services.red_flags(rows, external=1e-6) if f["kind"] == "sync_external"}
    assert any("'recv'" in n for n in low) and any("'sendall'" in n for n in low), low
    assert all("async" in f["advice"] for f in flags)
    sleep = next(f for f in flags if "sleep" in f["function"])
    assert "% of total" in sleep["figure"] and sleep["value"] > 0.3  # 30 x 2 ms of sleep dominate

    # exports
    r = api.get(f"/api/jobs/{job.pk}/profile/export/", {"type": "pstats"})
    assert r.status_code == 200
    (tmp_path / "p.pstats").write_bytes(r.content)
    st = pstats.Stats(str(tmp_path / "p.pstats"), stream=io.StringIO())
    by_name = {k[2]: v for k, v in st.stats.items()}
    assert by_name["blocking_lookup"][1] == 2 and by_name["blocking_lookup"][3] > 0.06 * 2
    callers = st.stats[next(k for k in st.stats if "sleep" in k[2])][4]
    assert any(k[2] == "blocking_lookup" for k in callers)  # the call graph survived
    cg = api.get(f"/api/jobs/{job.pk}/profile/export/", {"type": "callgrind"}).content.decode()
    assert "\nfn=blocking_lookup\n" in cg and "calls=60 " in cg  # 30 sleeps per worker, two workers
    tree = api.get(f"/api/jobs/{job.pk}/profile/export/", {"type": "tree"}).json()
    assert tree["value"] > 0 and tree["children"]
    assert api.get(f"/api/jobs/{job.pk}/profile/export/", {"type": "svg"}).status_code == 400


def test_tavg_growing_with_dataset_size_across_jobs(user, math_dataset, sim_endpoint):
    ep = sim_endpoint("http://127.0.0.1:9")
    small = job_services.create_job(owner=user, dataset=math_dataset(50), endpoint=ep, launch=False)
    big = job_services.create_job(owner=user, dataset=math_dataset(500), endpoint=ep, launch=False)
    for j, size in ((small, 2_000), (big, 200_000)):
        items = list(range(size))
        rows = profiled_rows(lambda: [scan(items, size - 1) for _ in range(20)])  # noqa: B023
        services.record(j.pk, [snap(services.start(j), rows, verifications=20, profiled=20)])
    flags = services.job_profile(big)["red_flags"]
    growth = [f for f in flags if f["kind"] == "growth"]
    assert [f["function"] for f in growth] == ["scan"] and growth[0]["other_job"] == small.pk  # not its callers
    assert growth[0]["value"] > 5 and "at 50 rollouts" in growth[0]["figure"] and "at 500 rollouts" in growth[0]["figure"]
    assert not [f for f in services.job_profile(small)["red_flags"] if f["kind"] == "growth"]


def test_compare_verdicts(user, math_dataset, sim_endpoint):
    ep = sim_endpoint("http://127.0.0.1:9")
    a = job_services.create_job(owner=user, dataset=math_dataset(10), endpoint=ep, launch=False)
    b = job_services.create_job(owner=user, dataset=math_dataset(10), endpoint=ep, launch=False)
    from workers.profiling.core import FuncRow

    services.record(a.pk, [snap(services.start(a), [
        FuncRow("/x/v.py", 1, "verify", 10, 0.1, 2.0, 0.2, [["/x/v.py", 5, "lookup", 10, 1.9]]),
        FuncRow("/x/v.py", 5, "lookup", 10, 1.9, 1.9, 0.19), FuncRow("/x/v.py", 9, "old", 5, 0.1, 0.1, 0.02),
        FuncRow("/x/v.py", 13, "normalize", 20, 0.4, 0.4, 0.02)])])
    services.record(b.pk, [snap(services.start(b), [
        FuncRow("/y/v2.py", 1, "verify", 10, 0.1, 0.3, 0.03), FuncRow("/y/v2.py", 7, "lookup", 10, 0.2, 0.2, 0.02),
        FuncRow("/y/v2.py", 11, "new", 20, 0.1, 0.1, 0.005),
        # cached: half the calls over the same 10 verifications, each call as dear as before
        FuncRow("/y/v2.py", 15, "normalize", 10, 0.2, 0.2, 0.02)])])
    fn = {f["name"]: f for f in comparison.compare_jobs(a, b)["functions"]}
    assert fn["normalize"]["verdict"] == "faster" and fn["normalize"]["d_tavg"] == pytest.approx(0)
    assert fn["normalize"]["a"]["per_verification"] == pytest.approx(0.04)
    assert fn["normalize"]["b"]["per_verification"] == pytest.approx(0.02)
    assert fn["lookup"]["verdict"] == "faster" and fn["lookup"]["d_tavg"] == pytest.approx(-0.17)
    assert fn["lookup"]["a"]["share"] == pytest.approx(1.9 / 2.5) and fn["lookup"]["d_ncall"] == 0
    assert fn["old"]["verdict"] == "gone" and fn["new"]["verdict"] == "new" and fn["new"]["d_ncall"] == 20
    assert comparison.compare_jobs(a, b)["warning"] == ""

    # a job whose profile sampled nothing: its functions are unknown, not gone, and the answer says why
    c = job_services.create_job(owner=user, dataset=math_dataset(10), endpoint=ep, launch=False)
    cmp = comparison.compare_jobs(a, c)
    assert {f["verdict"] for f in cmp["functions"]} == {"not profiled"} and cmp["b"]["profiled"] == 0
    assert f"job {c.pk} has no profile" in cmp["warning"]

    # a job profiled on a handful of its verifications: its scaled counts are rough, and the answer says so
    d = job_services.create_job(owner=user, dataset=math_dataset(10), endpoint=ep, launch=False)
    services.record(d.pk, [snap(services.start(d), [FuncRow("/y/v2.py", 15, "normalize", 60, 0.2, 0.2, 0.02)],
                                verifications=600, profiled=7)])
    cmp = comparison.compare_jobs(a, d)
    assert f"job {d.pk}: 7 of 600" in cmp["warning"] and "budget_pct 100" in cmp["warning"]
    assert f"job {a.pk}:" not in cmp["warning"]  # a: all 10 of its 10 verifications profiled
    assert services.job_profile(d)["few_samples"] and not services.job_profile(a)["few_samples"]

    # a second session of d: the comparison takes every window of the job, its rows and the verifications
    # behind them alike (per-verification figures stay right), and 37 profiled is no longer a thin sample
    services.record(d.pk, [snap(services.start(d), [FuncRow("/y/v2.py", 15, "normalize", 300, 1.0, 1.0, 0.02)],
                                verifications=300, profiled=30)])
    cmp = comparison.compare_jobs(a, d)
    assert cmp["b"]["verifications"] == 900 and cmp["b"]["profiled"] == 37 and cmp["warning"] == ""
    norm = next(f for f in cmp["functions"] if f["name"] == "normalize")
    assert norm["b"]["ncall"] == 360 and norm["b"]["per_verification"] == pytest.approx(1.2 / 900)
    assert services.job_profile(d)["verifications"] == 300  # the job's page shows its newest session


def test_profile_job_command(job):
    out = io.StringIO()
    call_command("profile_job", str(job.pk), "--seconds", "30", "--no-wait", stdout=out)
    assert services.active_session(job.pk).seconds == 30 and "profiling on" in out.getvalue()
    call_command("profile_job", str(job.pk), "--off", stdout=out)
    assert services.active_session(job.pk) is None


def test_diagnosis_offers_profiling_then_names_the_top_function(job):
    """A verification-bound job: the diagnosis offers "profile for 60 s"; once a snapshot exists it names the
    function holding the time, with the figure and the advice."""
    from controlplane.diagnostics.services import diagnose_job
    from tests.workers.test_diagnosis import base, shares
    from workers.diagnosis import VERIFICATION, diagnose
    from workers.profiling.core import FuncRow

    ev = shares(base(cpu_children_pct=760.0), 20, 80, 400, 510)
    d = diagnose(ev)
    assert d.verdict == VERIFICATION
    offer = next(r for r in d.recommendations if r.setting == "profile_seconds")
    assert offer.value == 60 and "Profile verification for 60 s" in offer.action

    assert services.profile_top(job) is None
    s = services.start(job, seconds=60)
    services.record(job.pk, [snap(s, [
        FuncRow("/srv/v.py", 10, "Verifier.verify", 100, 0.05, 2.0, 0.02, [["/srv/v.py", 30, "is_known", 100, 1.9]]),
        FuncRow("/srv/v.py", 30, "is_known", 100, 1.9, 1.9, 0.019)], verifications=100, profiled=100)])
    top = services.profile_top(job)
    assert top["function"] == "is_known" and top["flag"] == "over_half" and "97% of total" in top["figure"]  # 1.9 of 1.95 s
    ev.profile_top = top
    d = diagnose(ev)
    first = d.recommendations[0]
    assert first.action.startswith("Fix is_known (/srv/v.py:30) first") and "over_half" in first.why
    assert not any(r.setting == "profile_seconds" for r in d.recommendations)
    assert any(i.name == "profile_top_function" and i.value == "is_known" for i in d.evidence_items)
    # the stored-data path puts it into the evidence
    assert any(i.name == "profile_top_function" and i.value == "is_known" for i in diagnose_job(job).evidence_items)


@pytest.mark.django_db(transaction=True)  # the DB thread reads the session on its own connection
def test_a_job_created_with_profiling_enabled_opens_one_session(job):
    from controlplane.jobs.sink import DbThread

    job.profiling_enabled = True
    db = DbThread(name="t")
    try:
        sink, control = services.profile_run(job, object(), None, db=db, worker_name="w1")
        services.profile_run(job, object(), None, db=db, worker_name="w2")  # another chunk
        assert ProfileSession.objects.filter(job=job).count() == 1
        s = services.active_session(job.pk)
        assert s is not None and s.seconds is None and s.scope == "verify"
        assert type(control).__name__ == "ProfilingControl" and control.source().session == s.key
    finally:
        db.close()
    services.stop(job)
    services.profile_run(job, object(), None, db=None, worker_name="w3")  # after it was switched off: not again
    assert services.active_session(job.pk) is None


def test_rolloutctl_profile_on_show_off(user, job, capsys):
    """rolloutctl over the API (DRF's in-process requests adapter in place of the network)."""
    from tests.factories import api_token
    from rest_framework.test import RequestsClient

    from rolloutctl.cli import build_parser, do_profile
    from rolloutctl.client import Client

    token = api_token(user)
    client = Client("http://testserver", token, session=RequestsClient())
    client.session.headers["Authorization"] = f"Token {token}"
    args = build_parser().parse_args(["profile", str(job.pk), "--seconds", "45", "--clock", "cpu", "--no-wait"])
    assert do_profile(client, args) == 0
    s = services.active_session(job.pk)
    assert s.seconds == 45 and s.clock == "cpu"
    services.record(job.pk, [snap(s, profiled_rows(scan, list(range(50_000)), -1))])
    assert do_profile(client, build_parser().parse_args(["profile", str(job.pk), "--show"])) == 0
    out = capsys.readouterr().out
    assert "scan" in out and "ncall" in out and "1 snapshots from 1 worker(s)" in out
    assert do_profile(client, build_parser().parse_args(["profile", str(job.pk), "--off"])) == 0
    assert services.active_session(job.pk) is None
