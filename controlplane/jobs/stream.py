"""The rollout stream for trainers: batches of a job's verified rollouts as they land, exactly once per named
consumer, and bounded staleness (a rollout whose version lag is past the job's max_version_lag is never
handed out: collected again or kept and marked).

A consumer (StreamConsumer) has a durable cursor: a rollout id. `take` hands out the next batch after the
cursor and remembers it as pending (its token, its row ids packed as runs of consecutive ids, where the cursor
goes); `ack(token)` moves the cursor. Until it is acknowledged, every `take` hands out the same pending batch
again, so a trainer that dies between take and ack gets it again after its restart, and once acknowledged a
batch is never handed out again.

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

import json
import secrets
import time
from typing import Iterator

from django.db import connection, transaction
from django.utils import timezone

from controlplane.limits import STREAM_MAX_BATCH as MAX_BATCH
from controlplane.limits import STREAM_MAX_BATCH_BYTES as MAX_BATCH_BYTES

from controlplane.endpoints.models import WeightVersion

from .models import CollectionJob, JobChunk, JobState, Rollout, StreamConsumer

MAX_WAIT_S = 30.0
POLL_S = 0.05
_FIELDS = ("id", "task_index", "rollout_index", "reward", "weight_version", "stale")
_HEAD = ("id", "task_index", "rollout_index", "weight_version", "error")  # what the view needs beside the text
# A batch's row as the database hands it over, kept as it is (no dict per row): the values of _HEAD, then the
# reward, stale (and, while planning, the status), and the row's JSON text last.
ROW_ID, ROW_TASK, ROW_REPEAT, ROW_VERSION, ROW_ERROR, ROW_TEXT = 0, 1, 2, 3, 4, -1
_PLAIN_JSON = ("AutoField", "BigAutoField", "IntegerField", "BigIntegerField", "SmallIntegerField",
               "PositiveIntegerField", "PositiveBigIntegerField", "PositiveSmallIntegerField", "BooleanField")  # ::text is JSON
SCAN_PAGE = 5000  # rows mode reads the rows' JSON in pages of this many, up to `max` or MAX_BATCH_BYTES
STREAM_PAGE = 500  # take_streamed's pages: through uvicorn, 250-500 rows a page read 1.2x the rows/s of 2,500


class StreamConflict(Exception):
    """The request does not fit the consumer's state (another mode, an unknown token)."""


def lock_job_for_insert(job_id) -> None:
    """In the sink's write transaction, before the insert: one writer of the job's rows at a time, so that
    their ids are allocated in commit order (the stream's cursor skips nothing)."""
    list(CollectionJob.objects.select_for_update().filter(pk=job_id).values_list("pk", flat=True))


def stamp_rows(rows: list[dict]):
    """Once lock_job_for_insert returned: the rows' store time (created_at), now. The lock can wait behind the
    job's other writers (every chunk's sink); a row stamped before that wait would count, by its store time, in a
    rate read before it was committed (the live rate would miss it). Stamped here, store times follow commit
    order, as the ids do."""
    now = timezone.now()
    for row in rows:
        row["created_at"] = now
    return now


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


# --- the pending batch, compact -------------------------------------------------------------------
def pack_ids(ids: list[int]) -> list:
    """The batch's ids in their order, each run of consecutive ids (id, id+1, ...) as [first, last]: a batch
    of rows read by id is a handful of runs (one when nothing else was written in between), not thousands of
    numbers written with the consumer's row and read back at its ack. Exact: every id of a run is in the batch."""
    out: list = []
    start = prev = None
    for i in ids:
        if prev is not None and i == prev + 1:
            prev = i
            continue
        if start is not None:
            out.append(start if start == prev else [start, prev])
        start = prev = i
    if start is not None:
        out.append(start if start == prev else [start, prev])
    return out


def unpack_ids(packed: list) -> list[int]:
    """pack_ids undone; a plain list of ids (as stored before runs) is its own unpacking."""
    out: list[int] = []
    for p in packed:
        if isinstance(p, list):
            out.extend(range(p[0], p[1] + 1))
        else:
            out.append(p)
    return out


def packed_len(packed: list) -> int:
    return sum(p[1] - p[0] + 1 if isinstance(p, list) else 1 for p in packed)


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


def _plan_rows_read(job, cursor, max_n, current, fields):
    """_plan_rows reading the batch's rows whole in the same pass (PostgreSQL): ids, stale ids, 0, the id up to
    which rows were examined, and the batch's rows as rows_json gives them (with the reward, stale and status
    between the head and the text, as read). The rows' JSON stops before the row
    that would take it past MAX_BATCH_BYTES (at least one row); the cursor then stops there too."""
    plan: dict = {}
    rows = [r for page in _plan_rows_pages(job, cursor, max_n, current, fields, SCAN_PAGE, plan) for r in page]
    return plan["ids"], plan["stale"], 0, plan["high"], rows


def _plan_rows_pages(job, cursor, max_n, current, fields, page_rows: int, plan: dict, streamed: bool = False):
    """_plan_rows_read as it reads: yields each page's rows to hand out (a list, perhaps empty) as soon as the page
    is read, and when done sets plan["ids"], plan["stale"], plan["high"] (see _plan_rows_read).

    `streamed` (a batch sent as it is read): one query for the batch, its rows received in chunks of `page_rows` as
    PostgreSQL sends them (libpq's chunked rows mode, psycopg's stream(size=...)), so the database goes on writing
    the next rows while this process formats and sends a page; a query per page made the two wait on each other.
    Else a query per page, each fetched whole (a batch answered as one document: nothing to overlap)."""
    inline = job.verify_mode == CollectionJob.VerifyMode.INLINE
    bound = job.max_version_lag
    # failed rows are read too (their JSON left out) and passed, never handed out: as _scan does
    sql = _select_sql(fields, with_status=True) + " WHERE job_id = %s AND id > %s ORDER BY id LIMIT %s"
    lag_past: dict[str, bool] = {}
    ok = str(Rollout.Status.OK)  # a plain str: compared once per row
    out, stale = [], []
    plan.update(ids=out, stale=stale, high=cursor)
    high, size = cursor, 0
    with connection.cursor() as cur:
        while len(out) + len(stale) < max_n:  # failed rows take places in LIMIT, not in the batch: read on
            want = max_n - len(out) - len(stale)
            if streamed:
                source = _streamed_rows(cur, sql, [job.pk, high, want], page_rows)
            else:
                want = min(want, page_rows)
                cur.execute(sql, [job.pk, high, want])
                source = cur.fetchall()
            rows, read, ended = [], 0, False
            # read to the end even once the batch is planned (`ended`): leaving psycopg's stream early cancels the
            # query, which would abort the take's transaction; what is left is at most `want` rows
            for r in source:
                read += 1
                if ended:
                    continue
                rid, _, _, wv, _, reward, is_stale, status, text = r
                if status != ok:
                    high = rid
                elif reward is None and not inline:  # deferred verification: not past an unverified row
                    ended = True
                    continue
                else:
                    if is_stale:
                        past = True
                    elif bound is None:
                        past = False
                    else:
                        past = lag_past.get(wv)
                        if past is None:
                            lag = lag_of(wv, current)
                            past = lag_past[wv] = lag is not None and lag > bound
                    if past:
                        stale.append(rid)
                    elif out and size + len(text) > MAX_BATCH_BYTES:
                        ended = True
                        continue
                    else:
                        size += len(text)
                        out.append(rid)
                        rows.append(r)
                    high = rid
                if streamed and read % page_rows == 0 and not ended:
                    plan["high"] = high
                    yield rows
                    rows = []
            plan["high"] = high
            if rows or not streamed:
                yield rows
            if ended or read < want:
                return


def _streamed_rows(cur, sql: str, params: list, chunk_rows: int):
    """The rows of `sql` as PostgreSQL sends them, received `chunk_rows` at a time (libpq 17+; row by row before)."""
    from psycopg import pq

    return cur.cursor.stream(sql, params, size=chunk_rows if pq.version() >= 170000 else 1)


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
         skip_equal: bool = False, fields=None, ack_token: str | None = None) -> dict:
    """The consumer's next batch (its pending one again when not acknowledged), waiting up to wait_s for
    rollouts to land. {"token", "cursor", "redelivered", "ids", "skipped_stale", "skipped_equal", "current_version",
    "rows"}; token "" with no ids when nothing came within wait_s. `fields`: the rows' fields as rows_json(ids,
    fields) gives them (which rows are handed out does not depend on them); on PostgreSQL a fresh batch of rows (not
    groups) is read whole while it is planned and comes as "rows" (else "rows" is None: read them with rows_json).
    `ack_token`: acknowledge that batch first, as ack() does, in the same transaction as the take's first look (one
    request per batch: fewer round trips to the database, each a wait for its process to be scheduled on a busy
    machine). `job`: as read just before (the first look uses its bound and repeats as they are; the later looks of
    a long poll read them again)."""
    for kind, value in _take_steps(job, name, max_n=max_n, wait_s=wait_s, groups=groups, skip_equal=skip_equal,
                                   fields=fields, ack_token=ack_token, stream=False):
        if kind == "end":
            return value
    raise AssertionError("a take ends with its batch")  # pragma: no cover


def take_streamed(job, name: str, *, max_n: int = 100, wait_s: float = 0.0, fields=None,
                  ack_token: str | None = None) -> Iterator[tuple[str, object]]:
    """take() for rows (not groups) on PostgreSQL, as it reads: yields ("current", the current version) at each
    look (its first, once the consumer is locked and `ack_token` applied: a StreamConflict comes before it), then
    ("rows", [row tuples as rows_json gives them]) page by page (STREAM_PAGE rows) while the batch is planned, so a
    reader decodes a page while the database writes the next, then ("end", take()'s dict less "rows"), sent once the
    batch is committed as the consumer's pending one: a reader that has the end line holds a token it can
    acknowledge. A reader that hangs up before it leaves the transaction rolled back (nothing handed out, nothing
    acknowledged: the same rows come again)."""
    return _take_steps(job, name, max_n=max_n, wait_s=wait_s, groups=False, skip_equal=False, fields=fields,
                       ack_token=ack_token, stream=True)


def _take_steps(job, name: str, *, max_n: int, wait_s: float, groups: bool, skip_equal: bool, fields,
                ack_token: str | None, stream: bool) -> Iterator[tuple[str, object]]:
    """The one loop of take() and take_streamed(): ("current", version) at each look, ("rows", page) as a
    streamed batch's rows are read (`stream`: rows mode on PostgreSQL, a redelivered batch's too), then ("end", the
    batch's dict: with "rows" unless streamed)."""
    from . import services

    max_n = max(1, min(int(max_n), MAX_BATCH))
    deadline = time.monotonic() + max(0.0, min(float(wait_s), MAX_WAIT_S))
    skipped_stale = skipped_equal = 0
    looked = False
    while True:
        passed, redelivered, rows, stale = False, None, None, []
        with transaction.atomic():
            c = _locked_consumer(job, name, groups=groups, skip_equal=skip_equal)
            acked = []
            if ack_token:
                acked = _ack_in(c, ack_token)  # saved with what the take changes, in one UPDATE
                ack_token = None  # once: a take that waits and looks again does not acknowledge again
            current = current_version(job.endpoint_id)
            yield "current", current  # before any row: the rows' lag is worked out against it
            if c.pending_token:  # (an acknowledgement just applied leaves none pending)
                ids = unpack_ids(c.pending_ids)
                if stream:
                    for k in range(0, len(ids), STREAM_PAGE):
                        yield "rows", rows_json(ids[k:k + STREAM_PAGE], fields)
                redelivered = {"token": c.pending_token, "cursor": c.pending_cursor, "redelivered": True, "ids": ids,
                               "skipped_stale": 0, "skipped_equal": 0, "current_version": current}
            else:
                if looked:  # `job` was read by the caller just before (its request); a long poll's later looks re-read it
                    job.refresh_from_db(fields=["max_version_lag", "stale_policy", "num_repeats", "verify_mode"])
                looked = True
                equal = 0
                if groups:
                    ids, stale, equal, high = _plan_groups(job, c.cursor, max_n, current, skip_equal)
                elif stream:
                    plan: dict = {}
                    for page in _plan_rows_pages(job, c.cursor, max_n, current, fields, STREAM_PAGE, plan,
                                                 streamed=True):
                        if page:
                            yield "rows", page
                    ids, stale, high = plan["ids"], plan["stale"], plan["high"]
                elif fields is not None and connection.vendor == "postgresql":
                    ids, stale, equal, high, rows = _plan_rows_read(job, c.cursor, max_n, current, fields)
                else:
                    ids, stale, equal, high = _plan_rows(job, c.cursor, max_n, current)
                skipped_equal += equal
                if ids:
                    c.pending_token = secrets.token_hex(12)
                    c.pending_ids, c.pending_cursor = pack_ids(ids), high
                    c.save(update_fields={"pending_token", "pending_ids", "pending_cursor", "updated_at", *acked})
                elif passed := high > c.cursor:  # only left-out (or failed) rows were read: pass them for good
                    c.cursor = high
                    c.save(update_fields={"cursor", "updated_at", *acked})
                elif acked:
                    c.save(update_fields=acked)
        if redelivered is not None:
            if not stream:
                redelivered["rows"] = None
            yield "end", redelivered
            return
        if stale:
            skipped_stale += settle_stale(job, stale)
        if acked or (not ids and passed):  # room in an open-ended job's buffer, perhaps
            services.after_stream_ack(job)
        if ids:
            end = {"token": c.pending_token, "cursor": high, "redelivered": False, "ids": ids,
                   "skipped_stale": skipped_stale, "skipped_equal": skipped_equal, "current_version": current}
            if not stream:
                end["rows"] = rows
            yield "end", end
            return
        if passed or stale:
            continue  # read further at once
        if time.monotonic() >= deadline:
            end = {"token": "", "cursor": c.cursor, "redelivered": False, "ids": [], "skipped_stale": skipped_stale,
                   "skipped_equal": skipped_equal, "current_version": current}
            if not stream:
                end["rows"] = []
            yield "end", end
            return
        time.sleep(POLL_S)


def ack(job, name: str, token: str) -> dict:
    """Acknowledge the consumer's pending batch: the cursor moves past it, for good. Acknowledging the last
    acknowledged token again is a no-op (a retried request)."""
    with transaction.atomic():
        c = StreamConsumer.objects.select_for_update().filter(job=job, name=name).first()
        if c is None:
            raise StreamConflict(f"no consumer {name!r} on job {job.pk}")
        before = c.delivered
        changed = _ack_in(c, token)
        if changed:
            c.save(update_fields=changed)
    from . import services

    services.after_stream_ack(job)  # an open-ended job: room in its buffer now, perhaps
    return {"cursor": c.cursor, "acked": c.delivered - before, "delivered": c.delivered}


def _ack_in(c: StreamConsumer, token: str) -> list[str]:
    """The acknowledgement of `token` applied to the locked consumer `c` (not saved): the fields it changed, []
    for the last acknowledged token again (a retried request). StreamConflict for any other token."""
    if token and token == c.acked_token:
        return []
    if not c.pending_token or token != c.pending_token:
        raise StreamConflict("not the consumer's pending batch (taken again since, or never handed out)")
    n = packed_len(c.pending_ids)
    from .openended import record_ack

    c.cursor, c.delivered, c.acked_token = c.pending_cursor, c.delivered + n, token
    c.pending_token, c.pending_ids, c.pending_cursor = "", [], 0
    c.ack_log = record_ack(c, n)
    return ["cursor", "delivered", "acked_token", "pending_token", "pending_ids", "pending_cursor", "ack_log",
            "updated_at"]


def _locked_consumer(job, name: str, *, groups: bool, skip_equal: bool) -> StreamConsumer:
    """The consumer locked (select_for_update) in one query when it exists; else created first (consumer_for)."""
    c = StreamConsumer.objects.select_for_update().filter(job=job, name=name).first()
    if c is None:
        c = consumer_for(job, name, groups=groups, skip_equal=skip_equal)
        return StreamConsumer.objects.select_for_update().get(pk=c.pk)
    if (c.groups, c.skip_equal) != (groups, skip_equal):
        raise StreamConflict(f"consumer {name!r} takes {'groups' if c.groups else 'rows'}"
                             f"{' without all-equal groups' if c.skip_equal else ''}; use another name for another mode")
    return c


def rows_of(ids: list[int], fields) -> list[dict]:
    """The rows (dicts of `fields`, and `data_text`: the stored JSON as text) in the batch's order."""
    from django.db.models import TextField
    from django.db.models.functions import Cast

    qs = Rollout.objects.filter(pk__in=ids).annotate(data_text=Cast("data", TextField())).values(*fields, "data_text")
    by_id = {r["id"]: r for r in qs}
    return [by_id[i] for i in ids if i in by_id]


def _select_sql(fields, with_status: bool = False) -> str:
    """SELECT id, task_index, rollout_index, weight_version, error, reward, stale, (status,) and the row's `fields` (less
    `error`; `id` always, first; `data` last when named) as one JSON object text written by PostgreSQL without its
    closing brace, FROM the rollouts table. The object is each value's JSON text joined with `||`: half the
    database time of json_build_object (which works out every argument's type again on every row; 2,000 rows:
    27 ms against 58 ms, data::text alone 14 ms, min of 12 runs), the same JSON values; integers and booleans as
    their ::text (3 ms less again); `||` rather than concat() (variadic, each argument looked up and converted
    through its type's output function again): 43-44 ms against 46-48 for 5,000 rows, data::text alone 39."""
    meta = Rollout._meta
    qn = connection.ops.quote_name
    named = ["id", *(f for f in fields if f not in ("id", "error", "data"))]
    col = {f: qn(meta.get_field(f).column) for f in (*named, *_HEAD, "reward", "stale", "data")}
    parts = []
    for k, f in enumerate(named):
        field = meta.get_field(f)
        parts.append("'%s%s: '" % ("{" if k == 0 else ", ", json.dumps(f)))
        value = f"{col[f]}::text" if field.get_internal_type() in _PLAIN_JSON else f"to_json({col[f]})::text"
        parts.append(f"coalesce({value}, 'null')" if field.null else value)
    if "data" in fields:
        parts += ["', \"data\": '", f"{col['data']}::text"]
    text = " || ".join(parts)  # every part is non-null (coalesce above): NULL || text would be NULL
    status = ""
    if with_status:  # the status before the text, and no JSON written for a row that is not ok
        st = qn(meta.get_field("status").column)
        status, text = f"{st}, ", f"CASE WHEN {st} = '{Rollout.Status.OK}' THEN {text} END"
    return (f"SELECT {', '.join(col[k] for k in _HEAD)}, {col['reward']}, {col['stale']}, {status}"
            f"{text} FROM {qn(meta.db_table)}")


def rows_json(ids: list[int], fields) -> list[tuple]:
    """The batch's rows in its order, each a tuple: id, task_index, rollout_index, weight_version, error (ROW_ID ..
    ROW_ERROR), and last (ROW_TEXT) the row's `fields` as one JSON object text, `id` first, less `error`, `data`
    last when named, less its closing brace. On PostgreSQL the database writes each object (_select_sql): the
    stored `data` is never decoded and encoded again in Python."""
    from django.core.serializers.json import DjangoJSONEncoder

    if connection.vendor != "postgresql":
        named = ["id", *(f for f in fields if f not in ("id", "error", "data"))]
        out = []
        for r in rows_of(ids, sorted({*named, *_HEAD})):
            data = r.pop("data_text")
            text = json.dumps({k: r[k] for k in named}, cls=DjangoJSONEncoder, ensure_ascii=False)[:-1]
            out.append((*(r[k] for k in _HEAD), text + (', "data": ' + data if "data" in fields else "")))
        return out
    with connection.cursor() as cur:
        cur.execute(_select_sql(fields) + f" WHERE {connection.ops.quote_name(Rollout._meta.pk.column)} = ANY(%s)",
                    [list(ids)])
        by_id = {r[ROW_ID]: r for r in cur.fetchall()}
    return [by_id[i] for i in ids if i in by_id]


def group_ids(job, rows: list[tuple]) -> list[list[int]]:
    """The rows' (rows_json's tuples) groups (task, occurrence), each its ids in repeat order, in the order the
    batch has them."""
    R = max(1, job.num_repeats)
    out: dict[tuple, list[int]] = {}
    for r in rows:
        out.setdefault((r[ROW_TASK], r[ROW_REPEAT] // R), []).append(r[ROW_ID])
    return list(out.values())


def consumers(job) -> list[dict]:
    return [{"name": c.name, "groups": c.groups, "skip_equal": c.skip_equal, "cursor": c.cursor,
             "delivered": c.delivered, "pending": packed_len(c.pending_ids), "updated_at": c.updated_at}
            for c in StreamConsumer.objects.filter(job=job).order_by("name")]
