"""The dashboard side of verification: a user's verifier by dotted path in the launch form, rows lacking
its fields reported with line numbers, and "Verify this job" on a deferred job's page with the run's
figures (progress, cache hit rate, where it ran)."""
from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse

from controlplane.jobs import verification
from controlplane.jobs.models import CollectionJob, VerificationRun

from tests.factories import make_dataset, make_endpoint, make_job



@pytest.fixture
def client_alice(alice):
    c = Client()
    c.force_login(alice)
    return c


FORM = {"num_repeats": 1, "num_samples_in_parallel": 2, "verify_mode": "inline", "chunk_size": 5,
        "verify_cache": "job"}


def test_launch_form_takes_a_dotted_path_verifier(client_alice, alice, no_celery, settings):
    settings.VERIFIER_PATH_MODULES = ["tests.verifier_plugins"]  # the operator lets users name its verifiers
    ds = make_dataset(alice, n=3)
    ep = make_endpoint(alice)
    page = client_alice.get(reverse("dashboard:dataset", args=[ds.pk])).content.decode()
    assert '<datalist id="verifier-names">' in page and '<option value="mcqa">' in page and '<option value="code">' in page
    resp = client_alice.post(reverse("dashboard:dataset", args=[ds.pk]), {
        **FORM, "endpoint": ep.pk, "name": "mine", "verifier": "tests.verifier_plugins:last_word",
        "verifier_options": '{"suffix": "}"}'})
    assert resp.status_code == 302, resp.content.decode()[:3000]
    job = CollectionJob.objects.get(name="mine")
    assert job.verifier == "tests.verifier_plugins:last_word" and job.verifier_options == {"suffix": "}"}
    # a verifier whose fields the rows lack: the line numbers, nothing launched
    resp = client_alice.post(reverse("dashboard:dataset", args=[ds.pk]), {**FORM, "endpoint": ep.pk, "verifier": "mcqa"})
    assert resp.status_code == 400
    assert "3 row(s) lack fields verifier &#x27;mcqa&#x27; needs: line 1: options; line 2: options" in resp.content.decode()
    resp = client_alice.post(reverse("dashboard:dataset", args=[ds.pk]), {**FORM, "endpoint": ep.pk,
                                                                          "verifier": "tests.verifier_plugins:nope"})
    assert resp.status_code == 400 and "has no &#x27;nope&#x27;" in resp.content.decode()
    assert CollectionJob.objects.count() == 1


@pytest.mark.slow
def test_verify_this_job_from_the_job_page(client_alice, alice, monkeypatch, django_capture_on_commit_callbacks):
    from controlplane.jobs import tasks

    sent = []
    monkeypatch.setattr(tasks.verify_job_task, "delay", lambda run_id: sent.append(run_id))
    ds = make_dataset(alice, n=20)
    job = make_job(alice, ds, make_endpoint(alice), n_rollouts=40, repeats=2, rewards=lambda t, r: None)
    CollectionJob.objects.filter(pk=job.pk).update(verify_mode="deferred", verifier="math")
    html = client_alice.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'id="action-verify"' in html and "Collected without verification" in html
    with django_capture_on_commit_callbacks(execute=True):
        resp = client_alice.post(reverse("dashboard:job_action", args=[job.pk, "verify"]), follow=True)
    assert resp.status_code == 200 and b"verify: done" in resp.content
    run = VerificationRun.objects.get(job=job)
    assert sent == [run.pk] and run.total == 40
    html = client_alice.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert 'id="action-verify"' not in html and '<b id="verification-state">pending</b>' in html
    # the worker's part (run here in-process): rewards, the cache's hit rate (2 identical repeats per task)
    assert verification.run_verification(run.pk, "test") == "done"
    html = client_alice.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    assert '<b id="verification-state">done</b>' in html and "40 / 40" in html
    assert '<td id="verification-cache-hit-rate">50%</td>' in html
    job.refresh_from_db()
    assert job.aggregate_metrics["mean/reward"] == 1.0  # every stored response is right
    # again, on a job that is not finished: a message, not a crash
    running = make_job(alice, ds, make_endpoint(alice), n_rollouts=0, state="running")
    resp = client_alice.post(reverse("dashboard:job_action", args=[running.pk, "verify"]), follow=True)
    assert b"cannot verify a job that is running" in resp.content
