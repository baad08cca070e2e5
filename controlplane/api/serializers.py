"""Serializers: shape and validate; no domain logic here (that lives in the apps' services)."""
from __future__ import annotations

from django.conf import settings
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema_field
from django.core.validators import RegexValidator
from rest_framework import serializers

from workers.nemo_gym.trajectory import trajectory

from controlplane.access import visible_datasets, visible_endpoints
from controlplane import operator as knobs
from controlplane.disclosure import shown_for
from controlplane.limits import endpoint_errors
from controlplane.datasets.models import DESCRIPTION_MAX_CHARS, Dataset
from controlplane.endpoints.models import Endpoint
from controlplane.jobs.models import CollectionJob, JobMetricSample, JobState, Rollout
from controlplane.jobs.figures import job_figures, running_seconds
from controlplane.jobs.verification import summary as verification_summary
from controlplane.rest.fields import NO_NUL, NOT_BLANK, ErrorSerializer, StrictJSONTypes  # noqa: F401 - re-exported

# ---------------------------------------------------------------------------------------------- datasets


class DatasetSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True, default=None, allow_null=True)
    job_count = serializers.SerializerMethodField()

    class Meta:
        model = Dataset
        fields = ["id", "name", "description", "source_filename", "status", "row_count", "bad_line_count",
                  "size_bytes", "sha256", "owner", "created_at", "job_count"]
        read_only_fields = fields

    def get_job_count(self, obj) -> int:
        return obj.jobs.count()


class DatasetDetailSerializer(DatasetSerializer):
    class Meta(DatasetSerializer.Meta):
        fields = [*DatasetSerializer.Meta.fields, "validation_report"]
        read_only_fields = fields


class DatasetUploadSerializer(serializers.Serializer):
    """multipart/form-data: `file` plus the fields below. For a raw `application/x-ndjson` body the same
    fields are query parameters (`?name=...&accept_partial=true`)."""

    file = serializers.FileField(help_text="A NeMo Gym JSONL task file")
    name = serializers.CharField(max_length=200, required=False, allow_blank=True,
                                 help_text="Defaults to the uploaded file's name")
    description = serializers.CharField(max_length=DESCRIPTION_MAX_CHARS, required=False, allow_blank=True, default="")
    accept_partial = serializers.BooleanField(required=False, default=False,
                                              help_text="Keep the good lines of a file with bad lines")
    verifier = serializers.CharField(max_length=300, required=False, allow_blank=True, default="",
                                     help_text="Upload for this verifier: rows lacking a field it reads are bad lines "
                                               "(line numbers in the report)")


class DatasetListQuerySerializer(serializers.Serializer):
    sha256 = serializers.RegexField(r"^[0-9a-f]{64}$", required=False,
                                    help_text="Only datasets with this content hash (lets a CI run reuse an upload)")
    status = serializers.ChoiceField(choices=Dataset.Status.choices, required=False)
    name = serializers.CharField(max_length=200, required=False)


class DatasetUploadQuerySerializer(serializers.Serializer):
    name = serializers.CharField(max_length=200, required=False, allow_blank=True)
    description = serializers.CharField(max_length=DESCRIPTION_MAX_CHARS, required=False, allow_blank=True, default="")
    accept_partial = serializers.BooleanField(required=False, default=False)
    verifier = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")


class BadLineSerializer(serializers.Serializer):
    line = serializers.IntegerField()
    reason = serializers.CharField()


class DatasetRejectedSerializer(serializers.Serializer):
    """A rejected file: the bad-line report. (Missing or malformed form fields answer field errors instead.)"""

    detail = serializers.CharField(required=False)
    bad_lines = BadLineSerializer(many=True, required=False)
    bad_line_count = serializers.IntegerField(required=False)
    truncated = serializers.BooleanField(required=False)


class RowsQuerySerializer(serializers.Serializer):
    offset = serializers.IntegerField(min_value=0, max_value=2**31 - 1, default=0)
    limit = serializers.IntegerField(min_value=1, max_value=100, default=20)


class DatasetRowSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    line_number = serializers.IntegerField()
    data = serializers.JSONField(allow_null=True, help_text="null for a row longer than DATASET_ROW_MAX_CHARS")
    truncated = serializers.BooleanField(required=False, help_text="present (true) on such a row")
    size_chars = serializers.IntegerField(required=False, help_text="the length of such a row's JSON")
    excerpt = serializers.CharField(required=False, help_text="the first characters of such a row's JSON")


class DatasetRowsSerializer(serializers.Serializer):
    dataset = serializers.IntegerField()
    row_count = serializers.IntegerField()
    offset = serializers.IntegerField()
    limit = serializers.IntegerField()
    next_offset = serializers.IntegerField(allow_null=True, help_text="the offset of the next page (null at the end); "
                                           "a page stops early before DATASET_ROWS_MAX_CHARS")
    rows = DatasetRowSerializer(many=True)


# ---------------------------------------------------------------------------------------------- endpoints


# http(s)://host[:port][/path]. Unlike Django's URLValidator, single-label hosts are fine: model servers are
# often reached by a compose service or cluster name (http://vllm:8000). The same regex is the schema's pattern.
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
BASE_URL_REGEX = rf"^https?://(?:[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])(?::{_PORT})?(?:/[A-Za-z0-9._~!$&'()*+,;=:@%/-]*)?$"
validate_base_url = RegexValidator(BASE_URL_REGEX, "Enter a valid http(s) URL, e.g. http://127.0.0.1:8000")


# a visible character, and neither NUL nor lone surrogates (DRF refuses those): the schema says all of it

class ShownToUser:
    """Fields holding what servers answered (errors, health and pre-warm reports) as the requesting user may
    read them (controlplane.disclosure): staff everything, everyone else never a server's body or banner."""

    shown_fields: tuple[str, ...] = ()

    def to_representation(self, instance):
        data = super().to_representation(instance)
        user = getattr(self.context.get("request"), "user", None)
        for name in self.shown_fields:
            if name in data:
                data[name] = shown_for(user, data[name])
        return data


class EndpointSerializer(ShownToUser, StrictJSONTypes, serializers.ModelSerializer):
    shown_fields = ("last_health", "last_prewarm")

    # Names are stripped of surrounding whitespace, so they must hold a visible character (the
    # pattern puts that rule in the schema too).
    name = serializers.CharField(min_length=1, max_length=200, validators=[NOT_BLANK])
    model_name = serializers.CharField(min_length=1, max_length=300, validators=[NOT_BLANK],
                                       help_text="The model name the server serves")
    base_url = serializers.CharField(max_length=500, validators=[validate_base_url],
                                     help_text="e.g. http://127.0.0.1:8000 (the /v1 prefix is added)")
    api_key = serializers.CharField(write_only=True, required=False, allow_blank=True, max_length=500,
                                    validators=[NO_NUL], style={"input_type": "password"},
                                    help_text="Write-only: never returned; see has_api_key")
    has_api_key = serializers.BooleanField(read_only=True)
    owner = serializers.CharField(source="owner.username", read_only=True, default=None, allow_null=True)
    replica_urls = serializers.ListField(child=serializers.CharField(max_length=500, validators=[validate_base_url]),
                                         required=False,
                                         max_length=256, help_text="Extra replica base URLs")
    # the operator's bounds (controlplane.limits checks them again in validate(), for every way in)
    request_timeout_s = serializers.FloatField(min_value=0.1, max_value=settings.ENDPOINT_MAX_REQUEST_TIMEOUT_S,
                                               required=False)
    connect_timeout_s = serializers.FloatField(min_value=0.1, max_value=settings.ENDPOINT_MAX_CONNECT_TIMEOUT_S,
                                               required=False)
    max_retries = serializers.IntegerField(min_value=0, max_value=settings.ENDPOINT_MAX_RETRIES, required=False)
    rpm_limit = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False, allow_null=True)
    tpm_limit = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False, allow_null=True)

    class Meta:
        model = Endpoint
        fields = ["id", "name", "kind", "base_url", "replica_urls", "model_name", "api_flavor", "worker_queue", "api_key",
                  "has_api_key", "request_timeout_s", "connect_timeout_s", "max_retries", "rpm_limit",
                  "tpm_limit", "replica_affinity", "last_health", "last_health_at", "last_prewarm", "owner",
                  "created_at"]
        read_only_fields = ["id", "has_api_key", "last_health", "last_health_at", "last_prewarm", "owner",
                            "created_at"]

    def validate(self, attrs):
        # the bounds the dashboard and admin check too (Endpoint.clean)
        current = {f: getattr(self.instance, f) for f in ("base_url", "replica_urls")} if self.instance else {}
        errors = endpoint_errors({**current, **attrs})
        if why := knobs.queue_problem(attrs.get("worker_queue") or ""):  # the operator's queues only
            errors.setdefault("worker_queue", []).append(why)
        if errors:
            raise serializers.ValidationError(errors)
        return attrs


class EndpointQueuedSerializer(serializers.Serializer):
    endpoint = serializers.IntegerField()
    queued = serializers.ChoiceField(choices=["health", "prewarm"])
    last_health = serializers.JSONField()
    last_health_at = serializers.DateTimeField(allow_null=True)
    last_prewarm = serializers.JSONField()


class ReplicaLoadRowSerializer(serializers.Serializer):
    url = serializers.CharField()
    state = serializers.ChoiceField(choices=["in", "out", "idle"],
                                    help_text="in / out of rotation in the runs that use it; idle: no run in the window")
    since = serializers.DateTimeField(allow_null=True, help_text="when it entered this state")
    reason = serializers.CharField(help_text="why it is out of rotation")
    runs = serializers.IntegerField(help_text="runs (chunks on workers) that reported it in the window")
    in_flight = serializers.IntegerField()
    requests = serializers.IntegerField(help_text="attempts sent, summed over those runs")
    ok = serializers.IntegerField()
    errors = serializers.IntegerField()
    error_rate = serializers.FloatField(allow_null=True)
    share = serializers.FloatField(allow_null=True, help_text="its share of the requests")
    times_out = serializers.IntegerField(help_text="times taken out of rotation")
    last_error = serializers.CharField()
    health = serializers.JSONField(allow_null=True, help_text="the last health check of this replica")


class ReplicaLoadSerializer(serializers.Serializer):
    window_s = serializers.FloatField()
    runs = serializers.IntegerField()
    in_rotation = serializers.IntegerField()
    checked_at = serializers.CharField(allow_null=True)
    replicas = ReplicaLoadRowSerializer(many=True)


class EndpointPrewarmRequestSerializer(StrictJSONTypes, serializers.Serializer):
    count = serializers.IntegerField(min_value=0, max_value=64, default=4,
                                     help_text="how many tiny requests, spread over the replicas")


# ---------------------------------------------------------------------------------------------- jobs


def _known_verifiers():
    from workers.verifiers import VERIFIERS

    return sorted(VERIFIERS)


@extend_schema_field(OpenApiTypes.INT)
class VisiblePrimaryKeyField(serializers.PrimaryKeyRelatedField):
    """A related id the requesting user may see; other users' ids read as 'does not exist'."""

    def __init__(self, visible, **kw):
        self._visible = visible
        super().__init__(**kw)

    def get_queryset(self):
        request = self.context.get("request")
        return self._visible(getattr(request, "user", None))

    def to_internal_value(self, data):
        if isinstance(data, bool):
            self.fail("incorrect_type", data_type=type(data).__name__)
        try:
            if int(data) > 2**63 - 1 or int(data) < 0:
                self.fail("does_not_exist", pk_value=data)
        except (TypeError, ValueError):
            self.fail("incorrect_type", data_type=type(data).__name__)
        return super().to_internal_value(data)


class OpenEndedSerializer(StrictJSONTypes, serializers.Serializer):
    buffer = serializers.IntegerField(min_value=1, max_value=2**31 - 1,
                                      help_text="At most this many rollouts stored ahead of what the consumer "
                                                "acknowledged (plus one chunk in flight: never more than buffer + "
                                                "chunk rows x num_repeats - 1)")
    shuffle = serializers.BooleanField(default=False, help_text="Each pass in its own shuffled row order")
    seed = serializers.IntegerField(min_value=0, max_value=2**31 - 1, default=0,
                                    help_text="The shuffles' seed (pass p's order: seed and p)")
    consumer = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$", max_length=100, default="trainer",
                                      help_text="The trainer's stream consumer name whose acknowledgements free the "
                                                "buffer")

    def to_internal_value(self, data):
        if isinstance(data, dict) and (unknown := set(data) - set(self.fields)):
            raise serializers.ValidationError(f"unknown keys: {', '.join(sorted(map(str, unknown)))}")
        return super().to_internal_value(data)


class OpenEndedFiguresSerializer(serializers.Serializer):
    consumer = serializers.CharField(help_text="The stream consumer the buffer is measured against")
    buffer = serializers.IntegerField(help_text="Rollouts allowed ahead of the consumer's acknowledgements")
    chunk_rollouts = serializers.IntegerField(help_text="Rollouts per chunk (rows per chunk x num_repeats)")
    bound = serializers.IntegerField(help_text="The most ever stored ahead of the consumer: buffer + chunk_rollouts - 1")
    stored = serializers.IntegerField(help_text="Rollouts stored (ok and failed)")
    unconsumed = serializers.IntegerField(help_text="The buffer's fill: stored rollouts past the consumer's cursor")
    fill = serializers.FloatField(help_text="unconsumed / buffer")
    consumed = serializers.IntegerField(help_text="Stored rollouts up to the consumer's cursor")
    acked = serializers.IntegerField(help_text="Rollouts the consumer acknowledged (handed out to it)")
    acked_recent = serializers.IntegerField(help_text="Rollouts acknowledged in the last window_s")
    window_s = serializers.FloatField(help_text="The rate's window: 60 s, or the consumer's age when younger")
    consumption_per_s = serializers.FloatField(help_text="The trainer's consumption rate: acked_recent / window_s")
    pass_index = serializers.IntegerField(help_text="The newest chunk's pass over the dataset (0 = the first)")
    shuffle = serializers.BooleanField()
    seed = serializers.IntegerField()
    stopping = serializers.BooleanField(help_text="Stopped: no new chunks; those in flight finish, then it completes")


class JobCreateSerializer(StrictJSONTypes, serializers.Serializer):
    """Every parameter of ng_collect_rollouts, plus the verifier and distribution settings."""

    name = serializers.CharField(max_length=200, required=False, allow_blank=True, default="")
    dataset = VisiblePrimaryKeyField(visible_datasets, help_text="Dataset id (status ready)")
    endpoint = VisiblePrimaryKeyField(visible_endpoints, help_text="Endpoint id")
    limit = serializers.IntegerField(min_value=1, max_value=2**31 - 1, required=False, allow_null=True, default=None,
                                     help_text="Keep the first N dataset rows")
    num_repeats = serializers.IntegerField(min_value=1, max_value=settings.JOBS_MAX_NUM_REPEATS, default=1)
    num_samples_in_parallel = serializers.IntegerField(min_value=1, max_value=settings.JOBS_MAX_PARALLELISM, default=16)
    parallelism_auto = serializers.BooleanField(default=False)
    responses_create_params = serializers.DictField(required=False, default=dict,
                                                    help_text="Overrides merged into every row (temperature, top_p, max_output_tokens, ...)")
    verifier = serializers.CharField(max_length=300, default="math",
                                     help_text="A registered name (" + ", ".join(_known_verifiers()) + "), an installed "
                                     "entry point, or a dotted path ('mypkg.checks:my_verifier') into a module the operator lists in "
                                     "VERIFIER_PATH_MODULES")
    verifier_options = serializers.DictField(required=False, default=dict)
    verify_mode = serializers.ChoiceField(choices=CollectionJob.VerifyMode.choices, default="inline")
    verify_cache = serializers.ChoiceField(choices=["off", "job", "global"], default="job",
                                           help_text="Compute identical verifications once per job, across jobs, or never")
    chunk_size = serializers.IntegerField(min_value=1, max_value=settings.JOBS_MAX_CHUNK_SIZE, default=5000)
    profiling_enabled = serializers.BooleanField(default=False)
    profile_servers = serializers.BooleanField(
        default=False, help_text="Profile the NeMo Gym deployment's own servers (found through its head server; "
                                 "ng_run started with +profiling_enabled=true) while the job runs: the job's profile "
                                 "shows each server's table. A NeMo Gym endpoint only")
    mlflow_tracking_uri = serializers.CharField(
        required=False, allow_blank=True, default="", max_length=2000,
        help_text="Export the job as an MLflow run: the name (or exact URI) of one of the deployment's tracking "
                  "servers (MLFLOW_TRACKING_URIS); any other URI is refused")
    max_version_lag = serializers.IntegerField(
        min_value=0, max_value=2**31 - 1, required=False, allow_null=True, default=None,
        help_text="Bounded staleness: the largest version lag (endpoint's current weight version - the rollout's "
                  "version at dispatch) a trainer accepts from the rollout stream; null = any")
    stale_policy = serializers.ChoiceField(
        choices=CollectionJob.StalePolicy.choices, default="mark",
        help_text="A rollout past max_version_lag is collected again with the current weights (recollect) or kept "
                  "and marked stale (mark); either way the stream never hands it out")

    open_ended = OpenEndedSerializer(
        required=False, allow_null=True, default=None,
        help_text="Open-ended collection: passes over the dataset (fresh repeat indices each pass) until stopped "
                  "(POST .../stop/ or .../cancel/), at most `buffer` rollouts ahead of what `consumer` acknowledged "
                  "on the rollout stream; null = one pass")

    def validate_open_ended(self, value):
        return dict(value) if value is not None else None

    def validate_dataset(self, value):
        if value.status != Dataset.Status.READY:
            raise serializers.ValidationError(f"dataset {value.pk} is {value.status}, not ready")
        return value


class ProgressSerializer(serializers.Serializer):
    total = serializers.IntegerField()
    completed = serializers.IntegerField()
    failed = serializers.IntegerField()
    done = serializers.IntegerField()
    fraction = serializers.FloatField()


class JobSerializer(ShownToUser, serializers.ModelSerializer):
    shown_fields = ("error_message", "aggregate_metrics", "verification")

    owner = serializers.CharField(source="owner.username", read_only=True, default=None, allow_null=True)
    progress = serializers.SerializerMethodField()
    profile_servers = serializers.SerializerMethodField()

    class Meta:
        model = CollectionJob
        fields = ["id", "name", "state", "dataset", "endpoint", "limit", "num_repeats", "num_samples_in_parallel",
                  "parallelism_auto", "responses_create_params", "verifier", "verifier_options", "verify_mode",
                  "chunk_size", "profiling_enabled", "profile_servers", "idempotency_key", "max_version_lag", "stale_policy",
                  "progress", "stalled", "stall_reason",
                  "error_message",
                  "owner", "created_at", "started_at", "finished_at", "last_progress_at"]
        read_only_fields = fields

    def get_profile_servers(self, job) -> bool:
        return bool((job.collection_options or {}).get("profile_servers"))

    @extend_schema_field(ProgressSerializer)
    def get_progress(self, job):
        return {"total": job.total_rollouts, "completed": job.completed_count, "failed": job.failed_count,
                "done": job.done_count, "fraction": job.progress_fraction}


class JobDetailSerializer(JobSerializer):
    elapsed_s = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "aggregate_metrics", "timing_summary", "elapsed_s", "verify_cache",
                  "verification", "figures", "open_ended"]
        read_only_fields = fields

    open_ended = serializers.SerializerMethodField(
        help_text="Open-ended jobs: the buffer's fill and the trainer's consumption (controlplane.jobs.openended); "
                  "null for a job of one pass")

    @extend_schema_field(OpenEndedFiguresSerializer(allow_null=True))
    def get_open_ended(self, job):
        from controlplane.jobs.openended import figures

        return figures(job)

    figures = serializers.SerializerMethodField(
        help_text="The job's figures as the dashboard shows them (controlplane.jobs.figures): rollouts_stored, ok, "
                  "failed, running_s (pauses excluded), average_rollouts_per_s, recent_rollouts_per_s over "
                  "recent_window_s, recent_output_tokens_per_s; input_tokens and output_tokens stored, "
                  "average_tokens_per_s (input + output) and average_output_tokens_per_s over running_s")

    @extend_schema_field({"type": "object", "additionalProperties": {}})
    def get_figures(self, job):
        return job_figures(job)

    verification = serializers.SerializerMethodField(help_text="The latest batch verification run, if any")

    @extend_schema_field({"type": "object", "additionalProperties": {}, "nullable": True})
    def get_verification(self, job):
        if "verification" in self.context:  # read by the view before the job row (JobViewSet.retrieve)
            return self.context["verification"]
        return verification_summary(job)

    def get_elapsed_s(self, job) -> float | None:
        """Running time, pauses and queue waits excluded (the job page's elapsed)."""
        return running_seconds(job)


class JobListQuerySerializer(serializers.Serializer):
    state = serializers.MultipleChoiceField(choices=JobState.choices, required=False,
                                            help_text="One or more states (repeat the parameter or comma-separate)")
    dataset = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False)
    endpoint = serializers.IntegerField(min_value=1, max_value=2**63 - 1, required=False)
    created_after = serializers.DateTimeField(required=False, help_text="ISO 8601; inclusive")
    created_before = serializers.DateTimeField(required=False, help_text="ISO 8601; exclusive")


class HistoryQuerySerializer(serializers.Serializer):
    days = serializers.IntegerField(min_value=0, max_value=36500, required=False,
                                      help_text="Only jobs created in the last N days (0 or absent: all)")
    format = serializers.ChoiceField(choices=["json", "csv"], required=False, default="json",
                                       help_text="csv: the History page's throughput_log.csv")


class FiniteFloatField(serializers.FloatField):
    def to_internal_value(self, data):
        import math

        value = super().to_internal_value(data)
        if not math.isfinite(value):
            raise serializers.ValidationError("A finite number is required.")
        return value


class TaskProfileQuerySerializer(serializers.Serializer):
    pass_threshold = FiniteFloatField(required=False, default=1.0,
                                      help_text="A pass: an ok rollout with reward >= this (default 1.0)")
    order = serializers.ChoiceField(choices=["task", "mean", "-mean", "variance", "-variance", "pass_rate",
                                             "-pass_rate"], required=False, default="task",
                                    help_text="Sort the tasks by this ('-': descending; ties by task index)")
    limit = serializers.IntegerField(min_value=1, max_value=100_000, required=False, default=1000,
                                     help_text="JSON: at most this many tasks (the CSV has them all)")
    offset = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False, default=0)
    format = serializers.ChoiceField(choices=["json", "csv"], required=False, default="json",
                                     help_text="csv: every task, one line each (task_profile.csv)")


class RolloutQuerySerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=Rollout.Status.choices, required=False)
    failure_class = serializers.CharField(max_length=40, required=False)
    reward_min = FiniteFloatField(required=False)
    reward_max = FiniteFloatField(required=False)
    wall_ms_min = FiniteFloatField(required=False)
    wall_ms_max = FiniteFloatField(required=False)
    trace_id = serializers.CharField(max_length=60, required=False,
                                     help_text="The W3C trace id of its model requests (or a whole traceparent)")


class RolloutSerializer(ShownToUser, serializers.ModelSerializer):
    shown_fields = ("error",)
    trajectory = serializers.SerializerMethodField(
        help_text="An agent's rollout turn by turn (model calls, tool calls and their results); [] for one answer")

    class Meta:
        model = Rollout
        fields = ["id", "task_index", "rollout_index", "status", "failure_class", "error", "reward", "queue_ms",
                  "ttft_ms", "generation_ms", "verify_ms", "wall_ms", "input_tokens", "output_tokens", "attempts",
                  "weight_version", "completed_version", "spans_update", "stale", "worker", "trace_id", "created_at", "data",
                  "trajectory"]
        read_only_fields = fields

    def get_trajectory(self, obj) -> list:
        return trajectory(obj.data)


class MetricQuerySerializer(serializers.Serializer):
    since = serializers.DateTimeField(required=False, help_text="Only samples at or after this time")
    worker = serializers.CharField(max_length=200, required=False)


class JobMetricSampleSerializer(ShownToUser, serializers.ModelSerializer):
    shown_fields = ("extra",)  # replica and scrape errors from the workers

    class Meta:
        model = JobMetricSample
        fields = ["id", "t", "worker", "elapsed_s", "completed", "failed", "samples_per_s", "output_tokens_per_s",
                  "in_flight", "parallelism", "errors", "extra"]
        read_only_fields = fields


class JobWorkerSerializer(serializers.Serializer):
    """A worker process that ran part of a job (controlplane.jobs.workers.job_workers)."""
    host = serializers.CharField(help_text="the worker's hostname")
    pid = serializers.IntegerField(allow_null=True)
    worker = serializers.CharField(help_text="host:pid")
    alive = serializers.BooleanField(help_text="holds a chunk and heartbeated within the lease timeout")
    chunks_held = serializers.IntegerField(help_text="chunks it holds now")
    chunks_done = serializers.IntegerField(help_text="chunks it finished")
    rollouts = serializers.IntegerField(help_text="rollouts (ok + failed) its chunk runs reported in their last progress "
                                                  "sample (a killed worker's last second is not in it)")
    rollouts_per_s = serializers.FloatField(help_text="its current rate (0 when not alive)")
    in_flight = serializers.IntegerField()
    last_heartbeat = serializers.DateTimeField(allow_null=True)


class JobWorkersSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    workers = JobWorkerSerializer(many=True)


class ExportQuerySerializer(serializers.Serializer):
    which = serializers.ChoiceField(choices=["ok", "failed", "all"], default="ok",
                                    help_text="ok: the output rows; failed: the failures (with failure_class); all: both")
    reward_min = FiniteFloatField(required=False, help_text="Curate: rows with reward >= this only")
    reward_max = FiniteFloatField(required=False, help_text="Curate: rows with reward <= this only")
    skip_equal = serializers.BooleanField(required=False, default=False,
                                          help_text="Curate: leave out tasks whose ok rollouts all have the same reward")
    max_lag = serializers.IntegerField(min_value=0, max_value=2**31 - 1, required=False,
                                       help_text="Curate: leave out rows more than this many weight versions behind "
                                                 "the endpoint's current one, and rows marked stale")
    failure_class = serializers.RegexField(r"^[a-z0-9_]{1,40}(,[a-z0-9_]{1,40}){0,19}$", max_length=900,
                                           required=False, help_text="Curate: failed rows only of these classes "
                                                                     "(comma-separated)")


def export_filters(d: dict) -> dict:
    """ExportQuerySerializer's validated data -> controlplane.jobs.export.curate()'s keywords."""
    out = {k: d[k] for k in ("reward_min", "reward_max", "max_lag") if d.get(k) is not None}
    if d.get("skip_equal"):
        out["skip_equal"] = True
    if d.get("failure_class"):
        out["failure_classes"] = d["failure_class"].split(",")
    return out


class VerifyRequestSerializer(StrictJSONTypes, serializers.Serializer):
    verifier = serializers.CharField(max_length=300, required=False, allow_blank=True, default="",
                                     help_text="Verify with this verifier instead of the job's own")
    verifier_options = serializers.DictField(required=False, allow_null=True, default=None)
