"""The reference trainer (examples/train_reinforce.py) end to end on real vLLM on CPU, 3 steps, through the product
only: a live web server and a Celery worker (collection and the control lane) on this test's database, the trainer
a subprocess in the vLLM venv (torch) that speaks HTTP.

Must show: every consumed rollout is within the lag bound; the weights vLLM serves change after each update
(checksums through vLLM's dev-mode /weight_checker); a trainer killed with a batch taken and not acknowledged,
restarted, trains on every rollout exactly once; every group handed out is complete."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
import uuid

import pytest

from controlplane.jobs import stream
from controlplane.jobs.models import Rollout, StreamConsumer
from tests.api.test_cli_live import REPO, Proc, _database_url, _free_port
from tests.controlplane.test_weight_update_vllm import EMPTY_DIGEST, checksums
from tests.factories import api_token
from tests.fixtures_vllm import VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

PROMPTS, GROUP = 2, 4


@pytest.fixture
def train_stack(transactional_db, tmp_path, django_user_model):
    """Web server + one Celery worker serving a work queue and a control queue of this test's own, with the
    trainer's reward verifier nameable by users (VERIFIER_PATH_MODULES); yields (url, token)."""
    user = django_user_model.objects.create_user(username="trainer", password="pw")
    queue = f"train-{uuid.uuid4().hex[:10]}"
    env = {**os.environ, "DATABASE_URL": _database_url(), "CELERY_TASK_DEFAULT_QUEUE": queue,
           "CELERY_CONTROL_QUEUE": f"{queue}-control", "DJANGO_SETTINGS_MODULE": "controlplane.settings",
           "PYTHONUNBUFFERED": "1", "VERIFIER_PATH_MODULES": "examples.train_reward"}
    port = _free_port()
    py = str(REPO / ".venv" / "bin" / "python")
    procs = [Proc("web", [py, "manage.py", "runserver", f"127.0.0.1:{port}", "--noreload"], env, tmp_path),
             Proc("worker", [py, "-m", "celery", "-A", "controlplane", "worker", "-P", "threads", "-c", "3", "-Q",
                             f"{queue},{queue}-control", "-n", f"{queue}@%h", "--without-gossip", "--without-mingle",
                             "-l", "info"], env, tmp_path)]
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/api/schema/", timeout=5):
                    break
            except OSError:
                assert procs[0].popen.poll() is None and time.monotonic() < deadline, procs[0].tail()
                time.sleep(0.3)
        while b"ready" not in procs[1].log_path.read_bytes():
            assert procs[1].popen.poll() is None and time.monotonic() < deadline, procs[1].tail()
            time.sleep(0.3)
        yield url, api_token(user), procs
    finally:
        for p in procs:
            p.stop()


def visible_checksums(url: str) -> dict:
    # on a CPU with AVX-512 vLLM packs linear weights into a kernel copy and leaves empty parameters behind
    return {k: v for k, v in checksums(url).items() if v != EMPTY_DIGEST}


@pytest.mark.timeout(600)
def test_three_steps_of_the_reference_trainer_on_vllm(vllm_server, train_stack, tmp_path):
    url, token, procs = train_stack
    out = tmp_path / "run"

    def trainer(steps: int, *extra) -> subprocess.CompletedProcess:
        env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
        return subprocess.run(
            [str(VLLM_PYTHON), "examples/train_reinforce.py", "--url", url, "--token", token, "--vllm-url",
             vllm_server.url, "--out", str(out), "--run", "e2e", "--steps", str(steps), "--prompts", str(PROMPTS),
             "--group", str(GROUP), "--max-tokens", "8", "--lr", "1e-2", *extra],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    def ok(r):
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr[-3000:]}\n" + "\n".join(p.tail() for p in procs)

    sums = [visible_checksums(vllm_server.url)]
    # step 1 whole, then killed in step 2 with its batch taken and not acknowledged: nothing was updated since
    r = trainer(2, "--crash-after-take", "2")
    assert r.returncode == 3, f"{r.stdout}\n{r.stderr[-3000:]}"
    assert "crash: exiting with step 2's batch" in r.stdout
    sums.append(visible_checksums(vllm_server.url))
    consumer = StreamConsumer.objects.filter(name="e2e").order_by("-job_id").first()  # step 2's job
    assert stream.packed_len(consumer.pending_ids) == PROMPTS * GROUP  # handed out, not acknowledged
    ok(trainer(2))  # restarted: step 2 on the same batch, then its update
    sums.append(visible_checksums(vllm_server.url))
    ok(trainer(3))
    sums.append(visible_checksums(vllm_server.url))

    # the weights vLLM serves changed with each of the 3 steps' updates (every tensor the checksum sees)
    assert any("embed_tokens" in k for k in sums[0]), sorted(sums[0])
    for before, after in zip(sums[1:], sums[2:]):
        assert after.keys() == before.keys() and all(after[k] != before[k] for k in after)
    assert sums[1] != sums[0]  # step 1's update (from whatever the server served before the run)

    steps = [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["redelivered"] for s in steps] == [0, 1, 0]  # the killed consumer's batch came again, once
    # the next batch comes from the new weights: each step's version is the previous step's update
    assert [s["version"] for s in steps[1:]] == [s["next_version"] for s in steps[:-1]]
    all_ids = [i for s in steps for i in s["ids"]]
    assert len(all_ids) == len(set(all_ids)) == 3 * PROMPTS * GROUP  # each rollout trained on once
    for s in steps:
        rows = Rollout.objects.filter(pk__in=s["ids"])
        job_ok = set(Rollout.objects.filter(job_id=s["job"], status="ok").values_list("id", flat=True))
        assert set(s["ids"]) == job_ok  # none skipped: the whole job, exactly once
        # within the lag bound (max_version_lag 0): sampled on the version in force when handed out
        assert all(lag == 0 for lag in s["lags"]) and {r.weight_version for r in rows} == {str(s["version"])}
        # complete groups: every repeat of each task, together
        groups = {}
        for r in rows:
            groups.setdefault(r.task_index, []).append(r.rollout_index)
        assert s["group_sizes"] == [GROUP] * PROMPTS
        assert all(sorted(g) == list(range(GROUP)) for g in groups.values()) and len(groups) == PROMPTS
        c = StreamConsumer.objects.get(job_id=s["job"], name="e2e")
        assert c.delivered == len(s["ids"]) and not c.pending_ids
    assert sum(s["rollouts"] for s in steps) == 3 * PROMPTS * GROUP
    # the loss was on the tokens vLLM sampled (kept on each rollout's message), not on retokenized text
    assert all(s["sampled_ids"] == s["rollouts"] for s in steps)
    msg = next(i for i in Rollout.objects.get(pk=all_ids[0]).data["response"]["output"] if i["type"] == "message")
    assert msg["prompt_token_ids"] and 0 < len(msg["generation_token_ids"]) <= 8
    assert all(s["update_s"] > 0 and s["train_s"] > 0 and s["wait_s"] > 0 for s in steps)
