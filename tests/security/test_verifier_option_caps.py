"""A hostile user asks the code verifier for `wall_s` 1e9 and `memory_mb` 1e6 (and the judge for a million calls
at once): every user-settable numeric option of every built-in verifier is refused above the operator's
maximum at each way in (API, dashboard, the CLI), and clamped again where a worker uses it (options stored
before a maximum was lowered)."""
from __future__ import annotations

import threading
import time

import pytest
from django.core.management import CommandError, call_command

from controlplane.jobs.models import CollectionJob
from workers.verifiers import VERIFIERS
from workers.verifiers.execution import VerifyExecutor

from tests.factories import make_dataset

from .conftest import make_endpoint

CODE_ROWS = [{"responses_create_params": {"input": "q"},
              "verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": ["1"]}}}]
HOSTILE = [
    ("code", {"wall_s": 1e9}), ("code", {"memory_mb": 1_000_000}), ("code", {"cpu_s": 1e9}),
    ("code", {"processes": 100_000}), ("code", {"output_bytes": 10**12}), ("code", {"wall_s": 1e308}),
    ("judge", {"concurrency": 1_000_000}), ("judge", {"timeout_s": 1e9}), ("judge", {"max_retries": 10**6}),
    ("judge", {"max_tokens": 10**9}),
]


def _code_dataset(owner):
    return make_dataset(owner, rows=CODE_ROWS)


def _options(name, hostile):
    return {**({"base_url": "http://127.0.0.1:9"} if name == "judge" else {}), **hostile}


def test_every_numeric_option_of_every_builtin_verifier_has_a_maximum():
    for name, v in VERIFIERS.items():
        numeric = {k for k, (types, _) in (v.options or {}).items()
                   if {int, float} & set(types if isinstance(types, tuple) else (types,))} - v.record_options
        assert numeric <= set(v.option_caps()), (name, numeric - set(v.option_caps()))


@pytest.mark.parametrize("name,hostile", HOSTILE)
def test_api_refuses_options_above_the_operator_maximum(api, mallory, name, hostile):
    ds = _code_dataset(mallory)
    ep = make_endpoint(mallory)
    body = {"dataset": ds.pk, "endpoint": ep.pk, "verifier": name, "verifier_options": _options(name, hostile)}
    r = api.post("/api/jobs/", body, format="json")
    assert r.status_code == 400, r.content
    message = " ".join(r.json()["verifier_options"])
    option = next(iter(hostile))
    assert option in message and ("at most" in message or "finite" in message), message
    assert not CollectionJob.objects.exists()


@pytest.mark.parametrize("raw", ["NaN", "Infinity", "-1"])
def test_api_refuses_non_finite_and_negative_values(api, mallory, raw):
    ds = _code_dataset(mallory)
    ep = make_endpoint(mallory)
    body = f'{{"dataset": {ds.pk}, "endpoint": {ep.pk}, "verifier": "code", "verifier_options": {{"wall_s": {raw}}}}}'
    r = api.post("/api/jobs/", body, content_type="application/json")
    assert r.status_code == 400, r.content
    assert not CollectionJob.objects.exists()


def test_dashboard_and_cli_refuse_them_too(web, mallory, tmp_path):
    ds = _code_dataset(mallory)
    ep = make_endpoint(mallory)
    r = web.post(f"/datasets/{ds.pk}/", {"endpoint": ep.pk, "num_repeats": 1, "num_samples_in_parallel": 2,
                                          "verify_mode": "inline", "chunk_size": 5, "verify_cache": "job",
                                          "verifier": "code", "verifier_options": '{"wall_s": 1e9, "memory_mb": 1000000}'})
    assert r.status_code == 400 and "must be at most 60" in r.content.decode() and "memory_mb" in r.content.decode()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"responses_create_params": {"input": "q"}, "verifier_metadata": '
                     '{"unit_tests": {"inputs": [""], "outputs": ["1"]}}}\n')
    with pytest.raises(CommandError, match="wall_s.*must be at most 60"):
        call_command("collect_rollouts", f"+input_jsonl_fpath={tasks}", f"+output_jsonl_fpath={tmp_path}/o.jsonl",
                     "+model_base_url=http://127.0.0.1:9", "+model_name=m", "+verifier=code",
                     "+verifier_options.wall_s=1000000000")
    assert not CollectionJob.objects.exists()


def test_the_operator_sets_the_maxima(api, mallory, monkeypatch, settings):
    ds = _code_dataset(mallory)
    ep = make_endpoint(mallory)
    body = {"dataset": ds.pk, "endpoint": ep.pk, "verifier": "code", "verifier_options": {"wall_s": 100}}
    assert api.post("/api/jobs/", body, format="json").status_code == 400
    monkeypatch.setenv("VERIFIER_OPTION_MAX", "code.wall_s=120")
    r = api.post("/api/jobs/", {**body, "verifier_options": {"wall_s": 100}}, format="json")
    assert r.status_code == 201, r.content
    r = api.post("/api/jobs/", {**body, "verifier_options": {"wall_s": 121}}, format="json")
    assert r.status_code == 400 and "at most 120" in " ".join(r.json()["verifier_options"])


@pytest.mark.slow
def test_a_worker_clamps_options_stored_before_the_maximum_and_the_program_is_stopped(monkeypatch):
    """A job stored with wall_s 1e9 (before the maximum existed): the worker's executor holds it to the
    maximum, so a program that sleeps forever is killed at the operator's wall limit (real process)."""
    monkeypatch.setenv("VERIFIER_OPTION_MAX", "code.wall_s=2,code.cpu_s=1")
    ex = VerifyExecutor("code", {"wall_s": 1e9, "cpu_s": 1e9, "memory_mb": 1_000_000}, cache="off")
    assert ex.options["wall_s"] == 2 and ex.options["cpu_s"] == 1 and ex.options["memory_mb"] == 2048
    # the verifier clamps again where it runs the program (the pool path hands it options directly)
    done: dict = {}

    def verify():
        t0 = time.monotonic()
        done["result"] = VERIFIERS["code"].verify(
            {"verifier_metadata": {"unit_tests": {"inputs": [""], "outputs": ["1"]}}},
            "```python\nimport time\ntime.sleep(10**6)\n```", {"wall_s": 1e9, "cpu_s": 1e9})
        done["elapsed"] = time.monotonic() - t0

    t = threading.Thread(target=verify, daemon=True)
    t.start()
    t.join(30)
    assert "result" in done, "the program ran past the operator's wall limit"
    assert done["elapsed"] < 15 and "wall-clock limit exceeded" in done["result"].fields["failure_reason"]
    judge = VerifyExecutor("judge", {"base_url": "http://127.0.0.1:9", "concurrency": 10**6}, cache="off")
    assert judge.concurrency == 64
