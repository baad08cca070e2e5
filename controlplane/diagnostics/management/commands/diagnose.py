"""python manage.py diagnose JOB_ID [--json]: the bottleneck diagnosis of a job, from stored data."""
import json

from django.core.management.base import BaseCommand, CommandError

from controlplane.diagnostics import services
from controlplane.jobs.models import CollectionJob


class Command(BaseCommand):
    help = "Diagnose what limits a job's throughput (model, verification, network / rate limit, control plane)."

    def add_arguments(self, parser):
        parser.add_argument("job_id", type=int)
        parser.add_argument("--json", action="store_true", help="print the full diagnosis as JSON")
        parser.add_argument("--samples", type=int, default=5000, help="newest metric samples to use (default 5000)")

    def handle(self, job_id, **opts):
        job = CollectionJob.objects.select_related("endpoint").filter(pk=job_id).first()
        if job is None:
            raise CommandError(f"no job {job_id}")
        payload = services.diagnosis_payload(job, samples=opts["samples"])
        if opts["json"]:
            self.stdout.write(json.dumps(payload, indent=1, default=str))
            return
        d = payload["diagnosis"]
        w = self.stdout.write
        w(f"Job {job.pk} ({job.state}): {d['label']}" + (f" — confidence {d['confidence']:.2f}" if d["confidence"] else ""))
        w(d["summary"])
        if d.get("server_slots"):
            w(f"Model server capacity: {d['server_slots']} requests at once — {d['server_slots_bound']}")
        held = [i for i in d["evidence_items"] if i.get("holds")]
        if held:
            w("\nEvidence:")
            for i in held:
                w(f"  {i['name']:<28} {i['value']!s:>12}  (threshold {i['threshold']})  {i['meaning']}")
        w("\nNext steps:")
        for n, r in enumerate(d["recommendations"], 1):
            w(f"  {n}. {r['action']}\n     {r['why']}")
        if d["conditions"]:
            w("\nDetected conditions:")
            for c in d["conditions"]:
                w(f"  - {c['title']}: {c['evidence']}")
                for f in c["fixes"]:
                    w(f"      * {f}")
        if payload["adaptive_decisions"]:
            w("\nAdaptive concurrency decisions:")
            for x in payload["adaptive_decisions"][-20:]:
                w(f"  t={x['t']:>7}s  {x['from']:>5} -> {x['to']:<5} {x['reason']}")
        if payload["sweep"]:
            s = payload["sweep"]
            w(f"\nLatest sweep on this endpoint (#{s['id']}): recommended {s['recommended']}. {s['interpretation']}")
