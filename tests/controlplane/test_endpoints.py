"""Endpoints: health against the simulator and a closed port, pre-warm, and the write-only API key
in the admin."""
import socket

import pytest
from django.urls import reverse

from controlplane.endpoints.models import Endpoint
from controlplane.endpoints.services import (
    check_health,
    endpoint_spec,
    normalize_base_url,
    prewarm,
    redact_text,
    redacted_dict,
)

pytestmark = pytest.mark.django_db

SECRET = "sk-test-SECRET-9f8e7d6c5b4a"


def closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def make_endpoint(url, model="sim-model", **kw):
    kw.setdefault("name", f"ep {url}")
    kw.setdefault("connect_timeout_s", 2.0)
    kw.setdefault("request_timeout_s", 10.0)
    return Endpoint.objects.create(base_url=url, model_name=model, **kw)


def test_health_ok_against_simulator(simulator):
    ep = make_endpoint(simulator.url)
    res = check_health(ep)
    assert res["ok"] is True, res
    rep = res["replicas"][0]
    assert rep["health_status"] == 200 and rep["model_available"] is True and rep["latency_ms"] >= 0
    ep.refresh_from_db()
    assert ep.last_health["ok"] is True and ep.last_health_at is not None


def test_health_wrong_model_and_v1_suffix(simulator):
    ep = make_endpoint(simulator.base_url, model="not-served")  # base URL given with /v1: accepted
    res = check_health(ep)
    assert res["ok"] is False
    assert "not-served" in res["error"] and "not served" in res["error"]


def test_health_closed_port_never_raises():
    port = closed_port()
    ep = make_endpoint(f"http://127.0.0.1:{port}")
    res = check_health(ep, timeout=2.0)
    assert res["ok"] is False
    assert "connection refused" in res["error"].lower()
    ep.refresh_from_db()
    assert ep.last_health["ok"] is False


def test_health_unhealthy_simulator_and_replicas(simulator_factory, simulator):
    sick = simulator_factory(unhealthy=True)
    ep = make_endpoint(simulator.url, replica_urls=[sick.url])
    res = check_health(ep)
    assert res["ok"] is False
    by_url = {r["url"]: r for r in res["replicas"]}
    assert by_url[simulator.url]["ok"] is True
    assert by_url[sick.url]["ok"] is False and "503" in by_url[sick.url]["error"]


def test_health_api_key_required_and_hosted_kind(simulator_factory):
    sim = simulator_factory(api_key=SECRET)
    ep = make_endpoint(sim.url, kind="openai")  # hosted: /v1/models only
    res = check_health(ep)
    assert res["ok"] is False and "API key" in res["error"]
    assert "health_status" not in res["replicas"][0]
    ep.api_key = SECRET
    ep.save()
    res = check_health(ep)
    assert res["ok"] is True, res
    assert SECRET not in str(res)


def test_prewarm(simulator, simulator_factory):
    ep = make_endpoint(simulator.url)
    res = prewarm(ep, n=4)
    assert res["ok"] and res["succeeded"] == 4 and len(res["latencies_ms"]) == 4
    for flavor in ("completions", "responses"):
        ep.api_flavor = flavor
        assert prewarm(ep, n=2)["ok"], flavor
    bad = make_endpoint(f"http://127.0.0.1:{closed_port()}")
    res = prewarm(bad, n=2)
    assert res["ok"] is False and res["succeeded"] == 0 and len(res["errors"]) == 2


def test_redaction_helpers_and_spec():
    ep = make_endpoint("http://127.0.0.1:9/v1/", api_key=SECRET)
    assert normalize_base_url(ep.base_url) == "http://127.0.0.1:9"
    d = redacted_dict(ep)
    assert d["has_api_key"] is True and SECRET not in str(d)
    assert redact_text(f"boom {SECRET} boom", SECRET) == "boom ******** boom"
    assert endpoint_spec(ep).api_key == SECRET  # the engine gets it; nothing else shows it


# --- admin ----------------------------------------------------------------------------------------
@pytest.fixture
def admin_client_logged(db, django_user_model, client):
    u = django_user_model.objects.create_superuser("ep-admin", "a@example.com", "pw-admin-1234")
    client.force_login(u)
    return client


def _form_data(ep, **over):
    data = {
        "name": ep.name, "owner": "", "kind": ep.kind, "base_url": ep.base_url, "replica_urls": "[]",
        "model_name": ep.model_name, "api_flavor": ep.api_flavor, "api_key": "",
        "request_timeout_s": ep.request_timeout_s, "connect_timeout_s": ep.connect_timeout_s,
        "max_retries": ep.max_retries, "rpm_limit": "", "tpm_limit": "",
    }
    data.update(over)
    return data


def test_admin_never_echoes_api_key(admin_client_logged):
    ep = make_endpoint("http://127.0.0.1:9", api_key=SECRET)
    url = reverse("admin:endpoints_endpoint_change", args=[ep.pk])
    r = admin_client_logged.get(url)
    assert r.status_code == 200
    body = r.content.decode()
    assert 'name="api_key"' in body and 'type="password"' in body
    assert SECRET not in body and SECRET[:10] not in body
    lst = admin_client_logged.get(reverse("admin:endpoints_endpoint_changelist")).content.decode()
    assert SECRET not in lst

    # blank on edit keeps the stored key
    r = admin_client_logged.post(url, _form_data(ep, name="renamed"))
    assert r.status_code == 302, r.content.decode()[:2000]
    ep.refresh_from_db()
    assert ep.name == "renamed" and ep.api_key == SECRET
    # a new value replaces it; the clear box removes it
    admin_client_logged.post(url, _form_data(ep, api_key="sk-new"))
    ep.refresh_from_db()
    assert ep.api_key == "sk-new"
    admin_client_logged.post(url, _form_data(ep, clear_api_key="on"))
    ep.refresh_from_db()
    assert ep.api_key == ""


def test_admin_health_action(admin_client_logged, simulator):
    # The admin only queues the checks; a worker (inline here) runs them and stores the results.
    from controlplane.celery import app

    ok = make_endpoint(simulator.url, name="good-ep")
    down = make_endpoint(f"http://127.0.0.1:{closed_port()}", name="down-ep")
    before, app.conf.task_always_eager = app.conf.task_always_eager, True
    try:
        r = admin_client_logged.post(reverse("admin:endpoints_endpoint_changelist"),
                                     {"action": "action_check_health", "_selected_action": [ok.pk, down.pk]},
                                     follow=True)
    finally:
        app.conf.task_always_eager = before
    assert "health queued for 2 endpoint(s)" in r.content.decode().lower()
    ok.refresh_from_db()
    down.refresh_from_db()
    assert ok.last_health["ok"] is True
    assert down.last_health["ok"] is False and "connection refused" in down.last_health["error"].lower()
