"""A trace per rollout: every model request of a rollout carries a W3C `traceparent` with the rollout's trace id
(a new span id per attempt); the simulator sees it, the stored rollout has it, and the rollout browser and the
API find the rollout by it."""
from __future__ import annotations

import re

import pytest
from django.core.management import call_command
from django.urls import reverse

from controlplane.jobs.models import CollectionJob, Rollout
from tests.controlplane.test_collect_rollouts import cli_args, write_math
from tests.factories import api_token, make_user

TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-01")


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_each_rollouts_requests_carry_its_stored_trace_id(simulator_factory, tmp_path, client):
    sim = simulator_factory(seed=5, fault_rates={"500": 0.2})  # some requests retried: a new span, the same trace
    inp = write_math(tmp_path / "tasks.jsonl", 10)
    call_command("collect_rollouts", *cli_args(inp, tmp_path / "out.jsonl", sim.url, "+max_retries=5"))
    job = CollectionJob.objects.get()
    rows = list(Rollout.objects.filter(job=job).values_list("id", "trace_id", "attempts"))
    assert len(rows) == 20
    seen = [TRACEPARENT.fullmatch(h) for h in sim.get_json("/admin/traceparents")["traceparents"]]
    assert seen and all(seen), "a traceparent the simulator got is not W3C's"
    by_trace: dict[str, list[str]] = {}
    for m in seen:
        by_trace.setdefault(m.group(1), []).append(m.group(2))
    traces = {t for _, t, _ in rows}
    assert len(traces) == 20 and all(re.fullmatch(r"[0-9a-f]{32}", t) for t in traces)  # one per rollout
    assert set(by_trace) == traces  # every request the simulator saw belongs to a stored rollout, and each has its
    for _, trace, attempts in rows:
        spans = by_trace[trace]
        assert len(spans) == attempts and len(set(spans)) == attempts  # a span per attempt
    assert any(a > 1 for _, _, a in rows)

    # searchable: the rollout browser and the API find the rollout by its trace id (or the whole header)
    rid, trace, _ = rows[7]
    job.owner = make_user("tracer")  # the drop-in ran without +owner: hand the job to a user to browse it
    job.save(update_fields=["owner"])
    client.force_login(job.owner)
    html = client.get(reverse("dashboard:rollouts", args=[job.pk]), {"trace": trace}).content.decode()
    assert html.count('href="/rollouts/') == 1 and f'href="/rollouts/{rid}/' in html
    detail = client.get(reverse("dashboard:rollout", args=[rid])).content.decode()
    assert f'<code class="trace-id">{trace}</code>' in detail
    # from any page: /traces/<id or traceparent>/ leads to the rollout, for whoever may see the job only
    assert client.get(f"/traces/{trace}/").url == f"/rollouts/{rid}/"
    assert client.get(f"/traces/00-{trace}-{'b' * 16}-01/").url == f"/rollouts/{rid}/"
    assert client.get(f"/traces/{'0' * 31}1/").status_code == 404 and client.get("/traces/nope/").status_code == 404
    client.force_login(make_user("stranger"))
    assert client.get(f"/traces/{trace}/").status_code == 404
    client.force_login(job.owner)
    token = api_token(job.owner)
    found = client.get(f"/api/jobs/{job.pk}/rollouts/", {"trace_id": f"00-{trace}-{'a' * 16}-01"},
                       HTTP_AUTHORIZATION=f"Token {token}").json()
    assert [r["id"] for r in found["results"]] == [rid] and found["results"][0]["trace_id"] == trace
