"""The rollout stream for trainers: batches of a job's verified rollouts as they land, exactly once per named
consumer, and bounded staleness (a rollout whose version lag is past the job's max_version_lag is never
handed out: collected again or kept and marked).

A consumer (StreamConsumer) has a durable cursor: a rollout id. `take` hands out the next batch after the
cursor and remembers it as pending (its token, its row ids, where the cursor goes); `ack(token)` moves the
cursor. Until it is acknowledged, every `take` hands out the same pending batch again, so a trainer that
dies between take and ack gets it again after its restart, and once acknowledged a batch is never handed
out again.

Why an id cursor is exact: the sink writes a job's rows under a lock of the job row taken before the insert
(`lock_job_for_insert`), so a job's ids are allocated in commit order and a reader never sees a later id
before an earlier one of the same job is committed.

Groups mode (all repeats of a task, for group-relative advantages): a group is handed out once all its
repeats are stored ok, in the order of its last member's id; the cursor is then the last handed-out group's
last id, or the last id read when every group complete by then was examined (a group still incomplete gets
its last member later, with a larger id). Groups whose rewards are all equal can be left out (no signal for
a group-relative advantage); they pass the cursor like stale ones.
"""
from __future__ import annotations

import secrets
import time

from django.db import transaction

from controlplane.endpoints.models import WeightVersion

from .models import CollectionJob, JobChunk, JobState, Rollout, StreamConsumer

MAX_BATCH = 10_000
MAX_WAIT_S = 30.0
POLL_S = 0.05
_FIELDS = ("id", "task_index", "rollout_index", "reward", "weight_version", "stale")


class StreamConflict(Exception):
    """The request does not fit the consumer's state (another mode, an unknown token)."""


def lock_job_for_insert(job_id) -> None:
    """In the sink's write transaction, before the insert: one writer of the job's rows at a time, so that
    their ids are allocated in commit order (the stream's cursor skips nothing)."""
    list(CollectionJob.objects.select_for_update().filter(pk=job_id).values_list("pk", flat=True))


# --- staleness ------------------------------------------------------------------------------------
def current_version(endpoint_id) -> int | None:
    """The endpoint's current weight version as a number (the newest update), None before any numeric one."""
    best = None
    for v in WeightVersion.objects.filter(endpoint_id=endpoint_id).values_list("version", flat=True)[:50]:
        try:
            best = int(v) if best is None else max(best, int(v))
        except (TypeError, ValueError):
            continue
    return best


def lag_of(version: str, current: int | None) -> int | None:
    try:
        return None if current is None else current - int(version or "0")
    except (TypeError, ValueError):
        return None


def is_past_bound(row: dict, job, current: int | None) -> bool:
    if row.get("stale"):
        return True
    if job.max_version_lag is None:
        return False
    lag = lag_of(row["weight_version"], current)
    return lag is not None and lag > job.max_version_lag


def settle_stale(job, ids: list[int]) -> int:
    """The job's policy for rollouts past its lag bound: mark them stale (kept), or delete them and collect
    those (task, repeat) pairs again with the current weights (their chunks reopened; a finished job back to
    queued). Returns how many rows were settled."""
    if not ids:
        return 0
    if job.stale_policy == CollectionJob.StalePolicy.MARK:
        return Rollout.objects.filter(pk__in=ids, stale=False).update(stale=True)
    from . import services

    with transaction.atomic():
        fresh = CollectionJob.objects.select_for_update().get(pk=job.pk)
        rows = Rollout.objects.filter(pk__in=ids)
        pairs = set(rows.values_list("task_index", "rollout_index"))
        tasks = {t for t, _ in pairs}
        n, _ = rows.delete()
        services.refresh_counts(fresh)
        if fresh.open_ended:  # the chunk of the pair's pass and position (controlplane.jobs.openended)
            from .openended import chunks_of

            chunks = [(pk,) for pk in chunks_of(fresh, pairs)]
        else:
            chunks = [c for c in JobChunk.objects.filter(job=fresh).values_list("pk", "start_row", "end_row")
                      if any(c[1] <= t < c[2] for t in tasks)]
        JobChunk.objects.filter(pk__in=[c[0] for c in chunks]).update(
            state=JobChunk.State.PENDING, lease_owner="", heartbeat_at=None, finished_at=None)
        if fresh.state in JobState.TERMINAL:
            fresh.reopen_for_retry()
        if not fresh.output_path:  # the CLI's inline runner collects its own chunks; others go to the workers
            services.dispatch_chunks(fresh, [c[0] for c in chunks])
    return n


# --- the stream -----------------------------------------------------------------------------------
def consumer_for(job, name: str, *, groups: bool, skip_equal: bool) -> StreamConsumer:
    c, created = StreamConsumer.objects.get_or_create(job=job, name=name,
                                                      defaults={"groups": groups, "skip_equal": skip_equal})
    if not created and (c.groups, c.skip_equal) != (groups, skip_equal):
        raise StreamConflict(f"consumer {name!r} takes {'groups' if c.groups else 'rows'}"
                             f"{' without all-equal groups' if c.skip_equal else ''}; use another name for another mode")
    return c


def _scan(job, cursor: int, limit: int) -> tuple[list[dict], int]:
    """Ok rows after the cursor, by id, among the next `limit` rows; and the id up to which they were examined
    (failed rows, never handed out, are passed too: an open-ended job's buffer is not held by them; for deferred
    or fast verification: not past the first ok row still without a reward)."""
    rows = list(Rollout.objects.filter(job=job, pk__gt=cursor).order_by("pk").values(*_FIELDS, "status")[:limit])
    if job.verify_mode != CollectionJob.VerifyMode.INLINE:
        for i, r in enumerate(rows):
            if r["status"] == Rollout.Status.OK and r["reward"] is None:
                rows = rows[:i]
                break
    high = rows[-1]["id"] if rows else cursor
    return [r for r in rows if r["status"] == Rollout.Status.OK], high


def _plan_rows(job, cursor, max_n, current):
    rows, high = _scan(job, cursor, max_n)
    out, stale = [], []
    for r in rows:
        (stale if is_past_bound(r, job, current) else out).append(r["id"])
    return out, stale, 0, high


def _plan_groups(job, cursor, max_n, current, skip_equal):
    R = max(1, job.num_repeats)
    scanned, high = _scan(job, cursor, max(4 * max_n, 2000))
    if not scanned:
        return [], [], 0, cursor
    keys = {(r["task_index"], r["rollout_index"] // R) for r in scanned}
    members: dict[tuple, list[dict]] = {}
    tasks = sorted({t for t, _ in keys})
    qs = Rollout.objects.filter(job=job, status=Rollout.Status.OK, task_index__gte=tasks[0], task_index__lte=tasks[-1])
    if len(tasks) != tasks[-1] - tasks[0] + 1:
        qs = qs.filter(task_index__in=tasks)
    for r in qs.values(*_FIELDS):
        key = (r["task_index"], r["rollout_index"] // R)
        if key in keys:
            members.setdefault(key, []).append(r)
    complete = sorted((max(m["id"] for m in g), g) for g in members.values()
                      if len(g) == R and cursor < max(m["id"] for m in g) <= high)
    out, stale, equal = [], [], 0
    passed = cursor  # the last id of the last group handed out or left out
    for last, g in complete:
        if any(is_past_bound(m, job, current) for m in g):
            stale.extend(m["id"] for m in g)  # the whole group: collected again together, or kept marked
        elif skip_equal and len({m["reward"] for m in g}) == 1:
            equal += 1
        elif out and len(out) + R > max_n:
            return out, stale, equal, passed  # the rest next time
        else:
            out.extend(m["id"] for m in sorted(g, key=lambda m: m["rollout_index"]))
        passed = last
    return out, stale, equal, high


def take(job, name: str, *, max_n: int = 100, wait_s: float = 0.0, groups: bool = False,
         skip_equal: bool = False) -> dict:
    """The consumer's next batch (its pending one again when not acknowledged), waiting up to wait_s for
    rollouts to land. {"token", "cursor", "redelivered", "ids", "skipped_stale", "skipped_equal", "current_version"};
    token "" with no ids when nothing came within wait_s."""
    max_n = max(1, min(int(max_n), MAX_BATCH))
    deadline = time.monotonic() + max(0.0, min(float(wait_s), MAX_WAIT_S))
    skipped_stale = skipped_equal = 0
    while True:
        passed = False
        with transaction.atomic():
            c = consumer_for(job, name, groups=groups, skip_equal=skip_equal)
            c = StreamConsumer.objects.select_for_update().get(pk=c.pk)
            current = current_version(job.endpoint_id)
            if c.pending_token:
                return {"token": c.pending_token, "cursor": c.pending_cursor, "redelivered": True,
                        "ids": list(c.pending_ids), "skipped_stale": 0, "skipped_equal": 0, "current_version": current}
            job.refresh_from_db(fields=["max_version_lag", "stale_policy", "num_repeats", "verify_mode"])
            if groups:
                ids, stale, equal, high = _plan_groups(job, c.cursor, max_n, current, skip_equal)
            else:
                ids, stale, equal, high = _plan_rows(job, c.cursor, max_n, current)
            skipped_equal += equal
            if ids:
                c.pending_token = secrets.token_hex(12)
                c.pending_ids, c.pending_cursor = ids, high
                c.save(update_fields=["pending_token", "pending_ids", "pending_cursor", "updated_at"])
            elif passed := high > c.cursor:  # only left-out (or failed) rows were read: pass them for good
                c.cursor = high
                c.save(update_fields=["cursor", "updated_at"])
        if stale:
            skipped_stale += settle_stale(job, stale)
        if not ids and passed:  # room in an open-ended job's buffer, perhaps
            from .openended import after_ack

            after_ack(job)
        if ids:
            return {"token": c.pending_token, "cursor": high, "redelivered": False, "ids": ids,
                    "skipped_stale": skipped_stale, "skipped_equal": skipped_equal, "current_version": current}
        if passed or stale:
            continue  # read further at once
        if time.monotonic() >= deadline:
            return {"token": "", "cursor": c.cursor, "redelivered": False, "ids": [], "skipped_stale": skipped_stale,
                    "skipped_equal": skipped_equal, "current_version": current}
        time.sleep(POLL_S)


def ack(job, name: str, token: str) -> dict:
    """Acknowledge the consumer's pending batch: the cursor moves past it, for good. Acknowledging the last
    acknowledged token again is a no-op (a retried request)."""
    with transaction.atomic():
        c = StreamConsumer.objects.select_for_update().filter(job=job, name=name).first()
        if c is None:
            raise StreamConflict(f"no consumer {name!r} on job {job.pk}")
        if token and token == c.acked_token:
            return {"cursor": c.cursor, "acked": 0, "delivered": c.delivered}
        if not c.pending_token or token != c.pending_token:
            raise StreamConflict("not the consumer's pending batch (taken again since, or never handed out)")
        n = len(c.pending_ids)
        from .openended import after_ack, record_ack

        c.cursor, c.delivered, c.acked_token = c.pending_cursor, c.delivered + n, token
        c.pending_token, c.pending_ids, c.pending_cursor = "", [], 0
        c.ack_log = record_ack(c, n)
        c.save(update_fields=["cursor", "delivered", "acked_token", "pending_token", "pending_ids", "pending_cursor",
                              "ack_log", "updated_at"])
    after_ack(job)  # an open-ended job: room in its buffer now, perhaps
    return {"cursor": c.cursor, "acked": n, "delivered": c.delivered}


def rows_of(ids: list[int], fields) -> list[dict]:
    """The rows (dicts of `fields`, and `data_text`: the stored JSON as text) in the batch's order."""
    from django.db.models import TextField
    from django.db.models.functions import Cast

    qs = Rollout.objects.filter(pk__in=ids).annotate(data_text=Cast("data", TextField())).values(*fields, "data_text")
    by_id = {r["id"]: r for r in qs}
    return [by_id[i] for i in ids if i in by_id]


def rows_json(ids: list[int], fields) -> list[tuple[dict, str]]:
    """[(row's id, task_index, rollout_index, weight_version, error; the row's `fields` + data as one JSON object
    text, less `error`)] in the batch's order. On PostgreSQL the database writes each object (json_build_object):
    the stored `data` is never decoded and encoded again in Python."""
    from django.db import connection

    from django.core.serializers.json import DjangoJSONEncoder
    import json

    keys = ("id", "task_index", "rollout_index", "weight_version", "error")
    if connection.vendor != "postgresql":
        out = []
        for r in rows_of(ids, fields):
            data = r.pop("data_text")
            head = {k: r[k] for k in keys}
            r.pop("error")
            out.append((head, json.dumps(r, cls=DjangoJSONEncoder, ensure_ascii=False)[:-1] + ', "data": ' + data + "}"))
        return out
    meta = Rollout._meta
    qn = connection.ops.quote_name
    pairs = ", ".join(f"'{f}', {qn(meta.get_field(f).column)}" for f in fields if f != "error")
    sql = (f"SELECT {', '.join(qn(meta.get_field(k).column) for k in keys)}, "
           f"json_build_object({pairs}, 'data', {qn(meta.get_field('data').column)})::text "
           f"FROM {qn(meta.db_table)} WHERE {qn(meta.pk.column)} = ANY(%s)")
    with connection.cursor() as cur:
        cur.execute(sql, [list(ids)])
        by_id = {r[0]: (dict(zip(keys, r[:5])), r[5]) for r in cur.fetchall()}
    return [by_id[i] for i in ids if i in by_id]


def group_ids(job, rows: list[dict]) -> list[list[int]]:
    """The rows' groups (task, occurrence), each its ids in repeat order, in the order the batch has them."""
    R = max(1, job.num_repeats)
    out: dict[tuple, list[int]] = {}
    for r in rows:
        out.setdefault((r["task_index"], r["rollout_index"] // R), []).append(r["id"])
    return list(out.values())


def consumers(job) -> list[dict]:
    return [{"name": c.name, "groups": c.groups, "skip_equal": c.skip_equal, "cursor": c.cursor,
             "delivered": c.delivered, "pending": len(c.pending_ids), "updated_at": c.updated_at}
            for c in StreamConsumer.objects.filter(job=job).order_by("name")]
