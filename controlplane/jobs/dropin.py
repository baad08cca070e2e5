"""The keys of NeMo Gym's ng_collect_rollouts (nemo-gym 0.4.0's RolloutCollectionConfig and
SharedRolloutCollectionConfig) that need more than a job column, for the collect_rollouts command:

- `num_repeats` as a dict per agent (`{simple_agent: 32, _default: 1}`): checked as NeMo Gym does (every
  agent of the rows has an entry or `_default` exists; values >= 1) and resolved to one count when every row
  gets the same, else kept in `collection_options["repeats_by_agent"]` (workers.engine.materialize.row_repeats).
- `prompt_config`: the YAML's `system` / `user` templates filled from each row's fields (str.format_map) into
  responses_create_params.input, before the input is loaded, exactly as nemo_gym.prompt.apply_prompt_to_row.
- `skills` (`+skills.path=DIR`): NeMo Gym's skills_ref (name, hash and skills of the directory) stamped on
  every row.
- `resume_from_cache`: the rollouts already in the output files (the whole files, as NeMo Gym's resume reads
  them) are imported into the job, so they are not collected again (import_cache).
- keys that cannot apply here say why, once (notes()).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

MAX_ROLLOUT_ATTEMPTS = 3  # NeMo Gym's NEMO_GYM_MAX_ROLLOUT_ATTEMPTS default: failures retried on resume below it


def max_rollout_attempts() -> int:
    """NEMO_GYM_MAX_ROLLOUT_ATTEMPTS (a positive int), else 3, as nemo-gym 0.4.0's _get_max_rollout_attempts."""
    try:
        n = int(os.environ.get("NEMO_GYM_MAX_ROLLOUT_ATTEMPTS") or MAX_ROLLOUT_ATTEMPTS)
    except ValueError:
        return MAX_ROLLOUT_ATTEMPTS
    return n if n >= 1 else MAX_ROLLOUT_ATTEMPTS


class DropinError(ValueError):
    pass


# ------------------------------------------------------------------------------------------ values
def hydra_dict(text: str):
    """Hydra's `{a: 1, b: 2}` (unquoted keys) as a dict, or None when it is not one."""
    t = text.strip()
    if not (t.startswith("{") and t.endswith("}")):
        return None
    out = {}
    body = t[1:-1].strip()
    if not body:
        return out
    for part in body.split(","):
        if ":" not in part:
            return None
        k, v = part.split(":", 1)
        k, v = k.strip().strip("'\""), v.strip()
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v.strip("'\"")
    return out


def check_repeats(value):
    """NeMo Gym's num_repeats: an int >= 1 (null: 1) or {agent: int >= 1}. Raises DropinError."""
    if value is None:
        return 1
    if isinstance(value, dict):
        bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, int) or v < 1}
        if bad or not value:
            raise DropinError(f"+num_repeats dict values must be integers >= 1, got {json.dumps(bad or value)}")
        return dict(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise DropinError(f"+num_repeats must be an integer or a dict per agent ({{agent: n, _default: n}}), "
                          f"got {json.dumps(value)}")
    if value < 1:
        raise DropinError(f"+num_repeats must be >= 1, got {value}")
    return value


def resolve_repeats(num_repeats, rows, default_agent: str | None) -> tuple[int, dict, list[str]]:
    """(job's num_repeats, collection options, warnings) for NeMo Gym's num_repeats over the input rows."""
    if isinstance(num_repeats, int):
        return num_repeats, {}, []
    per_agent = {k: v for k, v in num_repeats.items() if k != "_default"}
    default = num_repeats.get("_default")
    seen, missing, counts = set(), set(), set()
    for row in rows:
        ref = row.get("agent_ref")
        name = (ref.get("name") if isinstance(ref, dict) else None) or default_agent
        if name is None:
            continue  # the row names no agent: the run records it (as NeMo Gym refuses it)
        seen.add(name)
        n = per_agent.get(name, default)
        if n is None:
            missing.add(name)
        else:
            counts.add(n)
    if missing:
        raise DropinError(f"num_repeats dict has no entry for agents {sorted(missing)} and no '_default' fallback. "
                          f"Listed agents: {sorted(per_agent)}")
    warnings = []
    if unknown := set(per_agent) - seen:
        warnings.append(f"num_repeats dict contains agent names that never appeared in input rows (possible "
                        f"typo?): {sorted(unknown)}")
    if len(counts) <= 1:
        return (counts.pop() if counts else 1), {}, warnings
    return max(counts), {"repeats_by_agent": dict(num_repeats), "default_agent": default_agent}, warnings


def job_repeats(cfg: dict, dataset, endpoint) -> tuple[int, dict, int, list[str]]:
    """(job's num_repeats, collection options, total rollouts, lines to print) for NeMo Gym's num_repeats."""
    from controlplane.datasets.services import iter_task_rows
    from workers.engine.materialize import row_repeats

    n_rows = min(cfg["limit"], dataset.row_count) if cfg["limit"] else dataset.row_count
    if isinstance(cfg["num_repeats"], int):
        return cfg["num_repeats"], {}, n_rows * cfg["num_repeats"], []
    default_agent = cfg["agent_name"] or (endpoint.model_name if endpoint.is_nemo_gym else None) or None
    rows = (row for _t, _o, row in iter_task_rows(dataset, 0, n_rows))
    n, options, warnings = resolve_repeats(cfg["num_repeats"], rows, default_agent)
    said = [f"Warning: {w}" for w in warnings] + [f"Per-agent num_repeats: {json.dumps(cfg['num_repeats'])}"]
    if not options:
        return n, {}, n_rows * n, said
    per_row = row_repeats(n, options)
    return n, options, sum(per_row(row) for _t, _o, row in iter_task_rows(dataset, 0, n_rows)), said


def parallelism(asked: int | None, owner, total: int) -> tuple[int, str]:
    """Requests in flight: +num_samples_in_parallel, or NeMo Gym's default (unbounded: every rollout at once),
    capped by the product's limits. Returns (parallelism, what capped it, or "")."""
    from django.conf import settings

    want = asked or max(1, total)
    caps = [(settings.JOBS_MAX_PARALLELISM, f"JOBS_MAX_PARALLELISM={settings.JOBS_MAX_PARALLELISM}")]
    if owner is not None:
        from controlplane.limits import active_work

        _n, used = active_work(owner)
        caps.append((max(1, settings.JOBS_MAX_PARALLELISM_PER_USER - used),
                     f"{owner.username}'s JOBS_MAX_PARALLELISM_PER_USER={settings.JOBS_MAX_PARALLELISM_PER_USER} "
                     f"({used} in use)"))
    cap, why = min(caps)
    if want <= cap:
        return want, ""
    return cap, f"{f'+num_samples_in_parallel={asked}' if asked else 'NeMo Gym default: unbounded'}; capped by {why}"


# ------------------------------------------------------------------------------------ input rewrites
def _fill(template: str, row: dict, path: str) -> str:
    try:
        return template.format_map(row)
    except KeyError as exc:
        raise DropinError(f"+prompt_config {path}: the template references field {exc} but the data row only has "
                          f"fields: {list(row)}") from None


def load_prompt(path: str) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise DropinError(f"+prompt_config: no such file: {path}")
    with open(path) as f:
        data = yaml.safe_load(f)
    if not isinstance(data, dict) or not isinstance(data.get("user"), str) or (
            data.get("system") is not None and not isinstance(data["system"], str)):
        raise DropinError(f"+prompt_config {path}: needs a string 'user' template (and optionally 'system')")
    return {"user": data["user"], "system": data.get("system")}


def apply_prompt(row: dict, prompt: dict, path: str) -> dict:
    messages = []
    if prompt["system"] is not None:
        messages.append({"role": "system", "content": _fill(prompt["system"], row, path)})
    messages.append({"role": "user", "content": _fill(prompt["user"], row, path)})
    rcp = row.get("responses_create_params")
    rcp = dict(rcp) if isinstance(rcp, dict) else {}
    rcp["input"] = messages
    return {**row, "responses_create_params": rcp}


def _skill_md(md: Path) -> dict:
    import yaml

    lines = md.read_text(encoding="utf-8-sig", errors="replace").splitlines()
    close = next((i for i in range(1, len(lines)) if lines[i].strip() == "---"), None) if lines and \
        lines[0].strip() == "---" else None
    if close is None:
        raise DropinError(f"Skill file {md} is missing a YAML frontmatter block ('---' lines with name: and "
                          "description:)")
    try:
        data = yaml.safe_load("\n".join(lines[1:close])) or {}
    except yaml.YAMLError as exc:
        raise DropinError(f"Skill file {md} has malformed YAML frontmatter: {exc}") from None
    if not isinstance(data, dict) or not data.get("name"):
        raise DropinError(f"Skill file {md} frontmatter is missing a required 'name' field.")
    meta = data.get("metadata")
    version = str(meta["version"]) if isinstance(meta, dict) and meta.get("version") is not None else None
    return {"name": str(data["name"]), "description": data.get("description"), "version": version}


def skills_ref(path: str) -> dict:
    """NeMo Gym's skills_ref (nemo_gym.skills.load_skill_directory): the path as given, a short sha256 over the
    directory's files (relative path and bytes, in sorted order) and each skill's SKILL.md front matter."""
    root = Path(path)
    if not root.is_dir():
        raise DropinError(f"+skills.path: not a directory of skill directories: {path}")
    digest = hashlib.sha256()
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        digest.update(p.relative_to(root).as_posix().encode())
        digest.update(b"\0")
        digest.update(p.read_bytes())
        digest.update(b"\0")
    skills = []
    for d in sorted(q for q in root.iterdir() if q.is_dir()):
        if not (d / "SKILL.md").is_file():
            raise DropinError(f"Skill directory {d} is missing a SKILL.md file.")
        skills.append(_skill_md(d / "SKILL.md"))
    if not skills:
        raise DropinError(f"Skills path {root} contains no skills (subdirectories with a SKILL.md).")
    return {"path": path, "hash": digest.hexdigest()[:12], "skills": skills}


def rewrite_input(path: str, *, prompt_path: str | None, skills_path: str | None) -> tuple[str, list[str]]:
    """The input file with prompt_config and skills applied (a new file under a temporary directory), or `path`
    itself when neither is given. Raises DropinError as NeMo Gym does (rows that already have an input)."""
    if not prompt_path and not skills_path:
        return path, []
    prompt = load_prompt(prompt_path) if prompt_path else None
    skills = skills_ref(skills_path) if skills_path else None
    said, conflicting = [], []
    out = Path(tempfile.mkdtemp(prefix="collect-rollouts-")) / Path(path).name
    with open(path, encoding="utf-8") as src, open(out, "w", encoding="utf-8") as dst:
        for i, line in enumerate(src):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                dst.write(line if line.endswith("\n") else line + "\n")  # the loader reports it
                continue
            if isinstance(row, dict) and prompt is not None:
                if (row.get("responses_create_params") or {}).get("input"):
                    conflicting.append(i)
                    continue
                row = apply_prompt(row, prompt, prompt_path)
            if isinstance(row, dict) and skills is not None:
                row["skills_ref"] = skills
            dst.write(json.dumps(row, ensure_ascii=False) + "\n")
    if conflicting:
        raise DropinError("Some rows have responses_create_params.input but prompt_config is also specified. These "
                          f"are mutually exclusive. Use one or the other. Violating rows: {conflicting[:20]}")
    if prompt_path:
        said.append(f"Using prompt config: {prompt_path}")
    if skills:
        said.append(f"Using skills from {skills_path} (hash={skills['hash']}, {len(skills['skills'])} skill(s))")
    return str(out), said


# ------------------------------------------------------------------------------------------ notes
NOT_APPLIED = {
    "upload_rollouts_to_wandb": "this product does not upload to Weights & Biases (NeMo Gym uploads only when a "
                                "W&B run is configured); the rollouts are in the output file and on the job page",
    "rollout_collection_driver": "a custom driver replaces NeMo Gym's own collection loop in `gym eval run`; "
                                 "ng_collect_rollouts does not use it either, and here the product's engine collects",
    "split": "it picks the prepared dataset split of `gym eval run`; ng_collect_rollouts does not use it, the "
             "input is +input_jsonl_fpath",
    "reuse_existing_data_preparation": "it belongs to `gym eval run`'s data preparation; the input is "
                                       "+input_jsonl_fpath",
}


def notes(cfg: dict) -> list[str]:
    """One line per NeMo Gym key given that cannot apply here, saying why (the run goes on)."""
    out = []
    for key, why in NOT_APPLIED.items():
        if key in cfg["_given"] and (key != "upload_rollouts_to_wandb" or cfg.get(key)):
            out.append(f"Note: +{key} is not applied: {why}.")
    return out


# -------------------------------------------------------------------------------------- resume cache
def _keys_of(path: Path):
    if not path.exists():
        return
    with open(path, "rb") as f:
        for line in f:
            try:
                row = json.loads(line)
                yield (int(row["_ng_task_index"]), int(row["_ng_rollout_index"])), row
            except (ValueError, KeyError, TypeError):
                continue


NO_PERSIST, TERMINAL = "_ng_no_persist", "_ng_failure_terminal"  # nemo-gym 0.4.0's NG_NO_PERSIST_KEY, NG_TERMINAL_KEY


def ledger(path: Path) -> tuple[dict, set, dict]:
    """NeMo Gym's failures ledger `<out>_failures.jsonl` (one line per failed attempt): (attempts per (task,
    rollout), the pairs a line marks `_ng_failure_terminal`, the last line of each pair)."""
    attempts, terminal, last = {}, set(), {}
    for key, row in _keys_of(path):
        attempts[key] = attempts.get(key, 0) + 1
        last[key] = row
        if row.get(TERMINAL):
            terminal.add(key)
    return attempts, terminal, last


def retry_from_ledger(job, out_path) -> dict:
    """+resume_from_cache on a job that has run before (the same command again), as nemo-gym 0.4.0's
    _load_from_cache: each failed rollout of the job is collected again unless its ledger holds
    max_rollout_attempts() lines for it or marks it `_ng_failure_terminal` (a `_ng_no_persist` failure has no
    line there: it is always retried); a failed rollout whose pair `<out>.jsonl` holds is done (import_cache takes
    it in). The ledger's lines stay where they are: the job's part of the failures file begins after them
    (outfiles, `after_pk`), so each failure of this run is one more line. Returns {"retry": [(task, rollout)],
    "capped": n, "terminal": n, "cap": n}."""
    from .export import export_paths
    from .models import JobChunk, JobState, Rollout
    from .services import refresh_counts, retry_failed

    paths = export_paths(out_path)
    done = {key for key, _row in _keys_of(paths["output"])}
    attempts, terminal, _last = ledger(paths["failures"])
    cap = max_rollout_attempts()
    drop, retry, capped, final = [], [], 0, 0
    for pk, t, r, data in Rollout.objects.filter(job=job, status=Rollout.Status.FAILED).values_list(
            "pk", "task_index", "rollout_index", "data").iterator(chunk_size=2000):
        key = (t, r)
        if key in done:
            drop.append(pk)
        elif key in terminal or (isinstance(data, dict) and data.get(TERMINAL)):
            final += 1
        elif attempts.get(key, 0) >= cap:
            capped += 1
        else:
            drop.append(pk)
            retry.append(key)
    where = os.path.abspath(paths["failures"])
    state = dict(job.output_files or {})
    last_pk = Rollout.objects.filter(job=job).order_by("-pk").values_list("pk", flat=True).first() or 0
    size = paths["failures"].stat().st_size if paths["failures"].exists() else 0
    state["failures"] = {"path": where, "start": size, "after_pk": last_pk}  # the lines before: the ledger's
    job.output_files = state
    type(job).objects.filter(pk=job.pk).update(output_files=state)
    if drop:
        if job.state in JobState.TERMINAL:
            retry_failed(job, launch=False, only=drop)
        else:  # paused, or left running by a killed run: the inline runner resumes it
            Rollout.objects.filter(pk__in=drop).delete()
            JobChunk.objects.filter(job=job, state=JobChunk.State.DONE).update(
                state=JobChunk.State.PENDING, finished_at=None)
            refresh_counts(job)
        job.refresh_from_db()
    return {"retry": retry, "capped": capped, "terminal": final, "cap": cap}


def import_cache(job, out_path) -> dict:
    """NeMo Gym's resume_from_cache: the rollouts in the output file are done (imported into the job as stored
    rows unless it has them); failures in `<out>_failures.jsonl` (one line per attempt) are not retried once a
    pair failed max_rollout_attempts() times or was marked terminal. Returns {"done": n, "failures": n, "imported": n}."""
    from django.db import transaction
    from django.utils import timezone

    from .export import export_paths
    from .models import Rollout
    from .services import refresh_counts

    from controlplane.datasets.services import iter_task_rows
    from workers.engine.materialize import materialize_tasks, row_repeats

    paths = export_paths(out_path)
    have = set(Rollout.objects.filter(job=job).values_list("task_index", "rollout_index"))
    end = min(job.limit, job.dataset.row_count) if job.limit else None
    expected = {(i.task_index, i.rollout_index) for i in materialize_tasks(
        iter_task_rows(job.dataset, 0, end), row_repeats(job.num_repeats, job.collection_options))}
    now = timezone.now()
    new, done = {}, set()
    for key, row in _keys_of(paths["output"]):
        done.add(key)
        if key in expected and key not in have and key not in new:
            new[key] = Rollout(job=job, task_index=key[0], rollout_index=key[1], status=Rollout.Status.OK,
                               reward=row.get("reward") if isinstance(row.get("reward"), (int, float)) else None,
                               data=row, worker="resume_from_cache", created_at=now)
    attempts, terminal, last = ledger(paths["failures"])
    gated = {k for k, n in attempts.items() if n >= max_rollout_attempts()} | terminal
    for key in (gated & expected) - done - have:
        if key not in new:
            row = last[key]
            new[key] = Rollout(job=job, task_index=key[0], rollout_index=key[1], status=Rollout.Status.FAILED,
                               failure_class=str(row.get("failure_class") or row.get("_ng_failure_class") or "")[:40],
                               error=str(row.get("error") or "")[:2000], data=row, worker="resume_from_cache",
                               created_at=now)
    if new:
        with transaction.atomic():
            Rollout.objects.bulk_create(list(new.values()), ignore_conflicts=True, batch_size=1000)
            refresh_counts(job)
    return {"done": len(done), "failures": len(attempts), "imported": len(new)}


# ----------------------------------------------------------------------------------------- profiling
def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._") or "server"


def _server_scope(job):
    """(deployment, url_check) of a NeMo Gym job: its servers as its head server lists them, each /stats URL
    checked against the job's own deployment (profiling.services.stats_url_problem); (None, why) when the head
    server cannot be read."""
    from controlplane.profiling.services import deployment_servers, stats_url_problem
    from workers.nemo_gym.deployment import DeploymentError, resolve_sync

    try:
        dep = resolve_sync(job.endpoint.base_url)
    except DeploymentError as exc:
        return None, str(exc)
    allowed = deployment_servers(job)
    return dep, (lambda url: stats_url_problem(url, allowed))


def begin_server_profiles(job) -> dict | None:
    """+profiling_enabled on a NeMo Gym job: each server's profile as the run starts (its profile is cumulative
    since ng_run started it), so that the run's own share can be written at the end. {name: rows or None}
    (None: not a NeMo Gym job)."""
    if not job.endpoint.is_nemo_gym:
        return None
    from workers.profiling.nemo_gym import pull_server_profile

    dep, check = _server_scope(job)
    if dep is None:
        return {}
    return {srv.name: pull_server_profile(srv, dep.profiling, url_check=check)[0]
            for srv in dep.servers.values()}


def _record_server_profiles(job, session, baseline: dict | None, started: float) -> list[str]:
    """Pull each NeMo Gym server's profile again, store what it did during the run as a snapshot of the run's
    session (source "nemo-gym", worker "nemo-gym:<server>": the job page and `rolloutctl profile` show it).
    Returns the lines to print for the servers that have nothing."""
    import time

    from controlplane.profiling.services import record
    from workers.profiling.core import ProfileSnapshot as EngineSnapshot
    from workers.profiling.nemo_gym import profile_change, pull_server_profile

    dep, check = _server_scope(job)
    if dep is None:
        return [f"Profiling: the deployment's servers were not reached ({check})"]
    said, snaps = [], []
    now = time.time()
    for srv in sorted(dep.servers.values(), key=lambda s: s.name):
        rows, why = pull_server_profile(srv, dep.profiling, url_check=check)
        if rows is None:
            said.append(f"Profiling: NeMo Gym server {srv.name}: no profile ({why})")
            continue
        if baseline.get(srv.name) is None:  # its profile is cumulative: without the start, the run's share is unknown
            said.append(f"Profiling: NeMo Gym server {srv.name}: its profile was not read as the run started, so "
                        "the run's share of it is unknown; none written")
            continue
        change = profile_change(baseline[srv.name], rows)
        if session is not None and change:
            snaps.append(EngineSnapshot(session=session.key, scope="verify", clock="cpu", worker=f"nemo-gym:{srv.name}",
                                        window_start=started, window_end=now, rows=change, source="nemo-gym"))
        elif not change:
            said.append(f"Profiling: NeMo Gym server {srv.name}: no calls profiled during this run")
    if snaps:
        record(job.pk, snaps)
    return said


def server_name_of(snap, verifier: str) -> str:
    """The `<server>` of a snapshot's `<server>.log`: a NeMo Gym server's name, else the product's verifier as
    `verifier_<name>`."""
    from workers.profiling.nemo_gym import server_of

    return server_of(str(snap.worker), str(snap.source)) or f"verifier_{verifier}"


def write_profile_logs(job, dirpath: str, baseline: dict | None = None, started: float | None = None) -> list[str]:
    """+profiling_enabled: `<dirpath>/<server>.log` in NeMo Gym's format for what was profiled during the run:
    the product's verifier (`verifier_<name>.log`) and, for a NeMo Gym job, each of the deployment's servers
    (discovered from its head server; `baseline`: begin_server_profiles at the start). Returns the lines to print."""
    import time

    from controlplane.profiling.models import ProfileSession, ProfileSnapshot
    from controlplane.profiling.services import sample_figures, stop
    from workers.profiling.nemo_gym import format_log

    stop(job)  # the run is over: its session ends with it
    out_dir = Path(dirpath)
    out_dir.mkdir(parents=True, exist_ok=True)
    said = []
    run_session = ProfileSession.objects.filter(job=job).order_by("-started_at", "-pk").first()
    if job.endpoint.is_nemo_gym and baseline is not None:  # servers of ng_run +profiling_enabled: this run's share
        said += _record_server_profiles(job, run_session, baseline, started or time.time())
    session = (ProfileSession.objects.filter(job=job, snapshots__isnull=False).distinct()
               .order_by("-started_at", "-pk").first())
    snaps = list(ProfileSnapshot.objects.filter(session=session)) if session else []
    by_source: dict[str, list] = {}
    for snap in snaps:  # the product's verifiers, and NeMo Gym servers
        by_source.setdefault(server_name_of(snap, job.verifier), []).append(snap)
    written = 0
    for name, group in sorted(by_source.items()):
        rows = sample_figures(group)["rows"]
        if not rows:  # windows with no verification in them (an agent job's verifier is "none")
            continue
        path = out_dir / f"{_safe_name(name)}.log"
        path.write_text(format_log(rows, clock=session.clock if session else "cpu"))
        said.append(f"Profiling: {path} ({len(rows)} functions)")
        written += 1
    if not written:
        said.append(f"Profiling: nothing was profiled in this run (no verification here: the "
                    f"{'agents verify' if job.endpoint.is_nemo_gym else 'verifier is none'}, and no NeMo Gym "
                    "server profiled itself)")
    return said
