"""Pages render what is stored; actions call the job services; uploads report bad lines."""
from __future__ import annotations

import csv
import html as html_lib
import io
import json
import re

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client
from django.urls import reverse

from tests.factories import make_dataset, make_endpoint, make_job, sum_rows

pytestmark = pytest.mark.django_db


@pytest.fixture
def client_alice(alice):
    c = Client()
    c.force_login(alice)
    return c


def test_overview_lists_jobs_endpoints_and_workers(client_alice, alice_job, alice):
    from controlplane.dashboard.heartbeat import beat

    running = make_job(alice, alice_job.dataset, alice_job.endpoint, n_rollouts=10, state="running", name="live-one")
    beat("celery@gpu-host-1", concurrency=4)
    html = client_alice.get("/").content.decode()
    assert f'data-job="{running.pk}"' in html and "live-one" in html
    assert "alice-run" in html  # recent
    assert "sim-model" in html  # endpoint
    assert "celery@gpu-host-1" in html  # heartbeat
    st = client_alice.get(reverse("dashboard:overview_state")).json()
    assert running.pk in st["active_ids"] and any(w["name"] == "celery@gpu-host-1" for w in st["workers"])


def test_job_page_shows_progress_charts_metrics_timing_and_actions(client_alice, alice_job):
    resp = client_alice.get(reverse("dashboard:job", args=[alice_job.pk]))
    assert resp.status_code == 200
    html = resp.content.decode()
    for needle in ('id="job-progress"', 'id="chart-samples"', 'id="chart-errors"', 'id="timing-table"',
                   'id="metrics-table"', 'id="failures-table"', "http_429", 'id="action-retry"', "mean/reward"):
        assert needle in html, needle
    # done / total from the job row
    assert f'<span data-field="done">{alice_job.done_count}</span>' in html
    series = resp.context["series"]
    # the chart's rate is the live row's: stored ok rows in the window over its running seconds (5 s sampled)
    assert len(series["t"]) == 6 and "http_429" in series["error_classes"]
    assert series["samples_per_s"][-1] is None  # the job ended: its line ends
    assert series["samples_per_s"][-2] == pytest.approx(alice_job.completed_count / 5, rel=0.01)


def test_state_json_has_the_progress_event_fields(client_alice, alice_job):
    st = client_alice.get(reverse("dashboard:job_state", args=[alice_job.pk]) + "?series=1").json()
    for k in ("job_id", "state", "total", "completed", "failed", "done", "in_flight", "parallelism", "samples_per_s",
              "output_tokens_per_s", "eta_s", "errors", "t", "stalled"):
        assert k in st["snapshot"], k
    assert st["snapshot"]["done"] == alice_job.done_count and "series" in st


def test_stored_summaries_are_shown_when_present(client_alice, alice_job):
    alice_job.aggregate_metrics = {"mean/reward": 0.625, "pass@2": 0.9}
    alice_job.timing_summary = {"wall_ms": {"p50": 11.0, "p90": 22.0, "p99": 33.0, "mean": 12.0, "count": 5}}
    alice_job.save()
    html = client_alice.get(reverse("dashboard:job", args=[alice_job.pk])).content.decode()
    assert "0.6250" in html and "pass@2" in html and "33.0" in html


def test_panels_are_extensible(client_alice, alice_job, tmp_path, settings):
    from controlplane import panels

    (tmp_path / "extra_panel.html").write_text('<section id="extra">extra {{ job.pk }} {{ panel_ctx.hello }}</section>')
    settings.TEMPLATES = [{**settings.TEMPLATES[0], "DIRS": [*settings.TEMPLATES[0]["DIRS"], tmp_path]}]
    saved = list(panels.JOB_PANELS)
    try:
        panels.register_panel("extra_panel.html", name="extra", context=lambda request, job: {"hello": "world"}, after="progress")
        html = client_alice.get(reverse("dashboard:job", args=[alice_job.pk])).content.decode()
        assert f"extra {alice_job.pk} world" in html
        assert html.index('id="extra"') < html.index('id="job-actions"')
    finally:
        panels.JOB_PANELS[:] = saved


def test_launch_form_shows_service_validation_errors(client_alice, alice, no_celery):
    ds = make_dataset(alice, n=3)
    ep = make_endpoint(alice)
    resp = client_alice.post(reverse("dashboard:dataset", args=[ds.pk]), {
        "endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 1, "verifier": "math", "verify_mode": "inline",
        "chunk_size": 5, "verifier_options": "[1, 2]"})
    assert resp.status_code == 400 and b"must be a JSON object" in resp.content
    assert not no_celery


def test_job_actions_call_the_services(client_alice, alice, no_celery):
    ds = make_dataset(alice, n=4)
    job = make_job(alice, ds, make_endpoint(alice), n_rollouts=0, state="running")
    resp = client_alice.post(reverse("dashboard:job_action", args=[job.pk, "pause"]), follow=True)
    job.refresh_from_db()
    assert job.state == "paused" and b"pause: done" in resp.content
    client_alice.post(reverse("dashboard:job_action", args=[job.pk, "cancel"]))
    job.refresh_from_db()
    assert job.state == "cancelled"
    # an action that does not fit: a message, not a crash
    resp = client_alice.post(reverse("dashboard:job_action", args=[job.pk, "pause"]), follow=True)
    assert resp.status_code == 200 and b"cannot pause" in resp.content
    assert client_alice.post(reverse("dashboard:job_action", args=[job.pk, "explode"])).status_code == 404


def test_rollout_detail_shows_input_output_verifier_usage_timings(client_alice, alice_job):
    r = alice_job.rollouts.filter(status="ok").order_by("id").first()
    html = client_alice.get(reverse("dashboard:rollout", args=[r.pk])).content.decode()
    assert f"What is {r.task_index} + 1?" in html
    assert f"The answer is \\boxed{{{r.task_index + 1}}}" in html
    assert "expected_answer" in html and "extracted_answer" in html
    assert "output_tokens" in html and "wall_ms" in html
    raw = html[html.index("raw output row (JSON)"):]
    raw = html_lib.unescape(raw[raw.index("<pre>") + 5:raw.index("</pre>")])
    assert json.loads(raw) == r.data  # the page's display keys (content_text ...) stay out of the row as stored


def test_dataset_page_clips_a_huge_row(client_alice, alice):
    big = {"responses_create_params": {"input": [{"role": "user", "content": "x" * 3_000_000}]}, "expected_answer": "1"}
    ds = make_dataset(alice, rows=[big, *sum_rows(2)])
    html = client_alice.get(reverse("dashboard:dataset", args=[ds.pk])).content.decode()
    assert len(html) < 200_000 and "more characters (too long to show whole)" in html
    assert "What is" in html  # the other rows are shown whole


def test_upload_good_file_then_launch_a_job(client_alice, alice, no_celery, django_capture_on_commit_callbacks):
    make_endpoint(alice)
    body = b"".join(json.dumps(r).encode() + b"\n" for r in sum_rows(7))
    resp = client_alice.post(reverse("dashboard:dataset_upload"), {"file": SimpleUploadedFile("m.jsonl", body), "name": "seven"},
                             HTTP_X_REQUESTED_WITH="XMLHttpRequest")
    assert resp.status_code == 200, resp.content
    payload = resp.json()
    assert payload["ok"] and payload["row_count"] == 7
    page = client_alice.get(payload["url"])
    assert page.status_code == 200 and b"What is" in page.content and b'id="launch-form"' in page.content
    form = page.context["form"]
    data = {"endpoint": form.fields["endpoint"].queryset.first().pk, "num_repeats": 2, "num_samples_in_parallel": 3,
            "verifier": "math", "verify_mode": "inline", "chunk_size": 5, "temperature": 0.7, "max_output_tokens": 64,
            "extra_params": '{"seed": 1}', "name": "from-form"}
    with django_capture_on_commit_callbacks(execute=True):
        resp = client_alice.post(payload["url"], data)
    assert resp.status_code == 302, resp.content[:2000]
    from controlplane.jobs.models import CollectionJob

    job = CollectionJob.objects.get(name="from-form")
    assert job.owner == alice and job.total_rollouts == 14 and job.num_samples_in_parallel == 3
    assert job.responses_create_params == {"seed": 1, "temperature": 0.7, "max_output_tokens": 64}
    assert len([s for s in no_celery if s[0] == "run_chunk"]) == 2  # 7 rows / chunk 5


def test_upload_bad_file_reports_line_numbers(client_alice):
    lines = [json.dumps(sum_rows(1)[0]), "{not json", json.dumps({"question": "no params"}), json.dumps(sum_rows(2)[1])]
    body = ("\n".join(lines) + "\n").encode()
    resp = client_alice.post(reverse("dashboard:dataset_upload"), {"file": SimpleUploadedFile("bad.jsonl", body)},
                             HTTP_X_REQUESTED_WITH="XMLHttpRequest")
    assert resp.status_code == 400
    report = resp.json()["report"]
    assert [b["line"] for b in report["bad_lines"]] == [2, 3]
    # the plain (no-JS) form shows the same report
    resp = client_alice.post(reverse("dashboard:dataset_upload"), {"file": SimpleUploadedFile("bad.jsonl", body)})
    assert resp.status_code == 400 and b"<td>2</td>" in resp.content and b"<td>3</td>" in resp.content


def test_compare_two_jobs_per_task(client_alice, alice):
    ds = make_dataset(alice, n=10)
    ep = make_endpoint(alice)
    a = make_job(alice, ds, ep, n_rollouts=10, rewards=lambda t, r: 1.0 if t < 6 else 0.0, name="A")
    b = make_job(alice, ds, ep, n_rollouts=10, rewards=lambda t, r: 1.0 if t >= 4 else 0.0, name="B")
    resp = client_alice.get(reverse("dashboard:compare") + f"?jobs={a.pk}&jobs={b.pk}")
    assert resp.status_code == 200
    pair = resp.context["result"]["per_task"]["pairs"][0]
    assert pair["a_only"] == [0, 1, 2, 3] and pair["b_only"] == [6, 7, 8, 9] and pair["both"] == 2 and pair["neither"] == 0
    html = resp.content.decode()
    assert 'id="compare-summary"' in html and 'id="compare-params"' in html
    assert 'id="compare-profiles"' not in html  # neither job was profiled: no per-function section
    # parameters as a user writes them, and a picker of checkboxes with the chosen ones ticked
    params = html[html.index('id="compare-params"'):html.index("</table>", html.index('id="compare-params"'))]
    assert "None" not in params and "{&#x27;" not in params and "<code>—</code>" in params
    assert f'name="jobs" value="{a.pk}" id="pick-{a.pk}" checked' in html


def test_history_and_csv_export(client_alice, alice_job):
    alice_job.aggregate_metrics = {"mean/reward": 0.5}
    alice_job.save()
    html = client_alice.get(reverse("dashboard:history")).content.decode()
    assert "alice-run" in html and 'id="history-throughput"' in html
    resp = client_alice.get(reverse("dashboard:history") + "?format=csv")
    assert resp["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(resp.content.decode())))
    assert len(rows) == 1
    row = rows[0]
    assert row["job_id"] == str(alice_job.pk) and row["rollouts"] == str(alice_job.done_count)
    # its running time is what its runs' samples cover: 5 ticks a second apart, 4.5 s of work (the first
    # started half a tick before), not the 60 s from start to end
    assert float(row["elapsed_sec"]) == pytest.approx(4.5, abs=0.1)
    assert float(row["avg_reward"]) == 0.5 and abs(float(row["samples_per_sec"]) - alice_job.done_count / 4.5) < 0.05


def _agents_section(html: str) -> list[tuple[str, int]]:
    sec = html[html.index('id="dataset-agents"'):]
    sec = sec[:sec.index("</section>")]
    import re

    return [(n, int(c)) for n, c in re.findall(r"<tr><td><code>([^<]+)</code></td><td class=\"num\">(\d+)</td></tr>", sec)]


def test_dataset_page_lists_the_agents_its_rows_route_to(client_alice, alice):
    from controlplane.datasets.services import ingest_jsonl

    rows = sum_rows(7)
    for i in (1, 3, 5):
        rows[i]["agent_ref"] = {"name": "math_agent"}
    rows[6]["agent_ref"] = {"name": "code_agent"}
    ds = ingest_jsonl(io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows)), name="routed", owner=alice)
    html = client_alice.get(reverse("dashboard:dataset", args=[ds.pk])).content.decode()
    assert _agents_section(html) == [("math_agent", 3), ("code_agent", 1)]
    assert "3 rows name no agent: an agent job sends them to the job's agent name." in html
    assert ds.validation_report["agents"] == {"by_name": {"code_agent": 1, "math_agent": 3}, "without_agent_ref": 3,
                                              "rows_of_unlisted_agents": 0}


def test_dataset_page_counts_agents_of_a_dataset_stored_before_the_count(client_alice, alice):
    rows = sum_rows(4)
    rows[0]["agent_ref"] = {"name": "solo"}
    ds = make_dataset(alice, rows=rows)  # written directly: no agent count in its report
    html = client_alice.get(reverse("dashboard:dataset", args=[ds.pk])).content.decode()
    assert _agents_section(html) == [("solo", 1)]
    assert "3 rows name no agent" in html
    ds.refresh_from_db()
    assert ds.validation_report["agents"]["by_name"] == {"solo": 1}  # kept for the next view


def test_agent_job_page_splits_run_time_into_model_and_agent(client_alice, alice):
    """Two chunk runs' cumulative agent_timing ticks (as AgentRun sends them): the page sums each run's last."""
    from controlplane.jobs.models import JobMetricSample

    ds = make_dataset(alice, rows=sum_rows(4))
    ep = make_endpoint(alice, "http://127.0.0.1:11000", kind="nemo_gym", model="math_agent")
    job = make_job(alice, ds, ep, n_rollouts=0)
    JobMetricSample.objects.filter(job=job).delete()
    for worker, ticks in (("w1 chunk 0", [(10, 2000.0, 10, 500.0, 10), (30, 6000.0, 30, 1500.0, 30)]),
                          ("w1 chunk 1", [(20, 4000.0, 20, 1000.0, 20)])):
        for i, (n, run_ms, reqs, model_ms, at) in enumerate(ticks):
            JobMetricSample.objects.create(job=job, worker=worker, elapsed_s=i + 1.0, completed=n, in_flight=1, parallelism=4,
                                           extra={"agent_timing": {"rollouts": n, "run_ms": run_ms, "model_requests": reqs,
                                                                   "model_ms": model_ms, "rollouts_at_model": at,
                                                                   "model_scrapes": 1}})
    html = client_alice.get(reverse("dashboard:job", args=[job.pk])).content.decode()
    table = html[html.index('id="agent-split"'):]
    table = table[:table.index("</table>")]
    cells = {part: [c.strip() for c in re.findall(r"<td>([^<]*)</td>", table[table.index(f'data-part="{part}"'):].split("</tr>")[0])]
             for part in ("run", "model", "agent")}
    # 50 rollouts: 10 s of /run, 2.5 s of model time over 50 requests
    assert cells["run"][0] == "200.0"
    assert cells["model"][:2] == ["50.0", "1.00 calls"]
    assert cells["agent"][:2] == ["150.0", "75% of /run"]
