"""Fixtures for the REST API tests (factories in tests/factories.py): users with tokens, API clients, and
small domain objects."""
from __future__ import annotations

import pytest
from django.core.cache import cache
from rest_framework.test import APIClient

from tests.factories import ingest_dataset, make_endpoint, make_user, service_job


@pytest.fixture(autouse=True)
def _fresh_throttle_cache(settings):
    """Each test starts with empty throttle counters and a rate no test reaches by accident."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK,
                               "DEFAULT_THROTTLE_RATES": {"user": "100000/min", "anon": "100000/min"}}
    cache.clear()
    yield
    cache.clear()


@pytest.fixture
def alice(db):
    return make_user("alice", token=True)


@pytest.fixture
def bob(db):
    return make_user("bob", token=True)


@pytest.fixture
def staff(db):
    return make_user("root", token=True, is_staff=True)


def _client(user=None):
    c = APIClient()
    if user is not None:
        c.credentials(HTTP_AUTHORIZATION=f"Token {user.api_token}")
    return c


@pytest.fixture
def anon():
    return _client()


@pytest.fixture
def api(alice):
    return _client(alice)


@pytest.fixture
def bob_api(bob):
    return _client(bob)


@pytest.fixture
def staff_api(staff):
    return _client(staff)


@pytest.fixture
def dataset(alice):
    return ingest_dataset(alice)


@pytest.fixture
def endpoint(alice):
    return make_endpoint(alice, api_key="sk-secret")


@pytest.fixture
def job(alice, dataset, endpoint):
    return service_job(alice, dataset, endpoint)
