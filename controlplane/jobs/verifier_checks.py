"""Checks of a job's verifier at launch: the verifier exists (name, entry point or dotted path), a user may
name it (controlplane.operator), its options are valid and within the operator's maxima, the URLs they name pass
the outbound gate, the secrets they name are the owner's to use, and every row it will see has the fields it
declares (line numbers of those that do not).

Secrets are operator-only: a user never names an environment variable or a file of the worker. The judge's key
comes from an endpoint record its owner may use (`endpoint`: an id) or from a variable the operator lists in
JUDGE_API_KEY_ENVS; `bind_options` resolves either when a run starts, checking again, and hands the key to the
verifier in memory (workers.verifiers.judge.Credentials), never through the job's stored options.
"""
from __future__ import annotations

import os

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db.models import Q

from controlplane import operator as knobs
from controlplane.datasets.models import DatasetRow
from controlplane.endpoints.models import Endpoint
from controlplane.limits import url_problem
from workers.verifiers import get_verifier
from workers.verifiers.judge import CREDENTIALS, Credentials
from workers.verifiers.registry import describe_missing, missing_fields

# verifier -> its options that name a URL the workers will call (checked by the outbound gate at launch too)
URL_OPTIONS = {"judge": ("base_url",), "nemo_gym": ("url", "head_url")}
_ANYONE = object()  # owner unknown: a management command run by the operator


def check_verifier(name, options, owner=_ANYONE, *, operator=False):
    """The verifier and its validated options; ValidationError {"verifier" | "verifier_options": msg}.
    `owner`: the user launching (their rights decide which endpoint a judge may use). `operator`: named by the
    operator (manage.py commands, or a job's own verifier checked when it was created), who may name any dotted
    path; a user may not (nothing is imported for a refused name)."""
    try:
        if not operator:
            knobs.check_user_verifier(name)
        verifier = get_verifier(name)
    except ValueError as exc:
        raise ValidationError({"verifier": str(exc)}) from None
    options = options if isinstance(options, dict) else {}
    if CREDENTIALS in options:
        raise ValidationError({"verifier_options": f"unknown option {CREDENTIALS!r}"})
    try:
        validated = verifier.validate_options(options)
    except ValueError as exc:
        raise ValidationError({"verifier_options": str(exc)}) from None
    problems = _option_problems(name, validated, owner)
    if problems:
        raise ValidationError({"verifier_options": "; ".join(problems)})
    return verifier, validated


def _may_use(owner, endpoint) -> bool:
    if owner is _ANYONE or owner is None:
        return True
    return bool(getattr(owner, "is_staff", False)) or endpoint.owner_id == getattr(owner, "pk", None)


def _option_problems(name, options: dict, owner) -> list[str]:
    problems = []
    for key in URL_OPTIONS.get(name, ()):
        url = options.get(key)
        if url and isinstance(url, str) and (why := url_problem(url)):
            problems.append(f"{key}: {why}")
    if name == "judge":
        env = options.get("api_key_env") or ""
        if env and env not in settings.JUDGE_API_KEY_ENVS:
            problems.append("api_key_env names an environment variable of the workers, which only the operator may "
                            "choose (JUDGE_API_KEY_ENVS); give the judge as an endpoint instead (option endpoint: "
                            "the id of an endpoint you own, with its API key)")
        if options.get("endpoint"):
            ep = Endpoint.objects.filter(pk=options["endpoint"]).first()
            if ep is None or not _may_use(owner, ep):
                problems.append(f"endpoint: no endpoint {options['endpoint']} of yours")
            elif ep.is_nemo_gym:
                problems.append("endpoint: a NeMo Gym endpoint cannot judge (an OpenAI-compatible model server can)")
            elif options.get("base_url"):
                problems.append("give the judge as endpoint or as base_url, not both")
            elif env:
                problems.append("give the judge's key through its endpoint or api_key_env, not both")
    return problems


def bind_options(name, options, owner=_ANYONE) -> dict:
    """A run's verifier options with the secrets they refer to resolved (in memory only). Checks the owner's
    rights and the operator's list again (they may have changed since launch); ValueError when they fail."""
    options = dict(options or {})
    options.pop(CREDENTIALS, None)
    if name != "judge":
        return options
    problems = _option_problems(name, {**options, "base_url": options.get("base_url") or ""}, owner)
    if problems:
        raise ValueError("verifier 'judge': " + "; ".join(problems))
    if options.get("endpoint"):
        ep = Endpoint.objects.get(pk=options["endpoint"])
        options["base_url"] = ep.base_url
        if not options.get("model") or options.get("model") == "judge":
            options["model"] = ep.model_name or "judge"
        options[CREDENTIALS] = Credentials(ep.api_key or "")
    elif options.get("api_key_env"):
        options[CREDENTIALS] = Credentials(os.environ.get(options["api_key_env"], ""))
    return options


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
