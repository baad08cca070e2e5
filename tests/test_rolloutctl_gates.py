"""rolloutctl's decisions that need no server: the failed-rows gate, endpoint reuse, output names."""
from __future__ import annotations

import pytest

from rolloutctl import EXIT_GATE, EXIT_OK
from rolloutctl.cli import build_parser, do_gate, jsonl_path
from rolloutctl.client import endpoint_matches


def job(completed, failed, mean_reward=0.9):
    return {"id": 7, "state": "completed", "aggregate_metrics": {"mean/reward": mean_reward},
            "progress": {"completed": completed, "failed": failed, "total": completed + failed}}


REWARD_GATE = [{"metric": "mean/reward", "min": 0.7, "max": None}]


def test_a_reward_gate_fails_by_default_when_too_many_rows_failed(capsys):
    assert do_gate(job(98, 2), REWARD_GATE) == EXIT_OK  # 2% failed: the reward gate alone decides
    assert do_gate(job(60, 40), REWARD_GATE) == EXIT_GATE  # mean/reward 0.9 over the 60 that came back
    err = capsys.readouterr().err
    assert "gate passed: mean/reward = 0.9" in err
    assert "gate failed: failed_fraction = 0.40 > max 0.05 (40 of 100 rows failed" in err
    assert do_gate(job(60, 40), REWARD_GATE, max_failed_fraction=1.0) == EXIT_OK  # asked to ignore them
    explicit = REWARD_GATE + [{"metric": "failed_fraction", "min": None, "max": 0.5}]
    assert do_gate(job(60, 40), explicit) == EXIT_OK  # an explicit failed_fraction bound is the rule


def test_max_failed_fraction_is_an_option_of_gate_and_run():
    args = build_parser().parse_args(["gate", "3", "--metric", "mean/reward", "--min", "0.5",
                                      "--max-failed-fraction", "0.2"])
    assert args.max_failed_fraction == 0.2
    args = build_parser().parse_args(["run", "--dataset", "d.jsonl", "--endpoint", "1", "--metric", "mean/reward",
                                      "--min", "0.5", "-o", "out/rollouts"])
    assert args.max_failed_fraction == 0.05 and args.output == "out/rollouts.jsonl"


@pytest.mark.parametrize("given, written", [("out/rollouts", "out/rollouts.jsonl"), ("rollouts.jsonl", "rollouts.jsonl"),
                                            ("a.b/rollouts", "a.b/rollouts.jsonl"), ("x.ndjson", "x.ndjson")])
def test_output_without_extension_gets_jsonl(given, written):
    assert jsonl_path(given) == written


def test_a_single_url_never_reuses_an_endpoint_with_replicas():
    ep = {"base_url": "http://h:8000/", "model_name": "m", "api_flavor": "chat_completions", "has_api_key": False,
          "replica_urls": []}
    assert endpoint_matches(ep, "http://h:8000", "m", None, None)
    assert not endpoint_matches({**ep, "replica_urls": ["http://dead:8000"]}, "http://h:8000", "m", None, None)
    assert not endpoint_matches(ep, "http://h:8000", "other", None, None)
    assert not endpoint_matches(ep, "http://h:8000", "m", None, "sk-key")


class _VerifyingServer:
    """The replies of a job whose verification ends between the two reads of one GET: that reply says "done"
    with the metrics from before the run (the job row was read first); the next read has the run's."""

    def __init__(self):
        run = {"id": 1, "verifier": "math", "total": 30, "verified": 30, "errors": 0, "cache_hit_rate": 0.0}
        before, after = {"mean/output_tokens": 8.0}, {"mean/output_tokens": 8.0, "mean/reward": 0.6}
        row = job(30, 0)
        self.replies = [
            {**row, "verification": {**run, "state": "running", "verified": 0}, "aggregate_metrics": before},
            {**row, "verification": {**run, "state": "done"}, "aggregate_metrics": before},
            {**row, "verification": {**run, "state": "done"}, "aggregate_metrics": after},
        ]

    def verify_job(self, job_id, verifier, options):
        return self.replies.pop(0)

    def job(self, job_id):
        return self.replies.pop(0)


@pytest.mark.parametrize("wait", ["verify", "exact pass"])
def test_a_verified_jobs_metrics_are_read_after_the_run_is_seen_done(wait, capsys):
    from rolloutctl.cli import _wait_exact_pass, do_verify

    server = _VerifyingServer()
    if wait == "verify":
        args = build_parser().parse_args(["verify", "7", "--poll-interval", "0", "--metric", "mean/reward",
                                          "--min", "0.2"])
        job, code = do_verify(server, args)
        assert "mean/reward 0.6" in capsys.readouterr().err
    else:
        job, code = _wait_exact_pass(server, server.replies.pop(0), None, 0)
    assert code == EXIT_OK and job["aggregate_metrics"]["mean/reward"] == 0.6 and not server.replies
    assert do_gate(job, [{"metric": "mean/reward", "min": 0.2, "max": None}]) == EXIT_OK
