"""Shared fixtures. Model-server fixtures live in their own plugin modules."""
import pytest

pytest_plugins = ["tests.fixtures_simulator", "tests.fixtures_vllm", "tests.fixtures_nemo_gym"]


@pytest.fixture
def eager_tasks():
    """Celery tasks run inline (as a worker would run them) so the test can read their results."""
    from controlplane.celery import app

    before = app.conf.task_always_eager
    app.conf.task_always_eager = True
    yield
    app.conf.task_always_eager = before
