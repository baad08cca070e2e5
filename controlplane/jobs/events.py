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


import logging
import time

logger = logging.getLogger(__name__)

MESSAGE_TYPE = "job.progress"


def progress_payload(job, *, completed=None, failed=None, state=None, stalled=None, in_flight=0, parallelism=None,
                     samples_per_s=0.0, output_tokens_per_s=0.0, errors=None, t=None) -> dict:
    """The message the dashboard consumes. Counts default to the job row's; live fields to zero."""
    completed = job.completed_count if completed is None else completed
    failed = job.failed_count if failed is None else failed
    total = job.total_rollouts
    done = completed + failed
    remaining = max(total - done, 0)
    eta_s = (remaining / samples_per_s) if samples_per_s and samples_per_s > 0 else (0.0 if remaining == 0 and total else None)
    return {
        "type": MESSAGE_TYPE,
        "job_id": job.pk,
        "state": str(job.state if state is None else state),
        "total": total,
        "completed": completed,
        "failed": failed,
        "done": done,
        "in_flight": in_flight,
        "parallelism": job.effective_parallelism if parallelism is None else parallelism,
        "samples_per_s": float(samples_per_s or 0.0),
        "output_tokens_per_s": float(output_tokens_per_s or 0.0),
        "eta_s": eta_s,
        "errors": dict(errors or {}),
        "t": time.time() if t is None else t,
        "stalled": bool(job.stalled if stalled is None else stalled),
    }


def publish_job_state(job, timeout: float = 2.0) -> bool:
    """Publish the job's current state and counts from sync code (services, tasks, admin).
    Never raises: a missing or unreachable channel layer is logged and ignored."""
    try:
        from asgiref.sync import async_to_sync
        from channels.layers import get_channel_layer

        layer = get_channel_layer()
        if layer is None:
            return False
        import asyncio

        async def send(message):
            await asyncio.wait_for(layer.group_send(job_group(job.pk), message), timeout=timeout)

        async_to_sync(send)(progress_payload(job))
        return True
    except Exception as exc:  # Redis down, or called from inside an event loop
        logger.warning("could not publish state of job %s: %s", job.pk, exc)
        return False
