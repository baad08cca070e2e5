"""Throughput in CI: `rolloutctl gate --baseline-job N --min-throughput-ratio R` (and --min-metric-ratio) run as a
subprocess against a live server exits 1 against a faster baseline, 0 against a slower one; `rolloutctl
diagnose` and `rolloutctl sweep` over the same API."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.api.test_history_api import rated_jobs

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def jobs(transactional_db):
    return rated_jobs()


def _cli(url, token, *args):
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(ROLLOUTCTL_URL=url, ROLLOUTCTL_TOKEN=token)
    return subprocess.run([sys.executable, "-m", "rolloutctl", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_gate_exits_1_against_a_faster_baseline_and_0_against_a_slower_one(jobs, live_server):
    from controlplane.alerts.models import Webhook, WebhookDelivery

    token, slow, fast, worse = jobs
    url = live_server.url
    Webhook.objects.create(owner=slow.owner, url="https://hooks.example.com/x", secret="s", events=["job.gate_failed"])
    r = _cli(url, token, "gate", slow.pk, "--baseline-job", fast.pk, "--min-throughput-ratio", 0.9)
    assert r.returncode == 1, r.stderr
    failed = [line for line in r.stderr.splitlines() if line.startswith("gate failed")]
    assert len(failed) == 1, r.stderr  # one line saying why
    # 100 rows over ~19.5 s of running (the first sample's half-second lead-in) against 400 over the same
    assert re.fullmatch(rf"gate failed: throughput \(rollouts/s\) = 5\.\d+ is 0\.250 x baseline job {fast.pk}'s "
                        r"20\.\d+ < min ratio 0\.9", failed[0]), failed[0]
    # the job's webhooks hear of it (queued for the control lane: no worker here to send it)
    d = WebhookDelivery.objects.get(job=slow)
    assert d.event == "job.gate_failed" and d.payload["detail"] == failed[0]

    r = _cli(url, token, "gate", fast.pk, "--baseline-job", slow.pk, "--min-throughput-ratio", 0.9)
    assert r.returncode == 0, r.stderr
    assert "gate passed: throughput (rollouts/s)" in r.stderr

    # tokens/s compared the same way
    r = _cli(url, token, "gate", slow.pk, "--baseline-job", fast.pk, "--min-throughput-ratio", 0.9,
             "--throughput-figure", "output_tokens")
    assert r.returncode == 1 and re.search(r"throughput \(output tokens/s\) = 25\d\.\d+ is 0\.250 x", r.stderr), r.stderr

    # a metric against the baseline's: reward 0.5 vs 0.8 is 0.625 x
    r = _cli(url, token, "gate", worse.pk, "--baseline-job", fast.pk, "--min-metric-ratio", "reward=0.95",
             "--min-throughput-ratio", 0.9)
    assert r.returncode == 1, r.stderr
    assert "gate failed: reward = 0.50 is 0.625 x baseline job" in r.stderr
    assert "gate passed: throughput (rollouts/s)" in r.stderr  # same speed
    r = _cli(url, token, "gate", fast.pk, "--baseline-job", worse.pk, "--min-metric-ratio", "mean/reward=0.95")
    assert r.returncode == 0, r.stderr

    # usage: a ratio without a baseline is an error (exit 2), not a silent pass
    r = _cli(url, token, "gate", fast.pk, "--min-throughput-ratio", 0.9)
    assert r.returncode == 2 and "--baseline-job" in r.stderr


@pytest.mark.slow
def test_diagnose_and_sweep_commands(jobs, live_server):
    from controlplane.diagnostics.models import ParallelismSweep

    token, slow, fast, _ = jobs
    url = live_server.url
    r = _cli(url, token, "diagnose", fast.pk)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"job {fast.pk} (completed): ") and "confidence" in r.stdout
    r = _cli(url, token, "diagnose", fast.pk, "--json")
    assert r.returncode == 0 and '"verdict"' in r.stdout

    done = ParallelismSweep.objects.create(
        owner=fast.owner, endpoint=fast.endpoint, dataset=fast.dataset, sample_size=32, state="completed",
        points=[{"parallelism": 1, "rollouts_per_s": 2.0, "p50_ms": 400, "p99_ms": 600, "error_rate": 0.0},
                {"parallelism": 8, "rollouts_per_s": 14.5, "p50_ms": 450, "p99_ms": 900, "error_rate": 0.0}],
        knee=8, recommended=8, best_rollouts_per_s=14.5, speedup=7.25)
    r = _cli(url, token, "sweep", "--show", done.pk)
    assert r.returncode == 0, r.stderr
    assert "recommended num_samples_in_parallel = 8" in r.stdout
    assert [line.split() for line in r.stdout.splitlines() if line.strip().startswith("8 ")] == [
        ["8", "14.50", "450", "900", "0.0%"]]

    # a new sweep is started through the API (no worker here: it stays queued; --no-wait prints its id)
    r = _cli(url, token, "sweep", "--endpoint", fast.endpoint_id, "--job", fast.pk, "--levels", "1,2",
             "--sample-size", 4, "--no-wait")
    assert r.returncode == 0, r.stderr
    started = ParallelismSweep.objects.get(pk=int(r.stdout.strip()))
    assert started.levels == [1, 2] and started.job_id == fast.pk and started.sample_size == 4
