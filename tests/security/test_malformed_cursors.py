"""Malformed keyset cursors never answer 500: the API's cursors (rollouts, metrics, jobs, datasets, endpoints)
answer 400 naming the cursor, the dashboard's rollout pages ignore what they cannot read."""
from __future__ import annotations

import base64

import pytest
from django.test import Client
from rest_framework.test import APIClient

from tests.factories import add_rollouts, make_dataset, make_endpoint, make_job, make_user

pytestmark = pytest.mark.django_db


def _cursor(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


# a forged position of every shape: not a number, too big, NUL, a list, negative offsets, not base64 at all
BAD_CURSORS = [_cursor("p=abc"), _cursor("p=1e400"), _cursor("p=99999999999999999999999"), _cursor("p=\x00"),
               _cursor("o=-5&p=1"), _cursor("r=maybe&p=x"), _cursor("p=" + "9" * 5000), "garbage", "not base64!",
               _cursor("\xff\xfe"), _cursor("p=2024-01-01"), _cursor("p= 7")]


@pytest.fixture
def setup():
    mallory = make_user("mallory")
    ds, ep = make_dataset(mallory, n=5), make_endpoint(mallory)
    job = make_job(mallory, ds, ep, n_rollouts=0)
    add_rollouts(job, 5)
    api = APIClient()
    api.force_authenticate(mallory)
    web = Client()
    web.force_login(mallory)
    return api, web, job


def test_api_cursors_answer_400(setup):
    api, _, job = setup
    for url in (f"/api/jobs/{job.pk}/rollouts/", f"/api/jobs/{job.pk}/metrics/", "/api/jobs/", "/api/datasets/",
                "/api/endpoints/"):
        for cursor in BAD_CURSORS:
            r = api.get(url, {"cursor": cursor})
            assert r.status_code == 400, (url, cursor, r.status_code, r.content[:200])
            assert "cursor" in str(r.json()).lower()
        assert api.get(url).status_code == 200


def test_dashboard_cursors_are_ignored(setup):
    _, web, job = setup
    for params in ({"after": "abc"}, {"before": "9" * 5000}, {"after": "\x00"}, {"after": "-1", "before": "1e9"},
                   {"size": "nan"}, {"page": "99999999999999999999999999"}, {"after": "1", "before": "2"},
                   {"min_reward": "nan"}, {"max_wall_ms": "inf"}, {"size": "-7"}):
        r = web.get(f"/jobs/{job.pk}/rollouts/", params)
        assert r.status_code in (200, 400), (params, r.status_code)
