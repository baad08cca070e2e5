"""Scrape vLLM's `/metrics` (one or several replicas) with a timeout, keep the previous scrape, and report
the window between the two (gauges, counter rates, bucket-delta percentiles)."""
from __future__ import annotations

import asyncio
import time

import aiohttp

from .prom import VllmSnapshot, merge_snapshots, parse_metrics, window


def metrics_url(base_url: str) -> str:
    """http://host:8000 or http://host:8000/v1 -> http://host:8000/metrics"""
    base = base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[: -len("/v1")]
    return base + "/metrics"


class VllmScraper:
    """`await scraper.scrape()` fetches every replica's /metrics, merges them and returns the window
    since the previous successful scrape (see prom.window), or a dict with `ok: False` and the error.
    A server without /metrics (a hosted API) answers 404: `supported` becomes False after a few tries
    and later scrapes are skipped."""

    def __init__(self, base_urls: list[str] | str, timeout_s: float = 2.0, session: aiohttp.ClientSession | None = None,
                 give_up_after: int = 3):
        if isinstance(base_urls, str):
            base_urls = [base_urls]
        self.urls = [metrics_url(u) for u in base_urls]
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session = session
        self._own_session = session is None
        self.prev: VllmSnapshot | None = None
        self.last: dict | None = None
        self.failures = 0
        self.give_up_after = give_up_after
        self.supported = True

    async def _fetch(self, session: aiohttp.ClientSession, url: str) -> VllmSnapshot:
        async with session.get(url, timeout=self.timeout) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            text = await resp.text()
        snap = parse_metrics(text, t=time.monotonic())
        if not snap.names_seen:
            raise RuntimeError("no vllm:* metrics")
        return snap

    async def scrape(self) -> dict:
        if not self.supported:
            return {"ok": False, "error": "endpoint exposes no vLLM /metrics", "unsupported": True}
        if self._session is None:
            self._session = aiohttp.ClientSession()
        results = await asyncio.gather(*(self._fetch(self._session, u) for u in self.urls), return_exceptions=True)
        snaps = [r for r in results if isinstance(r, VllmSnapshot)]
        errors = [f"{u}: {type(r).__name__}: {r}" for u, r in zip(self.urls, results) if not isinstance(r, VllmSnapshot)]
        if not snaps:
            self.failures += 1
            if self.failures >= self.give_up_after and self.prev is None:
                self.supported = False
            self.last = {"ok": False, "error": "; ".join(errors)[:500]}
            return self.last
        self.failures = 0
        cur = merge_snapshots(snaps) if len(snaps) > 1 else snaps[0]
        out = window(self.prev, cur)
        out["ok"] = True
        out["replicas"] = len(snaps)
        if errors:
            out["errors"] = errors
        self.prev = cur
        self.last = out
        return out

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
