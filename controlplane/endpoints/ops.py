"""Model-server operations on an endpoint's replicas, recorded and timed (the dashboard, API, command and CLI
all come through here).

Every operation goes out through the dedicated ops client (`workers.ops`), never through a rollout
session, with one trace id for the whole user action; each request to each replica is stored as an
`AdminOperation` with wall_ms / rpc_ms / queue_ms. Operations block for at most their own timeouts (a
replica that does not answer is reported as `no_answer`), and never raise on network errors.
"""
from __future__ import annotations

import logging
import math
import re
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane import disclosure, lanes
from controlplane.telemetry import record_ops_action
from workers.ops import replicas
from workers.ops.client import OpResult, new_trace_id
from workers.engine.aggregate import quantile

from .sharing import SharedServerDenied, check_may_change  # noqa: F401 (SharedServerDenied: for callers)
from .models import ADMIN_ACTION_CLAIM, AdminAction, AdminOperation, Endpoint, WeightVersion
from .services import normalize_base_url, redact_text

logger = logging.getLogger(__name__)

KINDS = [k for k, _ in AdminOperation.Kind.choices]
SIMPLE_KINDS = ("health", "reset_prefix_cache", "pause", "resume", "sleep", "wake_up", "prewarm")
STATS_WINDOW = 2000  # the latest operations per kind that percentiles are taken over
MAX_PREWARM = 1024


# What other apps do around a weight update (the jobs app: tagging its rollouts with the new version,
# controlplane/jobs/versions.py), registered from their ready(): before(endpoint) -> a mark, taken before the
# pause is sent; after(endpoint_id, mark), once the new version is recorded (on commit).
UPDATE_HOOKS: list[tuple] = []


def register_update_hook(before, after) -> None:
    if (before, after) not in UPDATE_HOOKS:
        UPDATE_HOOKS.append((before, after))


class OpsError(ValueError):
    """The operation cannot be sent as asked (bad parameter, hosted API without ops routes)."""


class StaleVersion(OpsError):
    """A weight update names a version lower than the endpoint's current one, or than an update asked before it
    (the API answers 409, code `stale_version`): versions never go backwards."""


# A caller's trace id (X-Trace-Id, or the body's trace_id): hex digits and dashes (a uuid, a W3C trace id),
# 8 to 64 characters; kept lower case, so the operation log's search by prefix finds it.
TRACE_ID = re.compile(r"[0-9a-fA-F][0-9a-fA-F-]{7,63}")
MAX_WAIT_S = 60.0  # ?wait=S on a POST: at most this long


def check_trace_id(value) -> str | None:
    """The caller's trace id, normalised, or None when none was given. Raises OpsError when malformed."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not TRACE_ID.fullmatch(value.strip()):
        raise OpsError("trace id must be 8 to 64 hex digits or dashes (a uuid, a W3C trace id)")
    return value.strip().lower()


def queue_alert_ms() -> float:
    return float(getattr(settings, "OPS_QUEUE_ALERT_MS", 1000.0))


def _client_kw(endpoint) -> dict:
    return {"api_key": endpoint.api_key or None, "connect_timeout_s": min(endpoint.connect_timeout_s, 10.0),
            "max_retries": min(endpoint.max_retries, 3)}


def _urls(endpoint) -> list[str]:
    return [normalize_base_url(u) for u in endpoint.all_base_urls]


def _status(r: OpResult) -> str:
    if r.ok:
        return AdminOperation.Status.OK
    return AdminOperation.Status.NO_ANSWER if r.timed_out else AdminOperation.Status.FAILED


def _record(endpoint, results: list[OpResult], *, params: dict, source: str, user) -> list[AdminOperation]:
    from datetime import datetime, timezone as dt_tz

    rows = [AdminOperation(
        endpoint=endpoint, trace_id=r.trace_id, kind=r.kind, replica=r.replica[:500], status=_status(r),
        http_status=r.status, error=redact_text(r.error, endpoint.api_key), wall_ms=r.wall_ms, rpc_ms=r.rpc_ms,
        queue_ms=r.queue_ms, connect_ms=r.connect_ms, rpc_source=r.rpc_source, attempts=min(r.attempts, 32767),
        params=params, source=source[:20], requested_by=user if getattr(user, "pk", None) else None,
        created_at=datetime.fromtimestamp(r.started_at, dt_tz.utc)) for r in results]
    return AdminOperation.objects.bulk_create(rows)


def _op_dict(r: OpResult, api_key: str | None) -> dict:
    return {"kind": r.kind, "replica": r.replica, "status": _status(r), "ok": r.ok, "http_status": r.status,
            "error": redact_text(r.error, api_key), "wall_ms": r.wall_ms, "rpc_ms": r.rpc_ms,
            "queue_ms": r.queue_ms, "attempts": r.attempts, "timed_out": r.timed_out}


def _check_ops_capable(endpoint) -> None:
    if endpoint.kind == Endpoint.Kind.OPENAI:
        raise OpsError("this endpoint is a hosted OpenAI-compatible API: it has no ops routes")


def check_operation(endpoint, kind: str, *, mode: str | None = None, level: int | None = None,
                    count: int | None = None) -> dict:
    """Validate an operation before it is queued; returns its params (defaults filled in). Raises
    OpsError (the API answers 400) for what no model server could fix."""
    if kind not in SIMPLE_KINDS:
        raise OpsError(f"unknown operation {kind!r}; known: {', '.join(SIMPLE_KINDS)} (and update_weights)")
    if kind != "prewarm" and kind != "health":
        _check_ops_capable(endpoint)
    params: dict[str, Any] = {}
    if kind == "pause":
        mode = mode or "keep"
        if mode not in replicas.PAUSE_MODES:
            raise OpsError(f"pause mode must be one of {', '.join(replicas.PAUSE_MODES)}, got {mode!r}")
        params["mode"] = mode
    elif kind == "sleep":
        level = 1 if level is None else level
        if level not in (1, 2):
            raise OpsError(f"sleep level must be 1 or 2, got {level!r}")
        params["level"] = level
    elif kind == "prewarm":
        count = len(_urls(endpoint)) * 4 if count is None else count
        if not isinstance(count, int) or isinstance(count, bool) or not 0 <= count <= MAX_PREWARM:
            raise OpsError(f"pre-warm count must be an integer between 0 and {MAX_PREWARM}, got {count!r}")
        params["count"] = count
    return params


def run_operation(endpoint, kind: str, *, mode: str | None = None, level: int | None = None,
                  count: int | None = None, user=None, source: str = "api", trace_id: str | None = None,
                  deadline_s: float | None = None) -> dict:
    """health | prewarm (count) | reset_prefix_cache | pause (mode) | resume | sleep (level) | wake_up on
    every replica, here and now (a worker's or a command's process, never the web's: see `submit`).
    Returns {"trace_id", "kind", "ok", "operations": [...], "unanswered": [urls]}."""
    params = check_operation(endpoint, kind, mode=mode, level=level, count=count)
    urls = _urls(endpoint)
    trace_id = trace_id or new_trace_id()
    if kind == "pause":
        fn = lambda c: replicas.pause(c, urls, params["mode"], trace_id=trace_id)  # noqa: E731
    elif kind == "sleep":
        fn = lambda c: replicas.sleep(c, urls, params["level"], trace_id=trace_id)  # noqa: E731
    elif kind == "prewarm":
        fn = lambda c: replicas.prewarm(c, urls, params["count"], model=endpoint.model_name,  # noqa: E731
                                        flavor=endpoint.api_flavor, trace_id=trace_id)
    else:
        fn = lambda c: replicas.simple(c, urls, kind, trace_id=trace_id)  # noqa: E731
    results = replicas.run(fn, deadline_s=deadline_s, **_client_kw(endpoint))
    _record(endpoint, results, params=params, source=source, user=user)
    out = {"trace_id": trace_id, "kind": kind, "params": params, "ok": all(r.ok for r in results),
           "operations": [_op_dict(r, endpoint.api_key) for r in results],
           "unanswered": sorted({r.replica for r in results if r.timed_out})}
    if kind == "prewarm":
        out["sent"] = len(results)
        out["succeeded"] = sum(r.ok for r in results)
    return out


# ------------------------------------------------------------------------------------ weight updates
def current_version(endpoint) -> str:
    """The endpoint's weight version as the control plane knows it: the latest applied update's, else ''."""
    return WeightVersion.objects.filter(endpoint=endpoint).values_list("version", flat=True).first() or ""


def _next_version(endpoint) -> int:
    versions = WeightVersion.objects.filter(endpoint=endpoint).values_list("version", flat=True)[:50]
    nums = [int(v) for v in versions if str(v).isdigit()]
    return max(nums, default=0) + 1


def _num(v) -> int | None:
    return int(v) if str(v).isdigit() else None


def version_floor(endpoint, *, before_action: int | None = None) -> int | None:
    """The highest numeric version an update may not go below: the current one, and (at submit) those of the
    updates asked before and not finished yet (they run first, in order)."""
    nums = [n for n in (_num(v) for v in WeightVersion.objects.filter(endpoint=endpoint)
                        .values_list("version", flat=True)[:50]) if n is not None]
    pending = AdminAction.objects.filter(endpoint=endpoint, kind="update_weights",
                                         state__in=[AdminAction.State.QUEUED, AdminAction.State.RUNNING])
    if before_action is not None:
        pending = pending.filter(pk__lt=before_action)
    nums += [n for n in (_num((p or {}).get("version")) for p in pending.values_list("params", flat=True))
             if n is not None]
    return max(nums, default=None)


def check_not_stale(endpoint, version, *, before_action: int | None = None) -> None:
    floor = version_floor(endpoint, before_action=before_action)
    if version is not None and floor is not None and int(version) < floor:
        raise StaleVersion(f"stale version {version}: the endpoint is at (or an update asked before this one goes "
                           f"to) version {floor}, and versions never go backwards; post a version >= {floor}, or "
                           f"none for the next one")


def check_update(endpoint, *, path: str = "", checkpoint_id: str = "", version: int | None = None,
                 pause_mode: str = "keep", server: str | None = None) -> dict:
    """Validate a weight update before it is queued; returns its params. Raises OpsError."""
    _check_ops_capable(endpoint)
    path, checkpoint_id = path or "", checkpoint_id or ""  # as given: the model server judges them
    if not path and not checkpoint_id:
        raise OpsError("give the new weights: a path or a checkpoint id")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool) or version < 0):
        raise OpsError(f"version must be an integer >= 0, got {version!r}")
    if pause_mode not in replicas.PAUSE_MODES:
        raise OpsError(f"pause mode must be one of {', '.join(replicas.PAUSE_MODES)}, got {pause_mode!r}")
    if server is not None and server not in replicas.SERVER_KINDS:
        raise OpsError(f"server must be one of {', '.join(replicas.SERVER_KINDS)}, got {server!r}")
    return {"path": path, "checkpoint_id": checkpoint_id, "version": version, "pause_mode": pause_mode,
            "server": server}


def update_weights(endpoint, *, path: str = "", checkpoint_id: str = "", version: int | None = None,
                   pause_mode: str = "keep", server: str | None = None, user=None, source: str = "api",
                   trace_id: str | None = None, deadline_s: float | None = None) -> dict:
    """pause(keep) -> update -> resume on every replica (resume always sent), here and now (a worker's or a
    command's process: see `submit`). When every replica took the new weights, records the new
    `WeightVersion` (given, or the last + 1). Returns the report with the version, failed / unanswered /
    not-resumed replicas and every request's timings."""
    p = check_update(endpoint, path=path, checkpoint_id=checkpoint_id, version=version, pause_mode=pause_mode,
                     server=server)
    path, checkpoint_id, version, pause_mode, server = (p["path"], p["checkpoint_id"], p["version"],
                                                        p["pause_mode"], p["server"])
    urls = _urls(endpoint)
    previous = current_version(endpoint)
    new_version = version if version is not None else _next_version(endpoint)
    trace_id = trace_id or new_trace_id()
    marks = [(after, before(endpoint)) for before, after in UPDATE_HOOKS]  # e.g. the newest rollout id

    async def go(client):
        kind = server or await replicas.detect_server(client, urls[0])
        return kind, await replicas.update_weights(client, urls, server=kind, path=path, checkpoint_id=checkpoint_id,
                                              version=new_version, trace_id=trace_id, pause_mode=pause_mode)

    server_kind, report = replicas.run(go, deadline_s=deadline_s, **_client_kw(endpoint))
    params = {"path": path, "checkpoint_id": checkpoint_id, "version": str(new_version), "pause_mode": pause_mode,
              "server": server_kind}
    updates = [s for s in report.steps if s.kind == "update_weights"]
    applied = len(updates) == len(urls) and all(s.ok for s in updates)
    with transaction.atomic():
        _record(endpoint, report.steps, params=params, source=source, user=user)
        wv = None
        if applied:
            from datetime import datetime, timezone as dt_tz

            started = min(s.started_at for s in report.steps)
            wv = WeightVersion.objects.create(
                endpoint=endpoint, version=str(new_version), previous_version=previous, weights_path=path[:1000],
                checkpoint_id=checkpoint_id[:300], trace_id=trace_id,
                started_at=datetime.fromtimestamp(started, dt_tz.utc), applied_at=timezone.now())
            endpoint_id = endpoint.pk
            for after, mark in marks:
                transaction.on_commit(lambda after=after, mark=mark: after(endpoint_id, mark))
    return {"trace_id": trace_id, "ok": report.ok, "applied": applied, "server": server_kind,
            "version": str(new_version) if wv else previous, "previous_version": previous,
            "requested_version": str(new_version), "failed_replicas": report.failed_replicas,
            "unanswered_replicas": report.unanswered_replicas, "not_resumed": report.not_resumed,
            "operations": [_op_dict(s, endpoint.api_key) for s in report.steps]}


# ------------------------------------------------------------------------------------ queued actions
class QueueUnavailable(RuntimeError):
    """The task queue could not take the action (the API answers 503); the action is marked failed."""


def submit(endpoint, kind: str, *, user=None, source: str = "api", **raw) -> AdminAction:
    """Validate an action (OpsError on bad input), store it as a queued `AdminAction` and hand it to a
    Celery worker, which calls the model servers; the report lands on the row. The web process never
    calls a model server (a user-registered URL), and never waits on one. An operation that changes a server
    another user's record points at raises SharedServerDenied (sharing.py; the API answers 403)."""
    check_may_change(user, endpoint, kind)
    trace_id = check_trace_id(raw.pop("trace_id", None)) or new_trace_id()
    if kind == "update_weights":
        params = check_update(endpoint, **raw)
        check_not_stale(endpoint, params["version"])
    else:
        params = check_operation(endpoint, kind, **raw)
    action = AdminAction.objects.create(endpoint=endpoint, trace_id=trace_id, kind=kind, params=params,
                                        source=source[:20], requested_by=user if getattr(user, "pk", None) else None)
    logger.info("ops action %s (%s) on endpoint %s asked by %s, trace %s", action.pk, kind, endpoint.pk,
                getattr(user, "username", None) or source, trace_id)
    from controlplane.celery import registered_app

    try:  # by name: the task module imports this one
        registered_app().tasks["controlplane.endpoints.tasks.run_admin_action_task"].delay(action.pk)
    except Exception as exc:  # noqa: BLE001 - kombu / redis errors: nothing was sent
        AdminAction.objects.filter(pk=action.pk).update(state=AdminAction.State.FAILED, finished_at=timezone.now(),
                                                        error=f"the task queue is unavailable: {exc}"[:2000])
        raise QueueUnavailable("The task queue is unavailable; try again shortly.") from exc
    action.refresh_from_db()  # eager tasks (tests, CELERY_TASK_ALWAYS_EAGER) have already run it
    return action


def recover_lost_actions(max_age_s: float | None = None, now=None) -> dict:
    """The broker came back without its data (services.broker_lost_its_data): the queued actions' messages are
    gone. A recent one is sent again (`execute` claims it atomically, so a message that did survive runs it
    once); one older than `max_age_s` (setting OPS_ACTION_RESEND_MAX_AGE_S) is failed with the reason
    instead: a weight update or pause asked for long ago may no longer be wanted, so it is for a person to ask
    again. Returns {"resent": [ids], "expired": [ids]}."""
    if max_age_s is None:
        max_age_s = settings.OPS_ACTION_RESEND_MAX_AGE_S
    now = now or timezone.now()
    queued = AdminAction.objects.filter(state=AdminAction.State.QUEUED)
    cutoff = now - timedelta(seconds=max_age_s)
    expired = list(queued.filter(created_at__lt=cutoff).values_list("pk", flat=True))
    if expired:
        AdminAction.objects.filter(pk__in=expired, state=AdminAction.State.QUEUED).update(
            state=AdminAction.State.FAILED, finished_at=now,
            error=(f"the task queue lost this action (its Redis restarted without its data) and it was queued more "
                   f"than {max_age_s:.0f} s ago, so it was not sent again; ask for it again if it is still wanted"))
    resent = list(queued.filter(created_at__gte=cutoff).order_by("pk").values_list("pk", flat=True))
    from controlplane.celery import registered_app

    task = registered_app().tasks["controlplane.endpoints.tasks.run_admin_action_task"]
    for pk in resent:
        try:
            task.delay(pk)
        except Exception as exc:  # noqa: BLE001 - kombu / redis errors: as in submit, said on the action
            AdminAction.objects.filter(pk=pk, state=AdminAction.State.QUEUED).update(
                state=AdminAction.State.FAILED, finished_at=timezone.now(),
                error=f"the task queue is unavailable: {exc}"[:2000])
    if resent or expired:
        logger.warning("ops actions after the broker lost its data: sent again %s, expired %s", resent, expired)
    return {"resent": resent, "expired": expired}


def action_ok(kind: str, result: dict | None) -> bool:
    if not result:
        return False
    return bool(result.get("ok")) and (kind != "update_weights" or bool(result.get("applied")))


def execute(action_id: int) -> str | None:
    """Run a queued action (in a worker). Claimed atomically, so a redelivered task does not run it twice.
    Returns its final state, or None when there was nothing to run."""
    _wait_for_earlier_updates(action_id)
    now = timezone.now()
    asked = AdminAction.objects.filter(pk=action_id).values_list("created_at", flat=True).first()
    claimed = ADMIN_ACTION_CLAIM.claim(action_id, now=now, started_at=now,
                                       dispatch_ms=_ms(asked, now) if asked else None)
    if not claimed:
        # Delivered again while marked running: the worker that ran it was lost (a live run finishes within
        # the task's time limit, well before the broker's visibility timeout redelivers it). Not re-sent:
        # a half-done pause or update is for a person to look at.
        AdminAction.objects.filter(pk=action_id, state=AdminAction.State.RUNNING).update(
            state=AdminAction.State.FAILED, finished_at=timezone.now(),
            error="the worker running this action was lost; check the replicas (they may still be paused)")
        return None
    action = AdminAction.objects.select_related("endpoint", "requested_by").get(pk=action_id)
    p, kw = action.params, {"user": action.requested_by, "source": action.source, "trace_id": action.trace_id,
                            "deadline_s": settings.OPS_ACTION_DEADLINE_S}  # Celery's limits: not under threads
    result, error = None, ""
    try:
        # checked again here: another user may have registered the same server since it was queued
        check_may_change(action.requested_by, action.endpoint, action.kind)
        logger.info("ops action %s (%s) on endpoint %s started after %.0f ms, trace %s", action_id, action.kind,
                    action.endpoint_id, _ms(action.created_at, action.started_at), action.trace_id)
        if action.kind == "update_weights":
            check_not_stale(action.endpoint, p.get("version"), before_action=action_id)  # asked before: versions never go backwards
            result = update_weights(action.endpoint, path=p.get("path", ""), checkpoint_id=p.get("checkpoint_id", ""),
                                    version=p.get("version"), pause_mode=p.get("pause_mode", "keep"),
                                    server=p.get("server"), **kw)
        else:
            result = run_operation(action.endpoint, action.kind, mode=p.get("mode"), level=p.get("level"),
                                   count=p.get("count"), **kw)
    except (OpsError, SharedServerDenied) as exc:  # the endpoint changed since it was queued
        error = str(exc)
    except TimeoutError as exc:  # replicas.run's total deadline: the replicas were told to resume
        error = f"{action.kind} {exc} (OPS_ACTION_DEADLINE_S); check the replicas"
    except Exception as exc:  # noqa: BLE001 - recorded on the row; the worker lives on
        error = f"{type(exc).__name__}: {exc}"
    state = AdminAction.State.SUCCEEDED if action_ok(action.kind, result) else AdminAction.State.FAILED
    finished = timezone.now()
    total_ms = _ms(action.created_at, finished)
    AdminAction.objects.filter(pk=action_id).update(state=state, result=result, error=error[:2000],
                                                    finished_at=finished, total_ms=total_ms)
    record_ops_action(action.kind, action.dispatch_ms, total_ms)
    slow = total_ms > queue_alert_ms()
    if slow:
        from controlplane import notices

        notices.emit("control.slow", endpoint_id=action.endpoint_id, owner_id=action.endpoint.owner_id,
                     requested_by_id=action.requested_by_id,
                     action_id=action_id, action_kind=action.kind, state=str(state), dispatch_ms=action.dispatch_ms,
                     total_ms=total_ms, threshold_ms=queue_alert_ms(), trace_id=action.trace_id)
    log = logger.warning if slow else logger.info
    log("ops action %s (%s) on endpoint %s %s: dispatch %.0f ms, total %.0f ms, trace %s", action_id, action.kind,
        action.endpoint_id, state, action.dispatch_ms or 0.0, total_ms, action.trace_id)
    return state


def _ms(start, end) -> float:
    return round((end - start).total_seconds() * 1000.0, 3)


ORDER_POLL_S = 0.02
ORDER_RETRY_S = 0.05  # a worker's update waiting for an earlier one is sent again this much later


def waits_for_earlier_update(action_id: int) -> bool:
    """Weight updates of one endpoint run one at a time, in the order they were asked for: whether this one (a
    queued weight update) must wait because an update of the same endpoint asked before it is queued or running.
    The earliest unfinished one never waits, so the line always moves. An update asked longer than
    OPS_ACTION_DEADLINE_S ago waits no more (an earlier one that never ran was lost); its version is still
    checked (never backwards)."""
    row = AdminAction.objects.filter(pk=action_id).values("endpoint_id", "kind", "state", "created_at").first()
    if not row or row["kind"] != "update_weights" or row["state"] != AdminAction.State.QUEUED:
        return False
    if (timezone.now() - row["created_at"]).total_seconds() > settings.OPS_ACTION_DEADLINE_S:
        return False
    return AdminAction.objects.filter(endpoint_id=row["endpoint_id"], kind="update_weights", pk__lt=action_id,
                                      state__in=[AdminAction.State.QUEUED, AdminAction.State.RUNNING]).exists()


def _wait_for_earlier_updates(action_id: int) -> None:
    """In-process callers (eager tasks, commands): wait here. The Celery task does not hold a control slot while
    it waits: it sends itself again (tasks.run_admin_action_task)."""
    deadline = time.monotonic() + settings.OPS_ACTION_DEADLINE_S
    while waits_for_earlier_update(action_id) and time.monotonic() < deadline:
        time.sleep(ORDER_POLL_S)


def wait_finished(action: AdminAction, timeout_s: float) -> AdminAction:
    """The action once finished, or as it is after `timeout_s` (?wait=S on a POST: the trainer's blocking call)."""
    deadline = time.monotonic() + max(0.0, min(float(timeout_s), MAX_WAIT_S))
    delay = 0.01
    while action.state not in AdminAction.FINISHED and time.monotonic() < deadline:
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 1.5, 0.1)
        action.refresh_from_db()
    return action


def action_summary(action: AdminAction, user=None) -> str:
    """One line for people (the dashboard, the command): what happened, and where it failed (errors as
    `user` may read them, when given)."""
    out = (result_for(user, action.result) if user else action.result) or {}
    if action.state == AdminAction.State.QUEUED:
        lane = lanes.control_served()
        if lane["served"] is False:
            return f"{action.kind}: queued; " + lanes.NOT_SERVED.format(queue=lane["queue"])
        return f"{action.kind}: queued"
    if action.state == AdminAction.State.RUNNING:
        return f"{action.kind}: running"
    if action.error:
        return f"{action.kind}: {error_for(user, action.error) if user else action.error}"
    if action.kind == "update_weights":
        if action.state == AdminAction.State.SUCCEEDED:
            return f"weights updated to version {out.get('version')}"
        unanswered = out.get("unanswered_replicas") or []
        not_resumed = out.get("not_resumed") or []
        return (f"weight update failed on {', '.join(out.get('failed_replicas') or []) or 'a replica'}"
                f"{' (no answer: ' + ', '.join(unanswered) + ')' if unanswered else ''}"
                f"{'; NOT resumed: ' + ', '.join(not_resumed) if not_resumed else '; resumed'}")
    if action.state == AdminAction.State.SUCCEEDED:
        return f"{action.kind}: ok"
    failed = [o for o in out.get("operations", []) if not o.get("ok")]
    detail = "; ".join(f"{o['replica']}: {o['error']}" for o in failed[:3])
    return f"{action.kind}: {len(failed)} of {len(out.get('operations', []))} request(s) failed: {detail}"


# ------------------------------------------------------------------------------------ reading back
def operations(endpoint, *, trace_id: str = "", kind: str = "", limit: int = 200):
    qs = AdminOperation.objects.filter(endpoint=endpoint)
    if trace_id:
        qs = qs.filter(trace_id__startswith=trace_id.strip().lower())
    if kind:
        qs = qs.filter(kind=kind)
    return qs[:limit]


def _p(values: list[float], q: float) -> float | None:
    return round(quantile(values, q), 3) if values else None


def timing_stats(endpoint) -> list[dict]:
    """Per kind, over its latest STATS_WINDOW answered operations: n and p50/p95/p99 of queue, rpc, wall;
    `alerts`: how many of them had queue_ms above the alert threshold, `worst_queue_ms`."""
    threshold = queue_alert_ms()
    out = []
    for kind in KINDS:
        rows = list(AdminOperation.objects.filter(endpoint=endpoint, kind=kind).exclude(wall_ms=None)
                    .values_list("queue_ms", "rpc_ms", "wall_ms")[:STATS_WINDOW])
        if not rows:
            continue
        stats: dict[str, Any] = {"kind": kind, "n": len(rows), "threshold_ms": threshold}
        for i, name in enumerate(("queue_ms", "rpc_ms", "wall_ms")):
            vals = sorted(r[i] for r in rows if r[i] is not None and not math.isnan(r[i]))
            for q in (0.5, 0.95, 0.99):
                stats[f"{name}_p{int(q * 100)}"] = _p(vals, q)
        queued = [r[0] for r in rows if r[0] is not None]
        stats["alerts"] = sum(q > threshold for q in queued)
        stats["worst_queue_ms"] = max(queued, default=None)
        out.append(stats)
    by_kind = {s["kind"]: s for s in out}
    for kind in KINDS:  # what the caller waited: asked -> started (dispatch) and asked -> finished (total)
        rows = list(AdminAction.objects.filter(endpoint=endpoint, kind=kind).exclude(total_ms=None)
                    .values_list("dispatch_ms", "total_ms")[:STATS_WINDOW])
        if not rows:
            continue
        stats = by_kind.get(kind)
        if stats is None:
            stats = by_kind[kind] = {"kind": kind, "n": 0, "threshold_ms": threshold, "alerts": 0,
                                     "worst_queue_ms": None}
            out.append(stats)
        stats["actions"] = len(rows)
        for i, name in enumerate(("dispatch_ms", "total_ms")):
            vals = sorted(r[i] for r in rows if r[i] is not None)
            for q in (0.5, 0.95, 0.99):
                stats[f"{name}_p{int(q * 100)}"] = _p(vals, q)
        totals = [r[1] for r in rows]
        stats["total_alerts"] = sum(t > threshold for t in totals)  # the threshold applies to what callers wait
        stats["worst_total_ms"] = max(totals)
    return out


def slow_actions(endpoint, *, limit: int = 20):
    """The latest actions whose total (asked -> finished) passed the alert threshold."""
    return AdminAction.objects.filter(endpoint=endpoint, total_ms__gt=queue_alert_ms())[:limit]


def queue_alerts(endpoint, *, limit: int = 20):
    """The latest operations whose queue_ms passed the threshold (what the dashboard warns about)."""
    return AdminOperation.objects.filter(endpoint=endpoint, queue_ms__gt=queue_alert_ms())[:limit]


def error_for(user, text: str) -> str:
    """What `user` may read of a replica's error: staff see it all (at most 300 characters of the server's
    own message, secrets redacted); anyone else the HTTP status and the product's words only, never the
    server's body or banner (controlplane.disclosure: a user-registered URL must not become a way to read
    other servers' pages)."""
    return disclosure.error_for(user, text)


def result_for(user, result: dict | None) -> dict | None:
    """An action's report with each request's error as `user` may read it."""
    return disclosure.shown_for(user, result)


def operation_dict(op: AdminOperation, user=None) -> dict:
    return {"id": op.pk, "endpoint": op.endpoint_id, "trace_id": op.trace_id, "kind": op.kind, "replica": op.replica,
            "status": op.status, "http_status": op.http_status, "error": error_for(user, op.error) if user else op.error,
            "wall_ms": op.wall_ms,
            "rpc_ms": op.rpc_ms, "queue_ms": op.queue_ms, "connect_ms": op.connect_ms, "rpc_source": op.rpc_source,
            "attempts": op.attempts, "params": op.params, "source": op.source, "created_at": op.created_at.isoformat()}
