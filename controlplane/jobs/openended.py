"""Open-ended collection: a job that keeps collecting, pass after pass over its dataset (each pass optionally in
its own seeded shuffled order, with fresh repeat indices), until its owner stops it, and never more than a bounded
buffer ahead of what the trainer's named stream consumer (controlplane.jobs.stream) has acknowledged: the
async-RL pattern (an orchestrator running ahead of its trainer), with exactly-once storage.

The job's `open_ended` holds {"buffer", "shuffle", "seed", "consumer", "stride", "chunk_rows", "stopping"}.
Chunks are made as they are needed, never all at creation: `add_chunks` (services.top_up_open_ended) adds
the next chunk (the next `chunk_rows`
positions of the current pass, or the first of the next pass) while

    unconsumed + open_rows * R < buffer

where unconsumed = the job's stored rollouts (ok or failed) with an id past the consumer's cursor, and open_rows
the rows of its chunks not yet done (their rollouts, stored or not, counted once more: the check is
conservative). `unconsumed + rollouts still to be stored` only grows when a chunk is added, by at most
C = chunk_rows * R, and only from below `buffer`, so at any time

    stored - consumed  <=  buffer + C - 1        (C = chunk_rows * R; chunk_rows = min(chunk_size, buffer // R))

It runs when a chunk is done, when the consumer acknowledges a batch, at resume and from the watchdog's
finalization path. Pass p's rollout indices are p * stride + occurrence * R + r, with stride =
(the dataset's largest occurrence + 1) * R, so (task, repeat) - the exactly-once key - never repeats across passes
and a stream group (task, rollout_index // R) is one pass's repeats of one row.

Stopping: `stop` lets the chunks in flight finish, adds no more, and completes the job when the last is done;
`cancel` (services.cancel_job) stops the chunks within about a second; either way every stored rollout is stored
once (the unique (job, task, repeat) key) and stays in the stream.
"""

from __future__ import annotations

import functools
import random
from array import array
import time

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import F, Max, Sum

from .models import CollectionJob, InvalidTransition, JobChunk, JobState, Rollout, StreamConsumer

MAX_INDEX = 2**31 - 1  # rollout_index is a 32-bit column
DEFAULT_CONSUMER = "trainer"
RATE_WINDOW_S = 60.0
ACK_LOG_KEEP_S = 300.0
ACK_LOG_MAX = 1000
_CONSUMER_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def options_for(value, *, dataset, limit, num_repeats, chunk_size) -> dict | None:
    """The job's `open_ended` from the user's value (None or an object {buffer, shuffle, seed, consumer});
    raises ValidationError({"open_ended": why})."""
    if value is None:
        return None

    def bad(why):
        return ValidationError({"open_ended": why})

    if not isinstance(value, dict):
        raise bad("must be an object {buffer, shuffle, seed, consumer} or null")
    unknown = set(value) - {"buffer", "shuffle", "seed", "consumer"}
    if unknown:
        raise bad(f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
    buffer, shuffle = value.get("buffer"), value.get("shuffle", False)
    seed, consumer = value.get("seed", 0), value.get("consumer", DEFAULT_CONSUMER)
    if not isinstance(buffer, int) or isinstance(buffer, bool) or not 1 <= buffer <= MAX_INDEX:
        raise bad(f"buffer must be an integer >= 1 (rollouts stored ahead of the consumer), not {buffer!r}")
    if not isinstance(shuffle, bool):
        raise bad(f"shuffle must be true or false, not {shuffle!r}")
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_INDEX:
        raise bad(f"seed must be an integer >= 0, not {seed!r}")
    if (
        not isinstance(consumer, str)
        or not 1 <= len(consumer) <= 100
        or not set(consumer) <= _CONSUMER_CHARS
        or not consumer[0].isalnum()
    ):
        raise bad(f"consumer must be a stream consumer's name (letters, digits, . _ -), not {consumer!r}")
    n_rows = min(limit, dataset.row_count) if limit else dataset.row_count
    top = dataset.rows.filter(index__lt=n_rows).aggregate(m=Max("occurrence"))["m"] or 0
    stride = (top + 1) * num_repeats
    if 2 * stride > MAX_INDEX:
        raise bad("the dataset's repeats leave no room for a second pass")
    return {
        "buffer": buffer,
        "shuffle": shuffle,
        "seed": seed,
        "consumer": consumer,
        "stride": stride,
        "chunk_rows": max(1, min(chunk_size, buffer // num_repeats)),
        "stopping": False,
    }


def pass_offset(job, pass_index: int) -> int:
    """What pass `pass_index` adds to every rollout index (0 for a job of one pass)."""
    return pass_index * job.open_ended["stride"] if job.open_ended else 0


@functools.lru_cache(maxsize=4)
def _order(n_rows: int, seed: int, pass_index: int) -> array:
    """A shuffled pass's row order (4 bytes a row: 4 MB kept for a 1M-row dataset, one per cached pass)."""
    order = list(range(n_rows))
    random.Random(f"{seed}:{pass_index}").shuffle(order)
    return array("I", order)


def pass_rows(job, pass_index: int, start: int, stop: int) -> list[int] | None:
    """The dataset row indices at positions [start, stop) of the pass's order; None when the order is the
    dataset's own (no shuffle: positions are row indices)."""
    if not (job.open_ended and job.open_ended.get("shuffle")):
        return None
    return list(_order(n_rows(job), job.open_ended["seed"], pass_index)[start:stop])


def n_rows(job) -> int:
    return min(job.limit, job.dataset.row_count) if job.limit else job.dataset.row_count


# --- the dispatcher -----------------------------------------------------------------------------------
def _consumer_cursor(job) -> int:
    return (
        StreamConsumer.objects.filter(job_id=job.pk, name=job.open_ended["consumer"])
        .values_list("cursor", flat=True)
        .first()
        or 0
    )


def unconsumed(job) -> int:
    """Stored rollouts (ok or failed) past the consumer's cursor: the buffer's fill."""
    return Rollout.objects.filter(job_id=job.pk, pk__gt=_consumer_cursor(job)).count()


def _open_rows(job) -> int:
    return (
        JobChunk.objects.filter(job_id=job.pk)
        .exclude(state=JobChunk.State.DONE)
        .aggregate(n=Sum(F("end_row") - F("start_row")))["n"]
        or 0
    )


def add_chunks(job) -> tuple[CollectionJob | None, list[int]]:
    """Add the next chunks while the buffer has room (the module's rule): the job as locked and the new chunks'
    ids (services.top_up_open_ended dispatches them). Under the job's row lock, so concurrent callers add each
    chunk once."""
    with transaction.atomic():
        fresh = CollectionJob.objects.select_for_update().select_related("dataset").get(pk=job.pk)
        oe = fresh.open_ended
        if not oe or oe.get("stopping") or fresh.state not in JobState.RUNNABLE:
            return None, []
        R, rows, size = fresh.num_repeats, n_rows(fresh), oe["chunk_rows"]
        filled, open_rows = unconsumed(fresh), _open_rows(fresh)
        last = (
            JobChunk.objects.filter(job_id=fresh.pk).order_by("-index").values("index", "pass_index", "end_row").first()
        )
        index, pass_index, start = (last["index"] + 1, last["pass_index"], last["end_row"]) if last else (0, 0, 0)
        new = []
        while filled + open_rows * R < oe["buffer"]:
            if start >= rows:
                pass_index, start = pass_index + 1, 0
            if (pass_index + 1) * oe["stride"] > MAX_INDEX:
                break  # no fresh repeat indices left (about 2**31 / stride passes)
            end = min(start + size, rows)
            new.append(JobChunk(job=fresh, index=index, pass_index=pass_index, start_row=start, end_row=end))
            open_rows += end - start
            index, start = index + 1, end
        if not new:
            return None, []
        JobChunk.objects.bulk_create(new)
        added = sum(c.end_row - c.start_row for c in new) * R
        CollectionJob.objects.filter(pk=fresh.pk).update(total_rollouts=F("total_rollouts") + added)
        ids = list(JobChunk.objects.filter(job_id=fresh.pk, index__gte=new[0].index).values_list("pk", flat=True))
    return fresh, ids


def chunks_of(job, pairs) -> set[int]:
    """The ids of the chunks that collect these (task_index, rollout_index) pairs: the pass of the repeat index,
    the position of the row (task, occurrence) in that pass's order (bounded staleness's recollect reopens them)."""
    oe, R = job.open_ended, job.num_repeats
    wanted = {(t, (r % oe["stride"]) // R, r // oe["stride"]) for t, r in pairs}
    rows = {}
    for index, t, occurrence in job.dataset.rows.filter(task_index__in={t for t, _, _ in wanted}).values_list(
        "index", "task_index", "occurrence"
    ):
        rows[(t, occurrence)] = index
    out = set()
    for t, occurrence, p in wanted:
        index = rows.get((t, occurrence))
        if index is None:
            continue
        position = index
        if oe.get("shuffle"):
            position = _order(n_rows(job), oe["seed"], p).index(index)
        out.update(
            JobChunk.objects.filter(
                job_id=job.pk, pass_index=p, start_row__lte=position, end_row__gt=position
            ).values_list("pk", flat=True)
        )
    return out


def mark_stopping(job) -> tuple[CollectionJob, bool]:
    """Mark an open-ended job stopping (no more chunks; those in flight finish): the job as locked, and whether
    chunks are still open (none: services.stop_job completes it now)."""
    with transaction.atomic():
        fresh = CollectionJob.objects.select_for_update().get(pk=job.pk)
        if not fresh.open_ended:
            raise InvalidTransition("only an open-ended job can be stopped; cancel this one")
        if fresh.state not in JobState.RUNNABLE:
            raise InvalidTransition(f"cannot stop a job that is {fresh.state} (resume it first, or cancel it)")
        fresh.open_ended = {**fresh.open_ended, "stopping": True}
        fresh.save(update_fields=["open_ended"])
        open_chunks = JobChunk.objects.filter(job_id=fresh.pk).exclude(state=JobChunk.State.DONE).exists()
    return fresh, open_chunks


def is_waiting(job) -> bool:
    """An open-ended job that runs on (not stopping), for the finalization paths to leave it running."""
    return bool(job.open_ended) and not job.open_ended.get("stopping")


# --- the consumer's side ------------------------------------------------------------------------------
def record_ack(consumer: StreamConsumer, n: int, now: float | None = None) -> list:
    """The consumer's ack_log with this acknowledgement of `n` rollouts added (recent ones kept)."""
    now = time.time() if now is None else now
    log = [e for e in (consumer.ack_log or []) if e[0] >= now - ACK_LOG_KEEP_S][-(ACK_LOG_MAX - 1) :]
    log.append([round(now, 3), n])
    return log


def figures(job, now: float | None = None) -> dict | None:
    """The buffer and the trainer's consumption, as the job page and the API show them (None for a job of one
    pass): buffer, bound (the most ever stored ahead: buffer + C - 1), unconsumed (stored past the consumer's
    cursor), fill (unconsumed / buffer), consumed (stored up to the cursor), acked (rollouts the consumer
    acknowledged), acked_recent / consumption_per_s over window_s (the last RATE_WINDOW_S, or the consumer's
    life when shorter), pass_index (the newest chunk's pass), stopping."""
    oe = job.open_ended
    if not oe:
        return None
    now = time.time() if now is None else now
    c = StreamConsumer.objects.filter(job_id=job.pk, name=oe["consumer"]).first()
    cursor = c.cursor if c else 0
    ok, failed = CollectionJob.objects.filter(pk=job.pk).values_list("completed_count", "failed_count").first()
    stored = ok + failed  # the job's counters, bumped in the transaction that stores the rows
    ahead = Rollout.objects.filter(job_id=job.pk, pk__gt=cursor).count()
    window = RATE_WINDOW_S
    recent = 0
    if c is not None:
        window = round(max(1.0, min(RATE_WINDOW_S, now - c.created_at.timestamp())), 3)
        recent = sum(n for t, n in (c.ack_log or []) if t >= now - window)
    newest = JobChunk.objects.filter(job_id=job.pk).aggregate(p=Max("pass_index"))["p"]
    chunk_rollouts = oe["chunk_rows"] * job.num_repeats
    return {
        "consumer": oe["consumer"],
        "buffer": oe["buffer"],
        "chunk_rollouts": chunk_rollouts,
        "bound": oe["buffer"] + chunk_rollouts - 1,
        "stored": stored,
        "unconsumed": ahead,
        "fill": round(ahead / oe["buffer"], 4),
        "consumed": stored - ahead,
        "acked": c.delivered if c else 0,
        "acked_recent": recent,
        "window_s": window,
        "consumption_per_s": round(recent / window, 3),
        "pass_index": newest or 0,
        "shuffle": oe["shuffle"],
        "seed": oe["seed"],
        "stopping": bool(oe.get("stopping")),
    }


def panel_context(request, job) -> dict:
    return {"oe": figures(job)}
