"""python manage.py collect_rollouts +key=value ...  — a drop-in for NeMo Gym's ng_collect_rollouts.

    python manage.py collect_rollouts \\
        +agent_name=my_agent \\
        +input_jsonl_fpath=data/demo_math.jsonl +output_jsonl_fpath=/tmp/rollouts.jsonl \\
        +limit=100 +num_repeats=2 +num_samples_in_parallel=16 \\
        +responses_create_params.max_output_tokens=256 +responses_create_params.temperature=0.7 \\
        +model_base_url=http://127.0.0.1:8000/v1 +model_name=Qwen/Qwen3-0.6B +verifier=math

The input is loaded as a dataset (a file with the same sha256 is reused), the endpoint is found or
created, and the run is a CollectionJob in the database, executed in this process with a progress bar.
The job's idempotency key is derived from the resolved arguments and the input's sha256, so RERUNNING
THE SAME COMMAND RESUMES the same job (exactly-once: nothing is lost or duplicated); a completed job
just writes its output again. Ctrl-C pauses the job; rerun to resume.

Output, NeMo Gym style: <out>.jsonl (successful rows), <out>_failures.jsonl (failed rows with
failure_class and error) and <out>_aggregate_metrics.json. The files are rewritten whole from the
database on every run (not appended), so they always hold the job's complete result.
Exit status: 0 when the job completed, 1 when it failed (or bad arguments / rejected input),
2 when it ended otherwise (cancelled, paused by someone else), 130 on Ctrl-C.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from django.core.management.base import BaseCommand, CommandError

# --- the keys ------------------------------------------------------------------------------------


@dataclass
class Key:
    name: str
    kind: str  # path | int | int_or_null | float | str | bool | choice | list | dict
    help: str
    default: Any = None
    minimum: float | None = None
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
    Key("limit", "int_or_null", "keep the first N input rows", None, minimum=1),
    Key("num_repeats", "int", "rollouts per input row (order a a b b ...)", 1, minimum=1),
    Key("num_samples_in_parallel", "int", "requests in flight at most", 16, minimum=1),
    Key("responses_create_params.<param>", "dict", "override merged into every row's responses_create_params, "
        "e.g. +responses_create_params.max_output_tokens=256 +responses_create_params.temperature=0.7 "
        "(top_p, service_tier, ...)", None),
    Key("verifier", "choice", "how rollouts are scored", "math", choices=()),  # choices filled lazily
    Key("verify_mode", "choice", "inline: verify as rows arrive; fast: cheap heuristic; deferred: collect now, verify later",
        "inline", choices=("inline", "fast", "deferred")),
    Key("verifier_options.<option>", "dict", "options passed to the verifier", None),
    Key("chunk_size", "int", "dataset rows per chunk (unit of resume)", 5000, minimum=1),
    Key("name", "str", "job name (default: agent_name or the input file name)", "", identity=False),
    Key("accept_partial", "bool", "load only the good lines of an input with bad lines (else it is rejected)", False,
        group="input", identity=False),
    Key("resume", "bool", "rerunning resumes the same job; false starts a fresh job", True, identity=False),
    Key("owner", "str", "username owning the dataset, endpoint and job (default: none)", "", identity=True),
    Key("prewarm", "int", "send N tiny requests to the endpoint before collecting", 0, minimum=0, identity=False),
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
        return value
    if key.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ArgError(f"+{n} must be a number, got {json.dumps(value)}")
        if key.minimum is not None and value < key.minimum:
            raise ArgError(f"+{n} must be > 0, got {value}")
        return float(value)
    if key.kind == "bool":
        if not isinstance(value, bool):
            raise ArgError(f"+{n} must be true or false, got {json.dumps(value)}")
        return value
    if key.kind == "choice":
        choices = verifiers if n == "verifier" else key.choices
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
        head, _, rest = key.partition(".")
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


# --- the command ---------------------------------------------------------------------------------


class Command(BaseCommand):
    help = ("Collect rollouts like NeMo Gym's ng_collect_rollouts (+key=value arguments), as a job in the "
            "database with a progress bar. Rerunning the same command resumes it.")

    def create_parser(self, prog_name, subcommand, **kwargs):
        import argparse

        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.formatter_class = argparse.RawDescriptionHelpFormatter
        parser.epilog = (keys_help() + "\n\nValues are parsed as JSON when they can be (numbers, true/false, null, "
                         "lists, objects), else taken as strings. Rerunning the same command resumes the same job; "
                         "+resume=false starts a fresh one. Exit status: 0 completed, 1 failed, 2 cancelled/paused, "
                         "130 interrupted (the job is paused; rerun to resume).")
        return parser

    def add_arguments(self, parser):
        parser.add_argument("overrides", nargs="*", metavar="+key=value", help="see the keys below")

    # -- helpers --
    def _fail(self, message: str, code: int = 1, with_keys: bool = False):
        if with_keys:
            message = f"{message}\n\nValid keys:\n{keys_help()}\n\nSee --help."
        raise CommandError(message, returncode=code)

    def _owner(self, cfg):
        if not cfg.get("owner"):
            return None
        from django.contrib.auth import get_user_model

        User = get_user_model()
        try:
            return User.objects.get(username=cfg["owner"])
        except User.DoesNotExist:
            self._fail(f"+owner: no such user {cfg['owner']!r}")

    def _dataset(self, cfg, owner):
        from controlplane.datasets.services import DatasetValidationError, find_by_sha256, ingest_jsonl
        from workers.nemo_jsonl import file_sha256, format_report

        path = cfg["input_jsonl_fpath"]
        if not os.path.isfile(path):
            self._fail(f"+input_jsonl_fpath: no such file: {path}")
        sha, size = file_sha256(path)
        ds = find_by_sha256(owner, sha)
        if ds is not None:
            self.stderr.write(f"Input: dataset {ds.pk} '{ds.name}' ({ds.row_count} rows, sha256 {sha[:12]}) reused")
            return ds
        try:
            ds = ingest_jsonl(path, name=os.path.basename(path), owner=owner, accept_partial=cfg["accept_partial"])
        except DatasetValidationError as exc:
            self.stderr.write(format_report(exc.report, max_lines=200))
            some_good = exc.report.get("good_rows", 0) > 0
            hint = "" if cfg["accept_partial"] or not some_good else " (+accept_partial=true keeps only the good lines)"
            self._fail(f"+input_jsonl_fpath {path}: {exc.message}{hint}")
        note = f", {ds.bad_line_count} bad line(s) skipped" if ds.bad_line_count else ""
        self.stderr.write(f"Input: dataset {ds.pk} '{ds.name}' loaded ({ds.row_count} rows{note}, sha256 {sha[:12]})")
        if ds.bad_line_count:
            self.stderr.write(format_report(ds.validation_report, max_lines=20))
        return ds

    def _ensure_schema(self):
        """A fresh checkout's embedded SQLite database is created and migrated here; any other database with
        migrations not applied is an error that says what to run."""
        from django.conf import settings
        from django.core.management import call_command
        from django.db import connection
        from django.db.migrations.executor import MigrationExecutor

        executor = MigrationExecutor(connection)
        plan = executor.migration_plan(executor.loader.graph.leaf_nodes())
        if not plan:
            return
        db = settings.DATABASES["default"]
        if db["ENGINE"].endswith("sqlite3") and Path(str(db["NAME"])).parent == Path(settings.VAR_DIR):
            self.stderr.write(f"Setting up the embedded database {db['NAME']} ({len(plan)} migrations) ...")
            call_command("migrate", interactive=False, verbosity=0)
            return
        self._fail(f"the database has {len(plan)} migration(s) not applied: run `python manage.py migrate` first")

    def _only_model(self, base: str, cfg) -> str:
        """The one model the server lists at /v1/models (+model_name was not given)."""
        from controlplane.endpoints.services import served_models

        try:
            models = served_models(base, cfg.get("api_key"), timeout=min(30.0, cfg.get("request_timeout_s") or 30.0))
        except ValueError as exc:
            self._fail(f"+model_name not given, and {base}/v1/models could not list the served models ({exc}); "
                       "give +model_name")
        if len(models) != 1:
            listed = ", ".join(models[:10]) if models else "none"
            self._fail(f"+model_name not given, and {base} serves {len(models)} models ({listed}); pick one with +model_name")
        self.stderr.write(f"Model: {models[0]} (the one model {base} serves)")
        return models[0]

    def _endpoint(self, cfg, owner):
        from controlplane.endpoints.models import Endpoint
        from controlplane.endpoints.services import normalize_base_url

        if cfg.get("_nemo_gym"):
            from workers.nemo_gym.deployment import head_url

            head = head_url(cfg["head_server"].get("host"), cfg["head_server"].get("port"))
            lookup = dict(kind=Endpoint.Kind.NEMO_GYM, base_url=head, model_name=cfg["agent_name"] or "")
            qs = Endpoint.objects.filter(**lookup)
            qs = qs.filter(owner=owner) if owner else qs.filter(owner__isnull=True)
            ep = qs.order_by("pk").first() or Endpoint(
                owner=owner, name=f"NeMo Gym {cfg['agent_name'] or 'agents'} @ {head}"[:200], **lookup)
        elif cfg.get("endpoint"):
            qs = Endpoint.objects.filter(name=cfg["endpoint"])
            ep = (qs.filter(owner=owner) if owner else qs.filter(owner__isnull=True)).first() or qs.first()
            if ep is None:
                self._fail(f"+endpoint: no endpoint named {cfg['endpoint']!r}")
        else:
            base = normalize_base_url(cfg["model_base_url"])
            if not base.startswith(("http://", "https://")):
                self._fail(f"+model_base_url must start with http:// or https://, got {cfg['model_base_url']!r}")
            if not cfg.get("model_name"):
                cfg["model_name"] = self._only_model(base, cfg)
            lookup = dict(base_url=base, model_name=cfg["model_name"], api_flavor=cfg["api_flavor"])
            qs = Endpoint.objects.filter(**lookup)
            qs = qs.filter(owner=owner) if owner else qs.filter(owner__isnull=True)
            ep = qs.order_by("pk").first()
            if ep is None:
                ep = Endpoint(owner=owner, name=f"{cfg['model_name']} @ {base}"[:200], **lookup)
        changed = ep.pk is None
        for field, key in ((("kind", "endpoint_kind"),) if not cfg.get("_nemo_gym") else ()) + (("api_key", "api_key"), ("request_timeout_s", "request_timeout_s"),
                           ("connect_timeout_s", "connect_timeout_s"), ("max_retries", "max_retries"),
                           ("rpm_limit", "rpm_limit"), ("tpm_limit", "tpm_limit")):
            given = key in cfg["_given"]
            if (given or ep.pk is None) and cfg.get(key) is not None and getattr(ep, field) != cfg[key]:
                setattr(ep, field, cfg[key])
                changed = True
        if cfg.get("replica_urls") is not None:
            reps = [normalize_base_url(u) for u in cfg["replica_urls"]]
            if reps != ep.replica_urls:
                ep.replica_urls = reps
                changed = True
        if changed:
            ep.save()
        return ep

    # -- main --
    def handle(self, *args, overrides, verbosity=1, **options):
        if not overrides:
            self._fail("no arguments: at least +input_jsonl_fpath, +output_jsonl_fpath and +model_base_url are needed",
                       with_keys=True)
        try:
            cfg = parse_overrides(overrides)
        except ArgError as exc:
            self._fail(str(exc), with_keys=True)
        if verbosity < 2:  # keep the progress bar readable: the runtime's INFO lines go only with -v 2
            for name in ("controlplane.jobs", "workers", "httpx", "celery"):
                logging.getLogger(name).setLevel(logging.WARNING)

        self._ensure_schema()
        from controlplane.jobs.export import write_export
        from controlplane.jobs.models import CollectionJob, JobState
        from controlplane.jobs.runtime import run_job_inline
        from controlplane.jobs.services import get_or_create_job

        out_path = Path(cfg["output_jsonl_fpath"])
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail(f"+output_jsonl_fpath: cannot create {out_path.parent}: {exc}")

        owner = self._owner(cfg)
        dataset = self._dataset(cfg, owner)
        endpoint = self._endpoint(cfg, owner)
        ep_ident = {"base_urls": endpoint.all_base_urls, "model": endpoint.model_name, "api_flavor": endpoint.api_flavor}
        if endpoint.is_nemo_gym:
            ep_ident["kind"] = endpoint.kind
        key = idempotency_key(cfg, dataset.sha256, ep_ident)
        if not cfg["resume"]:
            key = key[:60] + ":" + hashlib.sha256(f"{time.time_ns()}".encode()).hexdigest()[:16]

        from django.core.exceptions import ValidationError

        name = cfg["name"] or cfg["agent_name"] or Path(cfg["input_jsonl_fpath"]).stem
        try:
            job, created = get_or_create_job(
                owner=owner, dataset=dataset, endpoint=endpoint, limit=cfg["limit"], num_repeats=cfg["num_repeats"],
                num_samples_in_parallel=cfg["num_samples_in_parallel"],
                responses_create_params=cfg["responses_create_params"], verifier=cfg["verifier"],
                verifier_options=cfg["verifier_options"], verify_mode=cfg["verify_mode"], chunk_size=cfg["chunk_size"],
                name=(f"cli: {name}")[:200], idempotency_key=key, output_path=str(out_path.resolve()), launch=False,
            )
        except ValidationError as exc:
            self._fail(f"invalid job: {'; '.join(f'{k}: {v}' for k, v in exc.message_dict.items())}")
        if not created:
            self.stderr.write(f"Job {job.pk}: resuming ({job.state}, {job.done_count}/{job.total_rollouts} rollouts already stored)"
                              if job.state != JobState.COMPLETED else
                              f"Job {job.pk}: already completed ({job.done_count}/{job.total_rollouts}); writing its output")
        else:
            self.stderr.write(f"Job {job.pk}: {job.total_rollouts} rollouts ({dataset.row_count if not cfg['limit'] else min(cfg['limit'], dataset.row_count)} "
                              f"rows x {cfg['num_repeats']}) against {endpoint.model_name} @ {endpoint.base_url}")

        if cfg["prewarm"] and job.state != JobState.COMPLETED:
            from controlplane.endpoints.services import prewarm

            res = prewarm(endpoint, n=cfg["prewarm"])
            self.stderr.write(f"Pre-warm: {res['succeeded']}/{res['sent']} ok" +
                              (f" ({'; '.join(res['errors'][:2])})" if res["errors"] else ""))

        done_before = job.done_count
        t0 = time.monotonic()
        run_stats = {"lease_wait_s": 0.0}
        if job.state != JobState.COMPLETED:
            job = self._run(job, run_job_inline, run_stats)
        # a wait for a previous run's lease to expire (a run killed without a chance to release its chunks) is
        # not collection time
        self._lease_wait_s = run_stats["lease_wait_s"]
        elapsed = time.monotonic() - t0 - self._lease_wait_s

        job.refresh_from_db()
        if job.output_path != str(out_path.resolve()):
            CollectionJob.objects.filter(pk=job.pk).update(output_path=str(out_path.resolve()))
        res = write_export(job, out_path)
        from controlplane.jobs.nemo_gym import write_materialized_inputs

        res["materialized_inputs"] = str(write_materialized_inputs(job, out_path, cfg["agent_name"] or None))
        self._summary(job, res, elapsed, job.done_count - done_before)
        if job.state == JobState.FAILED:
            self._fail(f"job {job.pk} failed: {job.error_message or 'no message'}\n"
                       "Rerun the same command to resume it (stored rollouts are kept).", code=1)
        if job.state != JobState.COMPLETED:
            self._fail(f"job {job.pk} ended {job.state}; rerun the same command to resume it.", code=2)

    def _run(self, job, run_job_inline: Callable, run_stats: dict):
        from tqdm import tqdm

        bar = tqdm(total=job.total_rollouts, initial=job.done_count, desc="Collecting rollouts", file=sys.stderr,
                   dynamic_ncols=True, smoothing=0.1, mininterval=0.25)
        failed_seen = [job.failed_count]

        def on_progress(payload: dict):
            done = int(payload.get("done") or 0)
            if done > bar.n:
                bar.update(done - bar.n)
            failed = int(payload.get("failed") or 0)
            if failed != failed_seen[0]:
                failed_seen[0] = failed
                bar.set_postfix(failed=failed, refresh=False)

        import signal
        import threading

        previous = None
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):  # `kill` / tmux kill-session: stop like Ctrl-C (the job is paused)
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGTERM, on_term)
        try:
            job = run_job_inline(job, on_progress=on_progress, stats=run_stats)
        except KeyboardInterrupt:
            bar.close()
            job.refresh_from_db()
            self.stderr.write(f"\nInterrupted: job {job.pk} is {job.state} with {job.done_count}/{job.total_rollouts} "
                              "rollouts stored. Rerun the same command to resume.")
            raise CommandError("interrupted", returncode=130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        job.refresh_from_db()
        if job.done_count > bar.n:
            bar.update(job.done_count - bar.n)
        bar.close()
        return job

    def _summary(self, job, res, elapsed, collected_now):
        agg = job.aggregate_metrics or {}
        reward = agg.get("mean/reward")
        if reward is None:
            from django.db.models import Avg

            from controlplane.jobs.models import Rollout

            reward = Rollout.objects.filter(job=job, status=Rollout.Status.OK).aggregate(r=Avg("reward"))["r"]
        rate = collected_now / elapsed if elapsed > 0 and collected_now else 0.0
        lines = [
            f"Job {job.pk} {job.state}: {job.completed_count} ok, {job.failed_count} failed of {job.total_rollouts}",
            f"This run: {collected_now} rollouts in {elapsed:.1f}s ({rate:.2f} samples/s)"
            + (f"; waited {self._lease_wait_s:.0f}s before for a previous run's lease to expire"
               if getattr(self, "_lease_wait_s", 0) >= 1 else ""),
            f"Mean reward: {reward:.4f}" if isinstance(reward, (int, float)) else "Mean reward: n/a",
            f"Rollouts:          {res['output']} ({res['ok_rows']} rows)",
            f"Failures:          {res['failures']} ({res['failed_rows']} rows)",
            f"Aggregate metrics: {res['aggregate_metrics']}",
            f"Materialized inputs: {res['materialized_inputs']}",
        ]
        if job.failed_count:
            from django.db.models import Count

            from controlplane.jobs.models import Rollout

            by_class = dict(Rollout.objects.filter(job=job, status=Rollout.Status.FAILED).values_list("failure_class")
                            .annotate(n=Count("id")).order_by())
            lines.insert(1, "Failures by class: " + ", ".join(f"{k or 'unknown'}={v}" for k, v in sorted(by_class.items())))
        self.stdout.write("\n".join(lines))
