"""Routing over an endpoint's replicas: least outstanding requests, task affinity, a circuit breaker.

* **Least outstanding**: a request goes to the replica in rotation with the fewest requests in flight
  (ties broken round-robin).
* **Affinity**: the repeats of one task go to one replica (its "home", chosen by rendezvous hashing of the
  task index over the replicas in rotation), so the server's prefix cache serves the shared prompt. The
  home is left for the least-loaded replica when it is out of rotation or overloaded (more than
  `OVERLOAD_FACTOR` x the least-loaded replica's in-flight + `OVERLOAD_SLACK`): affinity never outweighs
  a replica that is slow or hung. Hashing the task index (a plain int: Python's int hash is not salted)
  gives the same home in every worker process, so chunks of one job share the caches as well.
* **Circuit breaker**: a replica that refuses connections, or fails `fail_threshold` attempts in a row
  with a replica fault (connection error, timeout, HTTP 5xx), or fails a health probe, is taken out of
  rotation. Out of rotation it is probed (GET `health_path`, `/health` for vLLM, `/v1/models` for hosted
  APIs) with exponential backoff bounded by `probe_max_s`; the first probe that answers 200 puts it
  back. Replicas in rotation are probed every `health_interval_s` too, so a replica that hangs (accepts
  connections, never answers) leaves rotation within about `health_interval_s + probe_timeout_s` even
  before its requests time out; the attempts already in flight on it are cut then and retried on another
  replica (a hung server would otherwise hold them for the whole request timeout). When every replica is out, requests still go to the least loaded one
  (a request that succeeds puts its replica back at once): the job never waits on probes alone.

* **Shared across runs**: a worker process runs many chunks, each with its own ReplicaSet. What one run learns
  (a replica taken out of rotation, put back) is kept per replica URL for the whole process, so a new run starts
  with a replica the worker knows to be out still out (probed at once: the first probe that answers 200 puts
  it back), instead of sending it requests until its own breaker trips again.

The run that owns a ReplicaSet calls `pick()` before an attempt, `begin()` / `end()` around it and
`succeeded()` / `failed()` after it; `snapshot()` gives the per-replica load for progress ticks. Probes
run in `probe_loop()`, a task the run starts when there are several replicas; they use their own
aiohttp session, so a hung replica never holds a connection the requests need.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import aiohttp

from workers import outbound
from workers.disclosure import public

OVERLOAD_FACTOR = 2.0
OVERLOAD_SLACK = 8
HUNG_SUFFIX = " (hung)"
CUT_MESSAGE = "replica cut"


# url -> (since: wall clock, reason) of the replicas out of rotation, as this process last saw them
_OUT: dict[str, tuple[float, str]] = {}
_OUT_LOCK = threading.Lock()


def known_out() -> dict[str, tuple[float, str]]:
    with _OUT_LOCK:
        return dict(_OUT)


def forget_shared_health() -> None:
    with _OUT_LOCK:
        _OUT.clear()


class ReplicaCut(Exception):
    """An attempt cut because its replica stopped answering (a health probe timed out)."""


@dataclass
class Replica:
    url: str
    in_flight: int = 0
    requests: int = 0  # attempts sent
    ok: int = 0  # attempts answered
    errors: int = 0  # attempts failed (any class)
    consecutive_faults: int = 0  # replica faults in a row (reset by a success)
    in_rotation: bool = True
    since: float = field(default_factory=time.time)  # wall clock: when it entered its current state
    reason: str = ""  # why it is out of rotation
    last_error: str = ""
    times_out: int = 0  # how many times it left rotation in this run
    probes: int = 0
    probe_backoff_s: float = 0.0
    next_probe: float = 0.0  # monotonic
    attempts: set = field(default_factory=set)  # asyncio tasks of the attempts in flight (cut when it hangs)
    cut: int = 0  # attempts cut because the replica stopped answering

    def as_dict(self) -> dict:
        return {"url": self.url, "state": "in" if self.in_rotation else "out", "since": round(self.since, 3),
                "reason": self.reason, "in_flight": self.in_flight, "requests": self.requests, "ok": self.ok,
                "errors": self.errors, "times_out": self.times_out, "cut": self.cut, "last_error": self.last_error[:200]}


class ReplicaSet:
    def __init__(self, urls: list[str], *, affinity: bool = True, health_path: str = "/health",
                 headers: dict | None = None, fail_threshold: int = 3, health_interval_s: float = 5.0,
                 probe_timeout_s: float = 2.0, probe_min_s: float = 0.5, probe_max_s: float = 10.0):
        if not urls:
            raise ValueError("no replica URL")
        self.replicas = [Replica(u) for u in urls]
        self.n = len(urls)
        self.affinity = affinity
        self.health_path = "/" + health_path.lstrip("/")
        self.headers = dict(headers or {})
        self.fail_threshold = max(1, int(fail_threshold))
        self.health_interval_s = health_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.probe_min_s = probe_min_s
        self.probe_max_s = max(probe_min_s, probe_max_s)
        self.rr = 0
        self._wake: asyncio.Event | None = None
        now = time.monotonic()
        out = known_out() if self.n > 1 else {}
        for r in self.replicas:
            r.next_probe = now  # probed as the run starts
            if r.url in out:  # another run of this process took it out: it stays out until a probe answers
                r.in_rotation = False
                r.since, reason = out[r.url]
                r.reason = f"{reason} (out since an earlier run of this worker)"[:300]
                r.probe_backoff_s = self.probe_min_s

    # ---------------------------------------------------------------- routing
    def pick(self, key: int | None = None, exclude: set[int] | frozenset = frozenset()) -> int:
        """The replica for the next attempt of task `key`, avoiding `exclude` (replicas that already failed
        this request) whenever another one is available."""
        n = self.n
        if n == 1:
            return 0
        reps = self.replicas
        live = [i for i in range(n) if reps[i].in_rotation and i not in exclude]
        if not live:  # every candidate is out of rotation: try one anyway rather than wait for probes
            live = [i for i in range(n) if i not in exclude] or list(range(n))
        self.rr = (self.rr + 1) % n
        least = min(live, key=lambda i: (reps[i].in_flight, (i - self.rr) % n))
        if self.affinity and key is not None and len(live) > 1:
            home = max(live, key=lambda i: hash((key, i)))
            if reps[home].in_flight <= OVERLOAD_FACTOR * reps[least].in_flight + OVERLOAD_SLACK:
                return home
        return least

    def in_rotation(self, exclude: set[int] | frozenset = frozenset()) -> int:
        return sum(1 for i, r in enumerate(self.replicas) if r.in_rotation and i not in exclude)

    def begin(self, idx: int) -> None:
        r = self.replicas[idx]
        r.in_flight += 1
        r.requests += 1

    def end(self, idx: int) -> None:
        self.replicas[idx].in_flight -= 1

    def succeeded(self, idx: int) -> None:
        r = self.replicas[idx]
        r.ok += 1
        r.consecutive_faults = 0
        if not r.in_rotation:
            self._put_back(r, "answered a request")

    def failed(self, idx: int, message: str, replica_fault: bool, unreachable: bool = False) -> None:
        """An attempt failed. A replica fault (connection, timeout, 5xx) counts toward the breaker; a
        refused connection takes the replica out at once (nothing listens there)."""
        r = self.replicas[idx]
        r.errors += 1
        r.last_error = public(message)  # ticks reach every user: never what a server said
        if not replica_fault:
            return
        r.consecutive_faults += 1
        if r.in_rotation and self.n > 1 and (unreachable or r.consecutive_faults >= self.fail_threshold):
            why = "cannot connect" if unreachable else f"{r.consecutive_faults} failed attempts in a row"
            self._take_out(r, f"{why}: {public(message)}"[:300])

    def _take_out(self, r: Replica, reason: str) -> None:
        r.in_rotation = False
        r.since = time.time()
        r.reason = reason
        r.times_out += 1
        r.probe_backoff_s = self.probe_min_s
        r.next_probe = time.monotonic() + r.probe_backoff_s
        with _OUT_LOCK:
            _OUT[r.url] = (r.since, reason)
        if self._wake is not None:
            self._wake.set()

    def _put_back(self, r: Replica, why: str) -> None:
        r.in_rotation = True
        r.since = time.time()
        r.reason = ""
        r.consecutive_faults = 0
        r.next_probe = time.monotonic() + self.health_interval_s
        with _OUT_LOCK:
            _OUT.pop(r.url, None)

    def _cut_attempts(self, r: Replica) -> None:
        """Cancel the attempts in flight on a hung replica; the run retries them on another (see track())."""
        for task in list(r.attempts):
            if not task.done():
                r.cut += 1
                task.cancel(CUT_MESSAGE)

    async def track(self, idx: int, coro):
        """Await one attempt on replica `idx` as its own task, so that a probe finding the replica hung can
        cut it (raises ReplicaCut then) without cancelling the caller."""
        r = self.replicas[idx]
        task = asyncio.ensure_future(coro)
        r.attempts.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if task.cancelled() and not (me is not None and me.cancelling()):
                raise ReplicaCut(f"{r.url} stopped answering (its health probe timed out): attempt cut") from None
            raise
        finally:
            r.attempts.discard(task)

    def snapshot(self) -> list[dict]:
        return [r.as_dict() for r in self.replicas]

    # ---------------------------------------------------------------- probes
    async def _probe(self, session, r: Replica) -> tuple[bool, str]:
        r.probes += 1
        try:
            async with session.get(r.url + self.health_path, headers=self.headers, max_bytes=65536) as resp:
                await resp.content.read(65536)
                if resp.status == 200:
                    return True, ""
                return False, f"{self.health_path} answered HTTP {resp.status}"
        except asyncio.CancelledError:
            raise
        except (asyncio.TimeoutError, aiohttp.ServerTimeoutError):
            return False, f"{self.health_path} did not answer within {self.probe_timeout_s:g}s{HUNG_SUFFIX}"
        except aiohttp.ClientConnectorError as exc:
            os_error = getattr(exc, "os_error", None)
            return False, f"cannot connect: {getattr(os_error, 'strerror', None) or exc}"[:300]
        except (aiohttp.ClientError, OSError) as exc:
            _fc, reason, _detail, _retry = outbound.describe(exc)
            return False, f"{self.health_path}: {reason}"[:300]

    async def _probe_and_apply(self, session, r: Replica) -> None:
        ok, why = await self._probe(session, r)
        now = time.monotonic()
        if r.in_rotation:
            if ok:
                r.next_probe = now + self.health_interval_s
            else:
                r.last_error = why
                self._take_out(r, "health probe failed: " + why)
                if why.endswith(HUNG_SUFFIX):  # it accepts connections and answers nothing: its requests never end
                    self._cut_attempts(r)
        elif ok:
            self._put_back(r, "health probe answered")
        else:
            r.last_error = why
            r.probe_backoff_s = min(self.probe_max_s, max(self.probe_min_s, r.probe_backoff_s * 2))
            r.next_probe = now + r.probe_backoff_s

    async def probe_loop(self) -> None:
        """Probe each replica when due (see the module docstring); runs until cancelled."""
        if self.n < 2:
            return
        self._wake = asyncio.Event()
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout_s, sock_connect=self.probe_timeout_s)
        async with outbound.gated_session(limit=0, force_close=True, timeout=timeout,  # a fresh connection per probe
                                          headers={"User-Agent": "rollout-engine-probe"}) as session:
            busy: dict[int, asyncio.Task] = {}
            try:
                while True:
                    now = time.monotonic()
                    for i, r in enumerate(self.replicas):
                        if i not in busy and r.next_probe <= now:
                            busy[i] = asyncio.create_task(self._probe_and_apply(session, r))
                    for i in [i for i, t in busy.items() if t.done()]:
                        busy.pop(i)
                    due = min((r.next_probe for i, r in enumerate(self.replicas) if i not in busy), default=now + 1.0)
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), max(0.05, min(1.0, due - time.monotonic())))
                    except asyncio.TimeoutError:
                        pass
            finally:
                for t in busy.values():
                    t.cancel()
                await asyncio.gather(*busy.values(), return_exceptions=True)
