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
just writes its output again. Ctrl-C pauses the job; rerun to resume. +engine_processes=N runs the job's
chunks in N processes on this host, when one process's CPU is the limit (controlplane.jobs.engine_procs).

Output, NeMo Gym style: <out>.jsonl (successful rows), <out>_failures.jsonl (failed rows with
failure_class and error) and <out>_aggregate_metrics.json. As in NeMo Gym, rollouts are appended and flushed
as they are stored (`wc -l` shows the progress; a killed run leaves every stored rollout on disk); a rerun
appends only what is new, and a new job writing to a file that has lines appends after them
(controlplane.jobs.outfiles). At the end the job's part of each file holds exactly one line per rollout.
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
from pathlib import Path
from typing import Callable

from django.core.management.base import BaseCommand, CommandError

from controlplane.jobs.dropin_args import ArgError, idempotency_key, keys_help, parse_overrides


class Command(BaseCommand):
    requires_system_checks = []  # the URL and admin checks import every view (~0.4 s); this command serves none
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
        if with_keys:  # one line: the keys are in --help, not 35 lines after every error
            message = f"{message} (the valid keys: manage.py collect_rollouts --help)"
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

        if not os.path.isfile(cfg["input_jsonl_fpath"]):
            self._fail(f"+input_jsonl_fpath: no such file: {cfg['input_jsonl_fpath']}")
        from controlplane.jobs.dropin import DropinError, rewrite_input

        try:  # prompt_config / skills applied to the rows first, as NeMo Gym does
            path, said = rewrite_input(cfg["input_jsonl_fpath"], prompt_path=cfg.get("prompt_config"),
                                       skills_path=(cfg.get("skills") or {}).get("path"))
        except DropinError as exc:
            self._fail(str(exc))
        for line in said:
            self.stderr.write(line)
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

        if self._all_migrations_applied():
            return
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

    @staticmethod
    def _all_migrations_applied() -> bool:
        """Every migration file of every app is recorded as applied (the usual case): a directory listing and one
        query, where the migration planner imports every migration module (0.05-0.3 s at the command's start).
        False sends the caller to the full check."""
        from django.apps import apps
        from django.db import DatabaseError, connection
        from django.db.migrations.recorder import MigrationRecorder

        try:
            applied = set(MigrationRecorder(connection).applied_migrations())
        except DatabaseError:
            return False
        for cfg in apps.get_app_configs():
            folder = Path(cfg.path) / "migrations"
            if folder.is_dir() and any((cfg.label, f.stem) not in applied for f in folder.glob("[0-9]*.py")):
                return False
        return True

    def _only_model(self, base: str, cfg) -> str:
        """The one model the server lists at /v1/models (+model_name was not given)."""
        from controlplane.endpoints.services import served_models

        try:
            models = served_models(base, cfg.get("api_key"), timeout=min(30.0, cfg.get("request_timeout_s") or 30.0))
        except ValueError as exc:
            text = str(exc).lower()
            if any(w in text for w in ("connect", "refused", "timed out", "timeout", "unreachable", "resolve")):
                # the server is down, not the model name unknown: say so (+model_name would not help)
                self._fail(f"cannot reach the model server at {base} ({exc}): start it, or fix +model_base_url")
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
        from controlplane.jobs.export import write_aggregate_metrics
        from controlplane.jobs.models import CollectionJob, JobState
        from controlplane.jobs.outfiles import OutputFiles
        from controlplane.jobs.runtime import run_job_inline
        from controlplane.jobs.services import feed_summaries, get_or_create_job
        from workers.engine.aggregate import StoredRowSummaries

        out_path = Path(cfg["output_jsonl_fpath"])
        try:
            out_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._fail(f"+output_jsonl_fpath: cannot create {out_path.parent}: {exc}")

        from controlplane.jobs import dropin

        if cfg["profiling_enabled"] and not cfg["profiling_results_dirpath"]:
            self._fail("+profiling_enabled=true needs +profiling_results_dirpath=DIR (where <server>.log is written)")
        for line in dropin.notes(cfg):  # NeMo Gym keys that cannot apply here: why, once; the run goes on
            self.stderr.write(line)
        owner = self._owner(cfg)
        dataset = self._dataset(cfg, owner)
        endpoint = self._endpoint(cfg, owner)
        try:  # NeMo Gym's num_repeats (an int, or a dict per agent resolved over the rows)
            num_repeats, options, total, said = dropin.job_repeats(cfg, dataset, endpoint)
        except dropin.DropinError as exc:
            self._fail(str(exc))
        for line in said:
            self.stderr.write(line)
        if cfg["num_repeats_add_seed"]:
            options["add_seed"] = True
            self.stderr.write("Adding unique `seed` values to each input via metadata.extra_body (only honored by "
                              "vLLM model servers)")
        if cfg["disable_aggregation"]:  # NeMo Gym's meaning: no /aggregate_metrics call and no metrics file
            options["disable_aggregation"] = True
        parallelism, capped_by = dropin.parallelism(cfg["num_samples_in_parallel"], owner, total)
        ep_ident = {"base_urls": endpoint.all_base_urls, "model": endpoint.model_name, "api_flavor": endpoint.api_flavor}
        if endpoint.is_nemo_gym:
            ep_ident["kind"] = endpoint.kind
        key = idempotency_key(cfg, dataset.sha256, ep_ident)
        if not cfg["resume"]:
            key = key[:60] + ":" + hashlib.sha256(f"{time.time_ns()}".encode()).hexdigest()[:16]

        from django.core.exceptions import ValidationError

        name = cfg["name"] or cfg["agent_name"] or Path(cfg["input_jsonl_fpath"]).stem
        chunk_size = cfg["chunk_size"]
        if "chunk_size" not in cfg["_given"]:  # one chunk for one process, else enough for every process
            from controlplane.jobs.engine_procs import chunk_size_for

            n_rows = min(cfg["limit"], dataset.row_count) if cfg["limit"] else dataset.row_count
            chunk_size = chunk_size_for(n_rows, cfg["engine_processes"], chunk_size)
        try:
            job, created = get_or_create_job(
                owner=owner, dataset=dataset, endpoint=endpoint, limit=cfg["limit"] or None, num_repeats=num_repeats,
                num_samples_in_parallel=parallelism,
                responses_create_params=cfg["responses_create_params"], verifier=cfg["verifier"],
                verifier_options=cfg["verifier_options"], verify_mode=cfg["verify_mode"], chunk_size=chunk_size,
                name=(f"cli: {name}")[:200], idempotency_key=key, output_path=str(out_path.resolve()), launch=False,
                profiling_enabled=bool(cfg["profiling_enabled"]),
                operator=True,  # run by the operator on their machine: any dotted-path verifier of theirs
            )
        except ValidationError as exc:
            self._fail(f"invalid job: {'; '.join(f'{k}: {v}' for k, v in exc.message_dict.items())}")
        if created and (options or total != job.total_rollouts):  # num_repeats per agent: each row's own count
            CollectionJob.objects.filter(pk=job.pk).update(collection_options=options, total_rollouts=total)
            job.collection_options, job.total_rollouts = options, total
        elif (not created and job.state != JobState.COMPLETED
              and bool((job.collection_options or {}).get("disable_aggregation")) != bool(cfg["disable_aggregation"])):
            kept = {**(job.collection_options or {}), "disable_aggregation": bool(cfg["disable_aggregation"])}
            CollectionJob.objects.filter(pk=job.pk).update(collection_options=kept)  # a job of an earlier version
            job.collection_options = kept
        self._capped_by = capped_by
        self._retried = None
        if cfg["resume_from_cache"] and not created and out_path.exists():  # the same command again
            self._retried = dropin.retry_from_ledger(job, out_path)
            self.stderr.write(self._retry_line(job, self._retried))
        if not created:
            self.stderr.write(f"Job {job.pk}: resuming ({job.state}, {job.done_count}/{job.total_rollouts} rollouts already stored)"
                              if job.state != JobState.COMPLETED else
                              f"Job {job.pk}: already completed ({job.done_count}/{job.total_rollouts}); writing its output")
        else:
            self.stderr.write(f"Job {job.pk}: {job.total_rollouts} rollouts ({dataset.row_count if not cfg['limit'] else min(cfg['limit'], dataset.row_count)} "
                              f"rows x {json.dumps(cfg['num_repeats'])}) against {endpoint.model_name} @ {endpoint.base_url}")

        if cfg["prewarm"] and job.state != JobState.COMPLETED:
            from controlplane.endpoints.services import prewarm

            sample = None
            if endpoint.is_nemo_gym:  # through the agents' POST /run, with the job's first row
                from controlplane.datasets.services import iter_task_rows

                sample = next((row for _t, _o, row in iter_task_rows(dataset, 0, 1)), None)
            res = prewarm(endpoint, n=cfg["prewarm"], sample_row=sample)
            self.stderr.write(f"Pre-warm: {res['succeeded']}/{res['sent']} ok" +
                              (f" ({'; '.join(res['errors'][:2])})" if res["errors"] else ""))

        if job.output_path != str(out_path.resolve()):
            CollectionJob.objects.filter(pk=job.pk).update(output_path=str(out_path.resolve()))
        if cfg["resume_from_cache"] and job.state != JobState.COMPLETED:
            if not out_path.exists():
                self.stderr.write(f"Skipping resume_from_cache because output_fpath {out_path} doesn't exist!")
            else:
                got = dropin.import_cache(job, out_path)
                job.refresh_from_db()
                self.stderr.write(f"Resumed from cache: {got['done']} rollouts already done in {out_path}, "
                                  f"{got['failures']} earlier failure line(s); {got['imported']} taken into job "
                                  f"{job.pk}; {job.total_rollouts - job.done_count} still to run")
        # written before collecting, as ng_collect_rollouts does: its own resume_from_cache, run on this command's
        # files after a crash, needs it
        from controlplane.jobs.nemo_gym import write_materialized_inputs

        materialized = str(write_materialized_inputs(job, out_path, cfg["agent_name"] or None))
        # the output files grow as rollouts are stored (appended and flushed after each batch commits)
        files = OutputFiles(job, out_path, whole_file=cfg["resume_from_cache"]).open()
        if created and any(files.earlier.values()):
            self.stderr.write(f"Output: appending to {files.paths['output']} (the lines already there are kept)")
        elif sum(files.repaired.values()):
            self.stderr.write(f"Output: {sum(files.repaired.values())} stored rollout(s) missing from the output "
                              "files were appended")

        if cfg["profiling_enabled"] and job.state != JobState.COMPLETED:  # a session for this run's duration
            from controlplane.profiling.models import ProfileSession
            from controlplane.profiling.services import active_session

            if active_session(job.pk) is None:
                # NeMo Gym profiles every call (CPU clock): no sampling budget here
                ProfileSession.objects.create(job=job, requested_by=job.owner, clock="cpu", budget_pct=100.0)
        server_profiles, profiling_t0 = None, time.time()
        if cfg["profiling_enabled"] and job.state != JobState.COMPLETED:  # the NeMo Gym servers' own, as it starts
            server_profiles = dropin.begin_server_profiles(job)

        done_before = job.done_count
        t0 = time.monotonic()
        run_stats = {"lease_wait_s": 0.0}
        try:
            if job.state != JobState.COMPLETED:
                summaries = StoredRowSummaries()  # the end's summaries without reading the table back

                def on_stored(rows):
                    files.stored(rows)
                    feed_summaries(summaries, rows)

                job = self._run(job, run_job_inline, run_stats, on_stored=on_stored, summaries=summaries,
                                processes=cfg["engine_processes"], quiet=verbosity < 2)
        finally:
            files.close()
        # a wait for a previous run's lease to expire (a run killed without a chance to release its chunks) is
        # not collection time
        self._lease_wait_s = run_stats["lease_wait_s"]
        elapsed = time.monotonic() - t0 - self._lease_wait_s

        job.refresh_from_db()
        # rewards written after collection (fast / deferred verification): the job's lines are written again
        res = files.finish(rewrite=job.verify_mode != CollectionJob.VerifyMode.INLINE)
        if cfg["profiling_enabled"]:
            for line in dropin.write_profile_logs(job, cfg["profiling_results_dirpath"], server_profiles, profiling_t0):
                self.stderr.write(line)
        if cfg["disable_aggregation"]:
            self.stderr.write("Skipping aggregate-metrics computation because disable_aggregation=True.")
            res["aggregate_metrics"] = None
        else:
            res["aggregate_metrics"] = write_aggregate_metrics(job, out_path)
        res["materialized_inputs"] = materialized
        self._summary(job, res, elapsed, job.done_count - done_before)
        if job.state == JobState.FAILED:
            self._fail(f"job {job.pk} failed: {job.error_message or 'no message'}\n"
                       "Rerun the same command to resume it (stored rollouts are kept).", code=1)
        if job.state != JobState.COMPLETED:
            self._fail(f"job {job.pk} ended {job.state}; rerun the same command to resume it.", code=2)

    def _run(self, job, run_job_inline: Callable, run_stats: dict, on_stored=None, summaries=None, processes: int = 1,
             quiet: bool = True):
        import threading

        from tqdm import tqdm

        children = self._engine_children(job, processes)
        bar = tqdm(total=job.total_rollouts, initial=job.done_count, desc="Collecting rollouts", file=sys.stderr,
                   dynamic_ncols=True, smoothing=0.1, mininterval=0.25)
        failed_seen = [job.failed_count]
        bar_lock = threading.Lock()  # the engine's thread and the children's reader move the bar

        def on_progress(payload: dict):
            with bar_lock:
                done = int(payload.get("done") or 0)
                if done > bar.n:
                    bar.update(done - bar.n)
                failed = int(payload.get("failed") or 0)
                if failed != failed_seen[0]:
                    failed_seen[0] = failed
                    bar.set_postfix(failed=failed, refresh=False)

        import signal

        previous = None
        terminated: list = []
        pool = None
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):  # `kill` / tmux kill-session: stop like Ctrl-C (the job is paused)
                terminated.append(signum)
                if pool is not None:  # at once: they pause the job even if the raise below lands where it is
                    pool.signal_children()  # ignored (a weakref callback of this thread)
                raise KeyboardInterrupt

            previous = signal.signal(signal.SIGTERM, on_term)
        from controlplane.jobs.runtime import default_worker_name

        self._worker_names = [default_worker_name("inline")]
        try:
            if children:  # the others first: they start (spawn, Django) while this process runs its first chunk
                from controlplane.jobs.engine_procs import EngineProcesses

                pool = EngineProcesses(job, children, on_stored=on_stored, on_progress=on_progress, quiet=quiet).start()
            job = run_job_inline(job, on_progress=on_progress, stats=run_stats, on_stored=on_stored, summaries=summaries,
                                 worker_name=self._worker_names[0],
                                 others_running=pool.others_running if pool else None, peers=1 + children)
            if pool is not None:
                pool.join()
            if terminated:  # the signal's KeyboardInterrupt was swallowed; the job was paused all the same
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            if pool is not None:  # Ctrl-C reached them too; SIGTERM (or a second Ctrl-C here) did not
                pool.stop()
            bar.close()
            job.refresh_from_db()
            self.stderr.write(f"\nInterrupted: job {job.pk} is {job.state} with {job.done_count}/{job.total_rollouts} "
                              "rollouts stored. Rerun the same command to resume.")
            raise CommandError("interrupted", returncode=130)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            if pool is not None:
                pool.stop()  # a no-op when they ended; else (an error here) they are not left running
                self._worker_names += pool.worker_prefixes()
        job.refresh_from_db()
        if job.done_count > bar.n:
            bar.update(job.done_count - bar.n)
        bar.close()
        return job

    def _engine_children(self, job, processes: int) -> int:
        """How many child engine processes to start for +engine_processes=N: N-1, fewer when the job has fewer
        chunks left to run than processes (said)."""
        if processes <= 1:
            return 0
        from controlplane.jobs.models import JobChunk

        left = JobChunk.objects.filter(job=job).exclude(state=JobChunk.State.DONE).count()
        used = max(1, min(processes, left))
        self.stderr.write(f"Engine processes: {used} (this one and {used - 1} more), {left} chunk(s) to run"
                          + (f"; +engine_processes={processes} needs at least {processes} chunks (this job was "
                             f"made with +chunk_size={job.chunk_size})" if used < processes else ""))
        return used - 1

    def _engine_line(self, job) -> str | None:
        """With +engine_processes > 1: the rollouts each process stored in this run."""
        names = getattr(self, "_worker_names", [])
        if len(names) < 2:
            return None
        from django.db.models import Count

        from controlplane.jobs.models import Rollout

        by_worker = dict(Rollout.objects.filter(job=job).values_list("worker").annotate(n=Count("id")).order_by())
        counts = [by_worker.get(names[0], 0)]
        counts += [sum(n for w, n in by_worker.items() if w.startswith(prefix)) for prefix in names[1:]]
        return (f"Engine processes: {len(names)}; rollouts stored this run by each: "
                + ", ".join(str(c) for c in counts) + " (this one first)")

    @staticmethod
    def _retry_line(job, got: dict) -> str:
        held = (f"; not retried: {got['capped']} at NEMO_GYM_MAX_ROLLOUT_ATTEMPTS={got['cap']} failure line(s), "
                f"{got['terminal']} marked _ng_failure_terminal" if got["capped"] or got["terminal"] else "")
        return (f"Resume from cache: job {job.pk} retries {len(got['retry'])} failed rollout(s) (fewer than "
                f"{got['cap']} failure lines each in the ledger){held}")

    @staticmethod
    def _retried_outcome(job, keys: list) -> str:
        from controlplane.jobs.models import Rollout

        want = set(keys)
        got = [s for t, r, s in Rollout.objects.filter(job=job, task_index__in={t for t, _r in want})
               .values_list("task_index", "rollout_index", "status") if (t, r) in want]
        ok = sum(s == Rollout.Status.OK for s in got)
        return (f"Retried: {len(want)} failed rollout(s): {ok} ok now, {len(got) - ok} failed again"
                + (f", {len(want) - len(got)} not run" if len(got) < len(want) else ""))

    @staticmethod
    def _throughput_line(job) -> str:
        """The job's throughput as the dashboard, History and the API show it (controlplane.jobs.figures): stored
        rows and tokens over its running time, every run of it (pauses excluded)."""
        from controlplane.jobs.figures import job_figures

        f = job_figures(job)
        if not f["running_s"]:
            return "Throughput: n/a (nothing ran)"
        return (f"Throughput: {f['average_rollouts_per_s']:.2f} rollouts/s, {f['average_tokens_per_s']:.1f} tokens/s "
                f"({f['average_output_tokens_per_s']:.1f} output tokens/s) over {f['running_s']:.1f}s running")

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
            self._throughput_line(job),
            f"Mean reward: {reward:.4f}" if isinstance(reward, (int, float)) else "Mean reward: n/a",
            f"Parallelism: {job.effective_parallelism} requests in flight at most"
            + (f" ({self._capped_by})" if getattr(self, "_capped_by", "") else ""),
            f"Rollouts:          {res['output']} ({res['ok_rows']} rows)",
            f"Failures:          {res['failures']} ({res['failed_rows']} rows)",
            f"Aggregate metrics: {res['aggregate_metrics'] or 'skipped (+disable_aggregation=true)'}",
            f"Materialized inputs: {res['materialized_inputs']}",
        ]
        if engine_line := self._engine_line(job):
            lines.insert(2, engine_line)
        if getattr(self, "_retried", None) and self._retried["retry"]:
            lines.insert(1, self._retried_outcome(job, self._retried["retry"]))
        if job.failed_count:
            from django.db.models import Count

            from controlplane.jobs.models import Rollout

            by_class = dict(Rollout.objects.filter(job=job, status=Rollout.Status.FAILED).values_list("failure_class")
                            .annotate(n=Count("id")).order_by())
            lines.insert(1, "Failures by class: " + ", ".join(f"{k or 'unknown'}={v}" for k, v in sorted(by_class.items())))
            if unwritten := Rollout.objects.filter(job=job, status=Rollout.Status.FAILED,
                                                   data___ng_no_persist=True).count():
                lines.append(f"Not in the failures file: {unwritten} failed rollout(s) the agent marked _ng_no_persist "
                             "(as NeMo Gym, written nowhere; +resume_from_cache=true collects them again)")
        self.stdout.write("\n".join(lines))
