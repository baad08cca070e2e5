"""Model endpoints: vLLM or any OpenAI-compatible server, with one or several replicas."""
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxLengthValidator, RegexValidator
from django.db import models

from controlplane import operator as knobs
from controlplane.fieldcrypt import EncryptedTextField
from controlplane.leases import Lease
from controlplane.limits import endpoint_errors


class Endpoint(models.Model):
    class Flavor(models.TextChoices):
        CHAT = "chat_completions", "Chat completions"
        COMPLETIONS = "completions", "Completions"
        RESPONSES = "responses", "Responses API"

    class Kind(models.TextChoices):
        VLLM = "vllm", "vLLM (has /metrics and admin routes)"
        OPENAI = "openai", "Hosted OpenAI-compatible API"
        NEMO_GYM = "nemo_gym", "NeMo Gym deployment (head server; agents discovered)"
        NEMO_GYM_AGENT = "nemo_gym_agent", "NeMo Gym agent server (/run)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="endpoints")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.VLLM)
    base_url = models.URLField(max_length=500, help_text="e.g. http://127.0.0.1:8000 (the /v1 prefix is added)")
    replica_urls = models.JSONField(default=list, blank=True, help_text="Extra replica base URLs; requests are spread over all")
    replica_affinity = models.BooleanField(
        default=True, help_text="Send the repeats of one task to one replica (its prefix cache serves the shared prompt); "
                                "a replica out of rotation or overloaded is left for the least loaded one")
    model_name = models.CharField(max_length=300)
    worker_queue = models.CharField(
        max_length=200, blank=True, validators=[RegexValidator(r"^[A-Za-z0-9_.:@-]+$", "letters, digits and _ . : @ - only")],
        help_text="Celery queue whose workers run this endpoint's chunks (start them with `-Q <queue>`, e.g. on "
                  "the GPU host): one of the operator's JOBS_WORKER_QUEUES; empty: JOBS_ENDPOINT_QUEUES, else the "
                  "default queue")
    api_flavor = models.CharField(max_length=30, choices=Flavor.choices, default=Flavor.CHAT)
    # write-only everywhere it is exposed; encrypted at rest (controlplane/fieldcrypt.py), plain text in Python
    api_key = EncryptedTextField(blank=True, validators=[MaxLengthValidator(500)])
    request_timeout_s = models.FloatField(default=600.0)
    connect_timeout_s = models.FloatField(default=10.0)
    max_retries = models.PositiveIntegerField(default=5, help_text="Retries per request before the row is recorded as failed")
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    last_health = models.JSONField(default=dict, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    last_prewarm = models.JSONField(default=dict, blank=True)  # the latest pre-warm's result (a worker's)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} ({self.model_name} @ {self.base_url})"

    def clean(self):
        errors = endpoint_errors({f: getattr(self, f) for f in ("base_url", "replica_urls", "request_timeout_s",
                                                                 "connect_timeout_s", "max_retries")})
        if why := knobs.queue_problem(self.worker_queue):  # the operator's queues only
            errors.setdefault("worker_queue", []).append(why)
        if errors:
            raise ValidationError(errors)

    @property
    def all_base_urls(self):
        return [self.base_url, *[u for u in self.replica_urls if u and u != self.base_url]]

    @property
    def is_nemo_gym(self):
        """An environment endpoint: rows go to NeMo Gym agents' /run (model_name is the default agent's name)."""
        return self.kind in (self.Kind.NEMO_GYM, self.Kind.NEMO_GYM_AGENT)

    @property
    def has_api_key(self):
        return bool(self.api_key)


# AdminOperation and AdminAction are model-server operations ("ops": controlplane.endpoints.ops, workers.ops).
# They keep their "Admin" names, tables, index names and related names on purpose: renaming them needs a
# migration of stored data for no behaviour change (so do the deprecated /admin/ API aliases and the Celery
# task's registered name, run_admin_action_task). Other new code says "ops"; "admin" is Django's admin site.
class AdminOperation(models.Model):
    """One ops request to one replica (a weight update is three: pause, update_weights, resume), timed as
    wall_ms (client) = rpc_ms (server) + queue_ms (client side). One trace id per user action, shared by
    the requests it made and sent to the server in the X-Trace-Id header."""

    class Kind(models.TextChoices):
        HEALTH = "health", "health"
        PREWARM = "prewarm", "pre-warm"
        RESET_PREFIX_CACHE = "reset_prefix_cache", "reset prefix cache"
        PAUSE = "pause", "pause"
        RESUME = "resume", "resume"
        UPDATE_WEIGHTS = "update_weights", "update weights"
        SET_WEIGHT_VERSION = "set_weight_version", "set weight version"
        SLEEP = "sleep", "sleep"
        WAKE_UP = "wake_up", "wake up"

    class Status(models.TextChoices):
        OK = "ok", "ok"
        FAILED = "failed", "failed"
        NO_ANSWER = "no_answer", "no answer (timed out)"

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="admin_operations")
    trace_id = models.CharField(max_length=64, db_index=True)
    kind = models.CharField(max_length=30, choices=Kind.choices)
    replica = models.CharField(max_length=500)
    status = models.CharField(max_length=20, choices=Status.choices)
    http_status = models.PositiveSmallIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    wall_ms = models.FloatField(null=True, blank=True)
    rpc_ms = models.FloatField(null=True, blank=True)
    queue_ms = models.FloatField(null=True, blank=True)
    connect_ms = models.FloatField(null=True, blank=True)
    rpc_source = models.CharField(max_length=20, blank=True, help_text="server-timing (the server's own figure) or ttfb")
    attempts = models.PositiveSmallIntegerField(default=1)
    params = models.JSONField(default=dict, blank=True)
    source = models.CharField(max_length=20, blank=True, help_text="dashboard, api, command")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    created_at = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["endpoint", "kind", "created_at"], name="adminop_ep_kind_time")]

    def __str__(self):
        return f"{self.kind} {self.replica} {self.status} ({self.trace_id})"


class AdminAction(models.Model):
    """One ops action a user asked for (an operation on every replica, or a weight update), run by a
    Celery worker: the web process creates this row and enqueues it, never calling a model server itself.
    The worker records each request to each replica as an `AdminOperation` with the same trace id, and
    the action's report lands in `result`."""

    class State(models.TextChoices):
        QUEUED = "queued", "queued"
        RUNNING = "running", "running"
        SUCCEEDED = "succeeded", "succeeded"
        FAILED = "failed", "failed"

    FINISHED = (State.SUCCEEDED, State.FAILED)

    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="admin_actions")
    trace_id = models.CharField(max_length=64, db_index=True)
    kind = models.CharField(max_length=30, choices=AdminOperation.Kind.choices)
    params = models.JSONField(default=dict, blank=True, help_text="as validated when the action was asked for")
    state = models.CharField(max_length=20, choices=State.choices, default=State.QUEUED)
    result = models.JSONField(null=True, blank=True, help_text="the report (every request's status and timings)")
    error = models.TextField(blank=True, help_text="why the action could not run (not a replica's failure)")
    source = models.CharField(max_length=20, blank=True, help_text="dashboard, api, command")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
                                     related_name="+")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True, help_text="when it was asked for")
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # What the caller waits (controlplane/lanes.py): asked -> a worker started it, asked -> it ended.
    dispatch_ms = models.FloatField(null=True, blank=True, help_text="asked -> started (waiting for a worker)")
    total_ms = models.FloatField(null=True, blank=True, help_text="asked -> finished (what the caller waited)")

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["endpoint", "kind", "state"], name="adminaction_ep_kind_state")]

    def __str__(self):
        return f"{self.kind} on endpoint {self.endpoint_id}: {self.state} ({self.trace_id})"


# claimed once by a worker (ops.execute): no holder or heartbeat; a redelivered message finds it running
ADMIN_ACTION_CLAIM = Lease(AdminAction, waiting=AdminAction.State.QUEUED, running=AdminAction.State.RUNNING,
                           owner=None, heartbeat=None, attempts=None)


class WeightVersion(models.Model):
    """A weight version an endpoint switched to through a weight update. Rollouts are tagged with the
    version the server reports (X-Weight-Version / weight_version); a server that reports none (vLLM) gets
    the version of the update in force when the rollout was dispatched: from the moment its pause was
    sent (`started_at`), since requests sent during the pause are generated with the new weights."""
    endpoint = models.ForeignKey(Endpoint, on_delete=models.CASCADE, related_name="weight_versions")
    version = models.CharField(max_length=100)
    previous_version = models.CharField(max_length=100, blank=True)
    weights_path = models.CharField(max_length=1000, blank=True)
    checkpoint_id = models.CharField(max_length=300, blank=True)
    trace_id = models.CharField(max_length=64, db_index=True)
    started_at = models.DateTimeField(help_text="when the pause before the update was sent")
    applied_at = models.DateTimeField(help_text="when every replica had resumed")

    class Meta:
        ordering = ["-started_at", "-id"]

    def __str__(self):
        return f"{self.endpoint_id} v{self.version}"
