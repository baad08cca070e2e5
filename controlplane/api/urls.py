from django.urls import include, path, re_path
from drf_spectacular.views import SpectacularAPIView, SpectacularRedocView, SpectacularSwaggerSplitView
from rest_framework.routers import DefaultRouter

from . import stream, views
from .auth import ObtainTokenView
from controlplane.rest.conventions import ID_REGEX

app_name = "api"

router = DefaultRouter()
router.include_root_view = False
router.register("datasets", views.DatasetViewSet, basename="dataset")
router.register("endpoints", views.EndpointViewSet, basename="endpoint")
router.register("jobs", views.JobViewSet, basename="job")

urlpatterns = [
    path("auth/token/", ObtainTokenView.as_view(), name="token"),
    path("history/", views.HistoryView.as_view(), name="history"),  # every job's throughput (History, its CSV)
    path("schema/", SpectacularAPIView.as_view(), name="schema"),
    # the split view serves its init script from a URL (no inline script: the CSP allows none)
    path("docs/", SpectacularSwaggerSplitView.as_view(url_name="api:schema"), name="docs"),
    path("redoc/", SpectacularRedocView.as_view(url_name="api:schema"), name="redoc"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/rollouts/$", views.JobRolloutsView.as_view(), name="job-rollouts"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/metrics/$", views.JobMetricsView.as_view(), name="job-metrics"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/weight-versions/$", views.JobWeightVersionsView.as_view(),
            name="job-weight-versions"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/task-profile/$", views.JobTaskProfileView.as_view(),
            name="job-task-profile"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/stream/$", stream.JobStreamView.as_view(), name="job-stream"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/stream/ack/$", stream.JobStreamAckView.as_view(), name="job-stream-ack"),
    re_path(rf"^jobs/(?P<job_id>{ID_REGEX})/stream/consumers/$", stream.JobStreamConsumersView.as_view(),
            name="job-stream-consumers"),
    path("", include("controlplane.endpoints.urls")),  # model-server operations (before the router)
    path("", include(router.urls)),
    # other apps' API routes mount here, before the catch-all
    path("", include("controlplane.diagnostics.urls")),
    path("", include("controlplane.alerts.urls")),  # webhooks, their deliveries, gate failures from CI
    path("", include("controlplane.profiling.urls")),
    # [\s\S]: a path parameter may carry a newline, which "." would not match
    re_path(r"^[\s\S]*/$", views.ApiNotFound.as_view(), name="not-found"),
]
