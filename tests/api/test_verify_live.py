"""Verification through the API and the CLI against a LIVE server and a real Celery worker: a user's
verifier by dotted path scores a job; a deferred job is verified later with `rolloutctl verify`; bad
verifiers, options and row fields are 400s naming the problem."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from .test_cli_live import DEMO, cli, stack  # noqa: F401  (the live web + worker fixture)


def _api(url, token, method, path, body=None):
    req = urllib.request.Request(f"{url}/api/{path}", method=method, data=json.dumps(body).encode() if body else None,
                                 headers={"Authorization": f"Token {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


@pytest.mark.e2e
@pytest.mark.timeout(420)
def test_user_verifier_and_deferred_verification_through_cli_and_api(stack, simulator_factory, tmp_path):  # noqa: F811
    url, token, procs = stack
    sim = simulator_factory(ttft_ms=5, itl_ms=0, jitter=0, seed=5, math_accuracy=0.6)
    common = ["--dataset", DEMO, "--endpoint-url", sim.url, "--model", sim.model, "--limit", 30,
              "--num-samples-in-parallel", 8, "--max-output-tokens", 8, "--timeout", 240, "--poll-interval", 0.5,
              "--no-progress"]

    # CLI: a user's verifier by dotted path, options as JSON
    out = tmp_path / "mine.jsonl"
    r = cli(url, token, "run", *common, "--verifier", "tests.verifier_plugins:last_word",
            "--verifier-option", 'suffix="}"', "-o", out)
    assert r.returncode == 0, r.stderr + "\n".join(p.tail() for p in procs)
    job_id = int(r.stdout.strip().splitlines()[-1])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 30 and all("last_word" in x for x in rows)
    assert all(x["reward"] == (1.0 if x["last_word"] == x["expected_answer"] else 0.0) for x in rows)
    status, job = _api(url, token, "GET", f"jobs/{job_id}/")
    assert job["verifier"] == "tests.verifier_plugins:last_word" and job["verification"] is None

    # CLI: a deferred job, then "verify this job" (the Celery worker runs the batch), gated on the result
    r = cli(url, token, "run", *common, "--verify-mode", "deferred", "--name", "deferred")
    assert r.returncode == 0, r.stderr
    deferred_id = int(r.stdout.strip().splitlines()[-1])
    status, job = _api(url, token, "GET", f"jobs/{deferred_id}/")
    assert "mean/reward" not in job["aggregate_metrics"]
    r = cli(url, token, "verify", deferred_id, "--poll-interval", 0.5, "--timeout", 200, "--metric", "mean/reward",
            "--min", 0.2)
    assert r.returncode == 0, r.stderr + "\n".join(p.tail() for p in procs)
    assert f"job {deferred_id} verified: 30 rollouts, 0 verifier errors" in r.stderr
    status, job = _api(url, token, "GET", f"jobs/{deferred_id}/")
    assert job["verification"]["state"] == "done" and job["verification"]["verified"] == 30
    assert 0.2 <= job["aggregate_metrics"]["mean/reward"] <= 1.0

    # CLI: a fast job: the exact pass runs by itself on the worker; `run` waits for it before the gate and the export
    out = tmp_path / "fast.jsonl"
    r = cli(url, token, "run", *common, "--verify-mode", "fast", "--name", "fast", "--metric", "mean/reward",
            "--min", 0.0, "-o", out)
    assert r.returncode == 0, r.stderr + "\n".join(p.tail() for p in procs)
    fast_id = int(r.stdout.strip().splitlines()[-1])
    assert "waiting for the exact verifier's pass" in r.stderr and "verified exactly: 30 rollouts" in r.stderr
    status, job = _api(url, token, "GET", f"jobs/{fast_id}/")
    assert job["verification"]["state"] == "done" and job["verification"]["info"]["trigger"] == "fast_exact_pass"
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 30 and all("library_reward" in x and "fast_reward" in x for x in rows)  # exact fields exported

    # API: verify again with another verifier (a user's, by dotted path): 202, then done
    status, job = _api(url, token, "POST", f"jobs/{deferred_id}/verify/",
                       {"verifier": "tests.verifier_plugins.Length", "verifier_options": {"min_words": 1}})
    assert status == 202 and job["verification"]["verifier"] == "tests.verifier_plugins.Length"
    # the same through the CLI: it finds the active run (or, if it is over already, verifies the same way again)
    r = cli(url, token, "verify", deferred_id, "--verifier", "tests.verifier_plugins.Length", "--verifier-option",
            "min_words=1", "--poll-interval", 0.5, "--timeout", 200)
    assert r.returncode == 0, r.stderr
    status, job = _api(url, token, "GET", f"jobs/{deferred_id}/")
    assert job["aggregate_metrics"]["mean/reward"] == 1.0

    # API: problems are 400s that say what is wrong
    status, ds = _api(url, token, "GET", "datasets/")
    base = {"dataset": ds["results"][0]["id"], "endpoint": job["endpoint"]}
    status, body = _api(url, token, "POST", "jobs/", {**base, "verifier": "tests.verifier_plugins:not_marked"})
    assert status == 400 and "must be a Verifier subclass" in json.dumps(body)
    status, body = _api(url, token, "POST", "jobs/", {**base, "verifier": "code"})
    assert status == 400 and "line 1: verifier_metadata.unit_tests" in json.dumps(body)
    status, body = _api(url, token, "POST", "jobs/", {**base, "verifier": "exact", "verifier_options": {"extrct": 1}})
    assert status == 400 and "unknown option 'extrct'" in json.dumps(body)
    status, body = _api(url, token, "POST", f"jobs/{10**9}/verify/")
    assert status == 404
