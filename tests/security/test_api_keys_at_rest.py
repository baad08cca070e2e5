"""Endpoint API keys are encrypted at rest: whoever reads the database (a dump, a backup, a program that got at
the database file) finds no key in it, the API never echoes one, and the engine still sends the plain key to the
model server at run time (a simulator that answers 401 without it). Keys stored before are encrypted by the
migration."""
from __future__ import annotations

import importlib

import pytest
from django.apps import apps
from django.db import connection
from rest_framework.test import APIClient

from controlplane.endpoints.models import Endpoint
from controlplane.jobs import services
from controlplane.jobs.models import JobState
from tests.factories import make_dataset, make_user

pytestmark = pytest.mark.django_db(transaction=True)

KEY = "sk-hostile-test-secret-0123456789"


def _stored(endpoint_id) -> str:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT api_key FROM {Endpoint._meta.db_table} WHERE id = %s", [endpoint_id])
        return cursor.fetchone()[0]


def _dump() -> str:
    """Every endpoint row as text, as a dump of the table would hold it."""
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT * FROM {Endpoint._meta.db_table}")
        return repr(cursor.fetchall())


@pytest.mark.slow
def test_keys_are_not_in_the_database_and_the_engine_still_sends_them(simulator_factory):
    sim = simulator_factory(ttft_ms=0, itl_ms=0, jitter=0, seed=0, api_key=KEY)
    mallory = make_user("mallory")
    api = APIClient()
    api.force_authenticate(mallory)
    r = api.post("/api/endpoints/", {"name": "keyed", "base_url": sim.url, "model_name": sim.model, "api_key": KEY},
                 format="json")
    assert r.status_code == 201 and KEY not in r.content.decode() and r.json()["has_api_key"] is True
    ep = Endpoint.objects.get(pk=r.json()["id"])
    assert KEY not in _dump() and _stored(ep.pk).startswith("fernet:")
    assert ep.api_key == KEY  # the application reads it back
    assert KEY not in api.get(f"/api/endpoints/{ep.pk}/").content.decode()

    job = services.create_job(owner=mallory, dataset=make_dataset(mallory, n=4), endpoint=ep, launch=False)
    from controlplane.jobs.runtime import run_job_inline

    job = run_job_inline(job)
    assert job.state == JobState.COMPLETED and job.completed_count == 4, job.error_message


def test_keys_stored_in_plain_text_are_encrypted_by_the_migration():
    ep = Endpoint.objects.create(name="old", base_url="http://127.0.0.1:9", model_name="m")
    with connection.cursor() as cursor:  # as the column held it before
        cursor.execute(f"UPDATE {Endpoint._meta.db_table} SET api_key = %s WHERE id = %s", [KEY, ep.pk])
    assert Endpoint.objects.get(pk=ep.pk).api_key == KEY  # read as is until saved again
    migration = importlib.import_module("controlplane.endpoints.migrations.0008_endpoint_api_key_encrypted")
    with connection.schema_editor() as editor:
        migration.encrypt_stored_keys(apps, editor)
    assert KEY not in _dump()
    assert Endpoint.objects.get(pk=ep.pk).api_key == KEY
    with connection.schema_editor() as editor:  # and back
        migration.decrypt_stored_keys(apps, editor)
    assert _stored(ep.pk) == KEY
