from django.urls import path

from . import endpoint_ops, views

app_name = "dashboard"
urlpatterns = [
    path("", views.overview, name="overview"),
    path("overview.json", views.overview_state, name="overview_state"),
    path("jobs/<int:job_id>/", views.job_detail, name="job"),
    path("jobs/<int:job_id>/state.json", views.job_state, name="job_state"),
    path("jobs/<int:job_id>/actions/<str:action>/", views.job_action, name="job_action"),
    path("jobs/<int:job_id>/rollouts/", views.rollouts, name="rollouts"),
    path("rollouts/<int:rollout_id>/", views.rollout_detail, name="rollout"),
    path("traces/<str:trace>/", views.rollout_by_trace, name="rollout_by_trace"),
    path("datasets/", views.datasets, name="datasets"),
    path("datasets/upload/", views.dataset_upload, name="dataset_upload"),
    path("datasets/<int:dataset_id>/", views.dataset_detail, name="dataset"),
    path("endpoints/", views.endpoints, name="endpoints"),
    path("endpoints/<int:endpoint_id>/health/", views.endpoint_health, name="endpoint_health"),
    path("endpoints/<int:endpoint_id>/", endpoint_ops.endpoint_detail, name="endpoint"),
    path("endpoints/<int:endpoint_id>/ops/<str:kind>/", endpoint_ops.endpoint_ops_action, name="endpoint_ops"),
    path("sweeps/<int:sweep_id>/cancel/", endpoint_ops.sweep_cancel, name="sweep_cancel"),
    path("compare/", views.compare, name="compare"),
    path("history/", views.history, name="history"),
]
