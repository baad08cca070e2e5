"""A job's `profile_servers` (the dashboard's launch form, the REST API, `rolloutctl submit/run --profile-servers`):
the NeMo Gym deployment's own servers, discovered from the endpoint's head server config and called through the
outbound gate, are profiled while the job runs, and the job page shows each server's table as it shows
collect_rollouts' +profiling_enabled results. Against a simulated NeMo Gym deployment
(tests.controlplane.test_dropin_nemo_gym_sim.FakeNemoGym: /stats writes yappi's files as nemo-gym 0.4.0 does)."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.jobs.models import CollectionJob, JobState
from controlplane.jobs.runtime import run_job_inline
from controlplane.profiling.services import job_profile
from tests.controlplane.test_dropin_nemo_gym_sim import AGENT, RES, FakeNemoGym
from tests.factories import ingest_dataset, make_endpoint

pytestmark = pytest.mark.django_db(transaction=True)


def _gym(owner, ng):
    return make_endpoint(
        owner, f"http://127.0.0.1:{ng.ports['agent']}", kind="nemo_gym", model=AGENT, name="gym", max_retries=0
    )


def test_api_job_with_profile_servers_shows_each_servers_own_table_on_the_job_page(api, alice, tmp_path):
    with FakeNemoGym(tmp_path / "ng") as ng:
        ds = ingest_dataset(alice, n=6)
        body = {
            "dataset": ds.pk,
            "endpoint": _gym(alice, ng).pk,
            "num_repeats": 2,
            "verifier": "none",
            "profile_servers": True,
        }
        r = api.post("/api/jobs/", body, format="json")
        assert r.status_code == 201, r.content
        assert r.json()["profile_servers"] is True and r.json()["profiling_enabled"] is True
        job = run_job_inline(CollectionJob.objects.get(pk=r.json()["id"]))
        assert job.state == JobState.COMPLETED, job.error_message
        assert ng.calls["stats"][RES] >= 2 and ng.calls["stats"][AGENT] >= 2  # a baseline, then the run's share
    servers = {s["name"]: s for s in job_profile(job)["servers"]}
    assert set(servers) == {AGENT, RES}
    calls = {row["name"]: row["ncall"] for row in servers[RES]["rows"]}
    assert calls["_verify_answer"] == 24 and "startup" not in calls, calls  # the run's 12 /run calls, 2 each
    c = Client()
    c.force_login(alice)
    html = c.get(f"/jobs/{job.pk}/").content.decode()
    assert f'data-server="{RES}"' in html and f"NeMo Gym server {AGENT}" in html
    assert "NeMo Gym servers&#x27; own profiles" in html or "NeMo Gym servers' own profiles" in html


def test_profile_servers_calls_no_listed_server_the_outbound_gate_refuses(api, alice, tmp_path, settings):
    """Hostile input: the head's config lists the servers; only those the gate allows are called."""
    with FakeNemoGym(tmp_path / "ng") as ng:
        settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{ng.ports['agent']}"]  # the head (and agent) only
        body = {
            "dataset": ingest_dataset(alice, n=2).pk,
            "endpoint": _gym(alice, ng).pk,
            "verifier": "none",
            "profile_servers": True,
        }
        r = api.post("/api/jobs/", body, format="json")
        job = run_job_inline(CollectionJob.objects.get(pk=r.json()["id"]))
        assert job.state == JobState.COMPLETED, job.error_message
        assert ng.calls["stats"][RES] == 0 and ng.calls["stats"][AGENT] >= 2
    assert {s["name"] for s in job_profile(job)["servers"]} == {AGENT}


def test_profile_servers_is_refused_for_an_endpoint_that_is_not_nemo_gym(api, alice):
    body = {"dataset": ingest_dataset(alice, n=2).pk, "endpoint": make_endpoint(alice).pk, "profile_servers": True}
    r = api.post("/api/jobs/", body, format="json")
    assert r.status_code == 400 and "NeMo Gym endpoint" in str(r.json()["profile_servers"]), r.content
    assert not CollectionJob.objects.exists()


def test_the_launch_form_starts_server_profiling(alice, tmp_path):
    with FakeNemoGym(tmp_path / "ng") as ng:
        ds, ep = ingest_dataset(alice, n=2), _gym(alice, ng)
        c = Client()
        c.force_login(alice)
        page = c.get(f"/datasets/{ds.pk}/").content.decode()
        assert 'name="profile_servers"' in page
        form = {
            "endpoint": ep.pk,
            "num_repeats": 1,
            "num_samples_in_parallel": 4,
            "verifier": "none",
            "verify_mode": "inline",
            "verify_cache": "job",
            "chunk_size": 5000,
            "profile_servers": "on",
        }
        r = c.post(f"/datasets/{ds.pk}/", form)
        assert r.status_code == 302, r.content.decode()[-3000:]
    job = CollectionJob.objects.get()
    assert job.collection_options.get("profile_servers") is True and job.profiling_enabled


def test_rolloutctl_sends_profile_servers_only_when_asked():
    from rolloutctl.cli import build_parser, do_submit

    class Api:
        def create_job(self, body, idempotency_key=None):
            self.body = body
            return {"id": 9, "progress": {"total": 1}}, True

    a = Api()
    do_submit(a, build_parser().parse_args(["submit", "--dataset-id", "1", "--endpoint", "2", "--profile-servers"]))
    assert a.body["profile_servers"] is True
    do_submit(a, build_parser().parse_args(["run", "--dataset-id", "1", "--endpoint", "2"]))
    assert "profile_servers" not in a.body
