"""Scrape vLLM's `/metrics` (one or several replicas) with a timeout, keep the previous scrape, and report
the window between the two (gauges, counter rates, bucket-delta percentiles)."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from workers import outbound

from .prom import VllmSnapshot, merge_snapshots, parse_metrics, window


METRICS_MAX_BYTES = 8 * 1024 * 1024  # vLLM's /metrics is a few hundred kB with many LoRA adapters


def _why(exc: BaseException) -> str:
    """A failed scrape in the product's words (the error lands in ticks every user sees)."""
    if isinstance(exc, RuntimeError):
        return str(exc)  # ours: "HTTP 404", "no vllm:* metrics"
    return outbound.describe(exc)[1]


def metrics_url(base_url: str) -> str:
    """http://host:8000 or http://host:8000/v1 -> http://host:8000/metrics"""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"


class VllmScraper:
    """`await scraper.scrape()` fetches every replica's /metrics, merges them and returns the window
    since the previous successful scrape (see prom.window), or a dict with `ok: False` and the error.
    The first scrape of a replica is a baseline (`baseline: True`, gauges and capacity only): counters and
    histograms are cumulative since the server started and would carry earlier jobs' requests.
    `capacity` is what the replicas state about themselves, summed (prom.capacity_of); `replica_errors`
    names the replicas whose /metrics failed this time.
    A server without /metrics (a hosted API) answers 404: `supported` becomes False after a few tries
    and later scrapes are skipped."""

    def __init__(self, base_urls: list[str] | str, timeout_s: float = 2.0, session=None, give_up_after: int = 3):
        if isinstance(base_urls, str):
            base_urls = [base_urls]
        self.urls = [metrics_url(u) for u in base_urls]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None
        self.prev: VllmSnapshot | None = None
        self.prev_by_url: dict[str, VllmSnapshot] = {}
        self.last: dict | None = None
        self.failures = 0
        self.give_up_after = give_up_after
        self.supported = True

    async def _fetch(self, session, url: str) -> VllmSnapshot:
        async with session.get(url, timeout=self.timeout, max_bytes=METRICS_MAX_BYTES) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            text = (await resp.read()).decode("utf-8", "replace")
        snap = parse_metrics(text, t=time.monotonic())
        if not snap.names_seen:
            raise RuntimeError("no vllm:* metrics")
        return snap

    async def scrape(self) -> dict:
        if not self.supported:
            return {"ok": False, "error": "endpoint exposes no vLLM /metrics", "unsupported": True}
        if self._session is None:
            self._session = outbound.gated_session(limit=len(self.urls) or 1)
        results = await asyncio.gather(*(self._fetch(self._session, u) for u in self.urls), return_exceptions=True)
        snaps = [r for r in results if isinstance(r, VllmSnapshot)]
        errors = [f"{u}: {_why(r)}" for u, r in zip(self.urls, results) if not isinstance(r, VllmSnapshot)]
        if not snaps:
            self.failures += 1
            if self.failures >= self.give_up_after and self.prev is None:
                self.supported = False
            self.last = {"ok": False, "error": "; ".join(errors)[:500]}
            return self.last
        self.failures = 0
        ok_urls = [u for u, r in zip(self.urls, results) if isinstance(r, VllmSnapshot)]
        by_url = dict(zip(ok_urls, snaps))
        # Deltas only between two scrapes of the SAME replicas: a replica seen for the first time (or back
        # after failing) is a baseline, never a sample: its histograms cover the server's whole life.
        paired = [u for u in ok_urls if u in self.prev_by_url]
        cur = merge_snapshots(snaps) if len(snaps) > 1 else snaps[0]
        if paired:
            cur_p = merge_snapshots([by_url[u] for u in paired])
            prev_p = merge_snapshots([self.prev_by_url[u] for u in paired])
            prev_p.t = min(self.prev_by_url[u].t for u in paired)
            cur_p.t = max(by_url[u].t for u in paired)
            out = window(prev_p, cur_p)
            for key in ("running", "waiting", "kv_usage"):  # gauges: every replica that answered now
                out[key] = window(None, cur)[key]
            out["capacity"] = dict(cur.capacity) if cur.capacity else out.get("capacity")
        else:
            out = window(None, cur)
            out = {k: v for k, v in out.items() if k in ("running", "waiting", "kv_usage", "names", "capacity",
                                                          "cache_config", "swapped")}
            out["baseline"] = True
        out["ok"] = True
        out["replicas"] = len(snaps)
        out["replicas_total"] = len(self.urls)
        if errors:
            out["errors"] = errors
            out["replica_errors"] = {u: _why(r)[:200] for u, r in zip(self.urls, results)
                                     if not isinstance(r, VllmSnapshot)}
        for u in self.urls:  # a replica that failed now is a baseline again when it comes back
            if u in by_url:
                self.prev_by_url[u] = by_url[u]
            else:
                self.prev_by_url.pop(u, None)
        self.prev = cur
        self.last = out
        return out

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
