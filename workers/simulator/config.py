"""The simulator's knobs: one dataclass, validated, shared by the CLI and `POST /admin/config`.

Every knob is a field of `SimConfig` with its help text, unit and default in the field metadata; the
CLI (`python -m workers.simulator --help`) is generated from these fields, and `/admin/config` takes
the same names as JSON keys (`ttft_ms`, `fault_rates`, ...).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# Fault types that can be injected by rate (--fault-rate) or forced per request (X-Sim-Fault header).
FAULT_TYPES = ("429", "500", "503", "400", "stall", "drop")
# Admin routes that can be made to fail (knob admin_faults) and how.
ADMIN_ROUTES = ("pause", "resume", "update_weights", "reset_prefix_cache", "sleep", "wake_up", "health")
ADMIN_FAULT_TYPES = ("500", "503", "400", "stall")


class ConfigError(ValueError):
    """A knob has a bad value; the message says which and why."""


def _knob(default: Any, help: str, unit: str = "", runtime: bool = True, **kw):
    md = {"help": help, "unit": unit, "runtime": runtime}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=md, **kw)
    return field(default=default, metadata=md, **kw)


@dataclass
class SimConfig:
    # identity and access
    model: str = _knob("sim-model", "model name served on /v1/models; requests naming another model get 404 like vLLM")
    api_key: str | None = _knob(None, "when set, /v1/* require 'Authorization: Bearer <key>' (401 otherwise); utility and admin routes stay open like vLLM's")
    seed: int | None = _knob(None, "seed for text, math answers and fault draws: same seed + same request sequence -> same outputs; unset = random", runtime=False)
    # latency model
    ttft_ms: float = _knob(50.0, "time to first token", "ms")
    itl_ms: float = _knob(5.0, "inter-token latency (time between two output tokens)", "ms")
    jitter: float = _knob(0.1, "relative jitter on every latency: each delay is multiplied by uniform(1-j, 1+j); 0..1", "fraction")
    prefill_ms_per_1k: float = _knob(0.0, "extra time to first token per 1000 uncached prompt tokens (prefix-cache hits are free)", "ms")
    load_factor: float = _knob(0.0, "latency slowdown under load: delays are multiplied by 1 + load_factor * running/max_num_seqs (0 = flat)", "factor")
    # capacity and queueing
    max_num_seqs: int = _knob(256, "sequences generated at once; requests beyond it wait in a FIFO queue", "requests")
    max_queue: int = _knob(100000, "waiting requests beyond which new ones are refused with 429 + Retry-After", "requests")
    kv_cache_tokens: int = _knob(262144, "simulated KV-cache capacity (prompt + generated tokens of running sequences); admission waits when full and a growing sequence that overflows it is preempted (vllm:num_preemptions_total) and recomputed", "tokens")
    max_model_len: int = _knob(8192, "context length: prompt + max_tokens above it gets vLLM's 400 context-length error", "tokens")
    # output length
    output_len_min: int = _knob(16, "lower bound of the sampled output length when the request sets no max_tokens / max_completion_tokens / max_output_tokens", "tokens")
    output_len_max: int = _knob(64, "upper bound of the sampled output length (inclusive)", "tokens")
    math_accuracy: float = _knob(0.7, "probability that the \\boxed{N} answer to an arithmetic prompt ('What is A + B?', 'Compute A * B', ops + - * x) is right; otherwise it is off by 1..10; 0..1", "probability")
    # faults and limits
    fault_rates: dict = _knob({}, "fault injection rates by type, e.g. '429=0.05,500=0.01'; types: " + ", ".join(FAULT_TYPES) + " (stall = never answers until the client gives up; drop = connection closed mid-request / mid-stream); each 0..1, sum <= 1. Per request, the header 'X-Sim-Fault: <type>' forces one (and 'X-Sim-Retry-After: <s>' sets the 429 Retry-After)", "probability")
    retry_after_s: float = _knob(1.0, "Retry-After sent with injected 429s and queue-full 429s (rounded up to whole seconds in the header)", "s")
    rpm_limit: int = _knob(0, "hosted-API mode: requests per minute (sliding 60 s window) beyond which 429 + Retry-After; 0 = off", "requests/min")
    tpm_limit: int = _knob(0, "hosted-API mode: tokens per minute (prompt + requested max tokens, sliding 60 s window) beyond which 429 + Retry-After; 0 = off", "tokens/min")
    # admin
    update_weights_ms: float = _knob(200.0, "time /update_weights takes; token generation is held meanwhile, as on a GPU busy loading weights", "ms")
    unhealthy: bool = _knob(False, "simulate a dead engine: /health and /v1/* answer 503")
    hang: bool = _knob(False, "simulate a hung server: every route but /admin/config accepts the connection and never answers while this is set (requests already hanging carry on once it is cleared)")
    tool_calls: bool = _knob(True, "a chat request that offers `tools` (and tool_choice is not 'none') is answered, until a tool result follows its last user message, with a call of its first tool (arguments filled from the tool's JSON schema, finish_reason 'tool_calls'); then in text. Non-streamed chat completions only")
    admin_faults: dict = _knob({}, "forced faults on admin routes, by route name, e.g. {\"update_weights\": \"500\"}; types: " + ", ".join(ADMIN_FAULT_TYPES) + " (stall = never answers until the client gives up); set and clear at runtime with POST /admin/config")

    def validate(self) -> "SimConfig":
        def nonneg(name):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ConfigError(f"{name} must be a number, got {v!r}")
            if v != v or v < 0:
                raise ConfigError(f"{name} must be >= 0, got {v!r}")

        for name in ("ttft_ms", "itl_ms", "prefill_ms_per_1k", "load_factor", "retry_after_s", "update_weights_ms"):
            nonneg(name)
        for name in ("jitter", "math_accuracy"):
            nonneg(name)
            if getattr(self, name) > 1:
                raise ConfigError(f"{name} must be between 0 and 1, got {getattr(self, name)!r}")
        for name in ("max_num_seqs", "max_queue", "kv_cache_tokens", "max_model_len", "output_len_min",
                     "output_len_max", "rpm_limit", "tpm_limit"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ConfigError(f"{name} must be an integer, got {v!r}")
            if v < 0:
                raise ConfigError(f"{name} must be >= 0, got {v!r}")
        for name in ("max_num_seqs", "kv_cache_tokens", "max_model_len", "output_len_min"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.output_len_max < self.output_len_min:
            raise ConfigError(f"output_len_max ({self.output_len_max}) must be >= output_len_min ({self.output_len_min})")
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model must be a non-empty string")
        if self.api_key is not None and not isinstance(self.api_key, str):
            raise ConfigError("api_key must be a string or null")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        for name in ("unhealthy", "hang", "tool_calls"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.fault_rates = parse_fault_rates(self.fault_rates)
        if not isinstance(self.admin_faults, dict):
            raise ConfigError(f"admin_faults must be an object {{route: fault}}, got {self.admin_faults!r}")
        for k, v in self.admin_faults.items():
            if k not in ADMIN_ROUTES:
                raise ConfigError(f"admin_faults: unknown route {k!r}; known routes: {', '.join(ADMIN_ROUTES)}")
            if v not in ADMIN_FAULT_TYPES:
                raise ConfigError(f"admin_faults: fault for {k!r} must be one of {', '.join(ADMIN_FAULT_TYPES)}, got {v!r}")
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if d["api_key"] is not None:
            d["api_key"] = "***"  # never echoed back
        return d

    def updated(self, changes: dict) -> "SimConfig":
        """A validated copy with `changes` applied (the /admin/config semantics)."""
        if not isinstance(changes, dict):
            raise ConfigError("the body must be a JSON object of knobs")
        known = {f.name: f for f in dataclasses.fields(self)}
        for k in changes:
            if k not in known:
                raise ConfigError(f"unknown knob {k!r}; known knobs: {', '.join(sorted(known))}")
            if not known[k].metadata.get("runtime", True):
                raise ConfigError(f"knob {k!r} can only be set on the command line")
        new = dataclasses.replace(self, **changes)
        # JSON gives ints for floats ("ttft_ms": 5): accept them; refuse floats for int knobs.
        for f in dataclasses.fields(new):
            v = getattr(new, f.name)
            if f.type == "float" and isinstance(v, int) and not isinstance(v, bool):
                setattr(new, f.name, float(v))
        return new.validate()


def parse_fault_rates(spec: Any) -> dict[str, float]:
    """'429=0.05,500=0.01' or {"429": 0.05} -> {"429": 0.05, "500": 0.01}, validated."""
    if spec is None or spec == "":
        return {}
    if isinstance(spec, str):
        out: dict[str, Any] = {}
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ConfigError(f"fault rate {part!r} must look like TYPE=RATE, e.g. 429=0.05")
            k, v = part.split("=", 1)
            try:
                out[k.strip()] = float(v)
            except ValueError:
                raise ConfigError(f"fault rate for {k.strip()!r} must be a number, got {v!r}") from None
        spec = out
    if not isinstance(spec, dict):
        raise ConfigError(f"fault_rates must be 'TYPE=RATE,...' or an object, got {spec!r}")
    rates: dict[str, float] = {}
    for k, v in spec.items():
        k = str(k)
        if k not in FAULT_TYPES:
            raise ConfigError(f"unknown fault type {k!r}; known types: {', '.join(FAULT_TYPES)}")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v or not 0 <= v <= 1:
            raise ConfigError(f"fault rate for {k!r} must be between 0 and 1, got {v!r}")
        if v > 0:
            rates[k] = float(v)
    if sum(rates.values()) > 1 + 1e-9:
        raise ConfigError(f"fault rates sum to {sum(rates.values()):.3f}, more than 1")
    return rates
