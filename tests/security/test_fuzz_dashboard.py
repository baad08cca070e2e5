"""Schema-driven fuzzing of the dashboard's forms and query parameters with schemathesis: an OpenAPI
document is derived from the Django forms themselves (field types, bounds, choices), and every generated
request (positive and negative data) is sent through the real WSGI app with a logged-in session and a
CSRF token. The check: never a 5xx."""
from __future__ import annotations

import pytest
import schemathesis
from django import forms as djforms
from hypothesis import HealthCheck, settings as hyp_settings
from schemathesis.checks import not_a_server_error

from controlplane.dashboard import forms as f
from tests.factories import add_rollouts, service_job

pytestmark = pytest.mark.slow  # fuzzing, as tests/api/test_schemathesis.py: `make test` runs it

MAX_EXAMPLES = 25


def field_schema(field) -> dict:
    if isinstance(field, djforms.ModelChoiceField):
        return {"type": "integer"}
    if isinstance(field, djforms.BooleanField):
        return {"type": "boolean"}
    if isinstance(field, djforms.ChoiceField):
        choices = [c for c, _ in field.choices]
        return {"type": "string", "enum": choices} if choices else {"type": "string"}
    if isinstance(field, djforms.IntegerField):
        return {"type": "integer", **({"minimum": field.min_value} if field.min_value is not None else {})}
    if isinstance(field, djforms.FloatField):
        return {"type": "number"}
    if isinstance(field, djforms.FileField):
        return {"type": "string", "format": "binary"}
    out = {"type": "string"}
    if getattr(field, "max_length", None):
        out["maxLength"] = field.max_length
    return out


def form_body(form_class, media="application/x-www-form-urlencoded", **kw) -> dict:
    form = form_class(**kw)
    props = {name: field_schema(field) for name, field in form.fields.items()}
    required = [name for name, field in form.fields.items() if field.required]
    return {"required": True, "content": {media: {"schema": {"type": "object", "properties": props,
                                                               "required": required}}}}


def query(params: dict) -> list[dict]:
    return [{"name": n, "in": "query", "required": False, "schema": s} for n, s in params.items()]


def path_param(name):
    return {"name": name, "in": "path", "required": True, "schema": {"type": "integer", "minimum": 0}}


ANY = {"default": {"description": "a page, a redirect or an error page"}}


def dashboard_schema() -> dict:
    filter_form = f.RolloutFilterForm()
    rollout_q = {n: field_schema(fld) for n, fld in filter_form.fields.items()}
    rollout_q.update({"after": {"type": "integer"}, "before": {"type": "integer"}, "size": {"type": "integer"},
                      "page": {"type": "integer"}})
    return {
        "openapi": "3.0.3",
        "info": {"title": "dashboard forms", "version": "1"},
        "paths": {
            "/endpoints/": {"post": {"requestBody": form_body(f.EndpointForm), "responses": ANY}},
            "/datasets/{dataset_id}/": {"post": {"parameters": [path_param("dataset_id")],
                                                 "requestBody": form_body(f.LaunchJobForm), "responses": ANY}},
            "/datasets/upload/": {"post": {"requestBody": form_body(f.DatasetUploadForm, "multipart/form-data"),
                                           "responses": ANY}},
            "/endpoints/{endpoint_id}/health/": {"post": {
                "parameters": [path_param("endpoint_id")],
                "requestBody": {"content": {"application/x-www-form-urlencoded": {"schema": {
                    "type": "object", "properties": {"next": {"type": "string"}}}}}},
                "responses": ANY}},
            "/jobs/{job_id}/rollouts/": {"get": {"parameters": [path_param("job_id"), *query(rollout_q)],
                                                 "responses": ANY}},
            "/jobs/{job_id}/actions/{action}/": {"post": {
                "parameters": [path_param("job_id"), {"name": "action", "in": "path", "required": True,
                                                      "schema": {"type": "string", "pattern": "^[a-z-]{1,20}$"}}],
                "responses": ANY}},
            "/history/": {"get": {"parameters": query({"days": {"type": "integer"},
                                                       "format": {"type": "string", "enum": ["csv", "html"]}}),
                                  "responses": ANY}},
            "/compare/": {"get": {"parameters": query({"jobs": {"type": "string"}}), "responses": ANY}},
        },
    }


@pytest.fixture
def world(db, django_user_model, settings):
    settings.ALLOWED_HOSTS = ["*"]
    user = django_user_model.objects.create_user(username="fuzzer", password="pw-fuzzer-123")
    job = service_job(user, limit=3)
    add_rollouts(job, 5, failed_every=2)
    from django.test import Client

    c = Client()
    c.force_login(user)
    csrf = "a" * 32
    cookies = {settings.SESSION_COOKIE_NAME: c.cookies[settings.SESSION_COOKIE_NAME].value,
               settings.CSRF_COOKIE_NAME: csrf}
    return {"job": job, "headers": {"X-CSRFToken": csrf}, "cookies": cookies}


@pytest.fixture
def dash_schema(db):
    from django.core import signals
    from django.db import close_old_connections

    from controlplane.wsgi import application

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        loaded = schemathesis.openapi.from_dict(dashboard_schema())
        loaded.app = application  # requests go to the WSGI app, as from_wsgi sets it
        yield loaded
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)
        from controlplane.celery import app

        app.control.purge()  # health checks the fuzz queued


schema = schemathesis.pytest.from_fixture("dash_schema")


@schema.parametrize()
@hyp_settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_dashboard_forms_never_answer_5xx(case, world):
    params = case.path_parameters or {}
    if params and hash(repr(case.query) + repr(case.body)) % 2 == 0:  # half the cases hit real objects
        for key in ("job_id", "dataset_id", "endpoint_id"):
            if key in params:
                obj = {"job_id": world["job"], "dataset_id": world["job"].dataset,
                       "endpoint_id": world["job"].endpoint}[key]
                params[key] = obj.pk
    response = case.call_and_validate(headers=world["headers"], cookies=world["cookies"], checks=[not_a_server_error])
    # the session and CSRF token were accepted: the form itself answered, not the login page or a 403
    assert response.status_code != 403 and "/accounts/login/" not in response.headers.get("Location", [""])[0]
