"""Collection jobs, their chunks, every rollout, and per-job metric time series.

The job owns its state transitions (NetBox style); services call these, views and tasks stay thin.
"""
import operator
from functools import reduce

from django.conf import settings
from django.db import models
from django.utils import timezone

from controlplane.leases import Lease
from controlplane.rest.errors import InvalidTransition  # noqa: F401 - raised by the jobs services
from workers.task_index import IndexRuns


class JobState(models.TextChoices):
    QUEUED = "queued"
    RUNNING = "running"
    PAUSED = "paused"
    CANCELLED = "cancelled"
    COMPLETED = "completed"
    FAILED = "failed"


# State groups, one meaning each (JobState.RUNNABLE, not a local tuple, wherever a group is meant):
JobState.RUNNABLE = frozenset({JobState.QUEUED, JobState.RUNNING})  # workers take and run its chunks
JobState.UNFINISHED = JobState.RUNNABLE | {JobState.PAUSED}  # listed as active: not at an end
JobState.TERMINAL = frozenset({JobState.CANCELLED, JobState.COMPLETED, JobState.FAILED})  # at an end
ACTIVE_STATES = JobState.UNFINISHED
TERMINAL_STATES = JobState.TERMINAL


class CollectionJob(models.Model):
    class VerifyMode(models.TextChoices):
        INLINE = "inline"
        FAST = "fast"
        DEFERRED = "deferred"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs")
    name = models.CharField(max_length=200, blank=True)
    dataset = models.ForeignKey("datasets.Dataset", on_delete=models.PROTECT, related_name="jobs")
    endpoint = models.ForeignKey("endpoints.Endpoint", on_delete=models.PROTECT, related_name="jobs")

    # ng_collect_rollouts parameters
    limit = models.PositiveIntegerField(null=True, blank=True, help_text="Keep the first N dataset rows")
    num_repeats = models.PositiveIntegerField(default=1)
    num_samples_in_parallel = models.PositiveIntegerField(default=16)
    parallelism_override = models.PositiveIntegerField(
        null=True, blank=True, help_text="Live parallelism set while the job runs (operator or adaptive controller)"
    )
    parallelism_auto = models.BooleanField(default=False, help_text="Let the adaptive controller choose parallelism")
    responses_create_params = models.JSONField(default=dict, blank=True, help_text="Overrides merged into every row")
    verifier = models.CharField(max_length=300, default="math", help_text="A registered name, an entry point or a dotted path")
    verifier_options = models.JSONField(default=dict, blank=True)
    verify_mode = models.CharField(max_length=20, choices=VerifyMode.choices, default=VerifyMode.INLINE)
    verify_cache = models.CharField(max_length=10, default="job", choices=[("off", "off"), ("job", "job"), ("global", "global")],
                                    help_text="Compute identical (verifier, options, answer, expected) once: per job, "
                                              "across jobs on a worker, or never")
    chunk_size = models.PositiveIntegerField(default=5000, help_text="Dataset rows per chunk (unit of distribution)")
    profiling_enabled = models.BooleanField(default=False)
    idempotency_key = models.CharField(max_length=200, null=True, blank=True)
    output_path = models.CharField(max_length=1000, blank=True, help_text="Set by the collect_rollouts CLI")
    output_files = models.JSONField(default=dict, blank=True,
                                    help_text="The CLI's output files: where this job's lines begin in each")
    # NeMo Gym keys with no column of their own: {"add_seed": bool, "repeats_by_agent": {agent: n, "_default": n},
    # "default_agent": name} (controlplane.jobs.dropin)
    collection_options = models.JSONField(default=dict, blank=True)

    # bounded staleness (controlplane.jobs.stream): a rollout whose version lag (the endpoint's current version -
    # its version at dispatch) is over max_version_lag when a trainer takes it is never handed out
    class StalePolicy(models.TextChoices):
        RECOLLECT = "recollect"  # deleted and collected again with the current weights
        MARK = "mark"  # kept, marked stale

    max_version_lag = models.PositiveIntegerField(null=True, blank=True,
                                                  help_text="The largest version lag a trainer accepts (null: any)")
    stale_policy = models.CharField(max_length=10, choices=StalePolicy.choices, default=StalePolicy.MARK)
    # open-ended collection (controlplane.jobs.openended): null for a job of one pass; else {"buffer", "shuffle",
    # "seed", "consumer", "stride", "chunk_rows", "stopping"}: passes over the dataset until stopped, at most
    # `buffer` rollouts (and one chunk) stored ahead of what `consumer` acknowledged
    open_ended = models.JSONField(null=True, blank=True, default=None,
                                  help_text="Open-ended collection: passes until stopped, bounded ahead of a consumer")

    # state and progress
    state = models.CharField(max_length=20, choices=JobState.choices, default=JobState.QUEUED, db_index=True)
    total_rollouts = models.PositiveIntegerField(default=0)
    completed_count = models.PositiveIntegerField(default=0)  # succeeded rows
    failed_count = models.PositiveIntegerField(default=0)  # rows recorded with a failure class
    error_message = models.TextField(blank=True)
    stalled = models.BooleanField(default=False)
    stall_reason = models.TextField(blank=True, default="", help_text="Why the watchdog flagged the job stalled")
    aggregate_metrics = models.JSONField(default=dict, blank=True)
    timing_summary = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    last_progress_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.UniqueConstraint(fields=["owner", "idempotency_key"], name="uniq_job_idempotency_key"),
        ]

    def __str__(self):
        return f"job {self.pk} {self.name or ''} [{self.state}]"

    # --- derived -------------------------------------------------------------------------------
    @property
    def done_count(self):
        return self.completed_count + self.failed_count

    @property
    def progress_fraction(self):
        return (self.done_count / self.total_rollouts) if self.total_rollouts else 0.0

    @property
    def effective_parallelism(self):
        return self.parallelism_override or self.num_samples_in_parallel

    @property
    def is_active(self):
        return self.state in JobState.UNFINISHED

    # --- state transitions (the only places that change `state`) -------------------------------
    # action -> the states it moves a job out of (what a user is offered) ...
    TRANSITIONS = {
        "start": {JobState.QUEUED},
        "pause": JobState.RUNNABLE,
        "resume": {JobState.PAUSED, JobState.FAILED, JobState.CANCELLED},
        "cancel": JobState.UNFINISHED,
        "complete": JobState.RUNNABLE,
        "fail": JobState.UNFINISHED,
        "retry_failed": JobState.TERMINAL,
    }
    # ... and the states where it is accepted as a repeat (a second worker starting, an API client resuming
    # a job that already runs: it re-dispatches the unfinished chunks).
    REPEATS = {
        "start": {JobState.RUNNING},
        "resume": JobState.RUNNABLE,
    }
    # the dashboard's buttons -> their transition
    ACTIONS = {"cancel": "cancel", "pause": "pause", "resume": "resume", "retry": "retry_failed"}

    def _check(self, action):
        if self.state not in self.TRANSITIONS[action] and self.state not in self.REPEATS.get(action, ()):
            raise InvalidTransition(f"cannot {action.replace('_', ' ')} a job that is {self.state}")

    def offered_actions(self) -> dict[str, bool]:
        """{dashboard action: offered now}, from the transition table (retry only when rows failed)."""
        offered = {name: self.state in self.TRANSITIONS[t] for name, t in self.ACTIONS.items()}
        offered["retry"] = offered["retry"] and self.failed_count > 0
        return offered

    @classmethod
    def action_states(cls) -> dict[str, str]:
        """{dashboard action: the states that offer it, space-separated} (for the page's live updates)."""
        return {name: " ".join(s.value for s in JobState if s in cls.TRANSITIONS[t]) for name, t in cls.ACTIONS.items()}

    def _set(self, state, **fields):
        self.state = state
        for k, v in fields.items():
            setattr(self, k, v)
        self.save(update_fields=["state", *fields.keys()])

    def mark_running(self):
        self._check("start")
        self._set(JobState.RUNNING, started_at=self.started_at or timezone.now(), stalled=False, stall_reason="")

    def pause(self):
        self._check("pause")
        self._set(JobState.PAUSED)

    def resume(self):
        self._check("resume")
        self._set(JobState.QUEUED, finished_at=None, error_message="", stalled=False, stall_reason="")

    def cancel(self):
        self._check("cancel")
        self._set(JobState.CANCELLED, finished_at=timezone.now())

    def complete(self):
        self._check("complete")
        self._set(JobState.COMPLETED, finished_at=timezone.now(), stalled=False, stall_reason="")
        self.notice("job.completed", f"{self.completed_count} ok, {self.failed_count} failed of {self.total_rollouts}")

    def reopen_for_retry(self):
        """After failed rows were deleted: back to queued so the missing (task, repeat) pairs run again."""
        self._check("retry_failed")
        self._set(JobState.QUEUED, finished_at=None, error_message="", stalled=False, stall_reason="")

    def fail(self, message):
        self._check("fail")
        self._set(JobState.FAILED, finished_at=timezone.now(), error_message=message[:10000])
        self.notice("job.failed", message[:500])

    def notice(self, kind: str, detail: str) -> None:
        """Tell the listeners (alerts' webhooks) about this job, once the change commits (controlplane.notices)."""
        from controlplane import notices

        notices.emit(kind, job_id=self.pk, job_name=self.name, owner_id=self.owner_id, endpoint_id=self.endpoint_id,
                     state=str(self.state), detail=detail)


class JobChunk(models.Model):
    """A range of dataset rows processed by one Celery task. Leased with a heartbeat so a chunk
    whose worker died is detected and handed out again; rollouts are unique, so a rerun is
    exactly-once."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"

    job = models.ForeignKey(CollectionJob, on_delete=models.CASCADE, related_name="chunks")
    index = models.PositiveIntegerField()
    start_row = models.PositiveIntegerField()  # dataset row index, inclusive
    end_row = models.PositiveIntegerField()  # exclusive
    # open-ended jobs: the pass over the dataset (rows are positions in the pass's order; its repeat indices are
    # offset by pass_index * the job's stride); 0 for a job of one pass
    pass_index = models.PositiveIntegerField(default=0, db_default=0)
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    dispatched_at = models.DateTimeField(null=True, blank=True, help_text="Last time a Celery task was sent for it")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "index"]
        indexes = [models.Index(fields=["state", "heartbeat_at"], name="chunk_state_heartbeat")]
        constraints = [models.UniqueConstraint(fields=["job", "index"], name="uniq_job_chunk_index")]


# taken by run_chunk, beaten by its sink (jobs.sink), reclaimed by the watchdog (jobs.runtime); see controlplane.leases
CHUNK_LEASE = Lease(JobChunk, waiting=JobChunk.State.PENDING, running=JobChunk.State.RUNNING)


class RolloutQuerySet(models.QuerySet):
    def matching(self, *, status=None, failure_class=None, reward_min=None, reward_max=None,
                 wall_ms_min=None, wall_ms_max=None, task_index=None, trace_id=None):
        """The rollout filters the dashboard and the API offer; None or "" means no filter. trace_id: the
        32-hex id of a `traceparent` (the whole header is accepted too)."""
        if trace_id:
            parts = str(trace_id).strip().lower().split("-")
            trace_id = parts[1] if len(parts) == 4 else parts[0]
        exact = {"status": status, "failure_class": failure_class, "task_index": task_index, "trace_id": trace_id,
                 "reward__gte": reward_min, "reward__lte": reward_max,
                 "wall_ms__gte": wall_ms_min, "wall_ms__lte": wall_ms_max}
        return self.filter(**{k: v for k, v in exact.items() if v not in (None, "")})

    def with_task_indices(self, task_ids):
        """Rows of these task indices, asked as index ranges: each run of consecutive indices a range, the rest
        one IN list, so the (job, task_index, rollout_index) index serves each part whatever the planner knows
        (a chunk page's stored pairs). Not one range from the smallest to the largest: a page of a file with
        repeated lines holds earlier lines' task indices too, and that range then spans the whole job (100k
        rows: 58 ms a page, growing with the job, vs 0.3 ms). Not an IN list alone: with no statistics yet (a
        fresh job, before ANALYZE) PostgreSQL read every stored row of the job per page."""
        ranges, singles = [], []
        for lo, hi in IndexRuns(sorted(task_ids)).ranges():
            if lo == hi:
                singles.append(lo)
            else:
                ranges.append(models.Q(task_index__gte=lo, task_index__lte=hi))
        if singles:
            ranges.append(models.Q(task_index__in=singles))
        return self.filter(reduce(operator.or_, ranges))


class Rollout(models.Model):
    """One (task, repeat) of a job: the NeMo Gym output row plus its timings. Unique on
    (job, task_index, rollout_index): resuming never duplicates a row."""

    class Status(models.TextChoices):
        OK = "ok"
        FAILED = "failed"

    job = models.ForeignKey(CollectionJob, on_delete=models.CASCADE, related_name="rollouts")
    task_index = models.PositiveIntegerField()
    rollout_index = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OK)
    failure_class = models.CharField(max_length=40, blank=True)  # http_429, http_5xx, timeout, connection, verifier_error, ...
    error = models.TextField(blank=True)
    reward = models.FloatField(null=True, blank=True)
    data = models.JSONField()  # the full NeMo Gym output row (input fields + response + reward + verifier fields)
    queue_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    generation_ms = models.FloatField(null=True, blank=True)
    verify_ms = models.FloatField(null=True, blank=True)
    wall_ms = models.FloatField(null=True, blank=True)
    input_tokens = models.PositiveIntegerField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(null=True, blank=True)
    attempts = models.PositiveSmallIntegerField(default=1)
    weight_version = models.CharField(max_length=100, blank=True, help_text="The weight version at dispatch")
    completed_version = models.CharField(max_length=100, blank=True, db_default="",
                                         help_text="The weight version in force when it completed")
    spans_update = models.BooleanField(default=False, db_default=False, help_text="A weight update happened while it ran "
                                                                "(completed_version != weight_version)")
    stale = models.BooleanField(default=False, db_default=False, help_text="Past the job's max_version_lag when it was to be handed "
                                                         "out: kept (stale_policy mark), never streamed")
    worker = models.CharField(max_length=200, blank=True)
    trace_id = models.CharField(max_length=32, blank=True, default="", db_default="",
                                help_text="W3C trace id sent in the traceparent of each of its model requests")
    created_at = models.DateTimeField(default=timezone.now)
    arrived_at = models.DateTimeField(null=True, blank=True, help_text="When its sink received it, before the "
                                      "batch's commit (created_at): dispatch = arrived_at - wall_ms")

    objects = RolloutQuerySet.as_manager()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["job", "task_index", "rollout_index"], name="uniq_rollout_per_job"),
        ]
        indexes = [
            models.Index(fields=["job", "id"], name="rollout_job_id"),
            models.Index(fields=["job", "status", "id"], name="rollout_job_status_id"),
            # failures-by-class counts read the index only (the job page at 1M rows)
            models.Index(fields=["job", "status", "failure_class"], name="rollout_job_status_class"),
            models.Index(fields=["job", "reward", "id"], name="rollout_job_reward_id"),
            models.Index(fields=["job", "wall_ms", "id"], name="rollout_job_wall_id"),
            # a trace id from a tracing backend finds its rollout in any job (rows without one are left out)
            models.Index(fields=["trace_id"], name="rollout_trace_id", condition=~models.Q(trace_id="")),
            # the recent rate (figures.recent_rate: a job's rows of the last seconds, every progress tick of every
            # chunk run): the created_at BRIN reads every block range not yet summarized, i.e. every row stored
            # since autovacuum last summarized it (with autovacuum off, the whole table), a cost that grew with
            # the job; this reads the window's rows only (PostgreSQL, 100k rows: 90 ms -> 14 ms a tick)
            models.Index(fields=["job", "created_at"], name="rollout_job_created"),
        ]


class JobMetricSample(models.Model):
    """A point of a job's time series, written about once a second per worker while it runs."""

    job = models.ForeignKey(CollectionJob, on_delete=models.CASCADE, related_name="metric_samples")
    worker = models.CharField(max_length=200, blank=True)  # the run's series: "<worker> chunk <index>"
    t = models.DateTimeField(default=timezone.now)
    elapsed_s = models.FloatField(default=0)
    completed = models.PositiveIntegerField(default=0)  # cumulative, this worker's chunk run
    failed = models.PositiveIntegerField(default=0)
    samples_per_s = models.FloatField(default=0)
    output_tokens_per_s = models.FloatField(default=0)
    in_flight = models.PositiveIntegerField(default=0)
    parallelism = models.PositiveIntegerField(default=0)
    errors = models.JSONField(default=dict, blank=True)  # {"http_429": n, ...} in this interval
    extra = models.JSONField(default=dict, blank=True)  # telemetry added by later work (cpu, loop lag, vLLM gauges)

    class Meta:
        ordering = ["job", "t"]
        indexes = [models.Index(fields=["job", "t"], name="metric_job_t")]


class VerificationRun(models.Model):
    """A batch verification of a job's stored rollouts (deferred or fast mode, or a re-verification):
    leased with a heartbeat like a chunk, resumable from `cursor` (the last rollout id whose new reward is
    committed), so a killed worker's run is picked up by another and no rollout is verified twice."""

    class State(models.TextChoices):
        PENDING = "pending"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"

    job = models.ForeignKey(CollectionJob, on_delete=models.CASCADE, related_name="verification_runs")
    verifier = models.CharField(max_length=300)
    verifier_options = models.JSONField(default=dict, blank=True)
    state = models.CharField(max_length=20, choices=State.choices, default=State.PENDING, db_index=True)
    cursor = models.BigIntegerField(default=0)
    total = models.PositiveIntegerField(default=0)
    verified = models.PositiveIntegerField(default=0)
    errors = models.PositiveIntegerField(default=0)
    cache_hits = models.PositiveIntegerField(default=0)
    cache_lookups = models.PositiveIntegerField(default=0)
    attempts = models.PositiveIntegerField(default=0)
    lease_owner = models.CharField(max_length=200, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    info = models.JSONField(default=dict, blank=True)  # sandbox in use, rollouts/s, pool size
    error_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    @property
    def is_active(self):
        return self.state in (self.State.PENDING, self.State.RUNNING)


# taken by run_verification, kept by its heartbeat thread, reclaimed by the watchdog (jobs.verification)
VERIFICATION_LEASE = Lease(VerificationRun, waiting=VerificationRun.State.PENDING,
                           running=VerificationRun.State.RUNNING)


class StreamConsumer(models.Model):
    """A trainer's named, durable place in a job's rollout stream (controlplane.jobs.stream): `cursor` is the
    last rollout id it acknowledged; the batch handed out and not yet acknowledged is `pending_*` (handed out
    again until acknowledged)."""

    job = models.ForeignKey(CollectionJob, on_delete=models.CASCADE, related_name="stream_consumers")
    name = models.CharField(max_length=100)
    groups = models.BooleanField(default=False, help_text="Batches of complete groups (all repeats of a task)")
    skip_equal = models.BooleanField(default=False, help_text="Groups whose rewards are all equal are left out")
    cursor = models.BigIntegerField(default=0)
    delivered = models.PositiveBigIntegerField(default=0, help_text="Rollouts acknowledged")
    pending_token = models.CharField(max_length=64, blank=True)
    pending_ids = models.JSONField(default=list, blank=True)
    pending_cursor = models.BigIntegerField(default=0)
    acked_token = models.CharField(max_length=64, blank=True)
    ack_log = models.JSONField(default=list, blank=True,
                               help_text="[[unix s, rollouts]] of its recent acknowledgements (its consumption rate)")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["job", "name"], name="uniq_stream_consumer")]
