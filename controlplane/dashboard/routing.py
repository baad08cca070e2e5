from django.urls import path

from .consumers import EndpointConsumer, JobConsumer, OverviewConsumer

websocket_urlpatterns: list = [
    path("ws/jobs/<int:job_id>/", JobConsumer.as_asgi()),
    path("ws/overview/", OverviewConsumer.as_asgi()),
    path("ws/endpoints/<int:endpoint_id>/", EndpointConsumer.as_asgi()),
]
