"""Mounted under /api/ (before the API's catch-all): model-server operations ("ops", queued actions)
under /ops/; the old /admin/ paths stay as deprecated aliases."""
from django.urls import re_path

from . import api

app_name = "endpoints"
ID = r"[0-9]{1,18}"

urlpatterns = [
    re_path(rf"^endpoints/(?P<id>{ID})/weights/$", api.WeightUpdateView.as_view(), name="weights"),
    re_path(rf"^endpoints/(?P<id>{ID})/ops/log/$", api.OperationLogView.as_view(), name="ops-log"),
    re_path(rf"^endpoints/(?P<id>{ID})/ops/actions/(?P<action_id>{ID})/$", api.ActionView.as_view(),
            name="ops-action"),
    re_path(rf"^endpoints/(?P<id>{ID})/ops/stats/$", api.OperationStatsView.as_view(), name="ops-stats"),
    re_path(rf"^endpoints/(?P<id>{ID})/ops/(?P<kind>[a-z_]{{1,40}})/$", api.OperationView.as_view(),
            name="ops-op"),
    # deprecated aliases (same views; Deprecation + Link headers; deprecated in the schema)
    re_path(rf"^endpoints/(?P<id>{ID})/admin/operations/$", api.deprecated_alias(api.OperationLogView).as_view(),
            name="admin-log"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/actions/(?P<action_id>{ID})/$",
            api.deprecated_alias(api.ActionView).as_view(), name="admin-action"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/stats/$", api.deprecated_alias(api.OperationStatsView).as_view(),
            name="admin-stats"),
    re_path(rf"^endpoints/(?P<id>{ID})/admin/(?P<kind>[a-z_]{{1,40}})/$",
            api.deprecated_alias(api.OperationView).as_view(), name="admin-op"),
]
