"""Jobs admin: list with progress, actions through services (messages on InvalidTransition), chunk
inline, and rollout / metric-sample lists."""
from __future__ import annotations

import pytest
from django.urls import reverse

from controlplane.jobs import services
from controlplane.jobs.models import CollectionJob, JobMetricSample, JobState, Rollout

pytestmark = pytest.mark.django_db


@pytest.fixture
def job(user, math_dataset, sim_endpoint):
    job = services.create_job(owner=user, dataset=math_dataset(10), endpoint=sim_endpoint("http://127.0.0.1:9"),
                              num_repeats=2, chunk_size=4, name="admin-job", launch=False)
    Rollout.objects.bulk_create([Rollout(job=job, task_index=t, rollout_index=0, data={"reward": 1.0}, reward=1.0)
                                 for t in range(5)])
    Rollout.objects.create(job=job, task_index=5, rollout_index=0, status="failed", failure_class="timeout", data={})
    services.refresh_counts(job)
    JobMetricSample.objects.create(job=job, worker="w", completed=5, samples_per_s=2.5)
    return job


def test_job_list_shows_state_and_progress(admin_client, job):
    page = admin_client.get(reverse("admin:jobs_collectionjob_changelist"))
    assert page.status_code == 200
    text = page.content.decode()
    assert "admin-job" in text and "6/20 (30%)" in text and "queued" in text


def test_job_change_page_has_read_only_chunks(admin_client, job):
    page = admin_client.get(reverse("admin:jobs_collectionjob_change", args=[job.pk]))
    assert page.status_code == 200
    assert page.content.decode().lower().count(">pending<") >= 3  # the three chunks, read-only


def _act(client, action, *jobs):
    return client.post(reverse("admin:jobs_collectionjob_changelist"),
                       {"action": action, "_selected_action": [j.pk for j in jobs]}, follow=True)


def test_actions_go_through_services_and_report_invalid_transitions(admin_client, job):
    page = _act(admin_client, "pause_job_action", job)
    assert "Paused 1 job." in page.content.decode()
    assert CollectionJob.objects.get(pk=job.pk).state == JobState.PAUSED
    page = _act(admin_client, "pause_job_action", job)
    assert f"Job {job.pk}: cannot pause a job that is paused" in page.content.decode()
    page = _act(admin_client, "cancel_job_action", job)
    assert CollectionJob.objects.get(pk=job.pk).state == JobState.CANCELLED
    page = _act(admin_client, "retry_failed_action", job)
    assert "Retrying failed rows of 1 job." in page.content.decode()
    job.refresh_from_db()
    assert job.state == JobState.QUEUED and job.failed_count == 0
    assert not Rollout.objects.filter(job=job, status="failed").exists()


def test_rollout_and_metric_lists(admin_client, job):
    page = admin_client.get(reverse("admin:jobs_rollout_changelist"), {"job": job.pk, "status": "ok"})
    assert page.status_code == 200
    assert "5 rollouts" in page.content.decode() or page.content.decode().count("ok") >= 5
    one = Rollout.objects.filter(job=job).first()
    assert admin_client.get(reverse("admin:jobs_rollout_change", args=[one.pk])).status_code == 200
    assert admin_client.get(reverse("admin:jobs_rollout_changelist")).status_code == 200
    assert admin_client.get(reverse("admin:jobs_jobmetricsample_changelist"), {"job": job.pk}).status_code == 200
