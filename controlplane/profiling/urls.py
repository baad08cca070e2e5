"""Mounted under /api/ (before the API's catch-all):  path("", include("controlplane.profiling.urls"))"""
from django.urls import re_path

from . import api

app_name = "profiling"
ID = r"[0-9]{1,18}"

urlpatterns = [
    re_path(rf"^jobs/(?P<job_id>{ID})/profile/$", api.JobProfileView.as_view(), name="job-profile"),
    re_path(rf"^jobs/(?P<job_id>{ID})/profile/export/$", api.JobProfileExportView.as_view(), name="job-profile-export"),
    re_path(r"^profiles/compare/$", api.ProfileCompareView.as_view(), name="compare"),
]
