"""python manage.py profile_job JOB_ID --seconds 60: profile a running job without stopping it, then print
its profile (the profiler's columns) and the red flags. --off switches profiling off; --show prints the
newest profile only; --export-pstats / --export-callgrind write files."""
import json
import time

from django.core.management.base import BaseCommand, CommandError

from controlplane.jobs.models import CollectionJob
from controlplane.profiling import exports, services
from controlplane.profiling.models import ProfileSnapshot


def print_profile(w, prof, top=25):
    s = prof["session"]
    if not prof["snapshots"]:
        w("No snapshot yet.")
        return
    w(f"Session {s['id']} ({s['scope']}, {s['clock']} clock): {prof['snapshots']} snapshots from "
      f"{len(prof['workers'])} worker(s), {prof['verifications']} verifications ({prof['profiled']} profiled)"
      + (f", measured overhead {prof['overhead_pct']:.2f} % of throughput" if prof["overhead_pct"] is not None else ""))
    w(f"{'name':<70} {'ncall':>9} {'tsub':>10} {'ttot':>10} {'tavg':>10} {'share':>6}")
    for r in prof["rows"][:top]:
        name = f"{r['module']}:{r['line']} {r['name']}"
        if len(name) > 70:
            name = ".." + name[-68:]
        w(f"{name:<70} {r['ncall']:>9} {r['tsub']:>10.6f} {r['ttot']:>10.6f} {r['tavg']:>10.6f} {r['share']:>6.1%}")
    if prof["red_flags"]:
        w("\nRed flags:")
        for f in prof["red_flags"]:
            w(f"  [{f['kind']}] {f['label']}: {f['figure']}\n      -> {f['advice']}")


class Command(BaseCommand):
    help = "Profile a job's verification (or whole workers) for N seconds while it runs; print the profile."

    def add_arguments(self, parser):
        parser.add_argument("job_id", type=int)
        parser.add_argument("--seconds", type=float, default=60.0)
        parser.add_argument("--scope", choices=["verify", "worker"], default="verify")
        parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
        parser.add_argument("--budget-pct", type=float, default=2.0,
                            help="verify scope: throughput cost aimed at, in %% (default 2); 100 profiles every "
                                 "verification (exact call counts, the highest cost)")
        parser.add_argument("--no-wait", action="store_true", help="switch it on and return")
        parser.add_argument("--off", action="store_true", help="switch profiling off")
        parser.add_argument("--show", action="store_true", help="print the newest profile only")
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--export-pstats", metavar="PATH")
        parser.add_argument("--export-callgrind", metavar="PATH")

    def handle(self, job_id, **o):
        job = CollectionJob.objects.filter(pk=job_id).first()
        if job is None:
            raise CommandError(f"no job {job_id}")
        w = self.stdout.write
        if o["off"]:
            w(f"profiling off for job {job.pk} ({services.stop(job)} session(s) ended)")
            return
        if not o["show"]:
            try:
                s = services.start(job, seconds=o["seconds"], scope=o["scope"], clock=o["clock"],
                                   budget_pct=o["budget_pct"])
            except services.ProfilingError as exc:
                raise CommandError(str(exc)) from None
            w(f"profiling on for job {job.pk}: session {s.pk}, {s.scope}, {s.clock} clock, {s.seconds:.0f} s")
            if o["no_wait"]:
                return
            try:
                while services.active_session(job.pk) is not None:
                    time.sleep(min(5.0, max(1.0, s.window_s)))
                    job.refresh_from_db()
                    if job.state not in ("queued", "running", "paused"):
                        break
            except KeyboardInterrupt:
                services.stop(job)
                w("interrupted: profiling switched off")
            time.sleep(min(10.0, s.window_s + 3))  # the workers' last windows
        prof = services.job_profile(job)
        if o["json"]:
            w(json.dumps(prof, indent=1, default=str))
        else:
            print_profile(w, prof)
        rows = None
        for key, fn, mode in (("export_pstats", exports.to_pstats, "wb"), ("export_callgrind", exports.to_callgrind, "w")):
            if o[key]:
                rows = rows if rows is not None else services.rows_of(list(ProfileSnapshot.objects.filter(job=job)))
                with open(o[key], mode) as f:
                    f.write(fn(rows))
                w(f"wrote {o[key]}")
