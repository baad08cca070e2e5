"""manage.py verify_job JOB_ID: verify a finished job's stored rollouts in this process (deferred or fast
jobs, or to re-verify with another verifier), resuming a run a dead worker left behind."""
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError

from controlplane.jobs import verification
from controlplane.jobs.models import CollectionJob, InvalidTransition, VerificationRun
from controlplane.jobs.runtime import default_worker_name


class Command(BaseCommand):
    help = "Verify a finished job's stored rollouts (a resumable batch run), then print the new mean reward"

    def add_arguments(self, parser):
        parser.add_argument("job_id", type=int)
        parser.add_argument("--verifier", help="verify with this verifier instead of the job's own")
        parser.add_argument("--batch-size", type=int, default=verification.BATCH)

    def handle(self, job_id, verifier=None, batch_size=verification.BATCH, **opts):
        job = CollectionJob.objects.filter(pk=job_id).first()
        if job is None:
            raise CommandError(f"no job {job_id}")
        try:
            run = verification.start_verification(job, verifier=verifier, launch=False, operator=True)
        except (ValidationError, InvalidTransition) as exc:
            raise CommandError(str(exc)) from None
        self.stderr.write(f"verifying job {job_id} with {run.verifier}: run {run.pk}, {run.verified}/{run.total} done")
        outcome = verification.run_verification(run.pk, default_worker_name("verify_job"), batch_size=batch_size)
        run = VerificationRun.objects.get(pk=run.pk)
        job.refresh_from_db()
        if outcome != "done":
            raise CommandError(f"verification {outcome}: {run.error_message or 'another worker holds the run'}")
        rate = f", cache hit rate {run.cache_hits / run.cache_lookups:.0%}" if run.cache_lookups else ""
        self.stdout.write(f"job {job_id} verified: {run.verified} rollouts, {run.errors} verifier errors, "
                          f"mean/reward {job.aggregate_metrics.get('mean/reward')}{rate}")
