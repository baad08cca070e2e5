"""The active-job quota holds under concurrent requests: 30 POSTs at once from threads (each its own
PostgreSQL connection) for a quota of 20 get exactly 20 jobs. The quota is checked under a lock on the user's
row, in the transaction that creates the job; sweeps count against the same quota."""
from __future__ import annotations

import threading

import pytest
from django.db import connection, connections
from rest_framework.test import APIClient

from controlplane.jobs.models import CollectionJob
from tests.factories import make_dataset, make_endpoint, make_user

pytestmark = pytest.mark.django_db(transaction=True)

QUOTA = 20
CONCURRENT = 30


def _post_all(user, n, url_for, body_for):
    """n POSTs released at once by a barrier, one thread (and database connection) each; their status codes."""
    barrier = threading.Barrier(n)
    codes: list[int] = []

    def one(i):
        try:
            c = APIClient()
            c.force_authenticate(user)
            barrier.wait(timeout=30)
            codes.append(c.post(url_for(i), body_for(i), format="json").status_code)
        finally:
            connections.close_all()  # this thread's connection

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return codes


@pytest.fixture
def quota(settings):
    if connection.vendor != "postgresql":
        pytest.skip("the race needs concurrent writers: PostgreSQL (SQLite serializes writes anyway)")
    settings.JOBS_MAX_ACTIVE_PER_USER = QUOTA
    settings.API_USER_MAX_IN_FLIGHT = CONCURRENT  # every POST reaches the quota's lock (the race under test)
    settings.CELERY_TASK_ALWAYS_EAGER = False


@pytest.mark.slow
def test_thirty_concurrent_job_posts_get_at_most_the_quota(quota):
    mallory = make_user("mallory")
    ds, ep = make_dataset(mallory, n=2), make_endpoint(mallory)
    codes = _post_all(mallory, CONCURRENT, lambda i: "/api/jobs/",
                      lambda i: {"dataset": ds.pk, "endpoint": ep.pk, "num_samples_in_parallel": 1, "name": f"j{i}"})
    assert len(codes) == CONCURRENT
    active = CollectionJob.objects.filter(owner=mallory, state__in=["queued", "running"]).count()
    assert active == QUOTA and codes.count(201) == QUOTA, (active, sorted(codes))
    assert codes.count(400) == CONCURRENT - QUOTA


@pytest.mark.slow
def test_concurrent_sweeps_and_jobs_share_the_quota(quota):
    from controlplane.diagnostics.models import ParallelismSweep

    mallory = make_user("mallory")
    ds, ep = make_dataset(mallory, n=2), make_endpoint(mallory)
    codes = _post_all(mallory, CONCURRENT, lambda i: "/api/jobs/" if i % 2 else "/api/sweeps/",
                      lambda i: {"dataset": ds.pk, "endpoint": ep.pk, "num_samples_in_parallel": 1} if i % 2 else
                      {"dataset": ds.pk, "endpoint": ep.pk, "sample_size": 2, "max_parallelism": 1})
    active = (CollectionJob.objects.filter(owner=mallory, state__in=["queued", "running"]).count()
              + ParallelismSweep.objects.filter(owner=mallory, state__in=["queued", "running"]).count())
    assert active == QUOTA and codes.count(201) == QUOTA, (active, sorted(codes))
