"""Checks of a job's verifier at launch: the verifier exists (name, entry point or dotted path), its
options are valid, and every row it will see has the fields it declares (line numbers of those that do not)."""
from __future__ import annotations

from django.core.exceptions import ValidationError
from django.db.models import Q

from controlplane.datasets.models import DatasetRow
from workers.verifiers import get_verifier
from workers.verifiers.registry import describe_missing, missing_fields


def check_verifier(name, options):
    """The verifier and its validated options; ValidationError {"verifier" | "verifier_options": msg}."""
    try:
        verifier = get_verifier(name)
    except ValueError as exc:
        raise ValidationError({"verifier": str(exc)}) from None
    try:
        return verifier, verifier.validate_options(options if isinstance(options, dict) else {})
    except ValueError as exc:
        raise ValidationError({"verifier_options": str(exc)}) from None


def check_dataset_fields(dataset, verifier, options, n_rows=None, limit=100):
    """ValidationError naming the line numbers of rows (of the first n_rows) that lack a field the verifier
    needs. The filter runs in the database; only the offending rows are read."""
    required = verifier.required(options)
    if not required:
        return
    lacking = Q()
    for field in required:
        parts = field.split(".")
        for i, leaf in enumerate(parts):  # each level: a missing parent makes the nested test NULL, not false
            lacking |= ~Q(**{"__".join(["data", *parts[:i]]) + "__has_key": leaf})
    qs = DatasetRow.objects.filter(dataset=dataset)
    if n_rows is not None:
        qs = qs.filter(index__lt=n_rows)
    bad = qs.filter(lacking).order_by("index")
    rows = bad.values_list("line_number", "data")[:limit]
    count = bad.count() if len(rows) >= limit else len(rows)
    n, report = missing_fields(required, rows, limit=limit)
    if report:
        raise ValidationError({"dataset": describe_missing(verifier.name, max(count, n), report)})
