"""Mounted under /api/ (before the API's catch-all):  path("api/", include("controlplane.diagnostics.urls"))"""
from django.urls import re_path

from controlplane.rest.conventions import ID_REGEX as ID

from . import api

app_name = "diagnostics"

urlpatterns = [
    re_path(rf"^jobs/(?P<job_id>{ID})/diagnosis/$", api.JobDiagnosisView.as_view(), name="job-diagnosis"),
    re_path(r"^sweeps/$", api.SweepListView.as_view(), name="sweeps"),
    re_path(rf"^sweeps/(?P<sweep_id>{ID})/$", api.SweepDetailView.as_view(), name="sweep-detail"),
    re_path(rf"^sweeps/(?P<sweep_id>{ID})/cancel/$", api.SweepCancelView.as_view(), name="sweep-cancel"),
]
