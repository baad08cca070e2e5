"""The rollout stream as a library a trainer imports (HTTP only, no Django):

    from rolloutctl.stream import RolloutStream

    stream = RolloutStream("http://127.0.0.1:8000", token, job=42, consumer="grpo", max=64, groups=True,
                           skip_equal=True)
    for batch in stream.batches():          # long-polls GET /api/jobs/42/stream/
        for group in batch.groups():        # all repeats of a task together
            ...                             # compute the loss, step
    # each batch is acknowledged when the loop asks for the next one: a trainer killed inside the loop body
    # gets the same batch again after its restart (same consumer name), and an acknowledged batch never again.

`fields=TRAIN_FIELDS` (or any of the rollout's field names): each rollout carries only those (`id` always), which
makes batches smaller and the stream faster; which rollouts come does not depend on it. `Batch.groups()` without
groups=True needs task_index and rollout_index among them.

Rows (not groups) come as JSON lines (`lines=True`, the default): each rollout is decoded as it arrives while the
server reads the next ones; a batch cut off on the way is taken again (the same rows come).

Exactly once per consumer name: the control plane keeps the cursor. Acknowledge yourself with
`stream.take()` / `stream.ack(batch)` when a step must be saved (a checkpoint) before the batch counts as done.
"""
from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from .client import BODY_ERRORS, ApiError, Client, loads

TERMINAL_STATES = {"completed", "cancelled", "failed"}
NDJSON = "application/x-ndjson"
TRAIN_FIELDS = ("id", "task_index", "rollout_index", "reward", "weight_version", "data")  # what a trainer trains on


@dataclass
class Batch:
    job: int
    consumer: str
    token: str
    cursor: int
    redelivered: bool
    rollouts: list[dict] = field(default_factory=list)
    skipped_stale: int = 0
    skipped_equal: int = 0
    current_version: int | None = None
    group_ids: list[list[int]] | None = None  # groups mode: each group's rollout ids
    taken_at: float = 0.0  # time.time() when the trainer had it

    def __len__(self) -> int:
        return len(self.rollouts)

    def groups(self) -> list[list[dict]]:
        """The batch's complete groups (all repeats of a task, in repeat order) when the stream was opened with
        groups=True; otherwise the rollouts by task_index."""
        if self.group_ids is not None:
            by_id = {r["id"]: r for r in self.rollouts}
            return [[by_id[i] for i in g if i in by_id] for g in self.group_ids]
        out: dict[int, list[dict]] = {}
        for r in self.rollouts:
            out.setdefault(r["task_index"], []).append(r)
        return [sorted(g, key=lambda r: r["rollout_index"]) for g in out.values()]


# rollouts asked for per take: each request costs a fixed ~20 ms (auth, job, the take's transaction and commit)
# that the export pays once per download; 2,000 rows (~3.5 MB) keep that under half of the batch's read+decode
DEFAULT_MAX = 2000


class RolloutStream:
    def __init__(self, base_url: str, token: str | None, job: int, consumer: str, *, max: int = DEFAULT_MAX,  # noqa: A002
                 wait: float = 10.0, groups: bool = False, skip_equal: bool = False, client: Client | None = None,
                 fields: Iterable[str] | None = None, lines: bool = True):
        self.client = client or Client(base_url, token, timeout_s=max_wait(wait) + 30)
        self.job = int(job)
        self.consumer = consumer
        self.max = int(max)
        self.wait = float(wait)
        self.groups = bool(groups)
        self.skip_equal = bool(skip_equal)
        self.fields = None if fields is None else ",".join(fields)  # None: every field
        self.lines = bool(lines)  # rows (not groups) as JSON lines, decoded while the server reads on

    def take(self, wait: float | None = None, ack: Batch | None = None) -> Batch | None:
        """The consumer's next batch (the unacknowledged one again, if any); None when nothing landed within
        `wait` seconds. `ack`: acknowledge that batch in the same request. Retried on connection errors: a
        repeated take hands out the same pending batch (and a repeated ack is a no-op)."""
        params = {"consumer": self.consumer, "max": self.max, "wait": self.wait if wait is None else wait,
                  "groups": str(self.groups).lower(), "skip_equal": str(self.skip_equal).lower()}
        if self.fields is not None:
            params["fields"] = self.fields
        if ack is not None:
            params["ack"] = ack.token
        body = self._get(params, lines=self.lines and not self.groups)
        if not body["count"]:
            return None
        return Batch(job=body["job"], consumer=body["consumer"], token=body["token"], cursor=body["cursor"],
                     redelivered=body["redelivered"], rollouts=body["rollouts"], skipped_stale=body["skipped_stale"],
                     skipped_equal=body["skipped_equal"], current_version=body["current_version"],
                     group_ids=body.get("groups"), taken_at=time.time())

    def _get(self, params: dict, lines: bool) -> dict:
        """A take's body, decoded. `lines`: asked for as JSON lines, each rollout decoded as it arrives while the
        server reads the next (decode_lines); else one JSON document read in 4 MiB reads (`.content` gathers it
        10 KiB at a time). A body cut off (the connection lost inside it, or no last line) is taken again like a
        take lost before its answer: the same batch comes."""
        headers = {"Accept": NDJSON} if lines else None
        for attempt in range(1 + self.client.retries):
            resp = self.client.request("GET", f"jobs/{self.job}/stream/", params=params, stream=True, headers=headers)
            try:
                body = decode_lines(resp.iter_content(1 << 16)) if lines else \
                    decode_batch(b"".join(resp.iter_content(1 << 22)))
                if body is not None:
                    return body
                cut: object = "no last line"
            except BODY_ERRORS as exc:
                cut = exc
            finally:
                resp.close()
            if attempt == self.client.retries:
                raise ApiError(f"GET jobs/{self.job}/stream/: the answer was cut off: {cut}")
            self.client._sleep(attempt, None)
        raise AssertionError("unreachable")  # pragma: no cover

    def ack(self, batch: Batch) -> dict:
        """Acknowledge: the batch never comes again (a retried ack is a no-op)."""
        return self.client.request("POST", f"jobs/{self.job}/stream/ack/", retry=True,
                                   json={"consumer": self.consumer, "token": batch.token}).json()

    def batches(self, *, until_finished: bool = True, idle_timeout_s: float | None = None) -> Iterator[Batch]:
        """Batches as they land, each acknowledged with the take of the next (`?ack=`). Leaving the loop (an
        exception, break) leaves the current batch unacknowledged: call ack(batch) first if it counts as done.
        Stops when the job is at an end and nothing is left (until_finished), or after idle_timeout_s without
        a batch."""
        idle_since = time.monotonic()
        done: Batch | None = None  # the batch the loop body finished: acknowledged with the next take
        while True:
            batch = self.take(ack=done)
            done = None
            if batch is None:
                if until_finished and self.client.job(self.job)["state"] in TERMINAL_STATES:
                    batch = self.take(wait=0)  # rows stored just before the end
                    if batch is None:
                        return
                elif idle_timeout_s is not None and time.monotonic() - idle_since > idle_timeout_s:
                    return
                else:
                    continue
            idle_since = time.monotonic()
            yield batch  # a loop left here (an exception, break) leaves this batch unacknowledged: it comes again
            done = batch


def decode_batch(content: bytes) -> dict:
    """A batch's body decoded, with the cyclic garbage collector paused meanwhile. A batch is one JSON document
    of thousands of rows, ~25 containers each, all alive until it is decoded: in a process that already holds
    many objects (a trainer: torch, the model) they set off full collections, each scanning every object of the
    process. Measured on a 2,000-row batch (3.6 MB) in a Django process: 135 ms with the collector, 31 ms
    paused. Nothing of the batch is garbage, so the pause frees nothing later."""
    with collector_paused():
        return loads(content)


@contextlib.contextmanager
def collector_paused():
    """The cyclic garbage collector paused while a batch is decoded, then the batch handed to its oldest
    generation. Left young, the first collection after the pause walks all of the batch's containers (~10-25 a
    row) and later ones again as they are promoted, though a decoded batch holds no cyclic garbage: through the
    web server, the reader's CPU per row fell 13.5 -> 7.5 µs (TRAIN_FIELDS, batches of 5,000). gc.freeze() +
    gc.unfreeze() moves every tracked object to the oldest generation in O(1). The young generations are
    collected first, before the batch exists (< 1 ms: a few thousand objects at most), so that the caller's
    young cyclic garbage is freed, not moved with it; _FULL runs the full collections the handover would
    otherwise put off. Full collections walk the batch while it lives and find any cycle in it. A caller that
    froze objects itself (gc.freeze() before a fork) keeps them frozen, one that set threshold 0 runs no
    collection: then the batch is left young."""
    enabled = gc.isenabled()
    # a caller that turned automatic collection off (threshold 0) or froze its heap gets no collection from here
    handover = enabled and gc.get_threshold()[0] > 0 and gc.get_freeze_count() == 0
    if handover:
        gc.collect(1)
    gc.disable()
    try:
        yield
    finally:
        if handover:
            decoded, _, gen1_runs = gc.get_count()  # containers made since the collection (~ the batch's), and
            gc.freeze()                             # the gen 1 collections since the last full one, which
            gc.unfreeze()                           # freeze() zeroes
        if enabled:
            gc.enable()
        if handover:
            _FULL.handed_over(decoded, gen1_runs - 1)  # less the young collection above


class _FullCollections:
    """Full collections as CPython would run them had the batches been promoted the usual way, and no later than
    every TAKES handovers. CPython runs one when gen 1 has been collected more than threshold[2] times since the
    last and the objects promoted since exceed a quarter of those the oldest generation held then. A handover
    zeroes that count and skips the promotion count, so without this a reader that allocates little else would
    never run one again, and what was alive at a handover and died after it as cyclic garbage (a test client's
    response, in the bench's one-process reader: 7 MB each) would be kept for good."""
    TAKES = 100

    def __init__(self):
        self.seen = -1  # full collections counted when this last looked (one by CPython itself resets the tally)
        self.promoted = self.gen1_runs = self.takes = 0  # since the last full collection
        self.oldest = 0  # objects in the oldest generation after the last full collection this ran

    def handed_over(self, containers: int, gen1_runs: int) -> None:
        full = gc.get_stats()[2]["collections"]
        if full != self.seen:
            self.seen, self.promoted, self.gen1_runs, self.takes = full, 0, 0, 0
        self.promoted += containers
        self.gen1_runs += gen1_runs
        self.takes += 1
        by_count = self.gen1_runs > gc.get_threshold()[2] and self.promoted > self.oldest // 4
        if by_count or self.takes >= self.TAKES:
            gc.collect()
            self.oldest = len(gc.get_objects(generation=2))
            self.seen, self.promoted, self.gen1_runs, self.takes = gc.get_stats()[2]["collections"], 0, 0, 0


_FULL = _FullCollections()


def decode_lines(chunks: Iterable[bytes]) -> dict | None:
    """A batch sent as JSON lines (Accept: application/x-ndjson), decoded line by line as the chunks come: the
    last line's {"batch": {...}} with "rollouts" the rows before it; None when there is no last line (cut off).
    The garbage collector is paused meanwhile, as in decode_batch (collector_paused)."""
    rollouts: list[dict] = []
    head = None
    rest = b""
    with collector_paused():
        for chunk in chunks:
            lines = (rest + chunk).split(b"\n") if rest else chunk.split(b"\n")
            rest = lines.pop()
            for line in lines:
                if line.startswith(b'{"batch": '):
                    head = loads(line)["batch"]
                elif line:
                    rollouts.append(loads(line))
    if head is None or rest:
        return None
    head["rollouts"] = rollouts
    return head


def max_wait(wait: float) -> float:
    return max(0.0, min(float(wait), 30.0))
