"""The +key=value arguments of `manage.py collect_rollouts` (NeMo Gym's ng_collect_rollouts keys): the key
table (`KEYS`: kind, default, bounds, group, aliases, whether the key is part of the job's identity), the
parsing and checking of the tokens into one resolved config (`parse_overrides`, ArgError with a clear
message), the help text (`keys_help`) and the job's idempotency key derived from the resolved config
(`idempotency_key`: rerunning the same command resumes the same job).

What the keys mean beyond a job column (num_repeats per agent, prompt_config, skills, resume_from_cache) is
in controlplane.jobs.dropin; the command (management/commands/collect_rollouts.py) does the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any

from .dropin import DropinError, check_repeats, hydra_dict


@dataclass
class Key:
    name: str
    kind: str  # path | int | int_or_null | float | str | bool | choice | list | dict
    help: str
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple = ()
    group: str = "collection"
    aliases: tuple = ()
    identity: bool = True  # part of the job's idempotency key


def _verifier_names():
    try:
        from workers.verifiers import VERIFIERS

        return tuple(sorted(VERIFIERS))
    except Exception:  # pragma: no cover
        return ("math", "exact", "normalized", "none")


KEYS: list[Key] = [
    Key("input_jsonl_fpath", "path", "NeMo Gym JSONL task file (required)"),
    Key("output_jsonl_fpath", "path", "where to write the rollouts (required); _failures.jsonl and "
        "_aggregate_metrics.json are written beside it"),
    Key("agent_name", "str", "NeMo Gym agent to send rows to (POST /run), found through the head server; rows with "
        "their own agent_ref go to that agent. Without +model_base_url the run drives the NeMo Gym deployment", ""),
    Key("head_server.<host|port>", "dict", "NeMo Gym head server (default 127.0.0.1:11000), e.g. "
        "+head_server.host=10.0.0.5 +head_server.port=11000", None, group="endpoint"),
    Key("limit", "int_or_null", "keep the first N input rows (0 or null: all)", None, minimum=0),
    Key("num_repeats", "repeats", "rollouts per input row (order a a b b ...), or a dict per agent, e.g. "
        "+num_repeats={simple_agent: 32, _default: 1} or +num_repeats.simple_agent=32", 1),
    Key("num_repeats_add_seed", "bool", "send each rollout a \"seed\" (its rollout index) in "
        "responses_create_params.metadata.extra_body, honoured by vLLM model servers", False),
    Key("num_samples_in_parallel", "int_or_null", "requests in flight at most (NeMo Gym's default: unbounded; "
        "capped by the product's limits, said in the summary)", None, minimum=1),
    Key("prompt_config", "path", "prompt YAML (user, optional system templates filled from each row's fields) that "
        "builds responses_create_params.input", None),
    Key("skills.<path>", "dict", "+skills.path=DIR: a directory of Agent Skills; its skills_ref is stamped on every row",
        None),
    Key("resume_from_cache", "bool", "take the rollouts already in the output files as done and collect only the "
        "rest (NeMo Gym's resume; rerunning the same command also resumes, from the database)", False),
    Key("disable_aggregation", "bool", "NeMo Gym's: no /aggregate_metrics call to the agents and no "
        "_aggregate_metrics.json (shards aggregated afterwards by `gym eval aggregate`)", False),
    Key("upload_rollouts_to_wandb", "bool", "NeMo Gym's W&B upload (not done here; said once)", True, identity=False),
    Key("rollout_collection_driver", "str", "NeMo Gym's custom driver for `gym eval run` (not used; said once)",
        None, identity=False),
    Key("split", "str", "`gym eval run`'s dataset split (not used; said once)", None, identity=False),
    Key("reuse_existing_data_preparation", "bool", "`gym eval run`'s data preparation (not used; said once)", False,
        identity=False),
    Key("profiling_enabled", "bool", "profile the run's verification while it runs and, on a NeMo Gym "
        "deployment (ng_run started with +profiling_enabled=true), write each of its servers' own profile of the "
        "run, the servers found through the head server", False, identity=False),
    Key("profiling_results_dirpath", "path", "where profiling writes <server>.log, NeMo Gym's format", None,
        identity=False),
    Key("responses_create_params.<param>", "dict", "override merged into every row's responses_create_params, "
        "e.g. +responses_create_params.max_output_tokens=256 +responses_create_params.temperature=0.7 "
        "(top_p, service_tier, ...)", None),
    Key("verifier", "choice", "how rollouts are scored", "math", choices=()),  # choices filled lazily
    Key("verify_mode", "choice", "inline: verify as rows arrive; fast: cheap heuristic; deferred: collect now, verify later",
        "inline", choices=("inline", "fast", "deferred")),
    Key("verifier_options.<option>", "dict", "options passed to the verifier", None),
    Key("chunk_size", "int", "dataset rows per chunk, the unit processes share by lease (unset: one chunk of "
        "the whole input for one process; with engine_processes, 2 chunks a process of at most the default)", 5000,
        minimum=1),
    Key("engine_processes", "int", "run the job's chunks in N processes on this host (this one and N-1 children, "
        "sharing the chunks by lease and the parallelism) when one process's CPU is the limit; with chunk_size "
        "unset the job gets 2 chunks per process", 1, minimum=1, maximum=64, identity=False),
    Key("name", "str", "job name (default: agent_name or the input file name)", "", identity=False),
    Key("accept_partial", "bool", "load only the good lines of an input with bad lines (else it is rejected)", False,
        group="input", identity=False),
    Key("resume", "bool", "rerunning resumes the same job; false starts a fresh job", True, identity=False),
    Key("owner", "str", "username owning the dataset, endpoint and job (default: none)", "", identity=True),
    Key("prewarm", "int", "send N tiny requests to the endpoint before collecting (a NeMo Gym "
        "deployment: POST /run to its agents with the first row)", 0, minimum=0, identity=False),
    Key("model_base_url", "str", "OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 (the /v1 is optional)",
        None, group="endpoint", aliases=("policy_base_url",)),
    Key("model_name", "str", "model name to request (default: the server's model, when /v1/models lists exactly one)",
        None, group="endpoint", aliases=("policy_model_name",)),
    Key("api_flavor", "choice", "API the server speaks", "chat_completions", group="endpoint",
        choices=("chat_completions", "completions", "responses")),
    Key("api_key", "str", "bearer token (stored write-only; not part of the job's identity)", None, group="endpoint",
        aliases=("policy_api_key",), identity=False),
    Key("endpoint_kind", "choice", "vllm (has /health and /metrics) or openai (hosted API)", "vllm", group="endpoint",
        choices=("vllm", "openai")),
    Key("replica_urls", "list", "extra replica base URLs (JSON list or comma-separated)", None, group="endpoint"),
    Key("endpoint", "str", "name of an existing endpoint to use instead of model_base_url/model_name", None,
        group="endpoint"),
    Key("request_timeout_s", "float", "timeout of a whole request", None, minimum=0.001, group="endpoint", identity=False),
    Key("connect_timeout_s", "float", "connect timeout", None, minimum=0.001, group="endpoint", identity=False),
    Key("max_retries", "int", "retries per request before the row is recorded as failed", None, minimum=0,
        group="endpoint", identity=False),
    Key("rpm_limit", "int_or_null", "client-side requests-per-minute limit", None, minimum=1, group="endpoint",
        identity=False),
    Key("tpm_limit", "int_or_null", "client-side tokens-per-minute limit", None, minimum=1, group="endpoint",
        identity=False),
]
KEY_BY_NAME = {k.name.split(".<")[0]: k for k in KEYS}
ALIASES = {a: k.name for k in KEYS for a in k.aliases}
DICT_KEYS = {k.name.split(".<")[0] for k in KEYS if k.kind == "dict"}


class ArgError(ValueError):
    pass


def keys_help() -> str:
    verifiers = _verifier_names()
    lines = []
    for group, title in (("collection", "Collection"), ("input", "Input"), ("endpoint", "Endpoint")):
        lines.append(f"{title} keys:")
        for k in KEYS:
            if k.group != group:
                continue
            choices = verifiers if k.name == "verifier" else k.choices
            extra = []
            if choices:
                extra.append("one of " + "|".join(choices))
            if k.default not in (None, "") and k.kind != "dict":
                extra.append(f"default {json.dumps(k.default)}")
            if k.aliases:
                extra.append("alias " + ", ".join("+" + a for a in k.aliases))
            lines.append(f"  +{k.name}=…  {k.help}" + (f" [{'; '.join(extra)}]" if extra else ""))
    return "\n".join(lines)


def parse_value(text: str) -> Any:
    """JSON when it parses (numbers, true/false/null, lists, objects, quoted strings), else the string."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("null", "none", "~"):
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set_nested(target: dict, path: list[str], value):
    cur = target
    for p in path[:-1]:
        nxt = cur.get(p)
        if not isinstance(nxt, dict):
            nxt = cur[p] = {}
        cur = nxt
    cur[path[-1]] = value


def _check(key: Key, value, verifiers) -> Any:
    n = key.name
    if key.kind in ("int", "int_or_null"):
        if value is None and key.kind == "int_or_null":
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ArgError(f"+{n} must be an integer, got {json.dumps(value)}")
        if key.minimum is not None and value < key.minimum:
            raise ArgError(f"+{n} must be >= {int(key.minimum)}, got {value}")
        if key.maximum is not None and value > key.maximum:
            raise ArgError(f"+{n} must be <= {int(key.maximum)}, got {value}")
        return value
    if key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgError(f"+{n} must be a number, got {json.dumps(value)}")
        if key.minimum is not None and value < key.minimum:
            raise ArgError(f"+{n} must be > 0, got {value}")
        return float(value)
    if key.kind == "repeats":
        try:
            return check_repeats(value)
        except DropinError as exc:
            raise ArgError(str(exc)) from None
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise ArgError(f"+{n} must be true or false, got {json.dumps(value)}")
        return value
    if key.kind == "choice":
        choices = verifiers if n == "verifier" else key.choices
        if value is None and "none" in choices:  # +verifier=none reads as null (as +limit=none does): the choice
            return "none"
        if n == "verifier" and isinstance(value, str) and value not in choices:  # an entry point or dotted path
            from workers.verifiers import get_verifier

            try:
                get_verifier(value)
                return value
            except ValueError as exc:
                raise ArgError(f"+verifier must be one of {', '.join(choices)}, an entry point or a dotted path "
                               f"'module:object', got {json.dumps(value)} ({exc})") from None
        if value not in choices:
            raise ArgError(f"+{n} must be one of {', '.join(choices)}, got {json.dumps(value)}")
        return value
    if key.kind == "list":
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ArgError(f"+{n} must be a list of URLs")
        return value
    if key.kind in ("str", "path"):
        if value is None:
            return None
        if not isinstance(value, str):
            value = json.dumps(value) if not isinstance(value, (int, float)) else str(value)
        return value
    return value


def parse_overrides(tokens: list[str]) -> dict:
    """Parse `+key=value` tokens (also `++key=value` and `key=value`) into a resolved config dict.
    Raises ArgError with a clear message."""
    verifiers = _verifier_names()
    cfg: dict[str, Any] = {}
    given: set[str] = set()
    for token in tokens:
        raw = token.lstrip("+")
        if "=" not in raw:
            raise ArgError(f"argument {token!r} is not of the form +key=value")
        key, value_text = raw.split("=", 1)
        key = key.strip()
        key = ALIASES.get(key, key)
        value = parse_value(value_text)
        if isinstance(value, str) and value.strip().startswith("{"):  # Hydra's {a: 1, b: 2}
            value = hydra_dict(value) if hydra_dict(value) is not None else value
        head, _, rest = key.partition(".")
        if head == "num_repeats" and rest:  # +num_repeats.simple_agent=32
            reps = cfg.get("num_repeats") if isinstance(cfg.get("num_repeats"), dict) else {}
            reps[rest] = value
            cfg["num_repeats"] = _check(KEY_BY_NAME["num_repeats"], reps, verifiers)
            given.add("num_repeats")
            continue
        if head in DICT_KEYS:
            if rest:
                _set_nested(cfg.setdefault(head, {}), rest.split("."), value)
            elif isinstance(value, dict):
                cfg.setdefault(head, {}).update(value)
            else:
                raise ArgError(f"+{head} must be a JSON object, or use +{head}.<param>=value")
            continue
        if key not in KEY_BY_NAME:
            import difflib

            close = difflib.get_close_matches(key, [*KEY_BY_NAME, *ALIASES], n=1)
            raise ArgError(f"unknown key +{key}" + (f" (did you mean +{close[0]}?)" if close else ""))
        given.add(key)
        kdef = KEY_BY_NAME[key]
        if kdef.kind == "path":
            value = value_text  # paths are never parsed as JSON ("+input_jsonl_fpath=1.jsonl")
        cfg[key] = _check(kdef, value, verifiers)
    for k in KEYS:
        name = k.name.split(".<")[0]
        if k.kind == "dict":
            cfg.setdefault(name, {})
        else:
            cfg.setdefault(name, k.default)
    cfg["_given"] = given
    missing = [f"+{k}" for k in ("input_jsonl_fpath", "output_jsonl_fpath") if not cfg.get(k)]
    # a NeMo Gym deployment: an agent name or a head server, and no model server of its own
    cfg["_nemo_gym"] = bool(not cfg.get("endpoint") and not cfg.get("model_base_url")
                            and (cfg.get("agent_name") or cfg.get("head_server")))
    if cfg["_nemo_gym"]:
        bad = set(cfg["head_server"]) - {"host", "port"}
        if bad:
            raise ArgError(f"unknown key +head_server.{sorted(bad)[0]} (host and port are known)")
        port = cfg["head_server"].get("port", 11000)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ArgError(f"+head_server.port must be a port number, got {json.dumps(port)}")
        if "verifier" not in given:
            cfg["verifier"] = "none"  # the agent's resources server verifies
    elif not cfg.get("endpoint"):
        missing += [f"+{k}" for k in ("model_base_url",) if not cfg.get(k)]  # the model name comes from /v1/models when it serves one
    if missing:
        raise ArgError("missing required key(s): " + ", ".join(missing))
    rcp = cfg["responses_create_params"]
    if rcp:
        from workers.nemo_jsonl import check_optional_params

        err = check_optional_params(rcp)
        if err:
            raise ArgError(f"+{err}")
        if "input" in rcp:
            raise ArgError("+responses_create_params.input cannot be overridden (it comes from each row)")
    return cfg


def idempotency_key(cfg: dict, dataset_sha256: str, endpoint_identity: dict) -> str:
    """cli:<sha256> over the resolved arguments that define the run (not secrets or operational knobs)."""
    ident = {k.name.split(".<")[0]: cfg.get(k.name.split(".<")[0]) for k in KEYS
             if k.identity and k.group != "endpoint" and k.name not in ("input_jsonl_fpath",)}
    ident["output_jsonl_fpath"] = os.path.abspath(cfg["output_jsonl_fpath"])
    ident["dataset_sha256"] = dataset_sha256
    ident["endpoint"] = endpoint_identity
    blob = json.dumps(ident, sort_keys=True, separators=(",", ":"), default=str)
    return "cli:" + hashlib.sha256(blob.encode()).hexdigest()
