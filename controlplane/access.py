"""Ownership model: every dataset, endpoint and job belongs to the user who created it.
A user sees only their own objects; staff see everything. Views, the API and the WebSocket
consumer all filter through these functions, so the rule lives in one place. Core: the models come from
Django's app registry by label, so this module imports no app."""
from __future__ import annotations

from django.apps import apps
from django.db.models import QuerySet


def _visible(qs: QuerySet, user) -> QuerySet:
    if not getattr(user, "is_authenticated", False):
        return qs.none()
    if user.is_staff:
        return qs
    return qs.filter(owner=user)


def visible_datasets(user):
    return _visible(apps.get_model("datasets.Dataset").objects.all(), user)


def visible_endpoints(user):
    return _visible(apps.get_model("endpoints.Endpoint").objects.all(), user)


def visible_jobs(user):
    return _visible(apps.get_model("jobs.CollectionJob").objects.all(), user)


def visible_sweeps(user):
    return _visible(apps.get_model("diagnostics.ParallelismSweep").objects.all(), user)


def can_see(user, obj) -> bool:
    if not getattr(user, "is_authenticated", False):
        return False
    return user.is_staff or getattr(obj, "owner_id", None) == user.id
