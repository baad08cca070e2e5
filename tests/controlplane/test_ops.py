"""Model-server operations from the control plane (API, dashboard, command) against the simulator, and the weight
versions of a job's rollouts."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db.models import Count
from django.utils import timezone
from tests.factories import InlineRun, api_token
from rest_framework.test import APIClient

from controlplane.endpoints import ops
from controlplane.endpoints.models import AdminAction, AdminOperation, WeightVersion
from controlplane.jobs.versions import VersionTagger
from controlplane.jobs import services
from controlplane.jobs.export import iter_export_lines
from controlplane.jobs.models import JobState, Rollout
from workers.engine.types import RolloutResult

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api(user, eager_tasks):
    """Celery tasks run inline: the API queues each action and a worker (here, inline) runs it."""
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {api_token(user)}")
    return c


def act(api, url, body=None, *, state=None):
    """POST an ops action (202 with its URL), then read it back as a trainer polling it would; returns
    its report (`result`)."""
    r = api.post(url, body or {}, format="json")
    assert r.status_code == 202, r.content
    assert r["Location"] == r.json()["url"]
    action = api.get(r["Location"]).json()
    assert action["state"] in ("succeeded", "failed") and action["trace_id"] == action["result"]["trace_id"]
    if state:
        assert action["state"] == state, action
    return action["result"]


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_weight_update_route_for_a_trainer(api, user, sim_endpoint, simulator_factory):
    a, b = simulator_factory(update_weights_ms=50), simulator_factory(update_weights_ms=50)
    ep = sim_endpoint(a.url, owner=user, replica_urls=[b.url])
    out = act(api, f"/api/endpoints/{ep.pk}/weights/", {"checkpoint_id": "step-100"}, state="succeeded")
    assert out["applied"] and out["ok"] and out["server"] == "simulator"
    assert out["version"] == "1" and out["previous_version"] == ""
    assert [o["kind"] for o in out["operations"]] == ["pause", "update_weights", "resume"] * 2
    for sim in (a, b):  # every replica took the version the control plane assigned, and generates again
        assert sim.get_json("/weight_version")["weight_version"] == 1
        assert sim.get_json("/is_paused")["is_paused"] is False
    # the next update without a version is numbered after it; an explicit version is kept
    assert act(api, f"/api/endpoints/{ep.pk}/weights/", {"path": "/ckpt/200"})["version"] == "2"
    assert act(api, f"/api/endpoints/{ep.pk}/weights/", {"path": "/ckpt/x", "version": 10})["version"] == "10"
    assert list(WeightVersion.objects.filter(endpoint=ep).values_list("version", flat=True)) == ["10", "2", "1"]
    # stored: six operations per update with one trace id, timed, rpc from the server's Server-Timing
    rows = AdminOperation.objects.filter(endpoint=ep, trace_id=out["trace_id"])
    assert rows.count() == 6 and set(rows.values_list("status", flat=True)) == {"ok"}
    upd = rows.filter(kind="update_weights").first()
    assert upd.rpc_source == "server-timing" and upd.rpc_ms >= 45 and upd.wall_ms >= upd.rpc_ms
    assert upd.queue_ms == pytest.approx(upd.wall_ms - upd.rpc_ms, abs=0.01)
    assert upd.params["checkpoint_id"] == "step-100" and upd.source == "api"
    # searchable by trace id (a prefix is enough), with percentiles per kind
    log = api.get(f"/api/endpoints/{ep.pk}/ops/log/", {"trace_id": out["trace_id"][:10]}).json()
    assert len(log["operations"]) == 6 and {o["trace_id"] for o in log["operations"]} == {out["trace_id"]}
    stats = {s["kind"]: s for s in api.get(f"/api/endpoints/{ep.pk}/ops/stats/").json()["stats"]}
    assert stats["update_weights"]["n"] == 6 and stats["update_weights"]["rpc_ms_p50"] >= 45
    assert stats["pause"]["queue_ms_p99"] is not None


def test_bad_update_requests_are_refused_and_send_nothing(api, user, sim_endpoint, simulator):
    ep = sim_endpoint(simulator.url, owner=user)
    r = api.post(f"/api/endpoints/{ep.pk}/weights/", {}, format="json")
    assert r.status_code == 400 and "path" in r.json()
    r = api.post(f"/api/endpoints/{ep.pk}/weights/", {"path": "/x", "pause_mode": "sideways"}, format="json")
    assert r.status_code == 400
    for bad in ({"path": ""}, {"path": "/x", "version": "3"}, ["/x"], "/x"):  # blank, wrong types, not an object
        assert api.post(f"/api/endpoints/{ep.pk}/weights/", bad, format="json").status_code == 400, bad
    hosted = sim_endpoint(simulator.url, owner=user, kind="openai", name="hosted")
    r = api.post(f"/api/endpoints/{hosted.pk}/weights/", {"path": "/x"}, format="json")
    assert r.status_code == 400 and "no ops routes" in json.dumps(r.json())
    assert not AdminOperation.objects.exists() and not AdminAction.objects.exists()


@pytest.mark.slow
def test_resume_is_sent_when_the_update_fails(api, user, sim_endpoint, simulator_factory):
    sim = simulator_factory()
    sim.configure(admin_faults={"update_weights": "503"})
    ep = sim_endpoint(sim.url, owner=user, max_retries=1)
    out = act(api, f"/api/endpoints/{ep.pk}/weights/", {"path": "/ckpt/bad"}, state="failed")
    assert not out["applied"] and out["failed_replicas"] == [sim.url] and out["not_resumed"] == []
    assert [(o["kind"], o["status"]) for o in out["operations"]] == [
        ("pause", "ok"), ("update_weights", "failed"), ("resume", "ok")]
    assert out["operations"][1]["attempts"] == 2 and out["operations"][1]["http_status"] == 503
    # the owner (not staff) reads the status code only, never the server's body; staff read the message
    stored = AdminOperation.objects.get(kind="update_weights", trace_id=out["trace_id"]).error
    assert out["operations"][1]["error"] == "HTTP 503" and stored.startswith("HTTP 503 — the server said: ") and len(stored) > 30
    log = api.get(f"/api/endpoints/{ep.pk}/ops/log/", {"kind": "update_weights"}).json()["operations"]
    assert [o["error"] for o in log] == ["HTTP 503"]
    staff = APIClient()
    staff.force_authenticate(user=type(user).objects.create_user("root", password="x", is_staff=True))
    action = staff.get(f"/api/endpoints/{ep.pk}/ops/actions/{AdminAction.objects.get().pk}/").json()
    assert action["result"]["operations"][1]["error"] == stored
    assert sim.get_json("/is_paused")["is_paused"] is False
    assert not WeightVersion.objects.exists() and out["version"] == ""
    assert AdminOperation.objects.filter(kind="resume", status="ok", trace_id=out["trace_id"]).count() == 1


@pytest.mark.slow
def test_a_replica_that_does_not_answer_is_reported(api, user, sim_endpoint, simulator_factory, settings):
    good, stuck = simulator_factory(), simulator_factory()
    stuck.configure(admin_faults={"pause": "stall", "health": "stall"})
    dead = _dead_url()
    ep = sim_endpoint(good.url, owner=user, replica_urls=[stuck.url, dead], max_retries=0, connect_timeout_s=1)
    from workers.ops import client as ops_client

    old = dict(ops_client.DEFAULT_TIMEOUTS_S)
    ops_client.DEFAULT_TIMEOUTS_S.update(pause=1.0, health=1.0)
    try:
        t0 = time.monotonic()
        out = act(api, f"/api/endpoints/{ep.pk}/weights/", {"path": "/ckpt/3"}, state="failed")
        assert time.monotonic() - t0 < 15
        assert out["unanswered_replicas"] == [stuck.url]
        assert set(out["failed_replicas"]) == {stuck.url, dead}
        statuses = {(o["replica"], o["kind"]): o["status"] for o in out["operations"]}
        assert statuses[(stuck.url, "pause")] == "no_answer" and statuses[(stuck.url, "resume")] == "ok"
        assert statuses[(dead, "pause")] == "failed" and statuses[(good.url, "update_weights")] == "ok"
        h = act(api, f"/api/endpoints/{ep.pk}/ops/health/")
        assert h["ok"] is False and h["unanswered"] == [stuck.url]
    finally:
        ops_client.DEFAULT_TIMEOUTS_S.clear()
        ops_client.DEFAULT_TIMEOUTS_S.update(old)


@pytest.mark.slow
def test_the_web_process_only_queues_the_worker_runs(user, sim_endpoint, simulator_factory, settings):
    """Without a worker the action stays queued and no model server hears of it; the task (what a worker
    runs) records the report on the action, once: a redelivered task does not send the update again."""
    from controlplane.endpoints.tasks import run_admin_action_task

    # a control queue of its own: a control worker another test SIGKILLed stays registered for up to a minute
    # on the shared one (and would run this action)
    settings.CELERY_CONTROL_QUEUE = f"ctl-nobody-serves-{os.getpid()}-{time.monotonic_ns()}"
    sim = simulator_factory(update_weights_ms=20)
    ep = sim_endpoint(sim.url, owner=user)
    c = APIClient()
    c.credentials(HTTP_AUTHORIZATION=f"Token {api_token(user)}")
    r = c.post(f"/api/endpoints/{ep.pk}/weights/", {"checkpoint_id": "ck-7"}, format="json")
    assert r.status_code == 202 and r.json()["state"] == "queued" and r.json()["result"] is None
    action = AdminAction.objects.get()
    assert action.params == {"path": "", "checkpoint_id": "ck-7", "version": None, "pause_mode": "keep", "server": None}
    assert not AdminOperation.objects.exists() and sim.get_json("/weight_version")["weight_version"] != 1
    # no worker serves the control lane: the action says so instead of sitting "queued" in silence
    assert c.get(r["Location"]).json()["summary"].startswith("update_weights: queued; no worker serves the control "
                                                            "queue")

    assert run_admin_action_task(action.pk) == "succeeded"
    got = c.get(r["Location"]).json()
    assert got["state"] == "succeeded" and got["result"]["version"] == "1" and got["summary"] == "weights updated to version 1"
    assert sim.get_json("/weight_version")["weight_version"] == 1
    assert AdminOperation.objects.filter(trace_id=action.trace_id).count() == 3
    assert run_admin_action_task(action.pk) is None  # delivered again: not run again
    assert AdminOperation.objects.filter(trace_id=action.trace_id).count() == 3 and WeightVersion.objects.count() == 1

    # a run whose worker died (left "running") is reported failed when the broker delivers it again
    lost = AdminAction.objects.create(endpoint=ep, trace_id="lost", kind="pause", params={"mode": "keep"},
                                      state="running", started_at=timezone.now())
    assert run_admin_action_task(lost.pk) is None
    lost.refresh_from_db()
    assert lost.state == "failed" and "worker running this action was lost" in lost.error
    assert not AdminOperation.objects.filter(trace_id="lost").exists()
    # another user's endpoint and action: 404
    other = APIClient()
    other.force_authenticate(user=type(user).objects.create_user("mallory", password="x"))
    assert other.get(r["Location"]).status_code == 404
    assert other.post(f"/api/endpoints/{ep.pk}/weights/", {"path": "/x"}, format="json").status_code == 404


def test_queued_actions_lost_with_the_brokers_data_are_sent_again_or_expired(user, sim_endpoint, simulator_factory,
                                                                           eager_tasks, monkeypatch):
    """Redis came back without its data, so the queued actions' messages are gone: the watchdog sends a recent
    one again (a worker runs it, once) and fails an old one with the reason, sending nothing for it."""
    from controlplane.jobs import tasks

    sim = simulator_factory()
    ep = sim_endpoint(sim.url, owner=user)
    recent = AdminAction.objects.create(endpoint=ep, trace_id="recent", kind="pause", params={"mode": "keep"})
    old = AdminAction.objects.create(endpoint=ep, trace_id="old", kind="resume", params={})
    AdminAction.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(minutes=30))
    done = AdminAction.objects.create(endpoint=ep, trace_id="done", kind="resume", params={}, state="succeeded")

    monkeypatch.setattr(services, "broker_lost_its_data", lambda: True)
    report = tasks.watchdog()
    assert report["broker_lost"] is True and report["ops_actions"] == {"resent": [recent.pk], "expired": [old.pk]}
    recent.refresh_from_db()
    old.refresh_from_db()
    assert recent.state == "succeeded" and AdminOperation.objects.filter(trace_id="recent", kind="pause").exists()
    assert sim.get_json("/is_paused")["is_paused"] is True
    assert old.state == "failed" and "lost this action" in old.error and old.finished_at is not None
    assert not AdminOperation.objects.filter(trace_id__in=["old", "done"]).exists()
    assert AdminAction.objects.get(pk=done.pk).state == "succeeded"

    monkeypatch.setattr(services, "broker_lost_its_data", lambda: False)  # the next beat: nothing lost, nothing sent
    assert "ops_actions" not in tasks.watchdog()
    assert AdminOperation.objects.filter(trace_id="recent").count() == 1


@pytest.mark.slow
def test_operations_from_the_api_and_the_command(api, user, sim_endpoint, simulator_factory, capsys, eager_tasks):
    a, b = simulator_factory(), simulator_factory()
    ep = sim_endpoint(a.url, owner=user, replica_urls=[b.url], name="two-sims")
    r = act(api, f"/api/endpoints/{ep.pk}/ops/pause/", {"mode": "abort"}, state="succeeded")
    assert r["ok"] and r["params"] == {"mode": "abort"}
    assert a.get_json("/is_paused") == {"is_paused": True, "mode": "abort"}
    assert act(api, f"/api/endpoints/{ep.pk}/ops/resume/")["ok"]
    assert b.get_json("/is_paused")["is_paused"] is False
    r = act(api, f"/api/endpoints/{ep.pk}/ops/prewarm/", {"count": 7})
    assert r["sent"] == 7 and r["succeeded"] == 7
    # the older prewarm action (run in a worker) honours its count too
    assert api.post(f"/api/endpoints/{ep.pk}/prewarm/", {"count": 3}, format="json").status_code == 202
    ep.refresh_from_db()
    assert ep.last_prewarm["sent"] == 3
    assert act(api, f"/api/endpoints/{ep.pk}/ops/sleep/", {"level": 2})["ok"]
    assert a.get_json("/is_sleeping")["is_sleeping"] is True
    assert act(api, f"/api/endpoints/{ep.pk}/ops/wake_up/")["ok"]
    assert api.post(f"/api/endpoints/{ep.pk}/ops/teleport/", {}, format="json").status_code == 404
    assert api.post(f"/api/endpoints/{ep.pk}/ops/pause/", {"mode": "x"}, format="json").status_code == 400
    assert api.post(f"/api/endpoints/{ep.pk}/ops/pause/", "keep", format="json").status_code == 400
    # one action per request, each with its requests to both replicas under its trace id
    assert AdminAction.objects.filter(endpoint=ep).count() == 5
    for action in AdminAction.objects.filter(endpoint=ep):
        assert AdminOperation.objects.filter(trace_id=action.trace_id).count() == (7 if action.kind == "prewarm" else 2)

    call_command("endpoint_ops", "two-sims", "update_weights", "--checkpoint-id", "ck-9", "--weight-version", "9")
    assert "ok, version 9" in capsys.readouterr().out
    assert a.get_json("/weight_version")["weight_version"] == 9
    a.configure(admin_faults={"reset_prefix_cache": "500"})
    with pytest.raises(CommandError, match="failed on a replica"):
        call_command("endpoint_ops", str(ep.pk), "reset_prefix_cache")
    call_command("endpoint_ops", str(ep.pk), "stats")
    assert "update_weights" in capsys.readouterr().out
    call_command("endpoint_admin", str(ep.pk), "stats")  # the deprecated name: the same command, a note on stderr
    out, err = capsys.readouterr()
    assert "update_weights" in out and "'endpoint_admin' is deprecated; use 'endpoint_ops'" in err
    kinds = set(AdminOperation.objects.filter(endpoint=ep).values_list("kind", flat=True))
    assert kinds == {"pause", "resume", "prewarm", "sleep", "wake_up", "update_weights", "reset_prefix_cache"}
    assert set(AdminOperation.objects.filter(endpoint=ep).values_list("source", flat=True)) == {"api", "command"}


def test_endpoint_page_buttons_log_search_percentiles_and_queue_alert(client, user, sim_endpoint, simulator, settings,
                                                                     eager_tasks):
    ep = sim_endpoint(simulator.url, owner=user)
    client.force_login(user)
    r = client.post(f"/endpoints/{ep.pk}/ops/update_weights/", {"checkpoint_id": "ck-1", "version": "4"})
    assert r.status_code == 302 and "?trace=" in r["Location"]
    trace = r["Location"].split("?trace=")[1]
    page = client.get(r["Location"]).content.decode()
    assert "weights updated to version 4" in page and page.count(f'title="{trace}"') == 3
    assert page.count('data-state="succeeded"') == 1  # the action list
    assert 'id="current-version">4<' in page
    client.post(f"/endpoints/{ep.pk}/ops/reset_prefix_cache/")
    page = client.get(f"/endpoints/{ep.pk}/").content.decode()
    assert 'data-kind="update_weights"' in page and 'data-kind="reset_prefix_cache"' in page
    assert 'id="queue-alert"' not in page  # nothing queued past 1,000 ms on an idle loopback server
    # an operation that queued on the client side past the threshold raises the alert
    AdminOperation.objects.create(endpoint=ep, trace_id="slowtrace0001", kind="update_weights", replica=simulator.url,
                                  status="ok", wall_ms=8600, rpc_ms=20, queue_ms=8580, created_at=timezone.now())
    page = client.get(f"/endpoints/{ep.pk}/").content.decode()
    assert 'id="queue-alert"' in page and "8580 ms" in page
    settings.OPS_QUEUE_ALERT_MS = 10_000
    assert 'id="queue-alert"' not in client.get(f"/endpoints/{ep.pk}/").content.decode()
    # search by trace id narrows the log to that operation
    page = client.get(f"/endpoints/{ep.pk}/", {"trace": "slowtrace"}).content.decode()
    assert page.count('title="slowtrace0001"') == 1 and f'title="{trace}"' not in page
    r = client.post(f"/endpoints/{ep.pk}/ops/pause/", {"mode": "sideways"}, follow=True)
    assert "pause mode must be one of" in r.content.decode()


@pytest.mark.slow
def test_a_job_spanning_two_weight_versions(api, client, user, math_dataset, sim_endpoint, simulator_factory, tmp_path):
    sim = simulator_factory(seed=4, ttft_ms=40, itl_ms=2, update_weights_ms=100)
    ep = sim_endpoint(sim.url, owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(60), endpoint=ep, num_repeats=2, launch=False,
                              num_samples_in_parallel=4, responses_create_params={"max_output_tokens": 8})
    run = InlineRun(job)
    run.wait_for_rows(30, timeout_s=60)
    assert act(api, f"/api/endpoints/{ep.pk}/weights/", {"path": "/ckpt/step-1"})["applied"]
    job = run.join(120)
    assert job.state == JobState.COMPLETED and job.completed_count == 120  # nothing lost across the update
    by_version = dict(Rollout.objects.filter(job=job).values_list("weight_version").annotate(n=Count("id")))
    assert set(by_version) == {"0", "1"} and sum(by_version.values()) == 120
    assert by_version["0"] >= 30 and by_version["1"] >= 1

    out = api.get(f"/api/jobs/{job.pk}/weight-versions/").json()
    assert out["current"] == "1" and out["tagged"] == 120 and out["untagged"] == 0
    rows = {v["version"]: v for v in out["versions"]}
    assert rows["0"]["total"] == by_version["0"] and rows["0"]["lag"] == 1
    assert rows["1"]["total"] == by_version["1"] and rows["1"]["lag"] == 0
    assert out["stale"] == by_version["0"] and out["max_lag"] == 1

    client.force_login(user)
    page = client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="weight-versions"' in page
    assert f'<tr data-version="0"><th>0</th><td class="count">{by_version["0"]}</td>' in page
    assert f'<tr data-version="1"><th>1</th><td class="count">{by_version["1"]}</td>' in page
    # exports carry each rollout's version
    lines = [json.loads(x) for x in iter_export_lines(job, "ok")]
    assert len(lines) == 120 and {x["weight_version"] for x in lines} == {"0", "1"}


def test_servers_without_a_version_are_tagged_by_dispatch_time(user, sim_endpoint):
    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    now = timezone.now()
    WeightVersion.objects.create(endpoint=ep, version="1", previous_version="", trace_id="t1",
                                 started_at=now - timedelta(seconds=100), applied_at=now - timedelta(seconds=99))
    WeightVersion.objects.create(endpoint=ep, version="2", previous_version="1", trace_id="t2",
                                 started_at=now - timedelta(seconds=10), applied_at=now - timedelta(seconds=9))
    tagger = VersionTagger(ep.pk)

    def result(wall_s, version=""):
        r = RolloutResult(task_index=0, rollout_index=0, ok=True, output_row={}, wall_ms=wall_s * 1000,
                          weight_version=version)
        tagger.stamp(r)
        return r

    batch = [result(200), result(50), result(5), result(5, version="7")]
    tagger.tag(batch)
    # dispatched before any update: the version before the first; then each update from its pause on
    assert [r.weight_version for r in batch] == ["0", "1", "2", "7"]
    assert ops.current_version(ep) == "2"


def test_rollouts_stored_before_the_first_update_are_tagged_when_it_is_recorded(user, sim_endpoint, math_dataset):
    from controlplane.jobs.versions import backfill

    ep = sim_endpoint("http://127.0.0.1:9", owner=user)
    job = services.create_job(owner=user, dataset=math_dataset(4), endpoint=ep, launch=False)
    now = timezone.now()
    # (stored seconds ago, wall seconds): dispatched 60 s ago; 20 s ago; 4 s ago (stored after the pause)
    for i, (ago, wall) in enumerate([(50, 10), (19, 1), (3, 1), (1, 0)]):
        Rollout.objects.create(job=job, task_index=i, rollout_index=0, status="ok", data={}, wall_ms=wall * 1000,
                               created_at=now - timedelta(seconds=ago), weight_version="7" if i == 3 else "")
    WeightVersion.objects.create(endpoint=ep, version="1", trace_id="t", started_at=now - timedelta(seconds=5),
                                 applied_at=now)
    assert backfill(ep.pk) == 3
    got = dict(Rollout.objects.filter(job=job).values_list("task_index", "weight_version"))
    assert got == {0: "0", 1: "0", 2: "1", 3: "7"}  # a version the server reported is kept


def test_old_admin_routes_are_deprecated_aliases_of_the_ops_routes(api, user, sim_endpoint, simulator):
    """/api/endpoints/<id>/admin/... still works (same views) but says it is deprecated and where to go;
    /ops/... is the canonical route and carries no such header; the schema marks the old paths deprecated."""
    ep = sim_endpoint(simulator.url, owner=user)
    old = api.post(f"/api/endpoints/{ep.pk}/admin/health/", {}, format="json")
    assert old.status_code == 202 and old["Deprecation"] == "true"
    assert old["Link"] == f'<http://testserver/api/endpoints/{ep.pk}/ops/health/>; rel="successor-version"'
    action_url = old.json()["url"]
    assert f"/api/endpoints/{ep.pk}/ops/actions/" in action_url  # new actions point at the canonical route
    new = api.get(action_url)
    assert new.status_code == 200 and "Deprecation" not in new and new.json()["state"] in ("succeeded", "failed")
    aid = new.json()["id"]
    for old_path, new_path in ((f"admin/actions/{aid}/", f"ops/actions/{aid}/"), ("admin/operations/", "ops/log/"),
                               ("admin/stats/", "ops/stats/")):
        o, n = api.get(f"/api/endpoints/{ep.pk}/{old_path}"), api.get(f"/api/endpoints/{ep.pk}/{new_path}")
        assert o.status_code == n.status_code == 200 and o.json() == n.json(), old_path
        assert o["Deprecation"] == "true" and "Deprecation" not in n
        assert o["Link"] == f'<http://testserver/api/endpoints/{ep.pk}/{new_path}>; rel="successor-version"'
    # an error answer from the old route is deprecated too (the header does not depend on success)
    missing = api.get(f"/api/endpoints/{ep.pk}/admin/actions/999999/")
    assert missing.status_code == 404 and missing["Deprecation"] == "true"
    schema = api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    assert schema["/api/endpoints/{id}/admin/stats/"]["get"].get("deprecated") is True
    assert schema["/api/endpoints/{id}/admin/{kind}/"]["post"].get("deprecated") is True
    assert "deprecated" not in schema["/api/endpoints/{id}/ops/stats/"]["get"]
    assert "deprecated" not in schema["/api/endpoints/{id}/ops/{kind}/"]["post"]


def test_the_old_admin_setting_names_are_still_read():
    """OPS_* settings were ADMIN_*: an operator's old variable still counts, the new one wins when both are set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPS_", "ADMIN_"))}
    env.update(ADMIN_QUEUE_ALERT_MS="5", ADMIN_ACTION_DEADLINE_S="9", OPS_ACTION_DEADLINE_S="7")
    code = "from controlplane import settings as s; print(s.OPS_QUEUE_ALERT_MS, s.OPS_ACTION_DEADLINE_S, " \
           "s.OPS_ACTION_RESEND_MAX_AGE_S)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["5.0", "7.0", "300.0"]
