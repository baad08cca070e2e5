"""A Celery worker that times every SQL statement it sends, for `bench_scale workers` with BENCH_SQL_TIMES=DIR
(issue 28: which statement's cost grows with the job's row count). Statements are grouped by shape (numbers and
quoted strings taken out); on exit (the bench's SIGTERM: Celery's warm shutdown) DIR/<tag>.sql.txt lists, per
shape, the count, the total and mean milliseconds as the worker waited for them (PostgreSQL's time included).

    python -m bench.sqltime_worker OUT_DIR TAG -A controlplane worker ...   # the rest: celery's arguments
"""
from __future__ import annotations

import re
import threading
import time
import traceback
from pathlib import Path

from bench._common import celery_worker_reporting

_SHAPE = re.compile(r"'(?:[^']|'')*'|\b\d+(?:\.\d+)?\b")
_times: dict[str, list] = {}
_lock = threading.Lock()


def _shape(sql: str) -> str:
    s = re.sub(r"(\?, )+\?|(%s, )+%s", "…", _SHAPE.sub("?", sql))
    return s if len(s) <= 400 else s[:150] + " … " + s[-250:]


def _timer(execute, sql, params, many, context):
    t = time.perf_counter()
    try:
        return execute(sql, params, many, context)
    finally:
        dt = time.perf_counter() - t
        key = _shape(sql)
        with _lock:
            entry = _times.get(key)
            if entry is None:  # where the shape is sent from (the project's frames), once
                where = [f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                         for f in traceback.extract_stack() if "/controlplane/" in f.filename]
                entry = _times[key] = [0, 0.0, " < ".join(reversed(where[-4:]))]
            entry[0] += 1
            entry[1] += dt


def _install(sender, connection, **kwargs):
    # once per connection object: it fires again at every reconnection (CONN_MAX_AGE=0, close_old_connections)
    if _timer not in connection.execute_wrappers:
        connection.execute_wrappers.append(_timer)


def _dump(out: Path, tag: str):
    out.mkdir(parents=True, exist_ok=True)
    with _lock:
        rows = sorted(_times.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for _, v in rows)
    lines = [f"total {total * 1000:.0f} ms in {sum(v[0] for _, v in rows)} statements",
             f"{'count':>8} {'total ms':>10} {'mean ms':>8}  statement"]
    lines += [f"{n:>8} {s * 1000:10.1f} {s * 1000 / n:8.3f}  {k}\n{'':>29}from {where}" for k, (n, s, where) in rows]
    (out / f"{tag}.sql.txt").write_text("\n".join(lines) + "\n")


def _connect():
    from django.db.backends.signals import connection_created

    connection_created.connect(_install, weak=False)


def main():
    celery_worker_reporting(_dump, setup=_connect)


if __name__ == "__main__":
    main()
