"""python manage.py load_dataset PATH [--name NAME] [--accept-partial] [--owner USERNAME] [--verifier NAME]

Streams a NeMo Gym JSONL file into a dataset, printing every bad line (number and reason).
Exits 1 when the file is rejected.
"""
import os

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from controlplane.datasets.services import DatasetValidationError, ingest_jsonl
from workers.nemo_jsonl import format_report


class Command(BaseCommand):
    help = "Load a NeMo Gym JSONL file as a dataset (validated while streaming)."

    def add_arguments(self, parser):
        parser.add_argument("path")
        parser.add_argument("--name", default="", help="dataset name (default: the file name)")
        parser.add_argument("--description", default="")
        parser.add_argument("--accept-partial", action="store_true", help="keep the good rows when some lines are bad")
        parser.add_argument("--owner", default="", help="username of the owner (default: none)")
        parser.add_argument("--verifier", default="", help="rows lacking a field this verifier reads are bad lines")
        parser.add_argument("--max-report-lines", type=int, default=None, help="print at most this many bad lines")

    def handle(self, *args, path, name, description, accept_partial, owner, max_report_lines, verifier="", **opts):
        if not os.path.isfile(path):
            raise CommandError(f"no such file: {path}")
        user = None
        if owner:
            try:
                user = get_user_model().objects.get(username=owner)
            except get_user_model().DoesNotExist:
                raise CommandError(f"no such user: {owner}")
        try:
            ds = ingest_jsonl(path, name=name or os.path.basename(path), owner=user, accept_partial=accept_partial,
                              description=description, verifier=verifier,
                              operator=True)  # the operator's command: dotted paths allowed
        except ValueError as e:  # an unknown verifier
            raise CommandError(str(e), returncode=2)
        except DatasetValidationError as e:
            self.stderr.write(format_report(e.report, max_lines=max_report_lines))
            kept = f" (dataset {e.dataset.pk} records the rejection)" if e.dataset else ""
            raise CommandError(f"{path}: {e.message}{kept}", returncode=1)
        rep = ds.validation_report
        if rep.get("bad_line_count"):
            self.stdout.write(format_report(rep, max_lines=max_report_lines))
        self.stdout.write(self.style.SUCCESS(
            f"dataset {ds.pk} '{ds.name}': {ds.row_count} rows, {ds.size_bytes} bytes, sha256 {ds.sha256}"
            + (f", {ds.bad_line_count} bad line(s) skipped" if ds.bad_line_count else "")
        ))
        if rep.get("verifier_fit"):
            self.stdout.write(rep["verifier_fit"])
