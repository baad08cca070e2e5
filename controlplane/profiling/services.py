"""Profiling of jobs: switching it on and off, storing the workers' snapshots, merging them into one job
profile and computing the profiling guide's red flags (`comparison` sets two jobs' profiles against each
other; `exports` writes pstats / callgrind files and the flame graph's tree). Views, the management command
and the worker hook call these."""
from __future__ import annotations

import logging
import os
import re
import socket
from datetime import datetime, timedelta, timezone as dt_timezone

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from controlplane import operator as knobs
from controlplane.jobs.models import CollectionJob, JobState
from controlplane.limits import url_problem
from workers.engine.verify_pool import SHARED_VERIFY_POOL
from workers.profiling.control import ProfilingControl, ProfilingSink
from workers.profiling.core import FuncRow, ProfileConfig, merge_rows
from workers.profiling.nemo_gym import ServerPuller, StatsPuller, log_path_problem

from .models import ProfileRow, ProfileSession, ProfileSnapshot
from .scope import deployment_servers, stats_url_problem  # callers (dropin, tests) import them from here too

logger = logging.getLogger(__name__)

MAX_SECONDS = 24 * 3600
MIN_SAMPLE = 30  # profiled verifications below which a comparison warns that its scaled figures are rough
# frames of the product itself (the pool's batch loop, the profiler, the verifier registry): never flagged
HARNESS = ("workers/profiling/", "workers/engine/runner.py", "workers/engine/feed.py", "workers/engine/attempt.py",
           "workers/verifiers/base.py", "concurrent/futures/", "multiprocessing/", "threading.py")
IDLE = {("select", "epoll.poll"), ("select", "poll"), ("_thread", "lock.acquire"), ("selectors", "select")}
EXTERNAL_MODULE = re.compile(r"(^|[/\\._])(socket|ssl|subprocess|requests|urllib3?|http[/\\.]client|httpx|aiohttp)"
                             r"([/\\._]|$)")


class ProfilingError(ValueError):
    pass


class ProfilingForbidden(ProfilingError):
    """A user asked for what only staff may (whole-worker profiling)."""


# ----------------------------------------------------------------------------------- on / off
def start(job, *, seconds=None, scope="verify", clock="wall", budget_pct=2.0, window_s=5.0, stats_urls=None,
          user=None) -> ProfileSession:
    """Switch profiling on for a job (queued or running); any session still on for it ends first. `user`: who
    asks (None: the operator's manage.py); scope "worker" shows every tenant's calls in a worker: staff only."""
    if scope == "worker" and user is not None and not knobs.may_profile_worker(user):
        raise ProfilingForbidden(knobs.WORKER_SCOPE_REFUSED)
    try:
        ProfileConfig(session="check", scope=scope, clock=clock)
    except ValueError as exc:
        raise ProfilingError(str(exc)) from None
    if seconds is not None:
        seconds = float(seconds)
        if not 1 <= seconds <= MAX_SECONDS:
            raise ProfilingError(f"seconds must be between 1 and {MAX_SECONDS}")
    if not 0.1 <= float(budget_pct) <= 100:
        raise ProfilingError("budget_pct must be between 0.1 and 100")
    if not 1 <= float(window_s) <= 600:
        raise ProfilingError("window_s must be between 1 and 600")
    urls = [u if isinstance(u, dict) else {"url": u} for u in (stats_urls or [])]
    allowed = deployment_servers(job) if urls else set()
    for u in urls:  # NeMo Gym servers: {"url": "http://host:port/stats", "log": "<results dir>/<server>.log"}
        if not isinstance(u.get("url"), str) or not re.match(r"^https?://", u["url"]):
            raise ProfilingError(f"stats_urls: {u.get('url')!r} is not an http(s) URL")
        if why := url_problem(u["url"]):  # the outbound gate's check; it checks again on every pull
            raise ProfilingError(f"stats_urls: {u['url']}: {why}")
        if why := stats_url_problem(u["url"], allowed):  # only the job's own servers (checked again by the puller)
            raise ProfilingError(f"stats_urls: {u['url']}: {why}")
        if u.get("log") and (why := log_path_problem(u["log"], settings.PROFILING_STATS_LOG_DIR)):
            raise ProfilingError(f"stats_urls: log: {why}")
    if job.state not in (JobState.QUEUED, JobState.RUNNING, JobState.PAUSED):
        raise ProfilingError(f"job {job.pk} is {job.state}: profiling applies to a queued, running or paused job")
    now = timezone.now()
    with transaction.atomic():
        stop(job)
        return ProfileSession.objects.create(
            job=job, requested_by=user if getattr(user, "is_authenticated", False) else None, scope=scope,
            clock=clock, budget_pct=float(budget_pct), window_s=float(window_s), seconds=seconds, stats_urls=urls,
            started_at=now, until=now + timedelta(seconds=seconds) if seconds else None)


def profiles_servers(job) -> bool:
    """The job asked for its NeMo Gym servers' own profiles (profile_servers: a NeMo Gym endpoint only)."""
    return bool((job.collection_options or {}).get("profile_servers")) and job.endpoint.is_nemo_gym


def start_with_job(job) -> ProfileSession | None:
    """A job created with profiling_enabled: its first run opens a session that lasts until it is switched off
    (once per job: a resumed job or its other chunks find it)."""
    with transaction.atomic():
        CollectionJob.objects.select_for_update().filter(pk=job.pk).first()  # one chunk at a time decides
        if ProfileSession.objects.filter(job=job).exists():
            return None
        return ProfileSession.objects.create(job=job, requested_by=job.owner)


def stop(job) -> int:
    """Switch profiling off for a job (the workers send their last window). Returns the sessions ended."""
    now = timezone.now()
    return (ProfileSession.objects.filter(job=job, stopped_at__isnull=True)
            .filter(models_q_active(now)).update(stopped_at=now))


def models_q_active(now):
    return Q(until__isnull=True) | Q(until__gt=now)


def active_session(job_id) -> ProfileSession | None:
    now = timezone.now()
    return (ProfileSession.objects.filter(job_id=job_id, stopped_at__isnull=True).filter(models_q_active(now))
            .order_by("-started_at", "-pk").first())


def config_for(session: ProfileSession | None) -> ProfileConfig | None:
    if session is None:
        return None
    return ProfileConfig(session=session.key, scope=session.scope, clock=session.clock,
                         budget_pct=session.budget_pct, window_s=session.window_s)


# ------------------------------------------------------------------------------ worker hook
def profile_run(job, sink, control, *, db, worker_name=""):
    """Wrap a run's (sink, control) so that profiling follows the job's sessions while it runs.
    Never raises: a problem here leaves the run as it was."""
    try:
        job_id = job.pk
        if getattr(job, "profiling_enabled", False):
            start_with_job(job)
        state = {"session": None}
        host = socket.gethostname()

        def read():
            s = active_session(job_id)
            state["session"] = s
            return s

        def source():
            return config_for(db.call(read))

        def emit(snaps):
            db.call(record, job_id, snaps)

        pullers = {}
        # the job's profile_servers: its NeMo Gym deployment's own servers, discovered from the head server
        head = job.endpoint.base_url if profiles_servers(job) else None

        def puller():
            s = state["session"]
            if s is None or not (s.stats_urls or head):
                return None
            p = pullers.get(s.pk)
            if p is None:
                pullers.clear()
                allowed = deployment_servers(job)
                check = lambda url: stats_url_problem(url, allowed)  # noqa: E731
                p = pullers[s.pk] = (StatsPuller(s.stats_urls, session=s.key, window_s=s.window_s,
                                                 log_dir=settings.PROFILING_STATS_LOG_DIR, url_check=check)
                                     if s.stats_urls else ServerPuller(head, s.key, window_s=s.window_s, url_check=check))
            return p

        def pull_stats():
            p = puller()
            return p.poll() if p is not None else []

        def last_pull():  # the run ends: a profile_servers puller pulls once more, whatever the window
            p = puller()
            return p.final() if isinstance(p, ServerPuller) else []

        pull_stats.final = last_pull
        if head is not None and (first := active_session(job_id)) is not None and not first.stats_urls:
            state["session"] = first
            puller().poll(force=True)  # each server's baseline before this run sends anything

        pctl = ProfilingControl(control, source, emit, worker=worker_name or host, extra_sources=[pull_stats],
                                pool=lambda: SHARED_VERIFY_POOL._executor)  # the running executor, never a new one
        return ProfilingSink(sink, pctl), pctl
    except Exception:  # noqa: BLE001
        logger.exception("job %s: could not attach profiling; running without", job.pk)
        return sink, control


def _session_from_key(key: str):
    m = re.match(r"^job(\d+)-p(\d+)$", key or "")
    return ProfileSession.objects.filter(pk=int(m.group(2)), job_id=int(m.group(1))).first() if m else None


def _dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, tz=dt_timezone.utc)


def record(job_id, snaps) -> list[ProfileSnapshot]:
    """Store engine ProfileSnapshot events (one window of one worker each) with their rows."""
    out = []
    for snap in snaps:
        session = _session_from_key(snap.session)
        if session is None or session.job_id != job_id:
            logger.warning("job %s: profiling snapshot for unknown session %s dropped", job_id, snap.session)
            continue
        with transaction.atomic():
            obj = ProfileSnapshot.objects.create(
                session=session, job_id=job_id, worker=str(snap.worker)[:200], source=snap.source[:40],
                window_start=_dt(snap.window_start), window_end=_dt(snap.window_end),
                verifications=int(snap.verifications), profiled=int(snap.profiled), overhead_pct=snap.overhead_pct,
                total_s=sum(max(0.0, r.tsub) for r in snap.rows), final=bool(snap.final))
            ProfileRow.objects.bulk_create([
                ProfileRow(snapshot=obj, module=r.module[:500], line=int(r.line), name=r.name[:300], ncall=r.ncall,
                           tsub=r.tsub, ttot=r.ttot, tavg=r.tavg, children=r.children) for r in snap.rows],
                batch_size=500)
        out.append(obj)
    return out


# ----------------------------------------------------------------------------------- merging
def rows_of(snapshots) -> list[FuncRow]:
    """Several workers' and windows' snapshots merged into one profile (sums per function)."""
    merged: dict = {}
    ids = [s.pk for s in snapshots]
    for r in ProfileRow.objects.filter(snapshot_id__in=ids).iterator(chunk_size=2000):
        merge_rows(merged, [FuncRow(r.module, r.line, r.name, r.ncall, r.tsub, r.ttot, r.tavg, r.children)])
    return sorted(merged.values(), key=lambda r: -r.ttot)


def sample_figures(snaps) -> dict:
    """What a set of snapshots adds up to: merged rows, the verifications behind them, how many were
    profiled, the measured overhead (weighted by verifications), and whether the sample is thin."""
    rows = rows_of(snaps)
    verifications = sum(s.verifications for s in snaps)
    profiled = sum(s.profiled for s in snaps)
    over = [(s.verifications, s.overhead_pct) for s in snaps if s.overhead_pct is not None and s.verifications]
    overhead = (sum(v * o for v, o in over) / sum(v for v, _ in over)) if over else None
    return {"rows": rows, "verifications": verifications, "profiled": profiled,
            "overhead_pct": None if overhead is None else round(overhead, 3),
            "total_s": sum(max(0.0, r.tsub) for r in rows),
            # figures scaled from a handful of verifications: call counts may be far off
            "few_samples": bool(rows) and 0 < profiled < min(MIN_SAMPLE, verifications)}


def job_profile(job, session=None) -> dict:
    """The job's profile: every snapshot of `session` (default: the newest session with snapshots)."""
    sessions = ProfileSession.objects.filter(job=job)
    if session is None:
        session = sessions.filter(snapshots__isnull=False).distinct().order_by("-started_at", "-pk").first()
    snaps = list(ProfileSnapshot.objects.filter(session=session)) if session else []
    fig = sample_figures(snaps)
    rows, verifications, total = fig["rows"], fig["verifications"], fig["total_s"]
    latest = snaps[0] if snaps else None
    current = active_session(job.pk)
    return {
        "job": job.pk,
        "session": _session_payload(session),
        "active": _session_payload(current),
        "snapshots": len(snaps),
        "workers": sorted({s.worker for s in snaps}),
        "window": {"start": min(s.window_start for s in snaps).isoformat(), "end": latest.window_end.isoformat()}
        if snaps else None,
        "latest_window_end": latest.window_end.isoformat() if latest else None,
        "verifications": verifications,
        "profiled": fig["profiled"],
        "few_samples": fig["few_samples"],
        "overhead_pct": fig["overhead_pct"],
        "total_s": total,
        "rows": [row_payload(r, total) for r in rows],
        "red_flags": red_flags(rows, verifications=verifications, job=job),
        "servers": server_profiles(snaps),
    }


SERVER_TOP_ROWS = 20


def server_profiles(snaps) -> list[dict]:
    """Each NeMo Gym server's own profile among the snapshots (seed 003's `<server>.log`, as collect_rollouts
    +profiling_enabled writes it): [{"name", "functions", "total_s", "rows": the top rows by total time}]."""
    from workers.profiling.nemo_gym import server_of

    by_server: dict[str, list] = {}
    for s in snaps:
        if (name := server_of(str(s.worker), str(s.source))) is not None:
            by_server.setdefault(name, []).append(s)
    out = []
    for name, group in sorted(by_server.items()):
        rows = rows_of(group)
        total = sum(max(0.0, r.tsub) for r in rows)
        out.append({"name": name, "functions": len(rows), "total_s": total,
                    "rows": [row_payload(r, total) for r in rows[:SERVER_TOP_ROWS]]})
    return out


def _session_payload(s):
    if s is None:
        return None
    return {"id": s.pk, "scope": s.scope, "clock": s.clock, "budget_pct": s.budget_pct, "seconds": s.seconds,
            "window_s": s.window_s, "started_at": s.started_at.isoformat(),
            "until": s.until.isoformat() if s.until else None,
            "stopped_at": s.stopped_at.isoformat() if s.stopped_at else None, "active": s.active,
            "stats_urls": s.stats_urls}


def short_module(module: str) -> str:
    m = module.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in m:
            return m.split(marker, 1)[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + "/"
    if m.startswith(root):
        return m[len(root):]
    if "/lib/python" in m:
        return m.split("/lib/python", 1)[1].split("/", 1)[-1]
    return m


def row_payload(r: FuncRow, total: float) -> dict:
    return {"module": short_module(r.module), "line": r.line, "name": r.name, "ncall": round(r.ncall),
            "tsub": r.tsub, "ttot": r.ttot, "tavg": r.tavg, "share": (r.ttot / total) if total else 0.0,
            "self_share": (r.tsub / total) if total else 0.0}


# ---------------------------------------------------------------------------------- red flags
def is_harness(r) -> bool:
    m = r.module.replace("\\", "/")
    return any(h in m for h in HARNESS)


def _is_idle(r) -> bool:
    return (r.module, r.name) in IDLE or r.name.endswith(("epoll.poll", "lock.acquire", "Condition.wait"))


def _is_external(r) -> bool:
    if r.module == "time" and r.name in ("sleep", "time.sleep"):
        return True
    return (bool(EXTERNAL_MODULE.search(r.module)) or bool(re.match(r"^_?socket\.|^_?ssl\.", r.name))
            or bool(re.search(r"of '_?(socket|ssl)\.", r.name)))  # builtin methods: <method 'recv' of '_socket.socket' objects>


def _label(r) -> str:
    return f"{r.name} ({short_module(r.module)}:{r.line})"


def _drill(r, by_key, seen=None):
    """Follow the child holding most of the time while it holds at least half of its parent's."""
    seen = seen or set()
    cur = r
    while True:
        seen.add(cur.key)
        kids = [(c[4], tuple(c[:3])) for c in cur.children if tuple(c[:3]) in by_key and tuple(c[:3]) not in seen]
        if not kids:
            return cur
        t, k = max(kids)
        if t < 0.5 * max(cur.ttot - cur.tsub, 1e-12) or t < 0.5 * cur.ttot * 0.5:
            return cur
        cur = by_key[k]


ADVICE = {
    "over_half": "optimize this function first: a better algorithm or data structure, caching repeated work, "
                 "or compiled code",
    "nested": "the time is in nested calls: optimize the child that holds it; run independent nested calls in "
              "parallel (asyncio.gather, a process pool or Ray)",
    "self_time": "expensive work in the function itself: a better data structure (a set or dict instead of "
                 "scanning a list), a faster algorithm, or compiled code (Cython, Rust, numpy)",
    "hot_repeated": "called many times at a high average cost: cache repeated calculations "
                    "(functools.lru_cache) or vectorize",
    "growth": "the cost per call grows with the data: index it (dict / set) or use a better algorithm",
    "sync_external": "a blocking external call on the verification hot path: make it async (asyncio.gather) or "
                     "move it off the path (batch it, a process pool or Ray)",
}


def red_flags(rows, *, verifications=0, job=None, over_half=0.5, nested=0.3, self_time=0.2, hot=0.1,
              external=0.01) -> list[dict]:
    """The profiling guide's red flags, each with the function, the figure and the advice."""
    total = sum(max(0.0, r.tsub) for r in rows)
    if total <= 0:
        return []
    by_key = {r.key: r for r in rows}
    cand = [r for r in rows if not is_harness(r) and not _is_idle(r)]
    flags = []

    def add(kind, r, figure, value, **extra):
        flags.append({"kind": kind, "function": r.name, "module": short_module(r.module), "line": r.line,
                      "label": _label(r), "figure": figure, "value": value, "advice": ADVICE[kind], **extra})

    # 1. one function over half of the total (the deepest such function: wrappers always are)
    over = [r for r in cand if r.ttot / total > over_half]
    over_keys = {r.key for r in over}
    for r in over:
        if not any(tuple(c[:3]) in over_keys for c in r.children):
            add("over_half", r, f"ttot {r.ttot:.3f}s = {100 * r.ttot / total:.0f}% of total", r.ttot / total)
    # 2. time in nested calls: drill down to the child holding it
    reported = set()
    for r in sorted(cand, key=lambda r: -(r.ttot - r.tsub)):
        if (r.ttot - r.tsub) / total < nested or r.tsub > 0.2 * r.ttot:
            continue
        leaf = _drill(r, by_key)
        if leaf.key == r.key or leaf.key in reported:
            continue
        reported.add(leaf.key)
        add("nested", r, f"ttot - tsub = {r.ttot - r.tsub:.3f}s ({100 * (r.ttot - r.tsub) / total:.0f}% of total) "
            f"in nested calls; held by {leaf.name} ({short_module(leaf.module)}:{leaf.line}, ttot {leaf.ttot:.3f}s)",
            (r.ttot - r.tsub) / total, drill_to=_label(leaf), drill_function=leaf.name)
        if len(reported) >= 3:
            break
    # 3. high self time
    for r in cand:
        if r.tsub / total > self_time:
            add("self_time", r, f"tsub {r.tsub:.3f}s = {100 * r.tsub / total:.0f}% of total "
                f"(tavg {1000 * r.tavg:.3f} ms x {round(r.ncall)} calls)", r.tsub / total)
    # 4. high tavg x ncall: many calls (more than one per verification) that together cost a lot
    min_calls = max(verifications, 1) if verifications else 1000
    for r in cand:
        if r.ttot / total >= hot and r.ncall > min_calls and r.tavg > 0:
            add("hot_repeated", r, f"tavg {1000 * r.tavg:.3f} ms x {round(r.ncall)} calls = {r.ttot:.3f}s "
                f"({100 * r.ttot / total:.0f}% of total; {r.ncall / max(verifications, 1):.1f} calls per "
                f"verification)", r.ttot / total)
    # 5. synchronous external calls on the hot path
    for r in rows:
        if _is_external(r) and r.ttot / total >= external and not is_harness(r):
            add("sync_external", r, f"ttot {r.ttot:.3f}s = {100 * r.ttot / total:.1f}% of total, "
                f"{round(r.ncall)} calls", r.ttot / total)
    # 6. tavg growing with the dataset size, across this job and earlier profiled jobs of the same verifier
    if job is not None:
        try:
            flags.extend(growth_flags(job, rows, total))
        except Exception:  # noqa: BLE001
            logger.exception("job %s: growth flags failed", getattr(job, "pk", None))
    order = {k: i for i, k in enumerate(ADVICE)}
    flags.sort(key=lambda f: (order[f["kind"]], -f["value"]))
    return flags


def growth_flags(job, rows, total, min_size_ratio=2.0, min_tavg_ratio=1.5, share=0.05) -> list[dict]:
    others = (CollectionJob.objects.filter(verifier=job.verifier, profile_snapshots__isnull=False)
              .exclude(pk=job.pk).distinct().order_by("-pk")[:10])
    size = job.total_rollouts or 0
    mine = {(short_module(r.module), r.name): r for r in rows if not is_harness(r) and r.ttot / total >= share}
    flags = []
    for other in others:
        osize = other.total_rollouts or 0
        if not osize or not size or size / osize < min_size_ratio:
            continue
        snaps = list(ProfileSnapshot.objects.filter(job=other))
        theirs = {(short_module(r.module), r.name): r for r in rows_of(snaps)}
        for k, r in mine.items():
            o = theirs.get(k)
            if o is None or o.tavg <= 0 or r.tavg / o.tavg < min_tavg_ratio:
                continue
            flags.append({"kind": "growth", "function": r.name, "module": short_module(r.module), "line": r.line,
                          "label": _label(r), "value": r.tavg / o.tavg, "advice": ADVICE["growth"],
                          "figure": f"tavg {1000 * o.tavg:.3f} ms at {osize} rollouts (job {other.pk}) -> "
                                    f"{1000 * r.tavg:.3f} ms at {size} rollouts (x{r.tavg / o.tavg:.1f} for "
                                    f"x{size / osize:.1f} data)", "other_job": other.pk,
                          "_key": tuple(r.key), "_children": r.children})
        if flags:
            break
    # A caller grows because its callee does (inclusive time): name only the innermost growing function, the
    # one to index, not every frame above it (a list comprehension, the loop that calls it).
    grown = {f.pop("_key") for f in flags}
    return [f for f in flags if not any(tuple(c[:3]) in grown for c in f.pop("_children"))]


# ------------------------------------------------------------------------------------ diagnosis
def profile_top(job) -> dict | None:
    """The function the diagnosis names for a verification-bound job: the first red flag of the newest
    profile (or its costliest function), or None before any snapshot. Never raises."""
    try:
        session = (ProfileSession.objects.filter(job=job, snapshots__isnull=False).distinct()
                   .order_by("-started_at", "-pk").first())
        if session is None:
            return None
        snaps = list(ProfileSnapshot.objects.filter(session=session))
        rows = rows_of(snaps)
        total = sum(max(0.0, r.tsub) for r in rows)
        if not rows or total <= 0:
            return None
        flags = red_flags(rows, verifications=sum(s.verifications for s in snaps))
        for kind in ("over_half", "self_time", "hot_repeated", "sync_external", "nested"):
            f = next((f for f in flags if f["kind"] == kind), None)
            if f is not None:
                if kind == "nested":  # name the child that holds the time
                    leaf = next((r for r in rows if r.name == f["drill_function"]), None)
                    if leaf is not None:
                        return {"function": leaf.name, "module": short_module(leaf.module), "line": leaf.line,
                                "figure": f["figure"], "flag": kind, "advice": f["advice"], "session": session.pk}
                return {"function": f["function"], "module": f["module"], "line": f["line"], "figure": f["figure"],
                        "flag": kind, "advice": f["advice"], "session": session.pk}
        r = max((r for r in rows if not is_harness(r) and not _is_idle(r)), key=lambda r: r.tsub, default=None)
        if r is None:
            return None
        return {"function": r.name, "module": short_module(r.module), "line": r.line, "flag": None,
                "figure": f"tsub {r.tsub:.3f}s = {100 * r.tsub / total:.0f}% of profiled time",
                "advice": "the costliest function by self time", "session": session.pk}
    except Exception:  # noqa: BLE001  (the diagnosis goes on without it)
        logger.exception("job %s: profile summary for the diagnosis failed", getattr(job, "pk", None))
        return None
