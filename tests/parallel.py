"""Runs the suite on several pytest-xdist workers (`bash scripts/test.sh`: `-n 3 --dist loadgroup`).

Loaded early (`-p tests.parallel` in pytest.ini), before pytest-django reads the settings, so that on an xdist
worker (PYTEST_XDIST_WORKER=gwN) everything the tests share outside PostgreSQL is the worker's own before any
settings module or subprocess reads it (pytest-django already gives each worker its own test database,
test_<name>_gwN):
- the Redis database: db <base - N> of REDIS_URL (and TEST_REDIS_URL, CELERY_BROKER_URL, VERIFY_CACHE_URL where
  they name the same one); so `TEST_REDIS_URL=redis://h:6379/15 ... -n 3` uses dbs 15, 14, 13. Never db 0 (the
  demo's);
- the Celery queues (CELERY_TASK_DEFAULT_QUEUE, CELERY_CONTROL_QUEUE) and CHANNELS_PREFIX: suffixed -gwN;
- PROMETHEUS_MULTIPROC_DIR: a gwN subdirectory, emptied.
The Celery workers, web servers and CLIs the tests start inherit these.

The expensive tiers start their servers once per run, not once per worker: a collection hook puts every test of
a tier into one xdist group (one worker runs it all: real NeMo Gym, real vLLM, Chromium), and moves the groups,
longest first, to the front of the queue (with --no-loadscope-reorder the workers take work in collection order),
so they start at once while the other worker(s) take the single tests.
"""
from __future__ import annotations

import os
import re
import shutil

import pytest

# (group, markers, fixtures): a test with one of the markers or fixtures goes to the group; longest group first
TIERS = [
    ("nemo_gym", {"nemo_gym"}, {"nemo_gym"}),
    ("browser", {"browser"}, set()),
    ("vllm", {"vllm"}, {"vllm_server"}),
]
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")


def _redis_db_url(url: str, index: int) -> str:
    """`url` with its database number lowered by `index` (redis://host:port/15 -> /14 for index 1)."""
    m = re.match(r"^(rediss?://[^/?#]*)(?:/(\d*))?([?#].*)?$", url)
    if not m:
        raise RuntimeError(f"tests/parallel.py: cannot give xdist worker {WORKER} its own Redis db in {url!r}")
    db = int(m.group(2) or 0) - index
    if db < 1:
        raise RuntimeError(f"tests/parallel.py: worker {WORKER} would use Redis db {db} of {url!r}: give the run a "
                           f"higher TEST_REDIS_URL db (worker gwN uses db <base - N>, never 0) or fewer workers")
    return f"{m.group(1)}/{db}{m.group(3) or ''}"


def isolate_worker(env: dict, worker: str) -> None:
    """Rewrites `env` (os.environ) so that xdist worker `worker` ("gw1") shares no Redis state, queue, channel
    prefix nor metrics directory with the other workers of the run."""
    index = int(worker.removeprefix("gw"))
    base = env.get("REDIS_URL") or "redis://127.0.0.1:6379/0"
    own = _redis_db_url(base, index)
    for var in ("REDIS_URL", "TEST_REDIS_URL", "CELERY_BROKER_URL", "VERIFY_CACHE_URL"):
        if var == "REDIS_URL" or env.get(var) == base:
            env[var] = own
    for var, default in (("CELERY_TASK_DEFAULT_QUEUE", "celery"), ("CELERY_CONTROL_QUEUE", "control"),
                         ("CHANNELS_PREFIX", "asgi")):
        value = env.get(var, default)
        if value:  # CELERY_CONTROL_QUEUE="" (the control lane off) stays off
            env[var] = f"{value}-{worker}"
    metrics = env.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics:
        own_dir = os.path.join(metrics, worker)
        shutil.rmtree(own_dir, ignore_errors=True)
        os.makedirs(own_dir)
        env["PROMETHEUS_MULTIPROC_DIR"] = own_dir


if WORKER:
    isolate_worker(os.environ, WORKER)


def tier_of(item) -> str | None:
    names = {m.name for m in item.iter_markers()}
    fixtures = set(getattr(item, "fixturenames", ()))
    for group, markers, fixture_names in TIERS:
        if names & markers or fixtures & fixture_names:
            return group
    return None


def _loadgroup(config) -> bool:
    # on a worker xdist sets dist to "no" and keeps loadgroup; the controller has dist itself
    return bool(config.getoption("loadgroup", False)) or config.getoption("dist", "no") == "loadgroup"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks into the node ids
def pytest_collection_modifyitems(config, items):
    if _loadgroup(config):
        for item in items:
            group = tier_of(item)
            if group is not None:
                item.add_marker(pytest.mark.xdist_group(group))


class GroupsFirst:
    @pytest.hookimpl(trylast=True)  # after pytest-django's own reordering (TestCase, then transactional tests)
    def pytest_collection_modifyitems(self, config, items):
        """The tiers' groups, longest first, then every other test in its order (the controller hands work out
        in collection order with --no-loadscope-reorder)."""
        if _loadgroup(config):
            rank = {group: i for i, (group, _, _) in enumerate(TIERS)}
            items.sort(key=lambda item: rank.get(tier_of(item), len(rank)))  # stable: in-group order kept


def pytest_configure(config):
    config.pluginmanager.register(GroupsFirst(), "tests-parallel-groups-first")
