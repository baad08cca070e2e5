"""The engine finds NeMo Gym's runs through its rollout-source registry and never imports workers.nemo_gym."""
import ast
import asyncio
import subprocess
import sys
import pytest
from dataclasses import replace
from pathlib import Path

from workers.engine.runner import CollectionRun, run_collection
from workers.engine.sources import run_class_for
from workers.engine.types import CollectionSpec, EndpointSpec

ROOT = Path(__file__).resolve().parents[2]


class _ListSink:
    def __init__(self):
        self.rows, self.closed = [], False

    async def rollout(self, result):
        self.rows.append(result)

    async def progress(self, tick):
        pass

    async def close(self):
        self.closed = True


@pytest.mark.slow
def test_engine_modules_never_import_the_nemo_gym_package():
    for path in (ROOT / "workers" / "engine").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("workers.nemo_gym") for n in names), f"{path.name} imports {names}"
    code = "import sys, workers.engine.runner; print('workers.nemo_gym' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


def test_registered_sources_are_found_by_endpoint_kind_and_verifier():
    import workers.nemo_gym.engine as ng

    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=["http://127.0.0.1:1"], model="m"))
    assert run_class_for(spec, CollectionRun) is CollectionRun
    assert run_class_for(replace(spec, endpoint=replace(spec.endpoint, api_flavor="nemo_gym_agent")), CollectionRun) is ng.AgentRun
    assert run_class_for(replace(spec, endpoint=replace(spec.endpoint, api_flavor="nemo_gym_head")), CollectionRun) is ng.AgentRun
    assert run_class_for(replace(spec, verifier="nemo_gym", verify_mode="inline"), CollectionRun) is ng.RemoteVerifyRun
    assert run_class_for(replace(spec, verifier="nemo_gym", verify_mode="deferred"), CollectionRun) is CollectionRun


def test_an_unregistered_endpoint_kind_is_refused_with_the_reason():
    spec = CollectionSpec(endpoint=EndpointSpec(base_urls=["http://127.0.0.1:1"], model="m", api_flavor="my_env"))
    sink = _ListSink()
    summary = asyncio.run(run_collection(spec, [], sink))
    assert summary.completed == 0 and sink.closed and not sink.rows
    assert "no rollout source for endpoint kind 'my_env'" in summary.fatal_error
