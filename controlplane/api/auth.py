"""POST /api/auth/token/ {username, password} -> {token}. Throttled per IP (anonymous rate)."""
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.authtoken.views import ObtainAuthToken

from .exceptions import api_exception_handler
from .throttling import AnonRateThrottle


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField()


class ObtainTokenView(ObtainAuthToken):
    throttle_classes = [AnonRateThrottle]

    def get_exception_handler(self):
        return api_exception_handler

    @extend_schema(summary="Obtain the API token for a username and password",
                   responses={200: TokenSerializer, 400: OpenApiResponse(description="Bad credentials"),
                              429: OpenApiResponse(description="Throttled")})
    def post(self, request, *args, **kwargs):
        return super().post(request, *args, **kwargs)
