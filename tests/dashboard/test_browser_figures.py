"""Every figure a user acts on is true: a multi-chunk job on 2 Celery workers, watched in headless Chromium
through pause, resume, cancel and a resume after the cancel. At each moment every figure on its pages - the
live row (rate, average rate, elapsed, in flight, ETA), the chart's last point, the workers panel, the
diagnosis's evidence and the endpoint's replica table - is compared with what the stored rollouts say
(computed here from the rows alone: their store times and wall times), within 10 %."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta
from datetime import timezone as dt_timezone

import pytest
from django.db import connection

from . import servers
from tests.factories import make_dataset

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

WINDOW_S = 10.0  # the recent rate's window
GAP_S = 5.0  # rows further apart than this: the job was not running in between
PARALLELISM = 16
REL = 0.10


@pytest.fixture
def figures_stack(transactional_db, simulator_factory, django_user_model, monkeypatch):
    servers.prepare_browser(monkeypatch)
    from django.conf import settings

    from controlplane.endpoints.models import Endpoint

    # ~0.4 s per request with room on the server: the job keeps its 16 slots busy (~40 rollouts/s)
    sim = simulator_factory(ttft_ms=150, itl_ms=5, output_len_min=40, output_len_max=50, jitter=0.05, seed=5)
    user = django_user_model.objects.create_user(username="erin", password="erin-pw-123")
    queue = f"figures-{uuid.uuid4().hex[:10]}"
    ep = Endpoint.objects.create(owner=user, name="simulator", base_url=sim.url, model_name=sim.model, max_retries=2,
                                 request_timeout_s=30, worker_queue=queue)  # a single URL
    env = servers.child_env(servers.database_url(connection.settings_dict), settings.REDIS_URL,
                            CELERY_TASK_DEFAULT_QUEUE=queue, JOBS_PROGRESS_MAX_PER_S=4, WORKER_HEARTBEAT_INTERVAL_S=2,
                            JOBS_FLUSH_INTERVAL_S=0.5, REPLICA_LOAD_WINDOW_S=900)  # every run of the test in the table
    procs = []
    try:
        daphne, url = servers.start_daphne(env)
        procs.append(daphne)
        procs.append(servers.start_celery(env, concurrency=2, name="figures-a"))
        procs.append(servers.start_celery(env, concurrency=2, name="figures-b"))
        yield {"url": url, "user": user, "endpoint": ep}
    finally:
        for p in reversed(procs):
            p.stop()


# ------------------------------------------------------------------------------- the stored truth
def _rows(job_id, at):
    from controlplane.jobs.models import Rollout

    return list(Rollout.objects.filter(job_id=job_id, created_at__lte=at).order_by("created_at")
                .values_list("created_at", "wall_ms", "status"))


def _stretches(rows, at, running):
    """When the job ran, from its rows alone: rows stored less than GAP_S apart belong to one stretch, which
    began when its first row's request started (store time - wall time); a running job runs until `at`."""
    out = []
    for created, wall_ms, _ in rows:
        if out and (created - out[-1][1]).total_seconds() <= GAP_S:
            out[-1][1] = created
        else:
            out.append([created - timedelta(milliseconds=wall_ms or 0), created])
    if running and out and (at - out[-1][1]).total_seconds() <= GAP_S:
        out[-1][1] = at
    return out


def truth(job_id, at, running, tail=None) -> dict:
    """The figures at `at` from the rows stored by then; `running`: the job ran at `at` (the rate is 0
    otherwise); `tail`: its last stretch lasts until `at` (default: when running)."""
    rows = _rows(job_id, at)
    stretches = _stretches(rows, at, running if tail is None else tail)
    running_s = sum((b - a).total_seconds() for a, b in stretches)
    since = at - timedelta(seconds=WINDOW_S)
    span = sum(max(0.0, (min(b, at) - max(a, since)).total_seconds()) for a, b in stretches)
    recent_ok = sum(1 for c, _, s in rows if c > since and s == "ok")
    ok = sum(1 for _, _, s in rows if s == "ok")
    rate = recent_ok / max(span, 3.0) if running and span else 0.0
    return {"done": len(rows), "ok": ok, "running_s": running_s, "avg": len(rows) / running_s if running_s else None,
            "throughput": ok / running_s if running_s else None, "rate": rate, "span": max(span, 3.0)}


# ------------------------------------------------------------------------------- what the pages show
def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _duration(text: str) -> float:
    return float(sum(int(v) * 60 ** i for i, v in enumerate(reversed(text.split(":")))))


READ_LIVE = """() => {
  const v = (f) => document.querySelector(`#job-progress ~ .kpis [data-field=${f}]`).textContent.trim();
  const ch = window.dashboardCharts;
  let chart = null;
  if (ch && ch.t.length) chart = {t: ch.t[ch.t.length - 1], sps: ch.sps[ch.sps.length - 1]};
  return {rate: v("samples_per_s"), avg: v("avg_samples_per_s"), elapsed: v("elapsed_s"), in_flight: v("in_flight"),
          eta: v("eta_s"), done: v("done"), state: document.querySelector("#job-state").textContent.trim(),
          t: window.dashboardLast.t, now: Date.now() / 1000, chart};
}"""
READ_PANELS = """() => {
  const workers = Array.from(document.querySelectorAll("#workers-table tbody tr"))
    .map((tr) => Array.from(tr.cells).map((c) => c.textContent.trim()));
  const evidence = {};
  for (const tr of document.querySelectorAll("#diagnosis-panel details table tr")) {
    evidence[tr.querySelector("th").textContent.trim()] = tr.querySelector("td").textContent.trim();
  }
  const ch = window.dashboardCharts;
  let chart = null;
  if (ch) for (let i = ch.t.length - 1; i >= 0; i--) if (ch.sps[i] !== null) { chart = {t: ch.t[i], sps: ch.sps[i]}; break; }
  const asOf = parseFloat(document.querySelector("#workers-table").dataset.asOf);  // when the server read them
  return {workers, evidence, chart, now: asOf};
}"""
READ_REPLICAS = """() => Array.from(document.querySelectorAll("#replica-load-table tbody tr")).map((tr) => ({
  state: tr.querySelector(".replica-state").textContent.trim(),
  in_flight: Number(tr.querySelector(".replica-in-flight").textContent), requests: Number(tr.querySelector(".replica-requests").textContent)}))"""


def _at(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=dt_timezone.utc)


def check_moment(name, page, ep_page, stack, job, log):
    """Read every figure (live row first, then a reload's panels, then the endpoint page) and compare each
    with the stored truth at the moment it was computed."""
    running = page.evaluate(READ_LIVE)["state"] == "running"
    live = page.evaluate(READ_LIVE)
    time.sleep(1.0)  # the rows of that moment reach the database (batched writes)
    t_msg = truth(job.pk, _at(live["t"]), running)
    t_now = truth(job.pk, _at(live["now"]), running)
    log.append((name, "live", live, t_msg))
    if running:
        assert _num(live["rate"]) == pytest.approx(t_msg["rate"], rel=REL), (name, live, t_msg)
        # in flight is a live figure, no stored one: between one chunk's last request and the next chunk's
        # first, the runs hold less than the job's parallelism for a moment; it comes back within seconds
        flights = [_num(live["in_flight"])]
        while abs(flights[-1] - PARALLELISM) > 0.1 * PARALLELISM and len(flights) < 10:
            time.sleep(0.5)
            now = page.evaluate(READ_LIVE)
            if now["state"] != "running":
                break
            flights.append(_num(now["in_flight"]))
        assert abs(flights[-1] - PARALLELISM) <= 0.1 * PARALLELISM or now["state"] != "running", (name, flights)
        left = job.total_rollouts - int(_num(live["done"]))
        assert _duration(live["eta"]) == pytest.approx(left / t_msg["rate"], rel=REL, abs=1.5), (name, live, t_msg)
        # the chart's last point is the rate of the live message it came from (the shown figures may be a later
        # catch-up answer's, which draws no point): compared at that message's time
        assert live["chart"], (name, live)
        t_point = truth(job.pk, _at(live["chart"]["t"]), running)
        assert live["chart"]["sps"] == pytest.approx(t_point["rate"], rel=REL), (name, live, t_point)
    else:
        assert _num(live["rate"]) == 0 and _num(live["in_flight"]) == 0 and live["eta"] in ("—", "00:00"), (name, live)
        assert live["chart"] is None or live["chart"]["sps"] is None, (name, live)  # the line breaks
    assert _num(live["avg"]) == pytest.approx(t_msg["avg"], rel=REL), (name, live, t_msg)
    assert _duration(live["elapsed"]) == pytest.approx(t_now["running_s"], rel=REL, abs=2.0), (name, live, t_now)

    from controlplane.jobs.models import Rollout

    before = Rollout.objects.filter(job_id=job.pk).count()
    page.reload()
    page.wait_for_selector("#workers-table", timeout=15000)
    panels = page.evaluate(READ_PANELS)
    after = Rollout.objects.filter(job_id=job.pk).count()
    t_panel = truth(job.pk, _at(panels["now"]), running)
    log.append((name, "panels", panels, t_panel, before, after))
    stored = sum(int(w[5]) for w in panels["workers"])
    assert before * (1 - REL) <= stored <= after * (1 + REL), (name, panels["workers"], before, after)
    if running:
        assert sum(float(w[6]) for w in panels["workers"]) == pytest.approx(t_panel["rate"], rel=REL), (name, panels)
    else:
        assert sum(int(w[7]) for w in panels["workers"]) == 0, (name, panels["workers"])
    ev = panels["evidence"]
    assert int(ev["rollouts"]) == pytest.approx((before + after) / 2, rel=REL), (name, ev, before, after)
    assert float(ev["throughput_rps"]) == pytest.approx(t_panel["throughput"], rel=REL), (name, ev, t_panel)
    if panels["chart"]:  # the chart's last running point: the figure at its second (a reload's series, whole
        ct = panels["chart"]["t"]  # seconds) or at its live message's time
        at = _at(ct + 1) if float(ct).is_integer() else _at(ct)
        t_chart = truth(job.pk, at, True, tail=False)  # a past point: the rows say when it stopped
        # a reload's series counts running time in whole seconds: at most one second of the window off
        whole_s = t_chart["rate"] / t_chart["span"] if float(ct).is_integer() else 0.0
        assert panels["chart"]["sps"] == pytest.approx(t_chart["rate"], rel=REL, abs=whole_s), (name, panels["chart"], t_chart)

    ep_page.goto(stack["url"] + f"/endpoints/{stack['endpoint'].pk}/")
    reps = ep_page.evaluate(READ_REPLICAS)
    stored_now = Rollout.objects.filter(job_id=job.pk).count()
    job.refresh_from_db()
    running = running and job.state == "running"  # it may have just finished
    log.append((name, "replicas", reps, stored_now))
    assert len(reps) == 1, reps  # the single URL
    (rep,) = reps
    assert rep["requests"] == pytest.approx(stored_now, rel=REL), (name, rep, stored_now)  # every run of the job
    if running:
        # in flight is no stored figure: the endpoint's and the job page's agree (read a moment apart, each from
        # its own latest tick, so a few reads; near the end a chunk with few tasks left holds fewer than its share)
        assert rep["state"] == "in rotation", (name, rep)
        pairs = []
        for _ in range(5):
            job_in_flight = _num(page.evaluate(READ_LIVE)["in_flight"])
            pairs.append((rep["in_flight"], job_in_flight))
            if abs(rep["in_flight"] - job_in_flight) <= 0.25 * PARALLELISM or page.evaluate(READ_LIVE)["state"] != "running":
                break
            time.sleep(0.5)
            ep_page.reload()
            (rep,) = ep_page.evaluate(READ_REPLICAS)
        else:
            raise AssertionError((name, "in flight never agreed", pairs))
    else:
        # nothing in flight; idle once its runs' last ticks age (a run that just finished is still "in")
        assert rep["in_flight"] == 0 and (rep["state"] == "idle" or job.state == "completed"), (name, rep)
    health = ep_page.locator(".sub .badge").first.inner_text().strip()
    assert health == "answering", health


def _wait(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while True:
        v = cond()
        if v:
            return v
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_every_figure_agrees_with_the_stored_rollouts_through_pause_resume_cancel(figures_stack):
    from playwright.sync_api import sync_playwright

    from controlplane.jobs.models import CollectionJob, JobChunk, JobMetricSample
    from controlplane.jobs.services import create_job

    stack = figures_stack
    ds = make_dataset(stack["user"], n=900, name="figures-math")
    job = create_job(owner=stack["user"], dataset=ds, endpoint=stack["endpoint"], num_repeats=2,
                     num_samples_in_parallel=PARALLELISM, chunk_size=100, verifier="math", name="figures")
    total = job.total_rollouts
    assert total == 1800 and JobChunk.objects.filter(job=job).count() == 9
    log: list = []

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=servers.CHROMIUM, args=servers.CHROMIUM_ARGS)
        try:
            ctx = browser.new_context(viewport={"width": 1360, "height": 1000})
            page = ctx.new_page()
            page.goto(stack["url"] + f"/jobs/{job.pk}/")
            servers.log_in(page, "erin", "erin-pw-123")
            page.wait_for_url(f"**/jobs/{job.pk}/", timeout=30000)
            ep_page = ctx.new_page()
            kpi = lambda f: page.locator(f"#job-progress ~ .kpis [data-field={f}]").first.inner_text().strip()  # noqa: E731
            state = lambda: page.locator("#job-state").inner_text().strip()  # noqa: E731
            done = lambda: int(_num(kpi("done") or "0"))  # noqa: E731

            def until_done(n, what):
                page.wait_for_selector("#live-status.live", timeout=15000)
                _wait(lambda: done() >= n, 120, what)

            def click(action, expect):
                if action == "cancel":
                    page.once("dialog", lambda d: d.accept())  # Cancel asks first
                page.click(f"#action-{action}")
                page.wait_for_load_state()
                _wait(lambda: state() == expect or (expect == "running" and state() == "completed"), 60,
                      f"{action} -> {expect}")

            # 1. running, past the first chunks (a full rate window in)
            until_done(0.30 * total, "30 %")
            check_moment("running", page, ep_page, stack, job, log)
            # 2. paused: nothing runs, the figures stop with it
            click("pause", "paused")
            time.sleep(GAP_S + 2)
            check_moment("paused", page, ep_page, stack, job, log)
            # 3. resumed: it/s and ETA come back within seconds (no 0.00 / "—" for long), no resume spike
            click("resume", "running")
            _wait(lambda: _num(kpi("samples_per_s")) > 0 and kpi("eta_s") != "—", 15, "rate and ETA after resume")
            mark = done()
            until_done(mark + 0.20 * total, "20 % more after resume")
            check_moment("resumed", page, ep_page, stack, job, log)
            # 4. cancelled
            click("cancel", "cancelled")
            time.sleep(GAP_S + 2)
            check_moment("cancelled", page, ep_page, stack, job, log)
            # 5. resumed after the cancel, to the end
            click("resume", "running")
            mark = done()
            until_done(mark + 0.25 * (total - mark), "25 % of the rest after resuming the cancelled job")
            check_moment("resumed after cancel", page, ep_page, stack, job, log)
            _wait(lambda: CollectionJob.objects.get(pk=job.pk).state == "completed", 120, "completion")
            page.reload()
            _wait(lambda: state() == "completed", 15, "completed badge")
            check_moment("completed", page, ep_page, stack, job, log)
            assert "nothing live" in page.locator("#live-status").inner_text()
            page.screenshot(path=str(servers.REPO / "test-artifacts" / "job_page_figures.png"), full_page=True)
        finally:
            for entry in log:
                print(entry)
            browser.close()

    series = set(JobMetricSample.objects.filter(job_id=job.pk).values_list("worker", flat=True))
    assert len({s.split(" chunk ")[0].rsplit(":", 2)[0] for s in series}) == 2, series  # both workers ran chunks
    assert CollectionJob.objects.get(pk=job.pk).completed_count + CollectionJob.objects.get(pk=job.pk).failed_count == total
