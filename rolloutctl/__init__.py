"""rolloutctl: drive the rollout control plane from CI over its REST API (HTTP only, no Django).

    python -m rolloutctl run --dataset tasks.jsonl --endpoint-url http://vllm:8000 --model my-model \\
        --num-repeats 4 --gate mean/reward --min 0.7 -o rollouts.jsonl

    python -m rolloutctl run ... --baseline-job 41 --min-throughput-ratio 0.9 --min-metric-ratio mean/reward=0.95
        # exit 1 when this job is below 0.9 x job 41's rollouts/s (over its running time) or 0.95 x its reward
    python -m rolloutctl diagnose 42        # the bottleneck diagnosis; `rolloutctl sweep` runs a parallelism sweep
    python -m rolloutctl submit ... --open-ended --buffer 512 --consumer grpo   # collects until `rolloutctl stop JOB`;
        # a trainer takes its rollouts with rolloutctl.stream.RolloutStream (see rolloutctl/openended.py)

Configuration: --url / ROLLOUTCTL_URL (e.g. http://127.0.0.1:8000) and --token / ROLLOUTCTL_TOKEN.
Exit codes: 0 ok; 1 a gate failed; 2 usage or configuration error; 3 the job failed or was cancelled;
4 timed out waiting; 5 the API answered an error or could not be reached.
"""
__version__ = "1.0.0"

EXIT_OK, EXIT_GATE, EXIT_USAGE, EXIT_JOB, EXIT_TIMEOUT, EXIT_API = 0, 1, 2, 3, 4, 5
