"""Progress events published to the Channels layer: one group per job, coalesced by the sink.

Group name: job_group(job_id) -> "job-<id>". Every message is a dict with "type": "job.progress"
(the consumer's handler `job_progress`) and the fields of `progress_payload`:
    job_id, state, total, completed, failed, done, in_flight, parallelism,
    samples_per_s, output_tokens_per_s, eta_s (None when unknown), errors {class: count in interval},
    t (unix seconds, float), stalled (bool)
State changes publish the same message type with fresh counts.
"""


def job_group(job_id: int) -> str:
    return f"job-{job_id}"
