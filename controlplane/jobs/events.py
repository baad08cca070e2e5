"""Progress events published to the Channels layer: one group per job, coalesced by the sink.

Group name: job_group(job_id) -> "job-<id>". Every message is a `ProgressMessage` (the shape, typed, below)
with "type": "job.progress" (the consumer's handler `job_progress`).
One builder (`progress_payload`), fed by `live_figures`: the job's rates from its stored rows (jobs.figures),
in flight / parallelism from every chunk's latest sample, so the live stream and a reload show the same
job-wide figures. State changes publish the same message type with fresh counts and figures.
"""
import logging
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Literal, TypedDict

from django.utils import timezone

from . import figures
from .models import JobMetricSample

logger = logging.getLogger(__name__)

MESSAGE_TYPE = "job.progress"


def job_group(job_id: int) -> str:
    return f"job-{job_id}"


RATE_WINDOW_S = figures.RATE_WINDOW_S  # the job's recent rate: rollouts stored over the last RATE_WINDOW_S
LIVE_FRESH_S = 5.0  # a chunk's latest sample counts toward in-flight / parallelism while this fresh


class ProgressMessage(TypedDict):
    """THE progress message: what the live stream sends, a reload renders and the page's script reads
    (static/dashboard/dashboard.js). `progress_payload` builds it; tests/dashboard/test_progress_message.py holds
    every builder to this shape."""

    type: Literal["job.progress"]
    job_id: int
    state: str  # JobState's value
    total: int
    completed: int  # ok rollouts stored
    failed: int
    done: int  # completed + failed
    in_flight: int  # requests in flight over every running chunk
    parallelism: int  # what the running chunks use together, else the job's effective value
    samples_per_s: float  # ok rollouts per second over the rate window (stored rows)
    output_tokens_per_s: float
    eta_s: float | None  # None when unknown
    errors: dict[str, int]  # failure class -> count in the window
    t: float  # unix seconds: when its rates, running time and average rate were read
    stalled: bool
    stall_reason: str  # why, when stalled
    elapsed_s: float  # running time, pauses excluded
    avg_samples_per_s: float | None  # rollouts stored / running time
    error_message: str  # why it failed (the consumer shows each user what they may read of it)


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

    def with_run(self, tick) -> "LiveFigures":
        """These figures plus a run's own (its latest ProgressTick), which no stored sample holds yet."""
        errors = dict(self.errors)
        for k, v in (tick.errors or {}).items():
            errors[k] = errors.get(k, 0) + v
        return replace(self, in_flight=self.in_flight + tick.in_flight, parallelism=self.parallelism + tick.parallelism,
                       errors=errors)


def live_figures(job_id: int, now=None) -> LiveFigures:
    """The job's live numbers: rates from its stored rows (figures.recent_rate: rollouts stored in the last
    RATE_WINDOW_S over the running time in it, every chunk together); in flight / parallelism: the sum of each
    chunk run's latest sample when fresh and still holding slots; errors by class over the window.
    Reads at most RATE_WINDOW_S of samples (bounded work for a job of any length)."""
    now = now or timezone.now()
    since = now - timedelta(seconds=RATE_WINDOW_S)
    rows = (JobMetricSample.objects.filter(job_id=job_id, t__gt=since, t__lte=now)
            .order_by("t").values_list("worker", "t", "in_flight", "parallelism", "errors"))
    latest: dict[str, tuple] = {}
    out = LiveFigures()
    for row in rows:
        latest[row[0]] = row
        for k, v in (row[4] or {}).items():
            out.errors[k] = out.errors.get(k, 0) + int(v or 0)
    for _, t, in_flight, parallelism, _ in latest.values():
        if (now - t).total_seconds() <= LIVE_FRESH_S and in_flight > 0:
            out.in_flight += in_flight
            out.parallelism += parallelism
            out.chunks += 1
    recent = figures.recent_rate(job_id, now)
    out.samples_per_s = recent.ok_per_s
    out.done_per_s = recent.done_per_s
    out.output_tokens_per_s = recent.output_tokens_per_s
    return out


def progress_payload(job, *, completed=None, failed=None, state=None, stalled=None, live: LiveFigures | None = None,
                     parallelism=None, t=None, running_s=..., stored_at_t=None) -> ProgressMessage:
    """THE progress message (live stream and page reload alike). Counts default to the job row's; live
    numbers come from `live` (live_figures: every chunk of the job summed), none when the job is not
    running. Parallelism: what the running chunks use together, else the job's effective value (override
    included). `t`: when `live` and `running_s` were read (default now); `stored_at_t`: the rows stored then,
    the average rate's count when the counts passed are newer."""
    completed = job.completed_count if completed is None else completed
    failed = job.failed_count if failed is None else failed
    state = str(job.state if state is None else state)
    live = live if (live is not None and state == "running") else LiveFigures()
    total = job.total_rollouts
    running_s = figures.running_seconds(job) if running_s is ... else running_s  # async callers pass theirs
    done = completed + failed
    remaining = max(total - done, 0)
    if remaining == 0 and total:
        eta_s = 0.0
    elif live.done_per_s > 0:
        eta_s = remaining / live.done_per_s
    else:
        eta_s = None
    return ProgressMessage(
        type=MESSAGE_TYPE,
        job_id=job.pk,
        state=state,
        total=total,
        completed=completed,
        failed=failed,
        done=done,
        in_flight=live.in_flight,
        parallelism=live.parallelism or parallelism or job.effective_parallelism,
        samples_per_s=round(live.samples_per_s, 3),
        output_tokens_per_s=round(live.output_tokens_per_s, 3),
        eta_s=eta_s,
        errors=dict(live.errors),
        t=time.time() if t is None else t,
        stalled=bool(job.stalled if stalled is None else stalled),
        stall_reason=(getattr(job, "stall_reason", "") or "") if (job.stalled if stalled is None else stalled) else "",
        elapsed_s=running_s,
        avg_samples_per_s=((done if stored_at_t is None else stored_at_t) / running_s) if running_s else None,
        error_message=(getattr(job, "error_message", "") or "") if state == "failed" else "",
    )


def job_progress(job, now=None) -> ProgressMessage:
    """The progress message for a job, from the database: what a reload shows and what every chunk's sink
    publishes (both aggregate the same stored samples)."""
    return progress_payload(job, live=live_figures(job.pk, now) if str(job.state) == "running" else None)


def process_channel_layer():
    """The process's channel layer (None when there is none or it cannot be built: the run goes on)."""
    try:
        from channels.layers import get_channel_layer

        return get_channel_layer()
    except Exception as exc:  # noqa: BLE001
        logger.warning("no channel layer for progress messages (%s: %s)", type(exc).__name__, exc)
        return None


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
