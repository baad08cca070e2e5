"""Keyset pagination of the rollout browser: every row exactly once, forward and backward, with
filters, and no OFFSET in the SQL."""
from __future__ import annotations

import re

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from controlplane.dashboard.pagination import keyset_page
from controlplane.jobs.models import Rollout

from tests.factories import make_dataset, make_endpoint, make_job

pytestmark = pytest.mark.django_db


@pytest.fixture
def big_job(alice):
    ds = make_dataset(alice, n=300)
    ep = make_endpoint(alice)
    other = make_job(alice, ds, ep, n_rollouts=50)  # interleaved ids of another job must not leak in
    job = make_job(alice, ds, ep, n_rollouts=237, fail_every=7, rewards=lambda t, r: (t % 10) / 10)
    return job, other


def walk_forward(qs, size):
    ids, after = [], None
    pages = 0
    while True:
        p = keyset_page(qs, after=after, size=size)
        ids += [r.id for r in p.rows]
        pages += 1
        if p.next_after is None:
            return ids, pages
        after = p.next_after


def test_forward_walk_returns_every_row_once_in_order(big_job):
    job, _ = big_job
    qs = Rollout.objects.filter(job=job)
    expected = list(qs.order_by("id").values_list("id", flat=True))
    for size in (1, 10, 50, 237, 500):
        ids, pages = walk_forward(qs, size)
        assert ids == expected
        assert pages == max(1, -(-len(expected) // size))


def test_backward_walk_matches(big_job):
    job, _ = big_job
    qs = Rollout.objects.filter(job=job)
    expected = list(qs.order_by("id").values_list("id", flat=True))
    p = keyset_page(qs, before=expected[-1] + 1, size=25)
    got = []
    while True:
        got = [r.id for r in p.rows] + got
        if p.prev_before is None:
            break
        p = keyset_page(qs, before=p.prev_before, size=25)
    assert got == expected


def test_filters_with_keyset(big_job):
    job, _ = big_job
    qs = Rollout.objects.filter(job=job, reward__gte=0.3, reward__lte=0.6, wall_ms__lte=130)
    expected = list(qs.order_by("id").values_list("id", flat=True))
    assert 0 < len(expected) < 237
    assert walk_forward(qs, 7)[0] == expected


def test_browser_view_pages_through_with_next_links_and_no_offset(alice, big_job):
    job, _ = big_job
    c = Client()
    c.force_login(alice)
    url = reverse("dashboard:rollouts", args=[job.pk]) + "?status=failed&size=5"
    seen = []
    pages = 0
    while url:
        with CaptureQueriesContext(connection) as q:
            resp = c.get(url)
        assert resp.status_code == 200
        for sql in (x["sql"] for x in q.captured_queries):
            assert "OFFSET" not in sql.upper(), sql
        seen += [r.id for r in resp.context["page"].rows]
        m = re.search(r'id="page-next" href="([^"]+)"', resp.content.decode())
        url = (reverse("dashboard:rollouts", args=[job.pk]) + m.group(1).replace("&amp;", "&")) if m else None
        pages += 1
    expected = list(Rollout.objects.filter(job=job, status="failed").order_by("id").values_list("id", flat=True))
    assert seen == expected and pages == -(-len(expected) // 5)
    assert resp.context["page_no"] == pages
