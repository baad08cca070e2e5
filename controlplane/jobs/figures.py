"""A job's figures, each defined once and computed from what is stored, for every place that shows one
(the job page and its live stream, the API, the CLI, the workers panel, History, Compare and the
diagnosis's evidence):

- rollouts stored: the job's rows (ok / failed). The job's counters are bumped in the same transaction as
  the rows they count (jobs.sink), so they are the stored rows; per worker, the rows each worker stored.
- running time: the job's wall time while it ran, pauses and queue waits excluded. Every chunk run writes a
  metric sample about once a second; the seconds covered by samples of runs with requests in flight are
  running time, a gap longer than GAP_S (no run of the job at work: paused, queued, cancelled, starting up)
  is not. A stretch begins before its first sample by the time that sample's run had been at work (its
  extra["busy_s"]: since the run's first request, or its first after an idle tick; however late the tick
  came), never more than the silence before it. Runs that overlap (several chunks or workers at once)
  count once; runs one after another, or before and after a resume, add up. (The same time the stored rows
  show: from the first request of a stretch to its last row.)
- average rate: rollouts stored / running time.
- recent rate: rollouts stored in the last RATE_WINDOW_S / the running time inside that window (at least
  MIN_SPAN_S, so the first batch of a run, or the first after a resume, is no spike).
- tokens stored: the input and output tokens of the job's stored rows (ok and failed: a failed row's tokens,
  when the server reported them, were spent too); tokens/s and output tokens/s: those over the running time.

Nothing here sums one run's rate with another's: rates are counts over time, the counts from stored rows.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from datetime import timedelta

from django.db import connection
from django.db.models import Count, Q, Sum
from django.db.models.fields.json import KeyTransform
from django.utils import timezone

from .models import JobMetricSample, Rollout

RATE_WINDOW_S = 10.0  # the recent rate's window
GAP_S = 5.0  # no sample of any run at work for longer than this: the job was not running
LEAD_IN_S = 0.5  # samples without busy_s (older workers): a stretch starts at most this long before its first
MIN_SPAN_S = 3.0  # a recent rate is never divided by less (a run's first batch is not a spike)


@dataclass
class RecentRate:
    ok_per_s: float = 0.0
    done_per_s: float = 0.0  # ok + failed: the ETA's rate
    output_tokens_per_s: float = 0.0
    span_s: float = 0.0  # running time inside the window the counts are divided by (0: nothing ran)


def stored_counts(job) -> tuple[int, int]:
    """(ok, failed) rows stored for the job (its counters, bumped with the rows they count)."""
    return job.completed_count, job.failed_count


def stored_counts_by_worker(job_id) -> dict[str, int]:
    """{worker name as the rows carry it: rows stored}."""
    return dict(Rollout.objects.filter(job_id=job_id).values_list("worker").annotate(n=Count("id")).order_by())


def _lead_in(elapsed, busy, gap) -> float:
    """The running seconds before a stretch's first sample: its run's busy_s (elapsed_s, at most LEAD_IN_S, for
    a sample without it), no more than the silence `gap` before it (None: the job's first sample)."""
    lead = busy if isinstance(busy, (int, float)) else min(elapsed or 0.0, LEAD_IN_S)
    return min(max(lead, 0.0), gap if gap is not None else lead)


def _span(stamps: list[tuple], lo=None, hi=None) -> float:
    """Running seconds covered by samples [(t, elapsed_s, busy_s)] sorted by t: gaps up to GAP_S count, and each
    stretch starts its _lead_in before its first sample; clipped to [lo, hi]."""
    total = 0.0
    prev = None
    for t, elapsed, busy in stamps:
        gap = (t - prev).total_seconds() if prev is not None else None
        if gap is not None and gap <= GAP_S:
            start = prev
        else:  # a run's first sample, or one after a long silence: what it ran before it, within the silence
            start = t - timedelta(seconds=_lead_in(elapsed, busy, gap))
        if lo is not None:
            start = max(start, lo)
        end = t if hi is None else min(t, hi)
        if end > start:
            total += (end - start).total_seconds()
        prev = t
    return total


def _stamps(qs) -> list[tuple]:
    """[(t, elapsed_s, busy_s)] of the samples with requests in flight, by time (_span's input).
    busy_s is read through an annotation, not values_list("extra__busy_s"): Django resolves that name by trying
    "extra__busy_s" as a field first, and the FieldError it catches keeps its traceback in a reference cycle
    (~230 objects). A chunk run reads this every progress tick (live_figures): cyclic garbage that waited for a
    full collection, fragmenting the worker's heap, whose RSS grew ~4 MB per 100k rollouts."""
    return list(qs.filter(in_flight__gt=0).annotate(_busy_s=KeyTransform("busy_s", "extra")).order_by("t")
                .values_list("t", "elapsed_s", "_busy_s"))


# _lead_in in SQL: d, the gap before the sample (NULL: none); e, its elapsed_s; b, its extra's busy_s
_SECONDS_SQL = (f"CASE WHEN d IS NOT NULL AND d <= {GAP_S} THEN d ELSE least(greatest(coalesce(b, least(coalesce(e, 0), "
                f"{LEAD_IN_S})), 0), coalesce(d, 1e12)) END")
# busy_s, read for a stretch's first sample only (the window's gap clause is spliced in)
_BUSY_SQL = ("CASE WHEN {lag} IS NULL OR t - {lag} > interval '%s seconds' THEN "
             "CASE WHEN jsonb_typeof(extra->'busy_s') = 'number' THEN (extra->>'busy_s')::float8 END END" % GAP_S)


PREFIX_STEP_S = 300  # the running time before a cut this old is cached: older samples never change


def _running_sql(job_id, lo, frm, to) -> tuple[int, float]:
    """(samples, running seconds) of the samples with frm < t <= to, each measured from the sample before
    it (found among those after lo): up to GAP_S apart, the gap counts; else its _lead_in."""
    table = JobMetricSample._meta.db_table
    lag = "lag(t) OVER (ORDER BY t)"
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT count(*), coalesce(sum({_SECONDS_SQL}), 0) FROM ("
            f"  SELECT t, extract(epoch FROM t - {lag}) AS d, elapsed_s AS e, {_BUSY_SQL.format(lag=lag)} AS b"
            f"  FROM {table} WHERE job_id = %s AND t > %s AND in_flight > 0) s WHERE t > %s AND t <= %s",
            [job_id, lo, frm, to])
        n, total = cur.fetchone()
    return int(n), float(total)


def running_seconds(job, now=None) -> float | None:
    """The job's running time (pauses and queue waits excluded); a job no run wrote a sample for: its wall
    time from start to end (or now), None before it started.
    The part before a cut (a multiple of PREFIX_STEP_S, older than any sample still to come) is cached, so
    a long job's figure costs a scan of its last minutes."""
    found = _sampled_seconds(job, now)
    if found is not None:
        return found
    started = getattr(job, "started_at", None)
    if not started:
        return None
    return max(((getattr(job, "finished_at", None) or now or timezone.now()) - started).total_seconds(), 0.0)


def _sampled_seconds(job, now=None) -> float | None:
    if connection.vendor != "postgresql":
        stamps = _stamps(JobMetricSample.objects.filter(job_id=job.pk))
        return _span(stamps) if stamps else None
    from datetime import datetime, timezone as tz

    from django.core.cache import cache

    now = now or timezone.now()
    cut_epoch = int((now.timestamp() - 2 * GAP_S) // PREFIX_STEP_S * PREFIX_STEP_S)
    cut = datetime.fromtimestamp(cut_epoch, tz.utc)
    floor = datetime.fromtimestamp(0, tz.utc)
    key = f"jobs:running_s:2:{job.pk}:{cut_epoch}"  # 2: lead-ins from busy_s
    running = str(getattr(job, "state", "")) == "running"  # the hot path (every progress message of a run)
    prefix = cache.get(key) if running else None
    if prefix is None:
        prefix = _running_sql(job.pk, floor, floor, cut)
        if running:
            cache.set(key, prefix, PREFIX_STEP_S * 2)
    tail = _running_sql(job.pk, cut - timedelta(seconds=PREFIX_STEP_S), cut, now + timedelta(days=1))
    n = prefix[0] + tail[0]
    return prefix[1] + tail[1] if n else None


def running_seconds_many(jobs) -> dict[int, float]:
    """{job id: running time} for many jobs in one query (History); jobs never started left out."""
    ids = [j.pk for j in jobs]
    if not ids:
        return {}
    if connection.vendor != "postgresql":
        return {j.pk: r for j in jobs if (r := running_seconds(j)) is not None}
    table = JobMetricSample._meta.db_table
    lag = "lag(t) OVER (PARTITION BY job_id ORDER BY t)"
    with connection.cursor() as cur:
        cur.execute(
            f"SELECT job_id, sum({_SECONDS_SQL}) FROM ("
            f"  SELECT job_id, t, extract(epoch FROM t - {lag}) AS d, elapsed_s AS e, {_BUSY_SQL.format(lag=lag)} AS b"
            f"  FROM {table} WHERE job_id = ANY(%s) AND in_flight > 0) s GROUP BY job_id",
            [ids])
        found = {jid: float(total) for jid, total in cur.fetchall()}
    now = timezone.now()
    for j in jobs:  # no samples: the wall time from start to end
        if j.pk not in found and j.started_at:
            found[j.pk] = max(((j.finished_at or now) - j.started_at).total_seconds(), 0.0)
    return found


def average_rate(job, running_s: float | None = None) -> float | None:
    """Rollouts stored (ok + failed) per second of running time."""
    running_s = running_seconds(job) if running_s is None else running_s
    if not running_s:
        return None
    ok, failed = stored_counts(job)
    return (ok + failed) / running_s


def recent_rate(job_id, now=None) -> RecentRate:
    """Rollouts stored in the last RATE_WINDOW_S over the running time in that window."""
    now = now or timezone.now()
    span = _recent_span(job_id, now)
    if span <= 0:
        return RecentRate()
    since = now - timedelta(seconds=RATE_WINDOW_S)
    agg = Rollout.objects.filter(job_id=job_id, created_at__gt=since, created_at__lte=now).aggregate(
        done=Count("id"), ok=Count("id", filter=Q(status=Rollout.Status.OK)), tokens=Sum("output_tokens"))
    div = max(span, MIN_SPAN_S)
    return RecentRate(ok_per_s=agg["ok"] / div, done_per_s=agg["done"] / div,
                      output_tokens_per_s=(agg["tokens"] or 0) / div, span_s=span)


def recent_rate_by_worker(job_id, now=None) -> dict[str, float]:
    """{worker name as the rows carry it: rollouts it stored per second over the recent window} (the
    recent rate, split by the worker that stored each row)."""
    now = now or timezone.now()
    span = _recent_span(job_id, now)
    if span <= 0:
        return {}
    since = now - timedelta(seconds=RATE_WINDOW_S)
    rows = (Rollout.objects.filter(job_id=job_id, created_at__gt=since, created_at__lte=now)
            .values_list("worker").annotate(n=Count("id")).order_by())
    return {w: n / max(span, MIN_SPAN_S) for w, n in rows}


def _recent_span(job_id, now) -> float:
    """Running seconds of the job inside the recent window ending at `now`."""
    since = now - timedelta(seconds=RATE_WINDOW_S)
    stamps = _stamps(JobMetricSample.objects.filter(job_id=job_id, t__gt=since - timedelta(seconds=GAP_S), t__lte=now))
    span = _span(stamps, lo=since, hi=now)
    if stamps and (now - stamps[-1][0]).total_seconds() <= GAP_S:
        span += (now - stamps[-1][0]).total_seconds()  # still running since its last sample
    return min(span, RATE_WINDOW_S)


TOKENS_CACHE_S = 3600  # a job's token sums, keyed by its stored-row count: new rows make a new key


def stored_tokens(job) -> tuple[int, int]:
    """(input, output) tokens of the job's stored rows. Cached under the job's stored-row count (its
    counters move with its rows), so a finished job's sums are read once."""
    from django.core.cache import cache

    ok, failed = stored_counts(job)
    key = f"jobs:tokens:{job.pk}:{ok + failed}"
    found = cache.get(key)
    if found is None:
        agg = Rollout.objects.filter(job_id=job.pk).aggregate(i=Sum("input_tokens"), o=Sum("output_tokens"))
        found = (int(agg["i"] or 0), int(agg["o"] or 0))
        cache.set(key, found, TOKENS_CACHE_S)
    return found


def stored_tokens_many(job_ids) -> dict[int, tuple[int, int]]:
    """{job id: (input, output) tokens stored} for many jobs in one query (History)."""
    rows = (Rollout.objects.filter(job_id__in=list(job_ids)).values("job_id")
            .annotate(i=Sum("input_tokens"), o=Sum("output_tokens")).values_list("job_id", "i", "o").order_by())
    return {jid: (int(i or 0), int(o or 0)) for jid, i, o in rows}


def token_rates(tokens: tuple[int, int], running_s: float | None) -> tuple[float | None, float | None]:
    """(total tokens/s, output tokens/s): stored tokens over running time (None before it ran)."""
    if not running_s:
        return None, None
    inp, out = tokens
    return (inp + out) / running_s, out / running_s


def history_figures(jobs) -> dict[int, dict]:
    """{job id: {running_s, rollouts_per_s, tokens_per_s, output_tokens_per_s, input_tokens, output_tokens}}
    for many jobs (History on the page, in its CSV and over the API): the figures above, two queries in all."""
    running = running_seconds_many(jobs)
    tokens = stored_tokens_many(j.pk for j in jobs)
    out = {}
    for j in jobs:
        el = running.get(j.pk)
        tok = tokens.get(j.pk, (0, 0))
        total_ps, output_ps = token_rates(tok, el)
        out[j.pk] = {"running_s": el, "rollouts_per_s": average_rate(j, el) if el else None,
                     "tokens_per_s": total_ps, "output_tokens_per_s": output_ps,
                     "input_tokens": tok[0], "output_tokens": tok[1]}
    return out


def _r3(x):
    return round(x, 3) if x is not None else None


def job_figures(job, now=None) -> dict:
    """Every figure of a job in one dict (the API's and the CLI's `figures`)."""
    ok, failed = stored_counts(job)
    running_s = running_seconds(job)
    recent = recent_rate(job.pk, now) if str(job.state) == "running" else RecentRate()
    tokens = stored_tokens(job)
    tokens_ps, output_ps = token_rates(tokens, running_s)
    return {
        "rollouts_stored": ok + failed, "ok": ok, "failed": failed,
        "running_s": round(running_s, 3) if running_s is not None else None,
        "average_rollouts_per_s": round(average_rate(job, running_s), 3) if running_s else None,
        "recent_rollouts_per_s": round(recent.ok_per_s, 3),
        "recent_window_s": RATE_WINDOW_S,
        "recent_output_tokens_per_s": round(recent.output_tokens_per_s, 3),
        "input_tokens": tokens[0], "output_tokens": tokens[1],
        "average_tokens_per_s": _r3(tokens_ps), "average_output_tokens_per_s": _r3(output_ps),
    }


def rate_series(job_id, secs: list[int], working: set[int] | None = None) -> tuple[list[float], list[float]]:
    """The recent rate (ok/s) and output tokens/s at each of `secs` (unix seconds, ascending, the seconds a
    run of the job wrote a sample; `working`: those with requests in flight, all when None): stored rows in
    the RATE_WINDOW_S before each, over the running seconds among them (at least MIN_SPAN_S) - the live
    row's figure, point by point."""
    if not secs:
        return [], []
    lo = secs[0] - int(RATE_WINDOW_S)
    per_sec: dict[int, list] = {}
    if connection.vendor == "postgresql":
        table = Rollout._meta.db_table
        with connection.cursor() as cur:
            cur.execute(
                f"SELECT floor(extract(epoch FROM created_at))::bigint AS sec, count(*) FILTER (WHERE status = 'ok'), "
                f"coalesce(sum(output_tokens), 0) FROM {table} WHERE job_id = %s AND created_at >= to_timestamp(%s) "
                f"GROUP BY sec", [job_id, lo])
            for sec, ok, tok in cur.fetchall():
                per_sec[int(sec)] = [ok, float(tok)]
    else:
        from datetime import datetime, timezone as tz

        for created, status, tok in Rollout.objects.filter(
                job_id=job_id, created_at__gte=datetime.fromtimestamp(lo, tz.utc)).values_list(
                "created_at", "status", "output_tokens"):
            b = per_sec.setdefault(int(created.timestamp()), [0, 0.0])
            b[0] += status == Rollout.Status.OK
            b[1] += tok or 0
    work = sorted(set(secs) if working is None else working)
    active = set(work)  # a second between two samples of a stretch ran too (samples come about once a second)
    for a, b in zip(work, work[1:]):
        if b - a <= GAP_S:
            active.update(range(a + 1, b))
    # and a second that stored rows within GAP_S after one with requests in flight: the run's last answers are
    # written after its last sample saw them in flight (batched writes, seconds late on a loaded machine); not
    # counting that second made the chart's last point of a finished job 13 % over what the rows say
    for x in per_sec:
        i = bisect.bisect_right(work, x) - 1
        if i >= 0 and x - work[i] <= GAP_S:
            active.add(x)
    window = int(RATE_WINDOW_S)
    rates, tokens = [], []
    for s in secs:
        ok = tok = 0.0
        running = 0
        for x in range(s - window + 1, s + 1):
            b = per_sec.get(x)
            if b:
                ok += b[0]
                tok += b[1]
            running += x in active
        div = max(running, MIN_SPAN_S)
        rates.append(round(ok / div, 3))
        tokens.append(round(tok / div, 3))
    return rates, tokens
