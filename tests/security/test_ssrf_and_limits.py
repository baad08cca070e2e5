"""Users cannot point the control plane at internal services, nor make it read or relay their answers, and
every way in (API, dashboard, admin) enforces the operator's bounds and per-user quotas."""
from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.endpoints.models import Endpoint
from controlplane.jobs.models import CollectionJob

from .conftest import make_dataset, make_endpoint

FORBIDDEN_URLS = ["http://169.254.169.254", "http://[fe80::1]:8000", "http://metadata.google.internal",
                  "http://2852039166", "http://[::ffff:169.254.169.254]"]


@pytest.fixture
def internal_server():
    """A loopback server whose model routes redirect (307) to an internal page."""
    hits = []

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _any(self):
            hits.append(self.path)
            if self.path == "/internal":
                body = b"SECRET-INTERNAL-PAGE"
                self.send_response(200)
            else:
                body = b""
                self.send_response(307)
                self.send_header("Location", "/internal")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _any

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.hits = hits
    srv.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()


@pytest.mark.parametrize("url", FORBIDDEN_URLS)
def test_link_local_and_metadata_refused_by_api_dashboard_and_admin(api, web, url):
    r = api.post("/api/endpoints/", {"name": "x", "base_url": url, "model_name": "m"}, format="json")
    assert r.status_code == 400 and "base_url" in r.json(), r.content
    r = api.post("/api/endpoints/", {"name": "x", "base_url": "http://127.0.0.1:9", "model_name": "m",
                                     "replica_urls": [url]}, format="json")
    assert r.status_code == 400 and "replica_urls" in r.json(), r.content
    r = web.post("/endpoints/", {"name": "x", "kind": "vllm", "base_url": url, "model_name": "m",
                                 "api_flavor": "chat_completions", "request_timeout_s": 60, "connect_timeout_s": 5,
                                 "max_retries": 1})
    assert r.status_code == 200 and "errorlist" in r.content.decode()  # the form again, with the reason
    from controlplane.endpoints.admin import EndpointAdminForm

    form = EndpointAdminForm({"name": "x", "kind": "vllm", "base_url": url, "model_name": "m",
                              "api_flavor": "chat_completions", "request_timeout_s": 60, "connect_timeout_s": 5,
                              "max_retries": 1, "replica_urls": "[]", "last_health": "{}", "last_prewarm": "{}"})
    assert not form.is_valid() and "base_url" in form.errors
    assert not Endpoint.objects.exists()


def test_operator_allow_list_of_model_server_hosts(api, settings):
    settings.ENDPOINT_ALLOWED_HOSTS = ["vllm.internal", ".gpu.example"]
    r = api.post("/api/endpoints/", {"name": "x", "base_url": "http://127.0.0.1:6379", "model_name": "m"},
                 format="json")
    assert r.status_code == 400 and "ENDPOINT_ALLOWED_HOSTS" in str(r.json())
    for ok in ("http://vllm.internal:8000", "http://node7.gpu.example:8000"):
        r = api.post("/api/endpoints/", {"name": "x", "base_url": ok, "model_name": "m"}, format="json")
        assert r.status_code == 201, r.content


def test_prewarm_and_health_follow_no_redirect_and_show_no_body(api, mallory, internal_server, eager_tasks):
    ep = make_endpoint(mallory, internal_server.url, connect_timeout_s=2, request_timeout_s=5)
    assert api.post(f"/api/endpoints/{ep.pk}/prewarm/").status_code == 202
    assert api.post(f"/api/endpoints/{ep.pk}/health/").status_code == 202
    body = api.get(f"/api/endpoints/{ep.pk}/").json()
    prewarm, health = body["last_prewarm"], body["last_health"]
    assert prewarm["ok"] is False and prewarm["succeeded"] == 0
    assert all("HTTP 307" in e for e in prewarm["errors"])
    assert health["ok"] is False and "307" in str(health)
    assert "SECRET" not in str(body)
    assert "/internal" not in internal_server.hits


def test_health_is_not_called_from_the_web_process(api, mallory, internal_server):
    from controlplane.celery import app

    ep = make_endpoint(mallory, internal_server.url)
    try:
        r = api.post(f"/api/endpoints/{ep.pk}/health/")
        assert r.status_code == 202 and r.json()["queued"] == "health"
        assert internal_server.hits == []  # queued for a worker; the web process called nothing
    finally:
        app.control.purge()


def test_health_refuses_an_endpoint_that_now_resolves_to_a_forbidden_address(mallory, settings):
    from controlplane.endpoints.services import check_health, prewarm

    ep = make_endpoint(mallory, "http://127.0.0.1:9")
    Endpoint.objects.filter(pk=ep.pk).update(base_url="http://169.254.169.254")  # stored before the rule
    ep.refresh_from_db()
    assert "not called" in check_health(ep)["replicas"][0]["error"]
    assert prewarm(ep)["sent"] == 0


def test_health_next_parameter_stays_on_this_site(web, mallory):
    from controlplane.celery import app

    ep = make_endpoint(mallory)
    try:
        r = web.post(f"/endpoints/{ep.pk}/health/", {"next": "https://evil.example/phish"})
        assert r.status_code == 302 and r["Location"] == "/endpoints/"
        r = web.post(f"/endpoints/{ep.pk}/health/", {"next": "/endpoints/?x=1"})
        assert r["Location"] == "/endpoints/?x=1"
    finally:
        app.control.purge()


# ------------------------------------------------------------------------------------------ bounds

ENDPOINT_FORM = {"name": "x", "kind": "vllm", "base_url": "http://127.0.0.1:9", "model_name": "m",
                 "api_flavor": "chat_completions", "request_timeout_s": 60, "connect_timeout_s": 5, "max_retries": 1}


@pytest.mark.parametrize("field,value", [("request_timeout_s", -5), ("connect_timeout_s", 0),
                                         ("max_retries", 4_000_000_000), ("request_timeout_s", 10**7)])
def test_endpoint_bounds_on_every_way_in(api, web, field, value):
    r = web.post("/endpoints/", {**ENDPOINT_FORM, field: value})
    assert r.status_code == 200 and "must be between" in r.content.decode(), field
    r = api.post("/api/endpoints/", {"name": "x", "base_url": "http://127.0.0.1:9", "model_name": "m", field: value},
                 format="json")
    assert r.status_code == 400 and field in r.json()
    from controlplane.endpoints.admin import EndpointAdminForm

    form = EndpointAdminForm({**ENDPOINT_FORM, field: value, "replica_urls": "[]", "last_health": "{}",
                              "last_prewarm": "{}"})
    assert not form.is_valid() and field in form.errors
    assert not Endpoint.objects.exists()


def test_launch_form_refuses_a_billion_parallel_requests(web, mallory):
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    r = web.post(f"/datasets/{ds.pk}/", {"endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 10**9,
                                         "verifier": "exact", "verify_mode": "inline", "chunk_size": 100})
    assert r.status_code == 400 and "at most 4096" in r.content.decode()
    assert not CollectionJob.objects.exists()


def test_api_job_bounds_and_per_user_quotas(api, mallory, settings):
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    body = {"dataset": ds.pk, "endpoint": ep.pk, "verifier": "exact"}
    r = api.post("/api/jobs/", {**body, "num_samples_in_parallel": 5000}, format="json")
    assert r.status_code == 400 and "num_samples_in_parallel" in str(r.json())
    settings.JOBS_MAX_ACTIVE_PER_USER = 2
    settings.JOBS_MAX_PARALLELISM_PER_USER = 100
    assert api.post("/api/jobs/", {**body, "num_samples_in_parallel": 60}, format="json").status_code == 201
    r = api.post("/api/jobs/", {**body, "num_samples_in_parallel": 60}, format="json")
    assert r.status_code == 400 and "60 more is over that" in str(r.json())
    assert api.post("/api/jobs/", {**body, "num_samples_in_parallel": 40}, format="json").status_code == 201
    r = api.post("/api/jobs/", {**body, "num_samples_in_parallel": 1}, format="json")
    assert r.status_code == 400 and "queued or running jobs" in str(r.json())
    assert CollectionJob.objects.filter(owner=mallory).count() == 2
