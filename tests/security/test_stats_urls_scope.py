"""stats_urls (profiling: NeMo Gym servers' /stats pulled by the worker) reach only the job's own deployment.

With the development allow-list ("*"), the gate alone admits any host, so a job owner could aim the worker at
anything else listening on 127.0.0.1 (an admin port, a metadata proxy ...). A stats URL must be a /stats of a
server of the job's own deployment (its endpoint; for NeMo Gym, the servers its head server lists) or of a host
the operator's allow-list names; a redirect is an answer, never followed; the worker's puller checks again."""
from __future__ import annotations

import pytest

from controlplane.jobs.models import CollectionJob, JobState

from .conftest import make_dataset, make_endpoint
from .listeners import Listener
from .test_outbound_gate import _client

pytestmark = pytest.mark.django_db


@pytest.fixture
def servers():
    made = []

    def make(answer):
        made.append(Listener(answer))
        return made[-1]

    yield make
    for li in made:
        li.close()


def _job(owner, url):
    return CollectionJob.objects.create(owner=owner, dataset=make_dataset(owner, 1), endpoint=make_endpoint(owner, url),
                                        state=JobState.RUNNING, total_rollouts=1)


def test_stats_urls_elsewhere_on_localhost_or_redirecting_are_refused(mallory, settings, servers):
    from controlplane.profiling.services import deployment_servers, stats_url_problem
    from workers.profiling.nemo_gym import StatsPuller

    settings.ENDPOINT_ALLOWED_HOSTS = ["*"]  # the development default: the gate admits every host
    other = servers(lambda hit: (200, {}, b""))  # something else on 127.0.0.1, not the job's
    own = servers(lambda hit: (307, {"Location": f"{other.url}/stats"}, b""))  # the job's endpoint, redirecting
    job = _job(mallory, own.url)
    api = _client(mallory)
    url = f"/api/jobs/{job.pk}/profile/"

    for target in (f"{other.url}/stats", f"http://localhost:{other.port}/stats", f"{own.url}/admin"):
        r = api.post(url, {"stats_urls": [{"url": target}]}, format="json")
        assert r.status_code in (400, 409), (target, r.content)
        assert "not a server of this job's deployment" in str(r.json()) or "/stats" in str(r.json()), r.content
    assert other.connections == 0 and own.connections == 0

    # the job's own server is accepted; its redirect to the other one is an answer, never followed
    r = api.post(url, {"stats_urls": [{"url": f"{own.url}/stats"}]}, format="json")
    assert r.status_code == 201, r.content
    allowed = deployment_servers(job)
    puller = StatsPuller([{"url": f"{own.url}/stats"}], session="s", window_s=0,
                         url_check=lambda u: stats_url_problem(u, allowed))
    assert puller.poll() == [] and own.paths() == ["/stats"] and other.connections == 0

    # a session stored before the rule: the worker's puller refuses the other server without calling it
    puller = StatsPuller([{"url": f"{other.url}/stats"}], session="s", window_s=0,
                         url_check=lambda u: stats_url_problem(u, allowed))
    assert puller.poll() == [] and other.connections == 0

    # a host the operator's allow-list names explicitly may be pulled
    settings.ENDPOINT_ALLOWED_HOSTS = [f"127.0.0.1:{other.port}", f"127.0.0.1:{own.port}"]
    assert stats_url_problem(f"{other.url}/stats", allowed) is None
