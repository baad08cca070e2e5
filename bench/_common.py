"""What several benches share: the engine sinks that only count, the aligned text table, and the Celery worker
wrapper that writes a report when the worker stops (bench/yappi_worker.py, bench/sqltime_worker.py)."""
from __future__ import annotations

import atexit
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable


# ------------------------------------------------------------------------------------------ sinks
class NullSink:
    """An engine sink that drops everything (the cost of the run without a sink's work)."""

    async def rollout(self, r):
        pass

    async def progress(self, t):
        pass

    async def close(self):
        pass


class CountingSink(NullSink):
    """Counts successful (`ok`) and failed rollouts; `times=True` also keeps the monotonic time each successful
    one finished (`ok_at`), `rewards=True` the reward of each successful one (`rewards`)."""

    def __init__(self, *, times: bool = False, rewards: bool = False):
        self.ok = self.failed = 0
        self.ok_at: list[float] | None = [] if times else None
        self.rewards: list | None = [] if rewards else None

    async def rollout(self, r):
        if r.ok:
            self.ok += 1
            if self.ok_at is not None:
                self.ok_at.append(time.monotonic())
            if self.rewards is not None:
                self.rewards.append(r.reward)
        else:
            self.failed += 1


# ------------------------------------------------------------------------------------------ tables
def table_lines(header, rows, *, left: int = 1) -> list[str]:
    """`header` and `rows` as aligned text: the first `left` columns left-aligned, the others right-aligned,
    a rule of dashes under the header."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "  ".join(str(x).ljust(w) if i < left else str(x).rjust(w)
                         for i, (x, w) in enumerate(zip(cells, widths)))

    return [line(header), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


# ------------------------------------------------------------------------------------------ workers
def celery_worker_reporting(dump: Callable[[Path, str], None], setup: Callable[[], None] | None = None) -> None:
    """Run Celery as `python -m bench.X OUT_DIR TAG <celery's arguments>`: `setup()` first, then the worker;
    `dump(OUT_DIR, TAG)` writes the report once when it stops (at exit for the bench's SIGTERM, Celery's warm
    shutdown, or when Celery returns)."""
    out, tag = Path(sys.argv[1]), sys.argv[2]
    sys.argv = ["celery", *sys.argv[3:]]
    if setup is not None:
        setup()
    atexit.register(dump, out, tag)
    from celery.__main__ import main as celery_main

    try:
        celery_main()
    finally:
        atexit.unregister(dump)
        dump(out, tag)


@contextmanager
def throwaway_api(name: str, row_count: int):
    """A throwaway test database (`<name>_<pid>`, dropped on exit; Django set up by the caller) holding a user,
    its API token, a ready dataset of `row_count` rows and an endpoint, with the API's throttles off: yields
    (user, token, dataset, endpoint)."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.db import connection

    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = f"{name}_{os.getpid()}"
    old_name = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        from controlplane.api.auth import issue_token
        from controlplane.datasets.models import Dataset
        from controlplane.endpoints.models import Endpoint

        settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"user": None, "anon": None}}
        user = get_user_model().objects.create_user("bench", password="x")
        token = issue_token(user)[0]
        ds = Dataset.objects.create(owner=user, name="bench", status="ready", row_count=row_count)
        ep = Endpoint.objects.create(owner=user, name="bench", base_url="http://127.0.0.1:9", model_name="m")
        yield user, token, ds, ep
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
