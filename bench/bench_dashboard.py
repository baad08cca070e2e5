"""Dashboard benchmarks (issue 4), on PostgreSQL + Redis, printing tables.

(a) live latency: a progress event published as the worker's sink publishes it (channel layer
    group_send to `job-<id>`, stamped with time.time()) -> daphne -> JobConsumer -> N job pages open
    in headless Chromium -> the page's JS has updated the DOM (progress bar, counters, 4 uPlot charts).
    Measured in each page as Date.now() - t when the update is applied ("DOM applied") and at the next
    animation frame ("next frame"). Same host, same clock. Target: p95 < 250 ms with 10 dashboards.
    `--clients ws` uses N bare WebSocket clients (aiohttp) instead of browser pages.
(b) page response time with 1,000,000 rollouts in one job: job page, state JSON, rollout browser
    page 1 and page 1,000 (keyset; also filtered), rollout detail — through the whole Django stack
    (Django test client: middleware, session, ORM, templates), plus OFFSET vs keyset side by side.
    Target: < 150 ms.

    .venv/bin/python bench/bench_dashboard.py                 # both
    .venv/bin/python bench/bench_dashboard.py --only pages --rows 1000000
    .venv/bin/python bench/bench_dashboard.py --only live --dashboards 10 --events 80

It uses its own database (`<DATABASE_URL name>_bench_dashboard`, created and migrated when missing;
the million rows are loaded once with INSERT ... SELECT generate_series and kept; --fresh reloads) and
its own Redis database number for nothing but the Channels layer.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import table_lines  # noqa: E402

DEFAULT_DB = "postgres://postgres@127.0.0.1:5432/controlplane"


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def table(title, header, rows):
    print(f"\n{title}")
    print("\n".join(table_lines(header, rows)))


# ------------------------------------------------------------------------------------------------
# setup: database, Django
# ------------------------------------------------------------------------------------------------
def bench_database_url(base_url: str) -> str:
    base, name = base_url.rsplit("/", 1)
    return f"{base}/{name.split('?')[0]}_bench_dashboard"


def ensure_database(url: str):
    import psycopg

    base, name = url.rsplit("/", 1)
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f'CREATE DATABASE "{name}"')
            print(f"created database {name}")
    env = dict(os.environ, DATABASE_URL=url)
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)


def setup_django(db_url: str, redis_url: str):
    os.environ["DATABASE_URL"] = db_url
    os.environ["REDIS_URL"] = redis_url
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"  # Playwright's sync API shares this thread
    import django

    django.setup()


def fixtures():
    """A bench user with a dataset and an endpoint (idempotent)."""
    from django.contrib.auth import get_user_model

    from controlplane.datasets.models import Dataset, DatasetRow
    from controlplane.endpoints.models import Endpoint

    User = get_user_model()
    user, _ = User.objects.get_or_create(username="bench-dashboard")
    ds = Dataset.objects.filter(owner=user, name="bench-math").first()
    if ds is None:
        ds = Dataset.objects.create(owner=user, name="bench-math", status="ready", row_count=500_000,
                                    source_filename="synthetic")
        DatasetRow.objects.bulk_create(
            DatasetRow(dataset=ds, index=i, line_number=i + 1,
                       data={"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1?"}]},
                             "question": f"What is {i} + 1?", "expected_answer": str(i + 1)})
            for i in range(100))
    ep, _ = Endpoint.objects.get_or_create(owner=user, name="bench-sim",
                                           defaults={"base_url": "http://127.0.0.1:9", "model_name": "sim-model"})
    return user, ds, ep


def session_cookie(user) -> str:
    from django.test import Client

    c = Client()
    c.force_login(user)
    return c.cookies["sessionid"].value


# ------------------------------------------------------------------------------------------------
# (b) pages with a million rollouts
# ------------------------------------------------------------------------------------------------
def load_million(user, ds, ep, rows: int, fresh: bool):
    from django.db import connection
    from django.utils import timezone

    from controlplane.jobs.models import CollectionJob, JobMetricSample, Rollout

    name = f"bench-{rows}"
    job = CollectionJob.objects.filter(owner=user, name=name).first()
    if job is not None and not fresh and job.completed_count + job.failed_count == rows:
        return job
    if job is not None:
        print(f"deleting the previous {name} job ...")
        with connection.cursor() as cur:
            cur.execute(f"DELETE FROM {Rollout._meta.db_table} WHERE job_id = %s", [job.pk])
        job.delete()
    now = timezone.now()
    job = CollectionJob.objects.create(owner=user, name=name, dataset=ds, endpoint=ep, num_repeats=2,
                                       num_samples_in_parallel=512, state="running", total_rollouts=rows + rows // 10,
                                       started_at=now - timezone.timedelta(hours=1))
    t0 = time.perf_counter()
    table_name = Rollout._meta.db_table
    # Every 50th row failed (http_429 / timeout), rewards 0/1, realistic timings and a NeMo Gym-shaped
    # output row (~600 bytes of JSON) per rollout.
    sql = f"""
    INSERT INTO {table_name} (job_id, task_index, rollout_index, status, failure_class, error, reward, data,
        queue_ms, ttft_ms, generation_ms, verify_ms, wall_ms, input_tokens, output_tokens, attempts,
        weight_version, worker, created_at)
    SELECT %(job)s, g / 2, g %% 2,
        CASE WHEN g %% 50 = 49 THEN 'failed' ELSE 'ok' END,
        CASE WHEN g %% 100 = 49 THEN 'http_429' WHEN g %% 50 = 49 THEN 'timeout' ELSE '' END,
        CASE WHEN g %% 50 = 49 THEN 'gave up after 5 retries' ELSE '' END,
        CASE WHEN g %% 50 = 49 THEN NULL ELSE ((hashint4(g) & 7) < 5)::int::float END,
        jsonb_build_object(
            'responses_create_params', jsonb_build_object('input', jsonb_build_array(
                jsonb_build_object('role', 'system', 'content', 'Solve the problem. Put the final answer in \\boxed{{}}.'),
                jsonb_build_object('role', 'user', 'content', 'What is ' || (g / 2) || ' + 1?'))),
            'question', 'What is ' || (g / 2) || ' + 1?', 'expected_answer', ((g / 2) + 1)::text,
            'response', jsonb_build_object('id', 'resp_' || g, 'status', 'completed',
                'output', jsonb_build_array(jsonb_build_object('type', 'message', 'role', 'assistant',
                    'content', jsonb_build_array(jsonb_build_object('type', 'output_text',
                        'text', repeat('Let me add the numbers step by step. ', 6) || 'The answer is \\boxed{{' || ((g / 2) + 1) || '}}.')))),
                'usage', jsonb_build_object('input_tokens', 31, 'output_tokens', 48, 'total_tokens', 79)),
            'reward', ((hashint4(g) & 7) < 5)::int, 'extracted_answer', ((g / 2) + 1)::text,
            '_ng_task_index', g / 2, '_ng_rollout_index', g %% 2),
        (hashint4(g) & 15)::float, 40 + (hashint4(g + 1) & 127), 200 + (hashint4(g + 2) & 1023), 1 + (hashint4(g + 3) & 7),
        250 + (hashint4(g + 4) & 2047), 31, 48, 1, 'v1', 'bench-worker', now() - make_interval(secs => (%(rows)s - g) * 0.0036)
    FROM generate_series(0, %(rows)s - 1) AS g
    """
    print(f"loading {rows:,} rollouts with INSERT ... SELECT generate_series ...", flush=True)
    with connection.cursor() as cur:
        cur.execute("CREATE OR REPLACE FUNCTION hashint4(int) RETURNS int LANGUAGE sql IMMUTABLE AS "
                    "$$ SELECT ((($1::bigint * 2654435761) % 4294967296) >> 8)::int $$")
        cur.execute(sql, {"job": job.pk, "rows": rows})
        cur.execute(f"ANALYZE {table_name}")
    n_failed = sum(1 for g in range(rows) if g % 50 == 49)
    job.completed_count, job.failed_count = rows - n_failed, n_failed
    job.save(update_fields=["completed_count", "failed_count"])
    # an hour of metric samples at 1/s
    JobMetricSample.objects.filter(job=job).delete()
    JobMetricSample.objects.bulk_create(
        (JobMetricSample(job=job, worker="bench-worker", t=now - timezone.timedelta(seconds=3600 - k), elapsed_s=k,
                         completed=k * 270, samples_per_s=270 + (k % 17), output_tokens_per_s=13000 + 10 * (k % 31),
                         in_flight=480 + (k % 32), parallelism=512, errors={"http_429": k % 3} if k % 3 else {})
         for k in range(3600)), batch_size=1000)
    print(f"loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    return job


def time_requests(client, url, n, cold=False):
    from django.core.cache import cache

    times = []
    client.get(url)  # warm
    for _ in range(n):
        if cold:
            cache.clear()
        t0 = time.perf_counter()
        resp = client.get(url)
        times.append((time.perf_counter() - t0) * 1000)
        assert resp.status_code == 200, (url, resp.status_code)
    return times


def bench_pages(args):
    from django.db import connection
    from django.test import Client

    from controlplane.jobs.models import Rollout

    user, ds, ep = fixtures()
    job = load_million(user, ds, ep, args.rows, args.fresh)
    n = job.done_count
    print(f"job {job.pk}: {n:,} rollouts in the job; {Rollout.objects.count():,} in the table", flush=True)
    c = Client()
    c.force_login(user)
    # Cursors for page 1,000 (50 per page): found once with OFFSET, only to build the URLs.
    size = 50
    page = args.page
    after_plain = Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True)[(page - 1) * size - 1]
    after_reward = (Rollout.objects.filter(job=job, reward__gte=0.5).order_by("id")
                    .values_list("id", flat=True)[(page - 1) * size - 1])
    mid = Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True)[n // 2]
    base = f"/jobs/{job.pk}/rollouts/"
    if args.proposed_index:
        with connection.cursor() as cur:
            cur.execute(f"CREATE INDEX IF NOT EXISTS bench_rollout_job_status_fc ON {Rollout._meta.db_table} "
                        "(job_id, status, failure_class)")
            cur.execute(f"VACUUM ANALYZE {Rollout._meta.db_table}")
        print("with the proposed index on (job, status, failure_class)")
    else:
        with connection.cursor() as cur:
            cur.execute("DROP INDEX IF EXISTS bench_rollout_job_status_fc")
    from controlplane.dashboard import panels

    all_panels = list(panels.JOB_PANELS)
    own = [p for p in all_panels if p.template.startswith("dashboard/")]
    others = [p.name for p in all_panels if p not in own]
    rows = []
    if others:
        # Panels registered by other apps are timed apart: the dashboard's own page first.
        panels.JOB_PANELS[:] = own
        for label, cold in (("job page, dashboard panels, cold cache", True), ("job page, dashboard panels", False)):
            t = time_requests(c, f"/jobs/{job.pk}/", args.repeat, cold=cold)
            rows.append((label, f"{statistics.median(t):.1f}", f"{pct(t, 95):.1f}", f"{max(t):.1f}",
                         "yes" if pct(t, 95) < 150 else "NO"))
        panels.JOB_PANELS[:] = all_panels
        print(f"panels registered by other apps: {', '.join(others)} (timed in the rows marked 'all panels')")
    sfx = " (all panels)" if others else ""
    cases = [
        (f"job page{sfx}, cold cache", f"/jobs/{job.pk}/", True),
        (f"job page{sfx}", f"/jobs/{job.pk}/"),
        ("job state JSON (+series)", f"/jobs/{job.pk}/state.json?series=1"),
        ("rollouts page 1", base),
        (f"rollouts page {page:,} (keyset)", f"{base}?after={after_plain}&page={page}"),
        ("rollouts reward>=0.5 page 1", f"{base}?reward_min=0.5"),
        (f"rollouts reward>=0.5 page {page:,}", f"{base}?reward_min=0.5&after={after_reward}&page={page}"),
        ("rollouts failed, page 1", f"{base}?status=failed"),
        ("rollouts wall 1000-1500 ms, page 1", f"{base}?latency_min=1000&latency_max=1500"),
        ("rollout detail (middle row)", f"/rollouts/{mid}/"),
        ("overview", "/"),
    ]
    for label, url, *cold in cases:
        t = time_requests(c, url, args.repeat, cold=bool(cold))
        ok = "yes" if pct(t, 95) < 150 else "NO"
        rows.append((label, f"{statistics.median(t):.1f}", f"{pct(t, 95):.1f}", f"{max(t):.1f}", ok))
    table(f"(b) response time, Django stack in-process, {n:,} rollouts in the job, {args.repeat} requests each (ms)",
          ["page", "p50", "p95", "max", "<150 ms"], rows)

    # Side by side: the SQL of page 1,000 as keyset vs OFFSET.
    t_name = Rollout._meta.db_table

    def sql_ms(sql, params, k=args.repeat):
        out = []
        with connection.cursor() as cur:
            for _ in range(k):
                t0 = time.perf_counter()
                cur.execute(sql, params)
                cur.fetchall()
                out.append((time.perf_counter() - t0) * 1000)
        return statistics.median(out)

    cols = "id, task_index, rollout_index, status, failure_class, reward, wall_ms, ttft_ms, output_tokens, attempts, created_at"
    k1 = sql_ms(f"SELECT {cols} FROM {t_name} WHERE job_id=%s AND id > %s ORDER BY id LIMIT 51", [job.pk, after_plain])
    o1 = sql_ms(f"SELECT {cols} FROM {t_name} WHERE job_id=%s ORDER BY id LIMIT 51 OFFSET %s", [job.pk, (page - 1) * size])
    deep = n // size
    after_deep = Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True)[(deep - 1) * size - 1]
    k2 = sql_ms(f"SELECT {cols} FROM {t_name} WHERE job_id=%s AND id > %s ORDER BY id LIMIT 51", [job.pk, after_deep])
    o2 = sql_ms(f"SELECT {cols} FROM {t_name} WHERE job_id=%s ORDER BY id LIMIT 51 OFFSET %s", [job.pk, (deep - 1) * size])
    table("(b') the rollout page's query, median ms: keyset vs OFFSET",
          ["page", "keyset", "OFFSET", "OFFSET/keyset"],
          [(f"{page:,}", f"{k1:.2f}", f"{o1:.2f}", f"{o1 / k1:.0f}x"),
           (f"{deep:,} (last)", f"{k2:.2f}", f"{o2:.2f}", f"{o2 / k2:.0f}x")])


# ------------------------------------------------------------------------------------------------
# (a) live latency
# ------------------------------------------------------------------------------------------------
LATENCY_HOOK = """
window.__lat = []; window.__latFrame = [];
document.addEventListener("dashboard:progress-applied", (e) => {
  const d = e.detail;
  if (!d.bench) return;
  window.__lat.push(Date.now() / 1000 - d.t);
  requestAnimationFrame(() => window.__latFrame.push(Date.now() / 1000 - d.t));
});
"""


def live_job(user, ds, ep):
    from django.utils import timezone

    from controlplane.jobs.models import CollectionJob, JobMetricSample

    job = CollectionJob.objects.filter(owner=user, name="bench-live").first()
    now = timezone.now()
    if job is None:
        job = CollectionJob.objects.create(owner=user, name="bench-live", dataset=ds, endpoint=ep, state="running",
                                           total_rollouts=1_000_000, num_samples_in_parallel=256,
                                           started_at=now - timezone.timedelta(minutes=5))
    JobMetricSample.objects.filter(job=job).delete()
    JobMetricSample.objects.bulk_create(
        JobMetricSample(job=job, worker="w", t=now - timezone.timedelta(seconds=300 - k), samples_per_s=200 + k % 9,
                        output_tokens_per_s=9000 + k, in_flight=250, parallelism=256) for k in range(300))
    job.state, job.completed_count, job.failed_count = "running", 0, 0
    job.save()
    return job


async def publish_events(job_id, n_events, rate, start_done=0):
    from channels.layers import get_channel_layer

    from controlplane.jobs.events import job_group

    layer = get_channel_layer()
    group = job_group(job_id)
    done = start_done
    interval = 1.0 / rate
    next_at = time.monotonic()
    for i in range(n_events):
        done += 50
        msg = {"type": "job.progress", "job_id": job_id, "state": "running", "total": 1_000_000, "completed": done,
               "failed": 0, "done": done, "in_flight": 250, "parallelism": 256, "samples_per_s": 200.0 + i % 7,
               "output_tokens_per_s": 9000.0 + i, "eta_s": (1_000_000 - done) / 200.0,
               "errors": {"http_429": i % 3}, "stalled": False, "bench": True}
        msg["t"] = time.time()
        await layer.group_send(group, msg)
        next_at += interval
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))


def bench_live_pages(args, job, url, cookie):
    from playwright.sync_api import sync_playwright

    sys.path.insert(0, str(REPO))
    from tests.dashboard.servers import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            pages = []
            for _ in range(args.dashboards):
                # one context (window) per dashboard: each page is a foreground page that paints, as
                # on ten users' screens (tabs of one window would be throttled in the background)
                ctx = browser.new_context(viewport={"width": 1280, "height": 900})
                ctx.add_cookies([{"name": "sessionid", "value": cookie, "url": url}])
                ctx.add_init_script(LATENCY_HOOK)
                pg = ctx.new_page()
                pg.goto(f"{url}/jobs/{job.pk}/")
                pages.append(pg)
            for pg in pages:
                pg.wait_for_selector("#live-status.live", timeout=30000)
            time.sleep(1.0)  # subscriptions settle
            # Playwright's sync API owns this thread's event loop: publish from another thread, while
            # this one keeps the pages' connections serviced.
            import threading

            pub = threading.Thread(target=lambda: asyncio.run(publish_events(job.pk, args.events, args.rate)))
            pub.start()
            while pub.is_alive():
                pages[0].wait_for_timeout(200)
            pages[0].wait_for_timeout(1500)
            lat, frame, per_page = [], [], []
            if args.verbose:
                for i, pg in enumerate(pages):
                    b = sorted(x * 1000 for x in pg.evaluate("window.__latFrame"))
                    print(f"  page {i}: next-frame p50 {pct(b, 50):.0f} ms, max {max(b or [0]):.0f} ms, "
                          f"visibility {pg.evaluate('document.visibilityState')}")
            for pg in pages:
                a = [x * 1000 for x in pg.evaluate("window.__lat")]
                b = [x * 1000 for x in pg.evaluate("window.__latFrame")]
                lat += a
                frame += b
                per_page.append(len(a))
            return lat, frame, per_page
        finally:
            browser.close()


def bench_live_ws(args, job, url, cookie):
    import aiohttp

    async def run():
        lat = []
        counts = []
        ws_url = url.replace("http://", "ws://") + f"/ws/jobs/{job.pk}/"
        headers = {"Cookie": f"sessionid={cookie}", "Origin": url}
        async with aiohttp.ClientSession() as s:
            socks = [await s.ws_connect(ws_url, headers=headers) for _ in range(args.dashboards)]

            async def reader(ws):
                got = 0
                async for m in ws:
                    d = json.loads(m.data)
                    if d.get("bench"):
                        lat.append((time.time() - d["t"]) * 1000)
                        got += 1
                        if got >= args.events:
                            break
                counts.append(got)

            tasks = [asyncio.create_task(reader(w)) for w in socks]
            await asyncio.sleep(1.0)
            await publish_events(job.pk, args.events, args.rate)
            await asyncio.wait(tasks, timeout=5)
            for w in socks:
                await w.close()
        return lat, counts

    lat, counts = asyncio.run(run())
    return lat, [], counts


def bench_live(args):
    sys.path.insert(0, str(REPO))
    from tests.dashboard import servers

    user, ds, ep = fixtures()
    job = live_job(user, ds, ep)
    cookie = session_cookie(user)
    servers.ensure_frontend()
    env = servers.child_env(os.environ["DATABASE_URL"], os.environ["REDIS_URL"])
    daphne, url = servers.start_daphne(env)
    try:
        if args.clients == "pages":
            lat, frame, per = bench_live_pages(args, job, url, cookie)
        else:
            lat, frame, per = bench_live_ws(args, job, url, cookie)
    finally:
        daphne.stop()
    expected = args.events * args.dashboards
    rows = []
    first = "DOM applied" if args.clients == "pages" else "message received"
    for label, vals in ((first, lat), ("next frame", frame)):
        if vals:
            rows.append((label, len(vals), f"{statistics.median(vals):.1f}", f"{pct(vals, 95):.1f}", f"{pct(vals, 99):.1f}",
                         f"{max(vals):.1f}", "yes" if pct(vals, 95) < 250 else "NO"))
    what = "browser pages (Chromium)" if args.clients == "pages" else "WebSocket clients (aiohttp)"
    table(f"(a) live latency, sink-style group_send -> daphne -> JobConsumer -> {args.dashboards} {what} on one job; "
          f"{args.events} events at {args.rate}/s; received {len(lat)}/{expected} (ms)",
          ["measured at", "n", "p50", "p95", "p99", "max", "p95<250"], rows)
    if len(lat) < expected:
        print(f"  per-dashboard counts: {per}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["live", "pages"], default=None)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--fresh", action="store_true", help="reload the rollouts even when present")
    ap.add_argument("--page", type=int, default=1000)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--dashboards", type=int, default=10)
    ap.add_argument("--events", type=int, default=80)
    ap.add_argument("--rate", type=float, default=4.0, help="events/s (the sink publishes at most JOBS_PROGRESS_MAX_PER_S=4)")
    ap.add_argument("--clients", choices=["pages", "ws"], default="pages")
    ap.add_argument("--redis-db", type=int, default=12)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--proposed-index", action="store_true",
                    help="add an index on rollouts (job, status, failure_class) in the bench database first")
    args = ap.parse_args()

    base = os.environ.get("DATABASE_URL", DEFAULT_DB)
    if not base.startswith("postgres"):
        sys.exit("bench_dashboard needs PostgreSQL: set DATABASE_URL=postgres://...")
    db_url = bench_database_url(base)
    redis_base = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0").rsplit("/", 1)[0]
    ensure_database(db_url)
    setup_django(db_url, f"{redis_base}/{args.redis_db}")
    print(f"database {db_url.rsplit('/', 1)[1]}, {os.cpu_count()} CPUs (shared), "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.only in (None, "live"):
        bench_live(args)
    if args.only in (None, "pages"):
        bench_pages(args)


if __name__ == "__main__":
    main()
