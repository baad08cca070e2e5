"""Mounted under /api/ (before the API's catch-all): path("", include("controlplane.alerts.urls"))"""
from django.urls import re_path

from controlplane.rest.conventions import ID_REGEX as ID

from . import api

app_name = "alerts"

urlpatterns = [
    re_path(r"^webhooks/$", api.WebhookListView.as_view(), name="webhooks"),
    re_path(rf"^webhooks/(?P<hook_id>{ID})/$", api.WebhookDetailView.as_view(), name="webhook"),
    re_path(rf"^webhooks/(?P<hook_id>{ID})/deliveries/$", api.WebhookDeliveriesView.as_view(), name="deliveries"),
    re_path(rf"^jobs/(?P<job_id>{ID})/gate-failed/$", api.JobGateFailedView.as_view(), name="job-gate-failed"),
]
