"""Shared fixtures. Model-server fixtures live in their own plugin modules."""
import signal

import pytest

pytest_plugins = ["tests.fixtures_simulator", "tests.fixtures_vllm", "tests.fixtures_nemo_gym"]


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored,
    # and so would every process a test starts: Ctrl-C tests would see the CLI, and stop-by-SIGINT fixtures
    # see ng_run, shrug it off. The tests' processes get Ctrl-C as they would in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    from django.conf import settings

    settings.PASSWORD_HASHERS = ["tests.hashers.FastPBKDF2PasswordHasher"]  # 1000 rounds, not 1M (tests/hashers.py)


@pytest.fixture
def eager_tasks():
    """Celery tasks run inline (as a worker would run them) so the test can read their results."""
    from controlplane.celery import app

    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before


@pytest.fixture
def counter():
    """(key, read): a Redis counter a test's verifiers INCR once per real computation (tests/verifier_plugins.py
    `counted`), so tests count work done, not cache bookkeeping."""
    import os
    import uuid

    import redis

    key = f"test:verify-count:{uuid.uuid4().hex}"
    r = redis.Redis.from_url(os.environ.get("TEST_REDIS_URL") or os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/0")
    yield key, lambda: int(r.get(key) or 0)
    r.delete(key)
    r.close()
