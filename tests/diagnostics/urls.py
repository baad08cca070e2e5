"""The project's URLs with the diagnostics API mounted under /api/ (the one-line include the API owner adds)."""
from django.urls import include, path

from controlplane.urls import urlpatterns as project_urls

urlpatterns = [path("api/", include("controlplane.diagnostics.urls")), *project_urls]
