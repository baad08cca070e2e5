"""Progress events published to the Channels layer: one group per job, coalesced by the sink.

Group name: job_group(job_id) -> "job-<id>". Every message is a dict with "type": "job.progress"
(the consumer's handler `job_progress`) and the fields of `progress_payload`:
    job_id, state, total, completed, failed, done, in_flight, parallelism,
    samples_per_s, output_tokens_per_s, eta_s (None when unknown), errors {class: count in the window},
    t (unix seconds, float), stalled (bool), stall_reason (str: why, when stalled)
One builder (`progress_payload`), fed by `live_figures`: the live numbers of every chunk of the job (on any
worker) summed from their stored samples, so the live stream and a reload show the same job-wide figures.
State changes publish the same message type with fresh counts.
"""
import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta

from django.utils import timezone

from .models import JobMetricSample

logger = logging.getLogger(__name__)

MESSAGE_TYPE = "job.progress"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


RATE_WINDOW_S = 10.0  # the job's rate: rollouts done over the last RATE_WINDOW_S, all chunks together
LIVE_FRESH_S = 5.0  # a chunk's latest sample counts toward in-flight / parallelism while this fresh


@dataclass
class LiveFigures:
    """A job's live numbers, summed over every chunk running it (on any worker)."""

    in_flight: int = 0
    parallelism: int = 0  # 0: no chunk is running; the job's configured (or overridden) value is shown
    samples_per_s: float = 0.0  # successful rollouts per second over the window
    done_per_s: float = 0.0  # finished (ok + failed) per second over the window: the ETA's rate
    output_tokens_per_s: float = 0.0
    errors: dict = field(default_factory=dict)  # by class, over the window
    chunks: int = 0  # chunks with a fresh sample


def live_figures(job_id: int, now=None) -> LiveFigures:
    """Aggregate the job's chunks from their stored metric samples (each chunk run writes its own series):
    - rate: per series, finished rollouts between its last sample before the window (or its start) and its
      latest sample, summed and divided by the window (shorter while the job is younger than it), so a
      chunk that finished inside the window still counts for what it did there, and no more;
    - in flight / parallelism: the sum of each series' latest sample when fresh and still holding slots.
    Reads at most 2 x RATE_WINDOW_S of samples (bounded work for a job of any length)."""
    now = now or timezone.now()
    since = now - timedelta(seconds=RATE_WINDOW_S)
    rows = (JobMetricSample.objects.filter(job_id=job_id, t__gt=now - timedelta(seconds=2 * RATE_WINDOW_S), t__lte=now)
            .order_by("t").values_list("worker", "t", "elapsed_s", "completed", "failed", "in_flight", "parallelism",
                                       "output_tokens_per_s", "errors"))
    series: dict[str, list] = {}
    for row in rows:
        series.setdefault(row[0], []).append(row)
    out = LiveFigures()
    if not series:
        return out
    start = min((s[0][1] - timedelta(seconds=s[0][2] or 0.0) for s in series.values()), default=since)
    span = max(0.5, min(RATE_WINDOW_S, (now - max(start, since)).total_seconds()))
    ok = done = tokens = 0.0
    for samples in series.values():
        before = [r for r in samples if r[1] <= since]
        inside = [r for r in samples if r[1] > since]
        if not inside:
            continue
        base = before[-1] if before else None
        last = inside[-1]
        ok += last[3] - (base[3] if base else 0)
        done += (last[3] + last[4]) - ((base[3] + base[4]) if base else 0)
        for r in inside:
            interval = (r[1] - (base or r)[1]).total_seconds() if base else 0.0
            tokens += (r[7] or 0.0) * interval
            for k, v in (r[8] or {}).items():
                out.errors[k] = out.errors.get(k, 0) + int(v or 0)
            base = r
        if (now - last[1]).total_seconds() <= LIVE_FRESH_S and last[5] > 0:
            out.in_flight += last[5]
            out.parallelism += last[6]
            out.chunks += 1
    out.samples_per_s = max(0.0, ok) / span
    out.done_per_s = max(0.0, done) / span
    out.output_tokens_per_s = tokens / span
    return out


def progress_payload(job, *, completed=None, failed=None, state=None, stalled=None, live: LiveFigures | None = None,
                     parallelism=None, t=None) -> dict:
    """THE progress message (live stream and page reload alike). Counts default to the job row's; live
    numbers come from `live` (live_figures: every chunk of the job summed), none when the job is not
    running. Parallelism: what the running chunks use together, else the job's effective value (override
    included)."""
    completed = job.completed_count if completed is None else completed
    failed = job.failed_count if failed is None else failed
    state = str(job.state if state is None else state)
    live = live if (live is not None and state == "running") else LiveFigures()
    total = job.total_rollouts
    done = completed + failed
    remaining = max(total - done, 0)
    if remaining == 0 and total:
        eta_s = 0.0
    elif live.done_per_s > 0:
        eta_s = remaining / live.done_per_s
    else:
        eta_s = None
    return {
        "type": MESSAGE_TYPE,
        "job_id": job.pk,
        "state": state,
        "total": total,
        "completed": completed,
        "failed": failed,
        "done": done,
        "in_flight": live.in_flight,
        "parallelism": live.parallelism or parallelism or job.effective_parallelism,
        "samples_per_s": round(live.samples_per_s, 3),
        "output_tokens_per_s": round(live.output_tokens_per_s, 3),
        "eta_s": eta_s,
        "errors": dict(live.errors),
        "t": time.time() if t is None else t,
        "stalled": bool(job.stalled if stalled is None else stalled),
        "stall_reason": (getattr(job, "stall_reason", "") or "") if (job.stalled if stalled is None else stalled) else "",
    }


def job_progress(job, now=None) -> dict:
    """The progress message for a job, from the database: what a reload shows and what every chunk's sink
    publishes (both aggregate the same stored samples)."""
    return progress_payload(job, live=live_figures(job.pk, now) if str(job.state) == "running" else None)


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

        async_to_sync(send)(job_progress(job))
        return True
    except Exception as exc:  # Redis down, or called from inside an event loop
        logger.warning("could not publish state of job %s: %s", job.pk, exc)
        return False
