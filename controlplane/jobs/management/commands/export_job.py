"""python manage.py export_job JOB_ID [--out PATH] [--failures]

Without --out: the job's rollouts as NeMo Gym JSONL on stdout (--failures: the failed rows instead).
With --out PATH: writes PATH, PATH's _failures.jsonl and _aggregate_metrics.json beside it.
Streams in constant memory.
"""
import sys

from django.core.management.base import BaseCommand, CommandError

from controlplane.jobs.export import iter_export_lines, write_export
from controlplane.jobs.models import CollectionJob


class Command(BaseCommand):
    help = "Export a job's rollouts as NeMo Gym JSONL (stdout by default)."

    def add_arguments(self, parser):
        parser.add_argument("job_id", type=int)
        parser.add_argument("--out", default="", help="write <out>.jsonl, <out>_failures.jsonl and <out>_aggregate_metrics.json")
        parser.add_argument("--failures", action="store_true", help="stdout mode: print the failed rows instead of the ok rows")
        parser.add_argument("--all", action="store_true", help="stdout mode: print ok and failed rows")

    def handle(self, *args, job_id, out, failures, all, **opts):
        try:
            job = CollectionJob.objects.get(pk=job_id)
        except CollectionJob.DoesNotExist:
            raise CommandError(f"no job {job_id}")
        if out:
            res = write_export(job, out)
            self.stderr.write(f"job {job.pk} [{job.state}]: {res['ok_rows']} rows -> {res['output']}; "
                              f"{res['failed_rows']} failed -> {res['failures']}; metrics -> {res['aggregate_metrics']}")
            return
        which = "all" if all else ("failed" if failures else "ok")
        stream = self.stdout._out if hasattr(self.stdout, "_out") else sys.stdout
        n = 0
        for line in iter_export_lines(job, which):
            stream.write(line)
            n += 1
        stream.flush()
        self.stderr.write(f"job {job.pk} [{job.state}]: {n} {which} row(s) exported")
