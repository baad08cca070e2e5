"""python manage.py sweep --endpoint ID (--dataset ID | --job ID) [--sample-size 64] [--max 512] [--start 1]
[--levels 1,2,4,...] [--async] [--json]: run a parallelism sweep and store its curve."""
import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from controlplane.datasets.models import Dataset
from controlplane.diagnostics import services
from controlplane.diagnostics.tasks import run_sweep_task
from controlplane.endpoints.models import Endpoint
from controlplane.jobs.models import CollectionJob


class Command(BaseCommand):
    help = "Run the same sample of tasks at parallelism 1, 2, 4 ... and recommend a setting (the profiling guide's quick diagnostic, automated)."

    def add_arguments(self, parser):
        parser.add_argument("--endpoint", type=int, help="endpoint id (default: the job's)")
        parser.add_argument("--dataset", type=int)
        parser.add_argument("--job", type=int, help="take dataset, verifier and sampling overrides from this job")
        parser.add_argument("--sample-size", type=int, default=64)
        parser.add_argument("--start", type=int, default=1)
        parser.add_argument("--max", type=int, default=512)
        parser.add_argument("--levels", help="comma-separated parallelism levels (overrides --start/--max)")
        parser.add_argument("--async", action="store_true", dest="run_async", help="queue it for a Celery worker")
        parser.add_argument("--json", action="store_true")

    def handle(self, **o):
        job = CollectionJob.objects.filter(pk=o["job"]).first() if o["job"] else None
        if o["job"] and job is None:
            raise CommandError(f"no job {o['job']}")
        endpoint_id = o["endpoint"] or (job.endpoint_id if job else None)
        endpoint = Endpoint.objects.filter(pk=endpoint_id).first() if endpoint_id else None
        if endpoint is None:
            raise CommandError("give --endpoint (or --job)")
        dataset = Dataset.objects.filter(pk=o["dataset"]).first() if o["dataset"] else None
        if o["dataset"] and dataset is None:
            raise CommandError(f"no dataset {o['dataset']}")
        try:
            levels = [int(x) for x in o["levels"].split(",") if x.strip()] if o["levels"] else []
        except ValueError:
            raise CommandError("--levels must be comma-separated integers")
        try:
            sweep = services.create_sweep(endpoint=endpoint, dataset=dataset, job=job, owner=job.owner if job else None,
                                          sample_size=o["sample_size"], levels=levels, start_parallelism=o["start"],
                                          max_parallelism=o["max"])
        except ValidationError as e:  # the jobs' caps and the owner's quotas
            raise CommandError("; ".join(e.messages))
        except ValueError as e:
            raise CommandError(str(e))
        if o["run_async"]:
            run_sweep_task.delay(sweep.pk)
            self.stdout.write(f"sweep {sweep.pk} queued")
            return
        sweep = services.run_sweep(sweep)
        if o["json"]:
            self.stdout.write(json.dumps(services.sweep_payload(sweep), indent=1, default=str))
            return
        self.stdout.write(f"sweep {sweep.pk}: {sweep.state}")
        self.stdout.write(f"{'parallelism':>11} {'rollouts/s':>11} {'p50 ms':>9} {'p99 ms':>9} {'errors':>7}")
        for p in sweep.points:
            self.stdout.write(f"{p['parallelism']:>11} {p['rollouts_per_s']:>11.2f} {p['p50_ms'] or 0:>9.1f} "
                              f"{p['p99_ms'] or 0:>9.1f} {100 * p['error_rate']:>6.1f}%")
        if sweep.state == "failed":
            raise CommandError(sweep.error_message)
        self.stdout.write(f"knee {sweep.knee}, recommended parallelism {sweep.recommended}")
        self.stdout.write(sweep.interpretation)
