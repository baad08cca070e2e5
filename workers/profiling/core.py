"""yappi in the verifier pool and the worker process; rows, windows, snapshots (see the package docstring)."""
from __future__ import annotations

import concurrent.futures as cf
import logging
import math
import os
import pickle
import random
import socket
import threading
import time
from dataclasses import dataclass, field

import yappi

log = logging.getLogger(__name__)

FLUSH_S = 5.0  # default: a pool process hands its rows back at most once per window (with a batch's results)
AIM = 0.5  # share of the budget the measured profiling costs may use (see _PoolState.plain_before_next)
READ_EST_S = 0.01  # what reading the stats is assumed to cost before it has been measured once
GRACE_S = 10.0  # after a session ends, batches still go through the wrapper so that every process flushes
_MARK = "__profiled__"


# ------------------------------------------------------------------------------------------- rows
@dataclass
class FuncRow:
    """One function: the columns of a yappi / NeMo Gym profile. Times in seconds.
    children: [[module, line, name, ncall, ttot], ...] — the calls this function made (for drill-down,
    call trees and callgrind)."""

    module: str
    line: int
    name: str
    ncall: float
    tsub: float
    ttot: float
    tavg: float = 0.0
    children: list = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.module, self.line, self.name)

    def as_list(self) -> list:
        return [self.module, self.line, self.name, self.ncall, self.tsub, self.ttot, self.tavg, self.children]

    @classmethod
    def from_list(cls, v) -> "FuncRow":
        return cls(v[0], int(v[1]), v[2], v[3], v[4], v[5], v[6], [list(c) for c in (v[7] if len(v) > 7 else [])])


def rows_from_yappi(stats) -> list[FuncRow]:
    out = []
    for s in stats:
        children = [[c.module, int(c.lineno), c.name, int(c.ncall), float(c.ttot)] for c in s.children]
        ncall = int(s.ncall)
        out.append(FuncRow(s.module, int(s.lineno), s.name, ncall, float(s.tsub), float(s.ttot),
                           float(s.ttot) / ncall if ncall else 0.0, children))
    return out


def read_yappi_raw() -> list | None:
    """The current yappi stats as yappi's C enumerator gives them, one tuple per function and code object:
    (name, module, lineno, ncall, nactualcall, builtin, ttot, tsub, index, children[(index, ncall, nactualcall,
    ttot, tsub)]). This is all a verifier process does with its stats (~0.3 ms for 400 sympy functions, where
    turning them into rows there cost 3-5 ms, and `yappi.get_func_stats()` ~30 ms): the rows are made in the
    engine process, off the verification hot path (`merge_raw`). None if yappi's internal API changed."""
    try:
        import _yappi
        entries: list = []
        _yappi._pause()
        try:
            _yappi.enum_func_stats(entries.append, {})
        finally:
            _yappi._resume()
        return [e[:10] for e in entries]
    except (ImportError, AttributeError, TypeError, ValueError, IndexError) as exc:
        log.warning("profiling: yappi's stats enumerator changed (%s); using get_func_stats()", exc)
        return None


def merge_raw(into: dict, entries: list, scale: float = 1.0) -> dict:
    """Add yappi's raw entries (`read_yappi_raw`) into `into` ({key: FuncRow}), ncall / tsub / ttot multiplied by
    `scale`: one row per (module, line, name), as get_func_stats() merges them (code compiled per call, e.g.
    exec'd strings, comes as one entry per code object), yappi's own functions left out."""
    by_index = {e[8]: e for e in entries}
    kid_maps: dict = {}  # key -> {child key: child} for the rows this call touches (children are short lists)
    for name, module, lineno, ncall, _, _, ttot, tsub, _, children in entries:
        if module == "_yappi" or os.path.basename(module) == "yappi.py":
            continue
        key = (module, lineno, name)
        cur = into.get(key)
        if cur is None:
            cur = into[key] = FuncRow(module, lineno, name, 0, 0.0, 0.0, 0.0, [])
        cur.ncall += ncall * scale
        cur.tsub += tsub * scale
        cur.ttot += ttot * scale
        cur.tavg = cur.ttot / cur.ncall if cur.ncall else 0.0
        if children:
            kids = kid_maps.get(key)
            if kids is None:
                kids = kid_maps[key] = {tuple(c[:3]): c for c in cur.children}
            for c in children:  # (index, ncall, nactualcall, ttot, tsub)
                k = by_index.get(c[0])
                if k is None:
                    continue
                ck = (k[1], k[2], k[0])
                have = kids.get(ck)
                if have is None:
                    have = kids[ck] = [ck[0], ck[1], ck[2], 0, 0.0]
                    cur.children.append(have)
                have[3] += c[1] * scale
                have[4] += c[3] * scale
    return into


def read_yappi_rows() -> list[FuncRow]:
    """The current yappi stats as rows (through the C enumerator, falling back to the public API)."""
    raw = read_yappi_raw()
    if raw is None:
        return rows_from_yappi(yappi.get_func_stats())
    return list(merge_raw({}, raw).values())


def merge_rows(into: dict, rows, scale: float = 1.0) -> dict:
    """Add `rows` (FuncRow) into `into` ({key: FuncRow}), multiplying ncall / tsub / ttot by `scale`."""
    for r in rows:
        cur = into.get(r.key)
        if cur is None:
            cur = into[r.key] = FuncRow(r.module, r.line, r.name, 0, 0.0, 0.0, 0.0, [])
        cur.ncall += r.ncall * scale
        cur.tsub += r.tsub * scale
        cur.ttot += r.ttot * scale
        cur.tavg = cur.ttot / cur.ncall if cur.ncall else 0.0
        if r.children:
            kids = {tuple(c[:3]): c for c in cur.children}
            for c in r.children:
                k = tuple(c[:3])
                if k in kids:
                    kids[k][3] += c[3] * scale
                    kids[k][4] += c[4] * scale
                else:
                    kids[k] = [c[0], c[1], c[2], c[3] * scale, c[4] * scale]
            cur.children = list(kids.values())
    return into


def _delta(now: dict, before: dict) -> list[FuncRow]:
    """Cumulative rows (now) minus an earlier cumulative (before): the calls in between."""
    out = []
    for k, r in now.items():
        b = before.get(k)
        if b is None:
            out.append(r)
            continue
        ncall = r.ncall - b.ncall
        if ncall <= 0 and r.ttot - b.ttot <= 1e-9:
            continue
        bk = {tuple(c[:3]): c for c in b.children}
        kids = []
        for c in r.children:
            p = bk.get(tuple(c[:3]))
            n, t = (c[3] - p[3], c[4] - p[4]) if p else (c[3], c[4])
            if n > 0 or t > 1e-9:
                kids.append([c[0], c[1], c[2], n, t])
        ttot = r.ttot - b.ttot
        out.append(FuncRow(r.module, r.line, r.name, ncall, r.tsub - b.tsub, ttot, ttot / ncall if ncall else 0.0, kids))
    return out


# ------------------------------------------------------------------------------------ config, events
@dataclass
class ProfileConfig:
    session: str  # identifies one "profile for N seconds" request
    scope: str = "verify"  # "verify" | "worker"
    clock: str = "wall"  # "wall" | "cpu"
    budget_pct: float = 2.0  # verify scope: the throughput cost the sampling aims at; 100: every verification
    window_s: float = 5.0  # one snapshot per window
    builtins: bool = True  # C functions too (time.sleep, socket methods): needed to see blocking calls

    def __post_init__(self):
        if self.scope not in ("verify", "worker"):
            raise ValueError(f"profiling scope must be 'verify' or 'worker', not {self.scope!r}")
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"profiling clock must be 'wall' or 'cpu', not {self.clock!r}")

    def pool_args(self) -> tuple:
        # a budget of 100 % is no cap at all: every verification, exact counts (what NeMo Gym's profiling does)
        budget = None if self.scope == "worker" or float(self.budget_pct) >= 100 else float(self.budget_pct)
        return (self.session, self.clock, budget, bool(self.builtins), max(1.0, float(self.window_s)))


@dataclass
class ProfileSnapshot:
    """A profiling event for the sink: one window of one worker, rows already scaled to all calls."""

    session: str
    scope: str
    clock: str
    worker: str
    window_start: float  # epoch seconds
    window_end: float
    rows: list  # [FuncRow]
    verifications: int = 0  # verifications run by the pool in the window
    profiled: int = 0  # of which profiled (the rest are estimated from them)
    overhead_pct: float | None = None  # estimated throughput cost of profiling in the window
    source: str = "yappi"
    final: bool = False  # the session's last window from this worker


# ------------------------------------------------------------------------------ pool-process side
class _PoolState:
    """One pool process's session. Budget gating: a verification is profiled only while the extra time spent
    profiling so far (profiled time minus the mean unprofiled time, per profiled call) is within `budget` % of
    all the verification time of the session; so the cost holds to the budget whatever the profiler's
    overhead on this verifier (4x on sympy-heavy code), and the sampled fraction follows from it. The one
    exception: the session's first verification after the baseline is always profiled (see plain_before_next)."""

    def __init__(self):
        self.session = None
        self.budget = None
        self.builtins = True
        self.n_plain = self.n_prof_all = 0
        self.t_plain = self.t_prof_all = 0.0
        self.t_all = 0.0  # all verification time of the session
        self.u_ema = None  # recent unprofiled time per call (a moving average: forgets a slow first call)
        self.just_profiled = False  # the last verification was profiled: the next one runs plain
        self.countdown = 0  # unprofiled verifications still to run before the budget is looked at again
        self.spent = 0.0  # extra time spent profiling (slower profiled calls, and reading the stats)
        self.read_est = READ_EST_S  # what the next read of the stats will cost (the last read's cost)
        self.flush_s = FLUSH_S
        self.reset_window()

    def reset_window(self):
        self.w_items = self.w_prof = 0
        self.w_time = self.w_spent = 0.0
        self.last_flush = time.monotonic()

    def count(self, n: int, dt: float, *, profiled: bool) -> None:
        """n verifications that took dt seconds, profiled or not."""
        self.w_items += n
        self.w_time += dt
        self.t_all += dt
        self.just_profiled = profiled
        self.countdown = 0 if profiled else max(0, self.countdown - n)
        if profiled:
            self.w_prof += n
            self.n_prof_all += n
            self.t_prof_all += dt
        else:
            self.n_plain += n
            self.t_plain += dt

    def per_item(self):
        if self.n_plain < 5 or self.n_prof_all < 1:
            return None, None
        return self.u_ema, self.t_prof_all / self.n_prof_all

    def plain_before_next(self) -> int | None:
        """How many verifications to run unprofiled before the next profiled one (0: the next one is profiled;
        None: none is affordable yet). Counted in verifications across batches, not once per batch: a batch's
        first item is often of a kind (a batch of one goes out when the pool is idle, e.g. the first repeat of
        a task, which misses a verifier's cache), and profiling it would skew the scaled figures. Only asked
        with a budget (without one, every verification is profiled)."""
        if self.budget <= 0:  # the pool's wrapper and windows only (the profiling bench's "plumbing" arm)
            return None
        if self.n_plain < 5:  # the unprofiled time per call first
            return 5 - self.n_plain
        if self.countdown:
            # the gap chosen last time, counted down across batches: the budget is looked at again only when it
            # has run out. Looked at again at each batch's start instead, it came due there more often than
            # within a batch whenever verifications ran slower than the moving average said (a loaded
            # machine), and a batch's first item was profiled more often than its share
            return self.countdown
        if self.just_profiled:
            # never two profiled in a row: the unprofiled time per call, which the cost of profiling is measured
            # against, must keep being measured (were it stale, e.g. held a slow warm-up, every profiled call
            # would look free and the gate would profile everything)
            n = self._plain_needed()
            if n is None:
                return None
            # and the gap drawn from [n, 2n]: a fixed gap aliases with a workload's period (a batch of one cold
            # item, then nine warm: a gap of 1 profiled only the warm ones, a gap of 9 only the cold)
            n = max(1, n)
            self.countdown = n + _gaps.randint(0, n)
            return self.countdown
        if self.n_prof_all == 0:
            # one per session whatever the budget: a session has a profile even of a verifier so fast that its
            # whole budget would never pay for one read of the stats. A one-off cost (one profiled call and one
            # read, a few ms), not one per verification or per window
            return 0
        n = self._plain_needed()
        self.countdown = n or 0
        return n

    def _plain_needed(self) -> int | None:
        u, p = self.per_item()  # both known: asked only after the baseline and a first profiled call
        expected = max(0.0, p - u)  # what the profiled call would add
        # the window's read of the stats is paid for before it happens, and the measured costs may use only
        # AIM of the budget: the budget is a ceiling, and what the gate cannot measure (pickling the rows back,
        # caches the profiled call evicts, the error of its own estimate) takes the rest. `need`: the
        # verification time still to run before the next profiled call is within the budget
        rate = AIM * self.budget / 100.0
        need = (self.spent + self.read_est + expected) / rate - self.t_all
        if need <= 0:
            # budget left unused is not banked past this call: after verifications that ran long (a loaded
            # machine) it would pay for a burst of profiled calls, and a window's few samples would then decide
            # the scaled figures of thousands of verifications
            self.spent = max(self.spent, rate * self.t_all - self.read_est - expected)
            return 0
        if not u or u <= 0:
            return None
        return math.ceil(need / u)


_STATE = _PoolState()
_gaps = random.Random()  # the sampler's jitter (plain_before_next)


def _start_session(st: _PoolState, cfg) -> None:
    session, clock, budget, builtins = cfg[:4]
    yappi.stop()
    yappi.clear_stats()
    yappi.set_clock_type(clock)
    st.__init__()
    st.session, st.budget, st.builtins = session, budget, builtins
    st.flush_s = cfg[4] if len(cfg) > 4 else FLUSH_S


def _flush(st: _PoolState, final=False) -> dict | None:
    if st.session is None or (st.w_items == 0 and not final):
        return None
    t0 = time.perf_counter()
    raw = rows = None
    if st.w_prof:
        raw = read_yappi_raw()
        if raw is None:
            rows = [r.as_list() for r in rows_from_yappi(yappi.get_func_stats())]
        # pickled here, so that handing the stats back is measured with the read (the engine unpickles them
        # off its event loop); the rows are made in the engine process (merge_raw)
        raw = pickle.dumps(raw if rows is None else rows, protocol=pickle.HIGHEST_PROTOCOL)
    yappi.clear_stats()
    cost = time.perf_counter() - t0  # reading the stats: part of the budget
    if st.w_prof:
        st.read_est = cost
    st.spent += cost
    st.w_spent += cost
    st.t_all += cost
    st.w_time += cost
    overhead = None
    if st.budget is not None and st.w_time > st.w_spent:
        overhead = 100.0 * st.w_spent / (st.w_time - st.w_spent)  # extra time / the time without profiling
    u, p = st.per_item()
    payload = {"session": st.session, "pid": os.getpid(), "stats": raw, "stats_format": "rows" if rows else "raw",
               "items": st.w_items, "profiled": st.w_prof, "overhead_pct": overhead, "final": final, "t_plain": u,
               "t_profiled": p}
    st.reset_window()
    return payload


def payload_rows(payload: dict, scale: float = 1.0, into: dict | None = None) -> dict:
    """A pool process's hand-back as rows ({key: FuncRow}), ncall / tsub / ttot multiplied by `scale`."""
    into = {} if into is None else into
    blob = payload.get("stats")
    if not blob:
        return into
    stats = pickle.loads(blob)
    if payload.get("stats_format") == "rows":
        return merge_rows(into, [FuncRow.from_list(v) for v in stats], scale)
    return merge_raw(into, stats, scale)


def _run_plain(st: _PoolState, fn, items) -> list:
    """Verifications run as one call, as without profiling; their mean time is the unprofiled time per call."""
    n = len(items)
    t = time.perf_counter()
    out = fn(items)
    dt = time.perf_counter() - t
    st.count(n, dt, profiled=False)
    per = dt / n
    if st.u_ema is None or per < st.u_ema / 4:
        st.u_ema = per  # the average held a warm-up (first imports, cold caches): start again from here
    else:
        w = 0.95 ** n  # a moving average per call, as if the n calls had been timed one by one
        st.u_ema = w * st.u_ema + (1 - w) * per
    return out


def _run_profiled(st: _PoolState, fn, items) -> list:
    """Verifications between a yappi start and stop: one alone when sampling (always after the unprofiled
    baseline, what it adds is charged to the budget), a whole batch when every verification is profiled."""
    n = len(items)
    t = time.perf_counter()
    yappi.start(builtins=st.builtins, profile_threads=False)
    try:
        out = fn(items)
    finally:
        yappi.stop()
    dt = time.perf_counter() - t
    st.count(n, dt, profiled=True)
    if st.u_ema is not None:
        extra = max(0.0, dt - n * st.u_ema)
        st.spent += extra
        st.w_spent += extra
    return out


def _profiled_batch(fn, items, cfg):
    """In a pool process: run `fn` (the engine's batch verifier) on `items`, profiling the items the budget
    allows (all of them when the budget is None) for the session in `cfg`; cfg None ends any session.
    With a budget, the items plain_before_next() picks are profiled one by one (alone, between a yappi start and
    stop) and the runs between them go as one call each, as they would without profiling."""
    st = _STATE
    payload = None
    if st.session is not None and (cfg is None or cfg[0] != st.session):
        payload = _flush(st, final=True)
        yappi.stop()
        yappi.clear_stats()
        st.session = None
    if cfg is not None and st.session is None:
        _start_session(st, cfg)
    if st.session is None:
        return (_MARK, fn(items), payload)
    if st.budget is None:  # every verification, one start / stop per batch
        out = _run_profiled(st, fn, items)
    else:
        out = []
        i = 0
        while i < len(items):
            k = st.plain_before_next()
            if k is None or i + k >= len(items):
                out += _run_plain(st, fn, items[i:])
                break
            if k:  # the item to profile is decided before these run: their own times do not move the choice
                out += _run_plain(st, fn, items[i:i + k])
                i += k
            out += _run_profiled(st, fn, items[i:i + 1])
            i += 1
    if payload is None and st.w_prof and time.monotonic() - st.last_flush >= st.flush_s:
        payload = _flush(st)
    return (_MARK, out, payload)


def _flush_now(session: str, hold_s: float = 0.01) -> tuple:
    """In a pool process: hand back what the session gathered since the last flush (used when it ends), and
    this process's pid (the caller asks again until every process has answered)."""
    st = _STATE
    payload = None
    if st.session == session:
        payload = _flush(st, final=True)
        yappi.stop()
        yappi.clear_stats()
        st.session = None
    time.sleep(hold_s)  # hold the process a moment so that the next flush call lands on another one
    return (_MARK, os.getpid(), payload)


# ------------------------------------------------------------------------------ engine-process side
_lock = threading.Lock()
_ACTIVE: tuple | None = None  # the pool args every batch carries while a verify/worker session is on
_GRACE_UNTIL = 0.0
_REGISTRY: dict[str, "Profiler"] = {}  # session -> the Profiler collecting it in this process
_WORKER_OWNER: str | None = None  # the session that holds yappi in this (engine) process


def verify_call(fn, items):
    """What the engine submits to its pool for one batch: pool.submit(*verify_call(fn, items))."""
    cfg = _ACTIVE
    if cfg is None and time.monotonic() > _GRACE_UNTIL:
        return fn, items
    return _profiled_batch, fn, items, cfg


def unwrap_result(result):
    """The batch's results, with any profiling rows handed to the session's Profiler."""
    if isinstance(result, tuple) and len(result) == 3 and result[0] == _MARK:
        _, out, payload = result
        if payload:
            prof = _REGISTRY.get(payload["session"])
            if prof is not None:
                prof.add(payload)
        return out
    return result


def active_profiler(session: str) -> "Profiler | None":
    return _REGISTRY.get(session)


class Profiler:
    """Collects one run's profiling in this process. apply() (control thread) starts / stops a session;
    add() (event loop, via unwrap_result) takes the pool's rows; drain() returns finished windows."""

    def __init__(self, worker: str = "", pool=None):
        self.worker = worker or socket.gethostname()
        self.pool = pool
        self.config: ProfileConfig | None = None
        self.lock = threading.Lock()
        self.ready: list[ProfileSnapshot] = []
        self._new_session()
        self._new_window()
        self._worker_prev: dict = {}

    def _new_session(self):
        # the session's profiled rows, unscaled, and how many calls they are: a hand-back of verifications none
        # of which was profiled (a process's last one, or a loaded machine's, where the budget afforded none)
        # stands for that many calls at the session's profile per call, not for none
        self.s_rows: dict = {}
        self.s_prof = 0

    def _new_window(self):
        self.w_rows: dict = {}
        self.w_pending: list = []  # pool hand-backs not yet merged into w_rows
        self.w_items = self.w_prof = 0
        self.w_over: list = []  # (items, overhead_pct)
        self.w_start = time.time()

    # --- session switching
    def apply(self, config: ProfileConfig | None) -> None:
        global _ACTIVE, _GRACE_UNTIL, _WORKER_OWNER
        cur = self.config
        if cur is not None and config is not None and cur.session == config.session:
            return
        if cur is not None:
            self._end(cur)
        if config is None:
            return
        self.config = config
        self._new_session()
        with _lock:
            _REGISTRY[config.session] = self
            _ACTIVE = config.pool_args()
            if config.scope == "worker":
                if _WORKER_OWNER is None:
                    _WORKER_OWNER = config.session
                    yappi.stop()
                    yappi.clear_stats()
                    yappi.set_clock_type(config.clock)
                    yappi.start(builtins=config.builtins, profile_threads=True)
                    self._worker_prev = {}
                else:
                    log.warning("profiling session %s: this process is already profiled whole by session %s; "
                                "profiling verification only", config.session, _WORKER_OWNER)
        self._new_window()
        log.info("profiling on: session %s, scope %s, %s clock", config.session, config.scope, config.clock)

    def _end(self, cur: ProfileConfig) -> None:
        global _ACTIVE, _GRACE_UNTIL, _WORKER_OWNER
        with _lock:
            if _ACTIVE is not None and _ACTIVE[0] == cur.session:
                _ACTIVE = None
                _GRACE_UNTIL = time.monotonic() + GRACE_S
        self._collect_pool_final(cur.session)
        if _WORKER_OWNER == cur.session:
            self._take_worker_rows()
            with _lock:
                yappi.stop()
                yappi.clear_stats()
                _WORKER_OWNER = None
        self._close_window(final=True)
        self.config = None
        log.info("profiling off: session %s", cur.session)

    def _collect_pool_final(self, session: str, timeout: float = 3.0) -> None:
        """Ask each pool process for what it gathered since its last flush (best effort, bounded)."""
        if self.pool is None:
            return
        try:
            pool = self.pool()
            if pool is None:
                return
            pids = set((getattr(pool, "_processes", None) or {}).keys())
            answered: set = set()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:  # bounded: a process that never answers loses its last window
                futs = [pool.submit(_flush_now, session) for _ in range(max(1, len(pids - answered)))]
                done, _ = cf.wait(futs, timeout=max(0.0, deadline - time.monotonic()))
                for f in done:
                    if f.exception() is None:
                        answered.add(unwrap_result(f.result()))
                if not pids or pids <= answered:
                    break
        except Exception as exc:  # noqa: BLE001  (a broken or shut-down pool: the last second is lost)
            log.warning("profiling: could not collect the pool's last rows: %s", exc)

    # --- data
    def add(self, payload: dict) -> None:
        """Called on the engine's event loop: only queues the hand-back (rows are made in drain())."""
        with self.lock:
            self.w_pending.append(payload)

    def _merge_pending(self) -> None:
        """The queued hand-backs into the window's rows (control thread; the lock is held)."""
        pending, self.w_pending = self.w_pending, []
        for payload in pending:
            items, prof = int(payload.get("items") or 0), int(payload.get("profiled") or 0)
            if prof:
                got = payload_rows(payload).values()
                merge_rows(self.s_rows, got)
                self.s_prof += prof
                merge_rows(self.w_rows, got, items / prof)
            elif items and self.s_prof:
                merge_rows(self.w_rows, self.s_rows.values(), items / self.s_prof)
            self.w_items += items
            self.w_prof += prof
            if payload.get("overhead_pct") is not None:
                self.w_over.append((items, float(payload["overhead_pct"])))

    def _take_worker_rows(self) -> None:
        if _WORKER_OWNER is None or self.config is None or _WORKER_OWNER != self.config.session:
            return
        now = {}
        merge_rows(now, read_yappi_rows())
        delta = _delta(now, self._worker_prev)
        self._worker_prev = now
        with self.lock:
            merge_rows(self.w_rows, delta)

    def _close_window(self, final=False) -> None:
        cfg = self.config
        if cfg is None:
            return
        with self.lock:
            self._merge_pending()
            rows = list(self.w_rows.values())
            if rows or self.w_items or final:
                over = None
                if self.w_over:
                    n = sum(i for i, _ in self.w_over) or 1
                    over = sum(i * o for i, o in self.w_over) / n
                self.ready.append(ProfileSnapshot(
                    session=cfg.session, scope=cfg.scope, clock=cfg.clock, worker=self.worker,
                    window_start=self.w_start, window_end=time.time(), rows=rows, verifications=self.w_items,
                    profiled=self.w_prof, overhead_pct=over, final=final))
            self._new_window()

    def drain(self, final: bool = False) -> list[ProfileSnapshot]:
        """Finished windows (the current one too when it is older than window_s, or when `final`)."""
        cfg = self.config
        if cfg is not None:
            if cfg.scope == "worker":
                self._take_worker_rows()
            if final or time.time() - self.w_start >= cfg.window_s:
                self._close_window(final=final)
        with self.lock:
            out, self.ready = self.ready, []
        return out

    def finish(self) -> list[ProfileSnapshot]:
        """The run ends: close any session and return everything not yet drained."""
        if self.config is not None:
            self._end(self.config)
        with _lock:
            for k in [k for k, v in _REGISTRY.items() if v is self]:
                del _REGISTRY[k]
        return self.drain()
