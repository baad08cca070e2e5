"""A hostile user profiles the whole worker (`scope=worker`) and reads other tenants' verifier calls in the
profile. Whole-worker profiling is the operator's: non-staff get 403 with the reason (API, so the dashboard's
panel and rolloutctl too), and the panel offers it to staff only; profiling one's own verifier calls
(`scope=verify`) stays open to every user."""
from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.jobs import services as job_services
from controlplane.profiling.models import ProfileSession

from .conftest import make_dataset, make_endpoint


@pytest.fixture
def job(mallory):
    return job_services.create_job(owner=mallory, dataset=make_dataset(mallory), endpoint=make_endpoint(mallory),
                                   launch=False)


def test_non_staff_cannot_profile_a_whole_worker(api, web, job):
    url = f"/api/jobs/{job.pk}/profile/"
    r = api.post(url, {"seconds": 60, "scope": "worker"}, format="json")
    assert r.status_code == 403, r.content
    assert "staff only" in r.json()["detail"] and "scope 'verify'" in r.json()["detail"]
    assert not ProfileSession.objects.exists()
    r = api.post(url, {"seconds": 60, "scope": "verify"}, format="json")
    assert r.status_code == 201 and r.json()["scope"] == "verify"
    page = web.get(f"/jobs/{job.pk}/").content.decode()
    assert '<option value="verify">' in page and '<option value="worker">' not in page


def test_staff_can(job, django_user_model, mallory):
    staff = django_user_model.objects.create_user(username="ops", password="pw-ops-12345", is_staff=True)
    job.owner = staff  # staff see every job anyway; their own here keeps the test about the scope
    job.save(update_fields=["owner"])
    api = APIClient()
    api.force_authenticate(staff)
    r = api.post(f"/api/jobs/{job.pk}/profile/", {"seconds": 60, "scope": "worker"}, format="json")
    assert r.status_code == 201 and r.json()["scope"] == "worker", r.content
    web = Client()
    web.force_login(staff)
    assert '<option value="worker">' in web.get(f"/jobs/{job.pk}/").content.decode()
