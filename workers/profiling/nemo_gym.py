"""NeMo Gym resources servers started with `+profiling_enabled=true`: their yappi profile, pulled into the
same rows while a job runs.

Such a server profiles itself with yappi (CPU clock) from start-up. `GET /stats` makes it write its
profile to `<profiling_results_dirpath>/<server key>/<server name>.log` (and `.callgrind`) and answers
with an empty body; the log is yappi's table with the columns name, ncall, tsub, ttot, tavg, where name is
"<file>:<line> <function>". The puller calls /stats, reads the log (the directory must be readable from
the worker: same host or a shared volume), and turns the change since its last pull into a snapshot.
"""
from __future__ import annotations

import logging
import re
import time
import urllib.request

from .core import FuncRow, ProfileSnapshot, _delta, merge_rows

log = logging.getLogger(__name__)

_ROW = re.compile(r"^(?P<name>.+?)\s+(?P<ncall>\d+(?:/\d+)?)\s+(?P<tsub>[\d.eE+-]+)\s+(?P<ttot>[\d.eE+-]+)\s+"
                  r"(?P<tavg>[\d.eE+-]+)\s*$")
_FULL = re.compile(r"^(?P<module>.*):(?P<line>\d+) (?P<func>.+)$")


def parse_log(text: str, source: str = "log") -> list[FuncRow]:
    """Rows of a yappi `print_all` table (NeMo Gym's <server>.log). Raises ValueError naming the line for
    a line that is not a row."""
    rows, header = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not header:
            if line.split()[:1] == ["name"]:
                header = True
            continue
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"{source} line {n}: not a profile row (name ncall tsub ttot tavg): {line[:120]!r}")
        name = m["name"].strip()
        fm = _FULL.match(name)
        module, lineno, func = (fm["module"], int(fm["line"]), fm["func"]) if fm else ("", 0, name)
        ncall = int(m["ncall"].split("/")[0])
        ttot = float(m["ttot"])
        rows.append(FuncRow(module, lineno, func, ncall, float(m["tsub"]), ttot, float(m["tavg"])))
    if not header:
        raise ValueError(f"{source}: no 'name ncall tsub ttot tavg' header found")
    return rows


class StatsPuller:
    """Pulls each source every `window_s`: sources are {"url": ".../stats", "log": "/path/<server>.log"}."""

    def __init__(self, sources, session: str, window_s: float = 5.0, timeout_s: float = 10.0):
        self.sources = [s if isinstance(s, dict) else {"url": s} for s in sources]
        self.session = session
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.prev: dict[str, dict] = {}
        self.last = 0.0
        self.last_t: dict[str, float] = {}

    def poll(self) -> list[ProfileSnapshot]:
        now = time.time()
        if now - self.last < self.window_s:
            return []
        self.last = now
        out = []
        for src in self.sources:
            try:
                out.extend(self._pull(src, now))
            except Exception as exc:  # noqa: BLE001  (one unreachable server never stops the job)
                log.warning("profiling: pulling %s failed: %s", src.get("url"), exc)
        return out

    def _pull(self, src: dict, now: float) -> list[ProfileSnapshot]:
        url = src["url"]
        with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:  # the server dumps its profile
            resp.read()
        path = src.get("log")
        if not path:
            return []
        with open(path, encoding="utf-8", errors="replace") as f:
            rows = parse_log(f.read(), source=path)
        cur: dict = {}
        merge_rows(cur, rows)
        before = self.prev.get(url)
        self.prev[url] = cur
        start = self.last_t.get(url, now)
        self.last_t[url] = now
        if before is None:  # first pull: the baseline (the server has profiled since it started)
            return []
        delta = [r for r in _delta(cur, before) if r.ncall > 0]
        return [ProfileSnapshot(session=self.session, scope="verify", clock="cpu", worker=url, window_start=start,
                                window_end=now, rows=delta, source="nemo-gym")]
