"""Verification from the control plane: fields checked at launch with line numbers, a user's verifier by
dotted path, deferred and fast jobs verified later in a batch run that resumes after a stop and
re-aggregates, the cache's hit rate."""
from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from controlplane.jobs import runtime, services, verification
from controlplane.jobs.models import JobState, Rollout, VerificationRun
from workers.engine.convert import response_text
from workers.verifiers import verify_row

pytestmark = pytest.mark.django_db(transaction=True)


def _job(user, ds, ep, **kw):
    job = services.create_job(owner=user, dataset=ds, endpoint=ep, launch=False, **kw)
    runtime.run_job_inline(job)
    job.refresh_from_db()
    assert job.state == JobState.COMPLETED, job.error_message
    return job


def test_launch_checks_the_rows_fields_with_line_numbers(user, math_dataset, sim_endpoint):
    rows = [{"responses_create_params": {"input": "q"}, "options": [{"A": "x"}], "expected_answer": "A"},
            {"responses_create_params": {"input": "q"}, "expected_answer": "A"},
            {"responses_create_params": {"input": "q"}, "options": [{"A": "x"}]}]
    ds = math_dataset(rows=rows)
    ep = sim_endpoint("http://127.0.0.1:9")
    with pytest.raises(ValidationError) as err:
        services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="mcqa", launch=False)
    msg = err.value.message_dict["dataset"][0]
    assert msg == "2 row(s) lack fields verifier 'mcqa' needs: line 2: options; line 3: expected_answer"
    # limit=1 keeps only the good row
    assert services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="mcqa", limit=1, launch=False).pk
    with pytest.raises(ValidationError) as err:
        services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="code", launch=False)
    assert "line 1: verifier_metadata.unit_tests" in err.value.message_dict["dataset"][0]
    with pytest.raises(ValidationError) as err:
        services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="mcqa", verifier_options={"grading_mode": "x"},
                            limit=1, launch=False)
    assert "grading_mode must be one of" in err.value.message_dict["verifier_options"][0]
    with pytest.raises(ValidationError) as err:
        services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="os:system", launch=False)
    assert "only the operator" in err.value.message_dict["verifier"][0]  # a user's module path: refused
    with pytest.raises(ValidationError) as err:  # the operator's (manage.py): imported, and not a verifier
        services.create_job(owner=user, dataset=ds, endpoint=ep, verifier="os:system", launch=False, operator=True)
    assert "must be a Verifier subclass" in err.value.message_dict["verifier"][0]


def test_user_verifier_by_dotted_path_scores_a_job(user, math_dataset, sim_endpoint, simulator, settings):
    settings.VERIFIER_PATH_MODULES = ["tests.verifier_plugins"]  # the operator lets users name its verifiers
    ds = math_dataset(30)
    job = _job(user, ds, sim_endpoint(simulator.url), verifier="tests.verifier_plugins:last_word",
               verifier_options={"suffix": "}"})
    rows = list(Rollout.objects.filter(job=job))
    assert len(rows) == 30 and all(r.status == "ok" for r in rows)
    for r in rows:  # '... \\boxed{N}' -> last word '\\boxed{N' minus '}' never equals N: and a '{N}' check instead
        assert r.data["last_word"] == response_text(r.data["response"]).split()[-1].removesuffix("}")
        assert r.reward == (1.0 if r.data["last_word"] == r.data["expected_answer"] else 0.0)
    assert "mean/reward" in job.aggregate_metrics


@pytest.mark.slow
def test_deferred_job_verified_in_a_resumable_batch_equals_inline(user, math_dataset, sim_endpoint, simulator_factory):
    ds = math_dataset(60)
    sim_a = simulator_factory(seed=7, math_accuracy=0.6)
    sim_b = simulator_factory(seed=7, math_accuracy=0.6)
    deferred = _job(user, ds, sim_endpoint(sim_a.url), verify_mode="deferred", verifier="math")
    inline = _job(user, ds, sim_endpoint(sim_b.url), verify_mode="inline", verifier="math")
    assert list(Rollout.objects.filter(job=deferred).values_list("reward", flat=True)) == [None] * 60
    assert "mean/reward" not in deferred.aggregate_metrics

    run = verification.start_verification(deferred, launch=False)
    assert run.total == 60 and verification.start_verification(deferred, launch=False).pk == run.pk
    assert verification.run_verification(run.pk, "w1", batch_size=25, stop_after_batches=1) == "stopped"
    run.refresh_from_db()
    assert run.verified == 25 and run.state == "running"
    # the first worker "died": its lease goes stale and another worker resumes after the cursor
    VerificationRun.objects.filter(pk=run.pk).update(heartbeat_at=None)
    assert verification.run_verification(run.pk, "w2", batch_size=25) == "done"
    run.refresh_from_db()
    assert (run.state, run.verified, run.attempts, run.errors) == ("done", 60, 2, 0)

    got = {r.task_index: (response_text(r.data["response"]), r.reward) for r in Rollout.objects.filter(job=deferred)}
    want = {r.task_index: (response_text(r.data["response"]), r.reward) for r in Rollout.objects.filter(job=inline)}
    assert got == want and 0 < sum(v[1] for v in got.values()) < 60
    deferred.refresh_from_db()
    inline.refresh_from_db()
    assert deferred.aggregate_metrics["mean/reward"] == pytest.approx(inline.aggregate_metrics["mean/reward"])
    summary = verification.summary(deferred)
    assert summary["state"] == "done" and summary["verified"] == 60 and summary["info"]["kind"] == "cpu"


@pytest.mark.slow
def test_fast_job_gets_the_exact_verifier_later_and_repeats_hit_the_cache(user, math_dataset, sim_endpoint,
                                                                            simulator_factory):
    rows = [{"responses_create_params": {"input": "What is 3 + 4?"}, "question": "What is 3 + 4?",
             "expected_answer": "7"}]
    ds = math_dataset(rows=rows)
    sim = simulator_factory(seed=3, math_accuracy=0.5)
    # 4 output tokens: just "The answer is \boxed{N}", so repeats often give the same response
    job = _job(user, ds, sim_endpoint(sim.url), verify_mode="fast", verifier="math", num_repeats=40,
               responses_create_params={"max_output_tokens": 4})
    # the exact pass ran by itself when collection ended (here in the inline runner's process)
    run = VerificationRun.objects.get(job=job)
    assert run.state == "done" and run.info["trigger"] == "fast_exact_pass" and run.verified == 40
    agree = run.info["fast_agreement"]
    fast_equal = 0
    for r in Rollout.objects.filter(job=job):
        text = response_text(r.data["response"])
        exact = verify_row("math", rows[0], text)
        assert r.reward == exact.reward and r.data["library_reward"] == exact.fields["library_reward"]
        assert r.data["fast_reward"] == verify_row("math", rows[0], text, fast=True).reward  # the heuristic's, kept
        fast_equal += r.data["fast_reward"] == r.reward
    assert agree == {"same": fast_equal, "compared": 40}
    distinct = len({response_text(r.data["response"]) for r in Rollout.objects.filter(job=job)})
    assert run.cache_lookups == 40 and run.cache_hits == 40 - distinct and distinct < 40
    job.refresh_from_db()
    assert job.aggregate_metrics["mean/reward"] == pytest.approx(sum(
        r.reward for r in Rollout.objects.filter(job=job)) / 40)
    # a second pass (a re-verification) finds every result in the job's cache and keeps fast_reward
    again = verification.start_verification(job, launch=False)
    assert verification.run_verification(again.pk, "w") == "done"
    again.refresh_from_db()
    assert again.cache_hits == again.cache_lookups == 40 and again.info["trigger"] == "user"
    assert "fast_agreement" not in again.info


def test_only_completed_jobs_are_verified(user, math_dataset, sim_endpoint):
    job = services.create_job(owner=user, dataset=math_dataset(3), endpoint=sim_endpoint("http://127.0.0.1:9"),
                              launch=False, verify_mode="deferred")
    from controlplane.jobs.models import InvalidTransition

    with pytest.raises(InvalidTransition, match="cannot verify a job that is queued"):
        verification.start_verification(job, launch=False)


@pytest.mark.slow
def test_fast_job_completion_sends_its_exact_pass_to_a_worker(user, math_dataset, sim_endpoint, simulator,
                                                              django_capture_on_commit_callbacks, monkeypatch):
    """Through Celery (not the inline runner): the last chunk's completion creates the exact pass in the same
    transaction and sends it; the job API shows it until it is done."""
    from controlplane.jobs import tasks

    sent = []
    monkeypatch.setattr(tasks.verify_job_task, "delay", lambda *a: sent.append(a))
    job = services.create_job(owner=user, dataset=math_dataset(6), endpoint=sim_endpoint(simulator.url), launch=False,
                              verify_mode="fast", verifier="math")
    chunk = job.chunks.get()
    with django_capture_on_commit_callbacks(execute=True):
        assert runtime.run_chunk(chunk.pk, "celery-like") == "done"
    job.refresh_from_db()
    run = VerificationRun.objects.get(job=job)
    assert job.state == JobState.COMPLETED and sent == [(run.pk,)] and run.state == "pending"
    assert verification.summary(job)["info"]["trigger"] == "fast_exact_pass"
    from django.test import Client
    from rest_framework.test import APIClient

    web, api = Client(), APIClient()
    web.force_login(user)
    api.force_authenticate(user)
    page = web.get(f"/jobs/{job.pk}/").content.decode()
    assert "exact pass (started when collection ended)" in page and "it starts by itself when collection ends" in page
    body = api.get(f"/api/jobs/{job.pk}/").json()
    assert body["verification"]["state"] == "pending" and body["verification"]["info"]["trigger"] == "fast_exact_pass"
    assert verification.run_verification(run.pk, "worker") == "done"
    assert verification.summary(job)["state"] == "done"
    body = api.get(f"/api/jobs/{job.pk}/").json()
    agree = body["verification"]["info"]["fast_agreement"]
    assert body["verification"]["state"] == "done" and agree["compared"] == 6
    page = web.get(f"/jobs/{job.pk}/").content.decode()
    assert f"({agree['same']} / 6); the heuristic's stays in each rollout as <code>fast_reward</code>" in page
    # an inline or deferred job gets none
    other = services.create_job(owner=user, dataset=math_dataset(3), endpoint=sim_endpoint(simulator.url), launch=False,
                                verify_mode="deferred", verifier="math")
    with django_capture_on_commit_callbacks(execute=True):
        assert runtime.run_chunk(other.chunks.get().pk, "celery-like") == "done"
    assert not VerificationRun.objects.filter(job=other).exists() and len(sent) == 1
