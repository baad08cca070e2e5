"""Issue 21, the outbound side: what a hostile ordinary user supplies (URLs, verifier options, stats sources)
never makes a worker call where the operator does not allow, send the deployment's secrets, read a file or an
unbounded answer, or show another service's body or banner. One test per finding; listeners on 127.0.0.1 record
what reaches them (tests/security/listeners.py), and the secret-key finding runs a real Celery worker on the
production settings."""
from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time

import pytest
import yaml
from django.conf import settings as django_settings
from django.test import Client
from rest_framework.test import APIClient

from controlplane import fieldcrypt
from controlplane.endpoints.models import Endpoint
from controlplane.jobs.models import CollectionJob, JobState, Rollout

from .conftest import make_dataset, make_endpoint
from .listeners import Listener, chat_answer, endless, json_answer

MB = 1 << 20


def _client(user) -> APIClient:
    c = APIClient()
    c.force_authenticate(user)
    return c


def _job_body(ds, ep, **kw):
    return {"dataset": ds.pk, "endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 2, **kw}


@pytest.fixture
def listeners():
    made = []

    def make(answer, host="127.0.0.1"):
        made.append(Listener(answer, host=host))
        return made[-1]

    yield make
    for li in made:
        li.close()


@pytest.fixture
def staff(db, django_user_model):
    return django_user_model.objects.create_user(username="operator", password="pw-operator-123", is_staff=True)


# --- Critical: the worker's secrets out through the judge ----------------------------------------------------
def _wait_job(pk, timeout=90.0) -> CollectionJob:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = CollectionJob.objects.get(pk=pk)
        if job.state in (JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED):
            return job
        time.sleep(0.3)
    raise AssertionError(f"job {pk} still {CollectionJob.objects.get(pk=pk).state} after {timeout}s")


@pytest.mark.e2e
@pytest.mark.timeout(240)
@pytest.mark.django_db(transaction=True)
def test_judge_never_sends_a_worker_secret_and_takes_its_key_from_the_owners_endpoint(
        mallory, django_user_model, simulator_factory, listeners):
    from controlplane.jobs import services
    from tests.dashboard.servers import child_env, database_url, start_celery

    sim = simulator_factory(math_accuracy=1.0, seed=3)
    judge = listeners(lambda hit: chat_answer("VERDICT: CORRECT"))
    ds = make_dataset(mallory, n=2)
    ep = make_endpoint(mallory, sim.url, model_name=sim.model)
    api = _client(mallory)
    hostile = {"base_url": judge.url, "api_key_env": "DJANGO_SECRET_KEY"}
    # a job stored with the hostile options (before the rule, or by any other way in)
    stored = services.create_job(owner=mallory, dataset=ds, endpoint=ep, num_repeats=1, verifier="judge",
                                 verifier_options={"base_url": judge.url}, launch=False)
    CollectionJob.objects.filter(pk=stored.pk).update(verifier_options=hostile)

    secret_key, metrics_token = secrets.token_urlsafe(64), secrets.token_urlsafe(24)
    redis_url = django_settings.REDIS_URL
    env = child_env(database_url(django_settings.DATABASES["default"]), redis_url,
                    DJANGO_SETTINGS_MODULE="controlplane.settings_production", DJANGO_SECRET_KEY=secret_key,
                    METRICS_TOKEN=metrics_token, ENDPOINT_ALLOWED_HOSTS="127.0.0.1",
                    DJANGO_ALLOWED_HOSTS="cp.example.com",
                    # the worker reads the API keys this process stored (under a secret key of its own here)
                    FIELD_ENCRYPTION_KEYS=fieldcrypt.derived_key(django_settings.SECRET_KEY).decode())
    worker = start_celery(env, concurrency=2, name="secgate")
    try:
        services.dispatch_chunks(stored)
        failed = _wait_job(stored.pk)
        seen = " ".join(f"{h.headers} {h.body!r}" for h in judge.hits)
        for value in (secret_key, metrics_token, redis_url, env["DATABASE_URL"]):
            assert value not in seen  # the worker's secrets never reach the user's server
        assert not judge.hits and failed.state == JobState.FAILED and "api_key_env" in failed.error_message, \
            (failed.error_message, judge.hits)

        # the API refuses the hostile options outright
        r = api.post("/api/jobs/", _job_body(ds, ep, verifier="judge", verifier_options=hostile), format="json")
        assert r.status_code == 400 and "api_key_env" in str(r.json()["verifier_options"]), r.content
        # the legitimate way: the judge is an endpoint mallory owns, with its key; bob cannot use it
        judge_ep = Endpoint.objects.create(owner=mallory, name="judge", base_url=judge.url,
                                           model_name="judge-model", api_key="judge-key-of-mallory")
        bob = django_user_model.objects.create_user(username="bob", password="pw-bob-12345")
        r = _client(bob).post("/api/jobs/", _job_body(make_dataset(bob), make_endpoint(bob, sim.url), verifier="judge",
                                                       verifier_options={"endpoint": judge_ep.pk}), format="json")
        assert r.status_code == 400 and "endpoint" in str(r.json()["verifier_options"]), r.content
        r = api.post("/api/jobs/", _job_body(ds, ep, verifier="judge", verifier_options={"endpoint": judge_ep.pk}),
                     format="json")
        assert r.status_code == 201, r.content
        ok = _wait_job(r.json()["id"])
    finally:
        worker.stop()
    assert ok.state == JobState.COMPLETED, (ok.error_message, worker.output())
    assert judge.hits and {h.headers.get("authorization") for h in judge.hits} == {"Bearer judge-key-of-mallory"}
    assert {h.path for h in judge.hits} == {"/v1/chat/completions"}
    assert list(Rollout.objects.filter(job_id=ok.pk).values_list("reward", flat=True)) == [1.0, 1.0]


# --- High: outbound URLs bypassed the allow-list -------------------------------------------------------------
def _head_config(servers: dict[str, int]) -> str:
    cfg = {name: {"responses_api_agents" if name.endswith("agent") else "resources_servers":
                  {"impl": {"host": "127.0.0.1", "port": port}}} for name, port in servers.items()}
    return yaml.safe_dump(cfg)


@pytest.mark.django_db(transaction=True)
def test_servers_a_head_config_lists_are_not_probed_outside_the_allow_list(mallory, settings, listeners, eager_tasks):
    """The port scan: a head server (allowed) lists "servers" on other ports of 127.0.0.1; a health check or an
    agent job must not touch them."""
    scanned = listeners(lambda hit: (200, {}, b"open"))
    closed_port = _free_port()
    head = listeners(lambda hit: json_answer(_head_config({"scan_agent": scanned.port, "redis_agent": closed_port})))
    settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{head.port}"]  # production: the operator lists the head only
    ep = Endpoint.objects.create(owner=mallory, name="gym", kind=Endpoint.Kind.NEMO_GYM, base_url=head.url,
                                 model_name="scan_agent", connect_timeout_s=1, request_timeout_s=3, max_retries=0)
    api = _client(mallory)
    assert api.post(f"/api/endpoints/{ep.pk}/health/").status_code == 202
    health = api.get(f"/api/endpoints/{ep.pk}/").json()["last_health"]
    assert health["ok"] is False and "not called" in health["error"] and "not an allowed host" in health["error"]
    # an agent job routed to the listed "agent": the gate refuses each call
    from controlplane.jobs import services
    from controlplane.jobs.runtime import run_job_inline

    job = run_job_inline(services.create_job(owner=mallory, dataset=make_dataset(mallory, 2), endpoint=ep,
                                             verifier="none", launch=False))
    assert "not called" in job.error_message, job.error_message
    assert scanned.connections == 0 and head.paths()  # the head was asked; nothing it listed was


@pytest.mark.django_db(transaction=True)
def test_remote_verifier_url_passes_the_gate(mallory, settings, simulator, listeners):
    target = listeners(lambda hit: json_answer({"reward": 1.0}))
    settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{simulator.url.rsplit(':', 1)[1]}"]
    ds, ep = make_dataset(mallory, 2), make_endpoint(mallory, simulator.url, model_name=simulator.model)
    body = _job_body(ds, ep, verifier="nemo_gym", verifier_options={"url": target.url})
    r = _client(mallory).post("/api/jobs/", body, format="json")
    assert r.status_code == 400 and "not an allowed host" in str(r.json()), r.content
    # stored before the rule: the engine's call is refused by the gate, per rollout
    from controlplane.jobs import services
    from controlplane.jobs.runtime import run_job_inline

    job = services.create_job(owner=mallory, dataset=ds, endpoint=ep, verifier="nemo_gym",
                              verifier_options={"url": simulator.url}, launch=False)
    CollectionJob.objects.filter(pk=job.pk).update(verifier_options={"url": target.url})
    job = run_job_inline(job)
    errors = list(Rollout.objects.filter(job=job).values_list("error", flat=True))
    assert len(errors) == 2 and all("not an allowed host" in e for e in errors), errors
    assert target.connections == 0


def test_judge_url_passes_the_gate_and_its_redirects_are_not_followed(db, mallory, settings, listeners):
    from workers.verifiers.execution import VerifyExecutor
    from workers.verifiers.judge import JudgeError

    internal = listeners(lambda hit: chat_answer("VERDICT: CORRECT"))
    judge = listeners(lambda hit: (307, {"Location": f"{internal.url}/v1/chat/completions"}, b""))
    settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{judge.port}"]  # the judge is allowed, the internal page not
    ds, ep = make_dataset(mallory, 2), make_endpoint(mallory, judge.url)
    r = _client(mallory).post("/api/jobs/", _job_body(ds, ep, verifier="judge",
                                                      verifier_options={"base_url": internal.url}), format="json")
    assert r.status_code == 400 and "not an allowed host" in str(r.json()), r.content

    async def verify():
        ex = VerifyExecutor("judge", {"base_url": judge.url, "max_retries": 0}, cache="off")
        try:
            return await ex.verify({"question": "1+1", "expected_answer": "2"}, "2")
        finally:
            await ex.aclose()

    with pytest.raises(JudgeError, match="judge answered HTTP 307"):
        asyncio.run(verify())
    assert judge.paths() == ["/v1/chat/completions"] and internal.connections == 0


def _profile_job(owner, endpoint):
    return CollectionJob.objects.create(owner=owner, dataset=make_dataset(owner, 1), endpoint=endpoint,
                                        state=JobState.RUNNING, total_rollouts=1)


def test_profiling_stats_urls_pass_the_gate(db, mallory, settings, listeners):
    from workers.profiling.nemo_gym import StatsPuller

    target = listeners(lambda hit: (200, {}, b""))
    settings.ENDPOINT_ALLOWED_HOSTS = ["vllm:8000"]  # the production default
    job = _profile_job(mallory, make_endpoint(mallory, "http://vllm:8000"))
    r = _client(mallory).post(f"/api/jobs/{job.pk}/profile/", {"stats_urls": [{"url": f"{target.url}/stats"}]},
                              format="json")
    assert r.status_code in (400, 409) and "not an allowed host" in str(r.json()), r.content
    # a session stored before the rule: the worker's puller is refused by the gate
    assert StatsPuller([{"url": f"{target.url}/stats"}], session="s", window_s=0).poll() == []
    assert target.connections == 0


def test_stats_log_paths_are_read_only_under_the_operators_directory(db, mallory, settings, listeners, tmp_path):
    from workers.profiling.nemo_gym import StatsPuller

    stats = listeners(lambda hit: (200, {}, b""))
    secret = tmp_path / "elsewhere" / "server.log"  # a yappi table anywhere on the worker
    secret.parent.mkdir()
    secret.write_text("Clock type: CPU\n\nname  ncall  tsub  ttot  tavg\nsecret.py:1 read_me  7  0.1  0.2  0.03\n")
    logs = tmp_path / "gym-profiles"
    logs.mkdir()
    (logs / "link.log").symlink_to(secret)  # inside the directory, pointing out of it
    job = _profile_job(mallory, make_endpoint(mallory, stats.url))
    api = _client(mallory)
    url = f"/api/jobs/{job.pk}/profile/"
    for directory, path in ((None, str(secret)), (str(logs), str(secret)), (str(logs), str(logs / "link.log")),
                            (str(logs), "/etc/passwd")):
        settings.PROFILING_STATS_LOG_DIR = directory or ""
        r = api.post(url, {"stats_urls": [{"url": f"{stats.url}/stats", "log": path}]}, format="json")
        assert r.status_code in (400, 409) and "log" in str(r.json()), (directory, path, r.content)
    # the worker's puller refuses the same paths (a session stored before the rule), whatever /stats said
    for log_dir in (None, str(logs)):
        for path in (str(secret), str(logs / "link.log")):
            puller = StatsPuller([{"url": f"{stats.url}/stats", "log": path}], session="s", window_s=0,
                                 log_dir=log_dir)
            assert puller.poll() == [] and puller.poll() == [] and not puller.prev  # nothing was read
    # under the directory, the operator's case still works
    (logs / "ok.log").write_text(secret.read_text())
    settings.PROFILING_STATS_LOG_DIR = str(logs)
    r = api.post(url, {"stats_urls": [{"url": f"{stats.url}/stats", "log": str(logs / "ok.log")}]}, format="json")
    assert r.status_code == 201, r.content


# --- High: unbounded reads in the worker ---------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _health(url):
    from controlplane.endpoints.services import check_health

    ep = Endpoint(name="x", base_url=url, model_name="m", connect_timeout_s=2, request_timeout_s=10)
    return check_health(ep, save=False)


def _remote_verify(url):
    from workers.engine.materialize import materialize
    from workers.engine.runner import run_collection
    from workers.engine.types import CollectionSpec, EndpointSpec
    import workers.nemo_gym.engine  # noqa: F401

    from tests.workers.test_engine import ListSink, math_rows

    sim_url, model = os.environ["SECGATE_SIM"].split(" ")
    sink = ListSink()
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=[sim_url], model=model, max_retries=0,
                                                request_timeout_s=20),
                          parallelism=1, verifier="nemo_gym", verifier_options={"url": url})
    asyncio.run(run_collection(spec, materialize(math_rows(1), 1), sink))


def _stats(url):
    from workers.profiling.nemo_gym import StatsPuller

    return StatsPuller([{"url": f"{url}/stats"}], session="s", window_s=0).poll()


def _discovery(url):
    from workers.nemo_gym.deployment import DeploymentError, resolve_sync

    with pytest.raises(DeploymentError):
        resolve_sync(url)


def _judge(url):
    from workers.verifiers.judge import JudgeError
    from workers.verifiers.execution import VerifyExecutor

    async def go():
        ex = VerifyExecutor("judge", {"base_url": url, "max_retries": 0}, cache="off")
        try:
            await ex.verify({"question": "q", "expected_answer": "2"}, "2")
        finally:
            await ex.aclose()

    with pytest.raises(JudgeError):
        asyncio.run(go())


@pytest.mark.parametrize("call", [_health, _remote_verify, _stats, _discovery, _judge],
                         ids=["health", "remote-verifier", "stats", "discovery", "judge"])
def test_answers_are_read_up_to_a_cap(db, call, simulator_session, listeners, monkeypatch):
    """A server that answers an endless body (here 256 MB): the worker reads a bounded part and hangs up."""
    monkeypatch.setenv("SECGATE_SIM", f"{simulator_session.url} {simulator_session.model}")
    firehose = listeners(lambda hit: (200, {"Content-Type": "application/json"}, endless()))
    t0 = time.monotonic()
    call(firehose.url)
    time.sleep(0.3)  # the listener's last write fails once the worker has hung up
    assert firehose.hits, "the call never reached the server"
    assert firehose.sent < 48 * MB, f"the server sent {firehose.sent / MB:.0f} MB before the worker hung up"
    assert time.monotonic() - t0 < 30


# --- High: bodies and banners reach non-staff users ---------------------------------------------------------
SECRET_BODY = "SECRET-INTERNAL-PAGE-a1b2c3"
BANNER = b"SSH-2.0-OpenSSH_9.2p1 SECRET-BANNER-d4e5f6\r\n"


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_non_staff_see_status_and_class_never_bodies_or_banners(mallory, staff, simulator, listeners, eager_tasks):
    from controlplane.endpoints.services import check_health
    from controlplane.jobs import services
    from controlplane.jobs.runtime import run_job_inline

    internal = listeners(lambda hit: (500, {"Server": "internal-admin/1.0"}, SECRET_BODY))
    banner = listeners(lambda hit: BANNER)
    forbidding_judge = listeners(lambda hit: (403, {}, SECRET_BODY))
    ds = make_dataset(mallory, 2)
    ep_500 = make_endpoint(mallory, internal.url, max_retries=0)
    ep_banner = make_endpoint(mallory, banner.url, max_retries=0, connect_timeout_s=2, request_timeout_s=5)
    ep_sim = make_endpoint(mallory, simulator.url, model_name=simulator.model)
    jobs = [run_job_inline(services.create_job(owner=mallory, dataset=ds, endpoint=e, verifier="none", launch=False))
            for e in (ep_500, ep_banner)]
    jobs.append(run_job_inline(services.create_job(
        owner=mallory, dataset=ds, endpoint=ep_sim, verifier="judge", launch=False,
        verifier_options={"base_url": forbidding_judge.url, "max_retries": 0})))
    check_health(ep_banner)
    check_health(ep_500)
    user_api, staff_api = _client(mallory), _client(staff)
    action = user_api.post(f"/api/endpoints/{ep_500.pk}/ops/reset_prefix_cache/").json()
    seen_by_user = []
    for job in jobs:
        seen_by_user.append(user_api.get(f"/api/jobs/{job.pk}/").content)
        seen_by_user.append(user_api.get(f"/api/jobs/{job.pk}/rollouts/").content)
        seen_by_user.append(user_api.get(f"/api/jobs/{job.pk}/export/?which=failed").getvalue())
        web = Client()
        web.force_login(mallory)
        for rollout in Rollout.objects.filter(job=job)[:1]:
            seen_by_user.append(web.get(f"/rollouts/{rollout.pk}/").content)
        seen_by_user.append(web.get(f"/jobs/{job.pk}/").content)
    for ep in (ep_500, ep_banner):
        seen_by_user.append(user_api.get(f"/api/endpoints/{ep.pk}/").content)
    seen_by_user.append(user_api.get(action["url"]).content)
    seen_by_user.append(user_api.get(f"/api/endpoints/{ep_500.pk}/ops/log/").content)
    text = b"\n".join(seen_by_user).decode()
    assert "SECRET" not in text and "internal-admin" not in text
    # what they do see: the status code, the error class and the product's reason
    assert "HTTP 500" in text and "http_5xx" in text and "not an HTTP answer" in text and "connection" in text
    assert "judge answered HTTP 403" in text
    # nothing was lost: staff read what the servers said, and the banner job failed attempts, not the job
    staff_text = b"".join(staff_api.get(f"/api/jobs/{j.pk}/rollouts/").content for j in jobs).decode()
    assert SECRET_BODY in staff_text and "SECRET-BANNER" in staff_text


def test_a_non_http_answer_fails_one_attempt_not_the_job(simulator, listeners):
    """A server that answers with a service banner: each attempt fails (class connection) and is retried like
    any transport error, and the run goes on to its end; before, the first banner stopped the whole job (an
    "internal engine error" quoting the banner)."""
    from workers.engine.materialize import materialize
    from workers.engine.runner import run_collection
    from workers.engine.types import FailureClass

    from tests.workers.test_engine import ListSink, math_rows, spec_for

    banner = listeners(lambda hit: BANNER)
    sink = ListSink()
    spec = spec_for(simulator, base_urls=[banner.url], parallelism=4, max_retries=1, verifier="none")
    summary = asyncio.run(run_collection(spec, materialize(math_rows(6), 1), sink))
    assert not summary.fatal_error and summary.failed == 6, summary
    assert all(r.failure_class == FailureClass.CONNECTION and r.attempts == 2 for r in sink.results), sink.results
    assert all(r.error.startswith(f"not an HTTP answer from {banner.url}") for r in sink.results)
    assert len(banner.hits) == 12  # every attempt was made: one per rollout and its retry


# --- the gate itself: pinned addresses, host:port pairs, userinfo ---------------------------------------------
def test_the_connection_goes_to_the_address_that_was_checked(db, mallory, settings, listeners, monkeypatch):
    """DNS rebinding: the name answers 127.0.0.1 once, then a cloud-metadata address. The call that was checked
    reaches the first; the next resolution is checked again and refused; nothing goes anywhere else."""
    from controlplane.endpoints.services import check_health

    server = listeners(lambda hit: (200, {}, b"ok") if hit.path == "/health" else json_answer({"data": [{"id": "m"}]}))
    real = socket.getaddrinfo
    answers = []

    def rebinding(host, *args, **kw):
        if host == "rebind.example":
            target = "127.0.0.1" if not answers else "169.254.169.254"
            answers.append(target)
            return real(target, *args, **kw)
        return real(host, *args, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    ep = Endpoint(owner=mallory, name="x", base_url=f"http://rebind.example:{server.port}", model_name="m",
                  connect_timeout_s=1, request_timeout_s=3)
    out = check_health(ep, save=False)["replicas"][0]
    assert server.paths() == ["/health"], server.paths()  # checked 127.0.0.1 -> connected to 127.0.0.1
    assert out["ok"] is False and "169.254.169.254" in out["error"] and "not called" in out["error"], out
    assert answers == ["127.0.0.1", "169.254.169.254"]


def test_allow_list_is_host_port_pairs_and_urls_with_credentials_are_refused(db, mallory, settings, listeners):
    server = listeners(lambda hit: (200, {}, b"ok"))
    settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{server.port}"]
    api = _client(mallory)
    new = {"name": "x", "model_name": "m"}
    assert api.post("/api/endpoints/", {**new, "base_url": server.url}, format="json").status_code == 201
    for url in (f"http://127.0.0.1:{_free_port()}", "http://127.0.0.1:6379",
                f"http://user:pw@127.0.0.1:{server.port}", f"http://127.0.0.1:{server.port}@169.254.169.254"):
        r = api.post("/api/endpoints/", {**new, "base_url": url}, format="json")
        assert r.status_code == 400 and "base_url" in r.json(), (url, r.content)
    settings.ENDPOINT_ALLOWED_HOSTS = ["*"]  # the laptop default still refuses credentials in a URL
    r = api.post("/api/endpoints/", {**new, "base_url": f"http://user:pw@127.0.0.1:{server.port}"}, format="json")
    assert r.status_code == 400, r.content
