"""Adaptive concurrency: tune parallelism while a run goes, with no engine changes.

    ctl = AdaptiveConcurrency(initial=16, telemetry=telemetry)      # telemetry optional (vLLM /metrics)
    summary = await run_collection(spec, tasks, ctl.wrap(sink), control=ctl.control(inner_control))

`ctl.wrap(sink)` observes every rollout and ProgressTick (goodput, latency, errors by class) and adds
`extra["adaptive"]` (limit, phase, new decisions) to each tick; `ctl.control(inner)` is a Control that
returns the inner control's pause / cancel as is and `ControlState(parallelism=limit)` otherwise (the
engine polls it from a thread; reading an int is safe).

The algorithm works for any endpoint (hosted APIs have no /metrics) and says why it moves:

1. Slow start: double the limit each measurement window while goodput keeps rising (x4 while it scales
   almost linearly); when a step gains less than `gain`, settle on the better of the last two levels.
2. Steady state: every `probe_every` windows, probe 25% higher; keep it if goodput rose, else go back
   (a probe that brings 429s or errors sets a ceiling for a while). When latency is inflated (more than
   `trim_latency` x the best seen) probe 20% lower and keep it if goodput held: concurrency that only
   queues is given back.
3. Back off at once on:
   - 429s (>= 1% of attempts, at most once per two latencies): to the concurrency that sustains the
     accepted rate, Little's law: accepted rollouts/s over the last 5 s x the model's request latency x 1.2,
     plus one (the rate-limit guide's "RPM/60 x latency"); already there: hold, and go no higher; many 429s there: x0.85;
   - timeouts / 5xx / connection errors (>= 2%): x0.7;
   - vLLM preemptions (server out of KV cache): x0.85; a waiting queue at the server with a full KV cache:
     trim by the queue length;
   - latency above `latency_tolerance` x the best seen for two windows in a row: scale down by the ratio.
Every decision is recorded as {"t", "from", "to", "reason", ...} in `decisions`.
"""
from __future__ import annotations

import collections
import math
import statistics
import threading
import time
from typing import Any

from workers.engine.types import ControlState

RATE_LIMIT_FRACTION = 0.01
ERROR_FRACTION = 0.02
OVERLOAD_ERRORS = ("timeout", "http_5xx", "connection")


class _Window:
    """Accumulates ticks between decisions."""

    def __init__(self):
        self.ticks = 0
        self.dt = 0.0
        self.ok = 0
        self.errors: dict[str, int] = {}
        self.latencies: list[float] = []  # slot time (wall_ms) of ok rollouts
        self.model_lat: list[float] = []  # ttft + generation of ok rollouts
        self.in_flight: list[int] = []

    @property
    def goodput(self) -> float:
        return self.ok / self.dt if self.dt > 0 else 0.0

    def latency_ms(self) -> float | None:
        return statistics.median(self.latencies) if self.latencies else None

    def mean_latency_ms(self) -> float | None:
        return sum(self.latencies) / len(self.latencies) if self.latencies else None

    def model_latency_ms(self) -> float | None:
        return statistics.median(self.model_lat) if self.model_lat else None

    def attempts(self) -> int:
        return self.ok + sum(self.errors.get(k, 0) for k in ("http_429", *OVERLOAD_ERRORS))


class AdaptiveConcurrency:
    def __init__(self, initial: int = 16, min_parallelism: int = 1, max_parallelism: int = 1024,
                 telemetry: Any = None, settle_ticks: int = 1, measure_ticks: int = 2, gain: float = 0.08,
                 probe_every: int = 4, probe_up: float = 1.25, probe_down: float = 0.8, backoff: float = 0.7,
                 latency_tolerance: float = 2.5, trim_latency: float = 1.6, ceiling_windows: int = 12,
                 min_window_rollouts: int = 20, max_window_s: float = 10.0, max_settle_s: float = 5.0,
                 rate_horizon_s: float = 5.0):
        self.min = max(1, int(min_parallelism))
        self.max = max(self.min, int(max_parallelism))
        self.limit = min(self.max, max(self.min, int(initial)))
        self.telemetry = telemetry
        self.settle_ticks = settle_ticks
        self.measure_ticks = measure_ticks
        self.gain = gain
        self.probe_every = probe_every
        self.probe_up = probe_up
        self.probe_down = probe_down
        self.backoff = backoff
        self.latency_tolerance = latency_tolerance
        self.trim_latency = trim_latency
        self.ceiling_windows = ceiling_windows
        self.min_window_rollouts = min_window_rollouts
        self.max_window_s = max_window_s
        self.max_settle_s = max_settle_s
        self._changed_at = 0.0
        self._last_latency: float | None = None
        self._holding_at: int | None = None  # the level a rate-limit hold was noted at
        self.rate_horizon_s = rate_horizon_s
        self._recent: collections.deque = collections.deque()  # (elapsed, dt, ok, slot_ms_sum, slot_n) per tick
        self._tick_slot_sum = 0.0
        self._tick_slot_n = 0
        self._last_429_t: float | None = None
        self._drained_at: float | None = 0.0
        self._lat_strikes = 0

        self.phase = "slow_start"
        self.decisions: list[dict] = []
        self._unreported = 0
        self._lock = threading.Lock()
        self._win = _Window()
        self._settle = settle_ticks
        self._elapsed = 0.0
        self._last_elapsed: float | None = None
        self._last_completed: int | None = None
        self._prev: tuple[int, float] | None = None  # (limit, goodput) of the previous window in slow start
        self._base: tuple[int, float] | None = None  # steady state: (limit, goodput) before a probe
        self._probe: str = ""  # "up" / "down" while probing
        self._windows_since_probe = 0
        self._min_latency: float | None = None
        self._ceiling: int | None = None
        self._ceiling_age = 0
        self._last_preemptions: float | None = None
        self._last_vllm_id: int | None = None
        self.history: list[dict] = []  # per window: limit, goodput, latency

    # ------------------------------------------------------------------ engine-facing
    def poll(self) -> ControlState:
        return ControlState(action="run", parallelism=self.limit)

    def control(self, inner: Any = None) -> "AdaptiveControl":
        return AdaptiveControl(self, inner)

    def wrap(self, sink: Any = None) -> "AdaptiveSink":
        return AdaptiveSink(self, sink)

    # ------------------------------------------------------------------ observations
    def observe_rollout(self, result: Any) -> None:
        if getattr(result, "ok", False):
            if result.wall_ms is not None:
                self._win.latencies.append(result.wall_ms)
                self._tick_slot_sum += result.wall_ms
                self._tick_slot_n += 1
            if result.ttft_ms is not None:
                self._win.model_lat.append(result.ttft_ms + (result.generation_ms or 0.0))

    def _latency_s(self) -> float:
        """The pipeline's current latency estimate (s): the last window's median slot time."""
        lat = self._last_latency or self._min_latency
        return (lat or 0.0) / 1000.0

    def observe_tick(self, tick: Any) -> list[dict]:
        """Feed one ProgressTick; returns the decisions made on it (possibly none).

        After a change the level first settles: the engine must report the new parallelism, the in-flight
        count must have come down to it, `settle_ticks` ticks and one request latency must have passed (so
        the window holds requests started at the new level). A window then lasts at least `measure_ticks`
        ticks, two latencies (one in slow start) and `min_window_rollouts` completions (or `max_window_s`)."""
        dt = tick.elapsed_s - self._last_elapsed if self._last_elapsed is not None else tick.elapsed_s
        d_ok = tick.completed - self._last_completed if self._last_completed is not None else tick.completed
        self._last_elapsed, self._last_completed = tick.elapsed_s, tick.completed
        self._elapsed = tick.elapsed_s
        self._recent.append((tick.elapsed_s, max(0.0, dt), max(0, d_ok), self._tick_slot_sum, self._tick_slot_n))
        self._tick_slot_sum, self._tick_slot_n = 0.0, 0
        while self._recent and self._recent[0][0] < tick.elapsed_s - self.rate_horizon_s:
            self._recent.popleft()
        # requests sent before a decrease (possibly queued at the server) must drain, then one latency pass
        if tick.in_flight > self.limit:
            self._drained_at = None
        elif self._drained_at is None:
            self._drained_at = tick.elapsed_s
        since = max(self._changed_at, self._drained_at if self._drained_at is not None else tick.elapsed_s)
        if tick.parallelism != self.limit or self._settle > 0 or tick.in_flight > self.limit \
                or tick.elapsed_s - since < min(self.max_settle_s, self._latency_s()):
            if tick.parallelism == self.limit and self._settle > 0:
                self._settle -= 1
            self._win = _Window()
            return []
        w = self._win
        w.ticks += 1
        w.dt += max(0.0, dt)
        w.ok += max(0, d_ok)
        w.in_flight.append(tick.in_flight)
        for k, v in (tick.errors or {}).items():
            w.errors[k] = w.errors.get(k, 0) + int(v)
        # react to 429s / overload errors without waiting for the full window
        urgent = self._error_fraction(w) is not None
        if not urgent and w.dt < self.max_window_s and (
                w.ticks < self.measure_ticks
                or w.dt < min(self.max_settle_s, (1 if self.phase == "slow_start" else 2) * self._latency_s())
                or w.ok < self.min_window_rollouts):
            return []
        before = len(self.decisions)
        self._decide(w)
        self._win = _Window()
        return self.decisions[before:]

    def _error_fraction(self, w: _Window) -> tuple[str, float] | None:
        attempts = max(1, w.attempts())
        n429 = w.errors.get("http_429", 0)
        if n429 and n429 / attempts >= RATE_LIMIT_FRACTION:
            return "http_429", n429 / attempts
        over = sum(w.errors.get(k, 0) for k in OVERLOAD_ERRORS)
        if over and over / attempts >= ERROR_FRACTION:
            return "overload", over / attempts
        return None

    def _vllm(self) -> dict | None:
        t = self.telemetry
        v = getattr(t, "latest_vllm", None) if t is not None else None
        if not v or id(v) == self._last_vllm_id:
            return None  # nothing new since the last decision
        age = time.monotonic() - getattr(t, "latest_vllm_t", 0.0)
        if self._elapsed - age < self._changed_at + self._latency_s():
            return None  # scraped before this level settled
        self._last_vllm_id = id(v)
        return v

    # ------------------------------------------------------------------ the decision
    def _set(self, new: int, reason: str, w: _Window, **info) -> None:
        new = int(min(self.max, max(self.min, new)))
        if self._ceiling is not None and new >= self._ceiling and not info.get("allow_ceiling"):
            new = max(self.min, self._ceiling - 1)
        info.pop("allow_ceiling", None)
        if new == self.limit:
            return
        lat = w.latency_ms()
        d = {"t": round(self._elapsed, 2), "from": self.limit, "to": new, "reason": reason, "phase": self.phase,
             "goodput": round(w.goodput, 2), "latency_ms": round(lat, 1) if lat is not None else None}
        d.update(info)
        with self._lock:
            self.decisions.append(d)
            self._unreported += 1
            self.limit = new
        self._settle = self.settle_ticks
        self._changed_at = self._elapsed

    def _decide(self, w: _Window) -> None:
        L = self.limit
        X = w.goodput
        lat = w.latency_ms()
        mlat = w.model_latency_ms()
        if lat is not None:
            self._last_latency = lat
        self.history.append({"t": round(self._elapsed, 2), "limit": L, "goodput": round(X, 3),
                             "latency_ms": round(lat, 1) if lat else None, "phase": self.phase})
        if lat is not None:
            if self._min_latency is None or lat < self._min_latency:
                self._min_latency = lat
            else:
                self._min_latency *= 1.01  # forget slowly: the workload may change
        if self._ceiling is not None:
            self._ceiling_age += 1
            if self._ceiling_age > self.ceiling_windows:
                self._ceiling = None

        # 1. errors
        err = self._error_fraction(w)
        if err is not None:
            kind, frac = err
            self._ceiling, self._ceiling_age = L, 0
            self._probe = ""
            self._base = None
            if self.phase == "slow_start":
                self.phase = "steady"
            self._windows_since_probe = 0
            if kind == "http_429":
                # the accepted rate over the last few seconds (one tick is too noisy) x the model's request
                # latency (not the slot time: that includes the 429s' backoff, and would feed on itself)
                if self._last_429_t is not None and self._elapsed - self._last_429_t < max(2.0, 2 * self._latency_s()):
                    return  # the last 429 decision has not had time to show its effect
                self._last_429_t = self._elapsed
                span = sum(r[1] for r in self._recent)
                X = sum(r[2] for r in self._recent) / span if span > 0 else X
                n_slot = sum(r[4] for r in self._recent)
                slot_ms = sum(r[3] for r in self._recent) / n_slot if n_slot else (lat or 1000.0)
                lat_s = (mlat or slot_ms) / 1000.0
                little = max(1, math.ceil(X * lat_s * 1.2))
                # Little's law gives the concurrency that sustains the accepted rate; one more keeps the pipe full
                why = (f"429 on {100 * frac:.0f}% of requests: rate limited; the accepted {X:.1f} rollouts/s x "
                       f"{lat_s:.2f} s latency x 1.2 needs about {little} in flight (RPM/60 x latency)")
                if little + 1 < L:
                    self._set(little + 1, why, w, signal="http_429")
                elif frac >= 0.25:
                    self._set(int(L * 0.85), why + "; many 429s at that level: x0.85", w, signal="http_429")
                else:  # at the sustaining level: a few 429s at the limit's edge are expected; stay, go no higher
                    self._ceiling, self._ceiling_age = L + 1, 0
                    if self._holding_at != L:
                        self._holding_at = L
                        self._note(why + f"; {L} is about that: holding")
            else:
                self._set(int(L * self.backoff), f"timeouts / 5xx / connection errors on {100 * frac:.0f}% of requests: "
                                                 f"server overloaded, backing off x{self.backoff}", w, signal="errors")
            return

        # 2. model server signals (only when /metrics is there and a new scrape arrived)
        v = self._vllm()
        if v is not None:
            pre = v.get("preemptions_total")
            if pre is not None and self._last_preemptions is not None and pre > self._last_preemptions:
                self._last_preemptions = pre
                self._ceiling, self._ceiling_age = L, 0
                self.phase = "steady"
                self._probe, self._base = "", None
                self._set(int(L * 0.85), f"vLLM preempted {pre - (self._last_preemptions or 0):.0f} sequences "
                                         f"(KV cache exhausted): backing off x0.85", w, signal="preemptions")
                return
            self._last_preemptions = pre
            waiting, running, kv = v.get("waiting") or 0, v.get("running") or 0, v.get("kv_usage") or 0.0
            if waiting > max(2.0, 0.25 * running) and (kv >= 0.9 or self.phase != "slow_start") and lat and self._min_latency \
                    and lat > self.trim_latency * self._min_latency:
                self.phase = "steady"
                self._probe, self._base = "", None
                self._set(max(int(running) + 1, L - int(0.75 * waiting)),
                          f"vLLM has {waiting:.0f} requests waiting behind {running:.0f} running (KV cache "
                          f"{100 * kv:.0f}%): the server is full, extra concurrency only queues", w, signal="server_queue")
                return

        # 3. slow start
        if self.phase == "slow_start":
            if self._prev is None:
                self._prev = (L, X)
                self._set(L * 2, f"slow start: {X:.1f} rollouts/s at {L}, trying {L * 2}", w)
                if self.limit == L:  # already at the maximum
                    self.phase = "steady"
                return
            pL, pX = self._prev
            ratio = X / pX if pX > 0 else (math.inf if X > 0 else 1.0)
            if ratio >= 1.0 + self.gain and L < self.max:
                efficiency = ratio / (L / pL) if pL else 0.0
                mult = 4 if efficiency >= 0.85 else 2
                self._prev = (L, X)
                self._set(L * mult, f"slow start: goodput {pX:.1f} -> {X:.1f} rollouts/s (x{ratio:.2f}) from {pL} to {L}: "
                                    f"still rising, trying {L * mult}", w)
                if self.limit == L:
                    self.phase = "steady"
                    self._base = (L, X)
                return
            self.phase = "steady"
            keep_high = ratio >= 1.0 + self.gain / 2
            target = L if keep_high else pL
            self._base = (target, X if keep_high else pX)
            self._windows_since_probe = 0
            if target != L:
                self._set(target, f"slow start over: goodput {pX:.1f} at {pL} vs {X:.1f} at {L} (x{ratio:.2f}, less than "
                                  f"+{int(self.gain * 100)}%): settling on {target}", w)
            else:
                self.decisions.append({"t": round(self._elapsed, 2), "from": L, "to": L, "phase": "steady",
                                       "reason": f"slow start over at {L} (goodput {X:.1f} rollouts/s)", "goodput": round(X, 2)})
                self._unreported += 1
            return

        # 4. steady state: the outcome of a probe
        if self._probe:
            bL, bX = self._base or (L, X)
            kind, self._probe = self._probe, ""
            self._windows_since_probe = 0
            if kind == "up":
                if X >= bX * (1.0 + self.gain / 2):
                    self._base = (L, X)
                    self._windows_since_probe = self.probe_every - 1  # keep climbing soon
                    self._note(f"probe up kept: {bX:.1f} -> {X:.1f} rollouts/s at {L}")
                else:
                    self._base = (bL, bX)
                    self._set(bL, f"probe up to {L} gave {X:.1f} rollouts/s vs {bX:.1f} at {bL}: no gain, back to {bL}", w)
            else:
                if X >= bX * (1.0 - self.gain / 2):
                    self._base = (L, X)
                    self._note(f"probe down kept: {X:.1f} rollouts/s at {L} vs {bX:.1f} at {bL}, with less queueing")
                else:
                    self._base = (bL, bX)
                    self._set(bL, f"probe down to {L} lost goodput ({X:.1f} vs {bX:.1f} rollouts/s): back to {bL}", w,
                              allow_ceiling=True)
            return

        # refresh the steady baseline with the current window (smoothed)
        if self._base is None or self._base[0] != L:
            self._base = (L, X)
        else:
            self._base = (L, 0.5 * self._base[1] + 0.5 * X)
        bX = self._base[1]

        # 5. latency guard: far above the best seen, with no goodput to show for it
        inflated = bool(lat and self._min_latency and lat > self.latency_tolerance * self._min_latency)
        self._lat_strikes = self._lat_strikes + 1 if inflated else 0
        if inflated and self._lat_strikes >= 2 and L > self.min:  # two windows in a row: not a leftover
            factor = max(0.5, self.latency_tolerance * self._min_latency / lat)
            self._set(int(L * factor), f"latency {lat:.0f} ms is {lat / self._min_latency:.1f}x the best seen "
                                       f"({self._min_latency:.0f} ms) at flat goodput: concurrency only queues", w,
                      signal="latency", allow_ceiling=True)
            self._base = None
            return

        self._windows_since_probe += 1
        if self._windows_since_probe >= self.probe_every:
            self._windows_since_probe = 0
            if lat and self._min_latency and lat > self.trim_latency * self._min_latency and L > self.min:
                new = max(self.min, int(L * self.probe_down))
                if new < L:
                    self._probe = "down"
                    self._set(new, f"probe down: latency {lat:.0f} ms is {lat / self._min_latency:.1f}x the best seen; "
                                   f"trying {new} for the same goodput", w, allow_ceiling=True)
                    return
            new = min(self.max, max(L + 1, int(math.ceil(L * self.probe_up))))
            if self._ceiling is not None and new >= self._ceiling:
                return
            if new > L:
                self._probe = "up"
                self._set(new, f"probe up: {bX:.1f} rollouts/s at {L}, trying {new}", w)

    def _note(self, reason: str) -> None:
        with self._lock:
            self.decisions.append({"t": round(self._elapsed, 2), "from": self.limit, "to": self.limit, "reason": reason,
                                   "phase": self.phase})
            self._unreported += 1

    def operator_set(self, n: int) -> None:
        """Someone set parallelism by hand while the controller runs: take it as the new starting point."""
        n = int(min(self.max, max(self.min, int(n))))
        with self._lock:
            if n == self.limit:
                return
            self.decisions.append({"t": round(self._elapsed, 2), "from": self.limit, "to": n, "phase": "steady",
                                   "reason": f"parallelism set to {n} by an operator; adapting from there"})
            self._unreported += 1
            self.limit = n
            self.phase = "steady"
            self._probe, self._base, self._ceiling = "", None, None
            self._settle = self.settle_ticks
            self._changed_at = self._elapsed

    # ------------------------------------------------------------------ reporting
    def take_new_decisions(self) -> list[dict]:
        with self._lock:
            n, self._unreported = self._unreported, 0
            return self.decisions[len(self.decisions) - n:] if n else []

    def state(self) -> dict:
        return {"limit": self.limit, "phase": self.phase, "ceiling": self._ceiling,
                "min_latency_ms": round(self._min_latency, 1) if self._min_latency else None,
                "decisions": len(self.decisions)}


class AdaptiveControl:
    """Control: the inner control's pause / cancel win; otherwise the adaptive limit."""

    def __init__(self, ctl: AdaptiveConcurrency, inner: Any = None):
        self.ctl = ctl
        self.inner = inner

    def poll(self) -> ControlState:
        if self.inner is not None:
            st = self.inner.poll()
            if st is not None and st.action != "run":
                return st
            if st is not None and st.parallelism:  # an operator set parallelism: start from there
                self.ctl.operator_set(st.parallelism)
        return ControlState(action="run", parallelism=self.ctl.limit)


class AdaptiveSink:
    """Sink wrapper feeding the controller and adding extra["adaptive"] to each tick."""

    def __init__(self, ctl: AdaptiveConcurrency, inner: Any = None):
        self.ctl = ctl
        self.inner = inner

    async def rollout(self, result) -> None:
        self.ctl.observe_rollout(result)
        if self.inner is not None:
            await self.inner.rollout(result)

    async def progress(self, tick) -> None:
        try:
            self.ctl.observe_tick(tick)
        except Exception as e:  # never let the controller take the run down
            self.ctl.decisions.append({"t": tick.elapsed_s, "from": self.ctl.limit, "to": self.ctl.limit,
                                       "reason": f"controller error: {type(e).__name__}: {e}"})
        tick.extra["adaptive"] = dict(self.ctl.state(), new_decisions=self.ctl.take_new_decisions())
        if self.inner is not None:
            await self.inner.progress(tick)

    async def close(self) -> None:
        if self.inner is not None:
            await self.inner.close()
