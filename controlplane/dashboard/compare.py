"""Job comparison: parameters, throughput, latency percentiles, reward; and per task (where jobs
share a dataset) the tasks one job got right and another got wrong."""
from __future__ import annotations

from . import live, stats

# A task counts as "right" in a job when its mean reward over repeats reaches this.
RIGHT_THRESHOLD = 0.5
MAX_LISTED_TASKS = 200

PARAMS = ["dataset", "endpoint", "limit", "num_repeats", "num_samples_in_parallel", "parallelism_auto",
          "responses_create_params", "verifier", "verifier_options", "verify_mode", "chunk_size", "state",
          "total_rollouts", "completed_count", "failed_count"]


def _param(job, name):
    if name == "dataset":
        return str(job.dataset.name)
    if name == "endpoint":
        return f"{job.endpoint.name} ({job.endpoint.model_name})"
    return getattr(job, name)


def shown_value(v) -> str:
    """A parameter as a user writes it: JSON for objects and lists, true/false, "—" for none (no Python reprs)."""
    import json

    if v is None or v == "" or v == {} or v == []:
        return "—"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True, ensure_ascii=False, default=str)
    return str(v)


def compare_jobs(jobs: list) -> dict:
    params = []
    for name in PARAMS:
        vals = [shown_value(_param(j, name)) for j in jobs]
        params.append({"name": name, "values": vals, "differs": len(set(vals)) > 1})

    summary = []
    for j in jobs:
        timing = stats.timing_breakdown(j)
        wall = next((r for r in timing["rows"] if r["field"] == "wall"), {})
        ttft = next((r for r in timing["rows"] if r["field"] == "ttft"), {})
        rm = stats.mean_reward(j)
        reward_source = "stored"
        if rm is None:
            rewards = stats.reward_metrics(j)
            rm = dict(rewards["items"]).get("mean/reward")
            reward_source = rewards["source"]
        summary.append({
            "job": j,
            "samples_per_s": live.average_rate(j),
            "elapsed_s": live.elapsed_s(j),
            "wall": wall,
            "ttft": ttft,
            "timing_source": timing["source"],
            "mean_reward": rm,
            "reward_source": reward_source,
        })

    # Per task, for jobs on the same dataset as the first job (the baseline).
    base = jobs[0]
    same = [j for j in jobs if j.dataset_id == base.dataset_id]
    per_task = None
    if len(same) >= 2:
        rates = [stats.per_task_pass_rates(j) for j in same]
        common = set(rates[0])
        for r in rates[1:]:
            common &= set(r)
        pairs = []
        for k in range(1, len(same)):
            a, b = rates[0], rates[k]
            a_only = sorted(t for t in common if a[t] >= RIGHT_THRESHOLD > b[t])
            b_only = sorted(t for t in common if b[t] >= RIGHT_THRESHOLD > a[t])
            both = sum(1 for t in common if a[t] >= RIGHT_THRESHOLD and b[t] >= RIGHT_THRESHOLD)
            neither = sum(1 for t in common if a[t] < RIGHT_THRESHOLD and b[t] < RIGHT_THRESHOLD)
            pairs.append({
                "a": same[0], "b": same[k],
                "a_only": a_only[:MAX_LISTED_TASKS], "a_only_count": len(a_only),
                "b_only": b_only[:MAX_LISTED_TASKS], "b_only_count": len(b_only),
                "both": both, "neither": neither,
            })
        disagree = sorted(t for t in common if len({rates[i][t] >= RIGHT_THRESHOLD for i in range(len(same))}) > 1)
        rows = [{"task": t, "rates": [rates[i][t] for i in range(len(same))]} for t in disagree[:MAX_LISTED_TASKS]]
        per_task = {"jobs": same, "common": len(common), "pairs": pairs, "disagree_rows": rows,
                    "disagree_count": len(disagree), "threshold": RIGHT_THRESHOLD}
    return {"params": params, "summary": summary, "per_task": per_task,
            "other_dataset_jobs": [j for j in jobs if j.dataset_id != base.dataset_id]}
