"""Mounted under /api/ (before the API's catch-all): admin operations (queued actions)."""
from django.urls import re_path

from . import api

app_name = "endpoints"
ID = r"[0-9]{1,18}"

urlpatterns = [
    re_path(rf"^endpoints/(?P<id>{ID})/weights/$", api.WeightUpdateView.as_view(), name="weights"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/operations/$", api.OperationLogView.as_view(), name="admin-log"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/actions/(?P<action_id>{ID})/$", api.ActionView.as_view(),
            name="admin-action"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/stats/$", api.OperationStatsView.as_view(), name="admin-stats"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/(?P<kind>[a-z_]{{1,40}})/$", api.OperationView.as_view(),
            name="admin-op"),
]
