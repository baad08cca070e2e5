"""The engine's contract with the outside world. Plain dataclasses: no Django here.

The Celery task (or the CLI, or a benchmark) builds a CollectionSpec, hands the engine an iterable
of TaskItem and a Sink, and gets a RunSummary back. The engine emits RolloutResult and
ProgressTick to the sink, and polls a Control for cancel / pause / parallelism changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class FailureClass:
    """Failure classes recorded on a failed rollout and counted in the error series."""

    HTTP_429 = "http_429"
    HTTP_5XX = "http_5xx"
    HTTP_4XX = "http_4xx"  # 400 context length, 401, 404 ... (not retried except 408/409)
    TIMEOUT = "timeout"
    CONNECTION = "connection"
    BAD_RESPONSE = "bad_response"  # unparseable body, missing fields
    VERIFIER_ERROR = "verifier_error"  # the verifier raised; reward 0, row kept
    CANCELLED = "cancelled"
    BAD_INPUT = "bad_input"  # the row cannot be turned into a request (e.g. malformed input messages)

    RETRYABLE = {HTTP_429, HTTP_5XX, TIMEOUT, CONNECTION}


@dataclass
class EndpointSpec:
    base_urls: list[str]  # one or several replicas, e.g. ["http://127.0.0.1:8000"]; "/v1/..." is appended
    model: str
    api_flavor: str = "chat_completions"  # "chat_completions" | "completions" | "responses"
    api_key: str | None = None
    request_timeout_s: float = 600.0  # whole request, including streaming
    connect_timeout_s: float = 10.0
    max_retries: int = 5  # retries per request after the first attempt
    backoff_base_s: float = 0.5  # exponential: base * 2**attempt, capped, with jitter
    backoff_max_s: float = 30.0
    rpm_limit: int | None = None  # client-side pacing when set
    tpm_limit: int | None = None
    read_timeout_s: float | None = None  # longest silence between streamed chunks; default request_timeout_s
    max_response_bytes: int = 16 * 1024 * 1024  # a larger answer is a bad_response, never read whole
    # several replicas (workers.engine.replicas): routing and the circuit breaker
    replica_affinity: bool = True  # the repeats of one task go to one replica (prefix-cache reuse)
    health_path: str = "/health"  # probed to take a replica out of rotation and put it back ("/v1/models" for hosted APIs)
    replica_fail_threshold: int = 3  # replica faults in a row (connection, timeout, 5xx) that take it out of rotation
    health_interval_s: float = 5.0  # probe period of the replicas in rotation
    probe_timeout_s: float = 2.0  # a probe not answered in this time fails (a hung replica)
    probe_max_s: float = 10.0  # longest wait between two probes of a replica out of rotation


@dataclass
class CollectionSpec:
    endpoint: EndpointSpec
    parallelism: int = 16  # num_samples_in_parallel: max requests in flight
    responses_create_params: dict[str, Any] = field(default_factory=dict)  # job-level overrides
    verifier: str = "math"  # name in workers.verifiers registry; "none" skips verification
    verifier_options: dict[str, Any] = field(default_factory=dict)
    verify_mode: str = "inline"  # "inline" | "fast" | "deferred" (deferred: no verification now)
    stream: bool = True  # stream responses to measure time-to-first-token
    max_resident: int | None = None  # tasks held in memory at once; default 2 * parallelism
    progress_interval_s: float = 1.0
    verify_processes: int | None = None  # process pool size for CPU-bound verifiers (default: cores)
    verify_concurrency: int = 32  # io / remote verifiers (sandboxed code, LLM judge): calls at once
    verify_cache: str = "job"  # "off" | "job" (one cache per run) | "global" (shared by the worker's runs)
    # Redis shared by every chunk / worker of the job (job scope) or of all jobs ("global"); None: local only
    verify_cache_url: str | None = None
    verify_cache_scope: str = ""
    verify_cache_ttl_s: int = 7 * 24 * 3600
    verify_cache_claim_s: float = 60.0  # how long others wait for a worker computing the same work (it may have died)
    verify_cache_shared_choice: str = "measured"  # "measured": Redis only while it pays (execution.py); "always";
    # "alone": this process alone verifies the scope (local cache, Redis never opened)
    worker_name: str = ""
    pause_grace_s: float = 10.0  # on pause: how long in-flight requests may finish before they are dropped
    add_seed: bool = False  # NeMo Gym's num_repeats_add_seed: metadata.extra_body {"seed": rollout index}
    tracing: Any = None  # a workers.tracing.TraceConfig: OpenTelemetry spans of the run (None: off)


@dataclass
class TaskItem:
    task_index: int  # _ng_task_index (shared by repeats of one row)
    rollout_index: int  # _ng_rollout_index (0..num_repeats-1)
    row: dict[str, Any]  # the input row, job overrides not yet merged


@dataclass
class RolloutResult:
    task_index: int
    rollout_index: int
    ok: bool
    output_row: dict[str, Any]  # NeMo Gym output row: input fields + response + reward + verifier fields
    reward: float | None = None
    failure_class: str = ""  # a FailureClass value when not ok (or verifier_error with ok=True rows? no: ok=False)
    error: str = ""
    queue_ms: float | None = None  # waiting for a parallelism slot
    ttft_ms: float | None = None  # request sent -> first token
    generation_ms: float | None = None  # first token -> last token
    verify_ms: float | None = None
    wall_ms: float | None = None  # slot acquired -> verified (excludes queue_ms)
    input_tokens: int | None = None
    output_tokens: int | None = None
    attempts: int = 1
    weight_version: str = ""  # the weights it was generated with (at dispatch)
    completed_version: str = ""  # the weights in force when it completed ('' = same as weight_version / unknown)
    replica: str = ""  # base URL of the replica that served the last attempt (several replicas only)
    trace_id: str = ""  # W3C trace id (32 hex) of the rollout: every model request carries it in `traceparent`


# The per-rollout timings, in stage order: RolloutResult's attributes, the Rollout table's columns and the keys
# of every timing summary (job, telemetry tick, diagnosis evidence).
TIMING_FIELDS = ("queue_ms", "ttft_ms", "generation_ms", "verify_ms", "wall_ms")


@dataclass
class ProgressTick:
    elapsed_s: float
    completed: int  # cumulative ok rows in this run
    failed: int  # cumulative failed rows in this run
    in_flight: int
    parallelism: int
    samples_per_s: float  # over the last interval
    output_tokens_per_s: float  # over the last interval
    errors: dict[str, int] = field(default_factory=dict)  # error events (incl. retried ones) in the interval, by class
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunSummary:
    completed: int
    failed: int
    cancelled: bool
    paused: bool
    elapsed_s: float
    fatal_error: str = ""  # set when the run stopped early (e.g. endpoint unreachable past the retry budget)


class Sink(Protocol):
    async def rollout(self, result: RolloutResult) -> None: ...  # may buffer; must be cheap
    async def progress(self, tick: ProgressTick) -> None: ...
    async def close(self) -> None: ...  # flush everything buffered


class Control(Protocol):
    """Polled by the engine about once a second (from a thread, so it may block briefly)."""

    def poll(self) -> "ControlState": ...


@dataclass
class ControlState:
    action: str = "run"  # "run" | "pause" | "cancel"
    parallelism: int | None = None  # a new parallelism to apply, if any
