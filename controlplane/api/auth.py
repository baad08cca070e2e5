"""API tokens (django-rest-knox): stored hashed (SHA-512 of a 256-bit random token; the database keeps
the digest and a 15-character lookup prefix, never the token), with an expiry, revocable.

    POST   /api/auth/token/   {username, password} -> {token, expiry}: a new token per login (throttled per IP)
    DELETE /api/auth/token/   revoke the token this request was sent with (logout)

An expired token answers 401 with code `token_expired` and says how to get a new one."""
from django.utils import timezone
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.utils import OpenApiResponse, extend_schema
from knox.models import AuthToken
from knox.settings import knox_settings
from rest_framework import serializers, status
from rest_framework.authtoken.serializers import AuthTokenSerializer
from rest_framework.exceptions import NotAuthenticated
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.rest.authentication import ExpiringTokenAuthentication
from controlplane.rest.exceptions import api_exception_handler
from .throttling import AnonRateThrottle


class ExpiringTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.rest.authentication.ExpiringTokenAuthentication"
    name = "tokenAuth"

    def get_security_definition(self, auto_schema):
        return {"type": "apiKey", "in": "header", "name": "Authorization",
                "description": f'Token-based authentication with required prefix "{knox_settings.AUTH_HEADER_PREFIX}"'}


def issue_token(user) -> tuple[str, object]:
    """A new token for `user` (the plaintext is returned once, never stored) and its expiry."""
    # the user's expired tokens go now (the authentication checks only the token presented; see
    # controlplane.rest.authentication)
    AuthToken.objects.filter(user=user, expiry__lt=timezone.now()).delete()
    instance, token = AuthToken.objects.create(user=user)
    return token, instance.expiry


class LoginSerializer(AuthTokenSerializer):
    # bounded as the user model bounds them (a longer name would reach the failed-login log and fail there)
    username = serializers.CharField(max_length=150, label="Username", write_only=True)
    password = serializers.CharField(max_length=4096, label="Password", style={"input_type": "password"},
                                     trim_whitespace=False, write_only=True)


class TokenSerializer(serializers.Serializer):
    token = serializers.CharField(help_text="send as `Authorization: Token <token>`; shown once, stored hashed")
    expiry = serializers.DateTimeField(allow_null=True, help_text="when the token stops working")


class ObtainTokenView(APIView):
    # POST (login) needs no credentials; DELETE (logout) needs the token it revokes.
    authentication_classes = [ExpiringTokenAuthentication]
    permission_classes = [AllowAny]
    throttle_classes = [AnonRateThrottle]
    serializer_class = LoginSerializer

    def get_exception_handler(self):
        return api_exception_handler

    @extend_schema(summary="Obtain a new API token for a username and password (it expires; see `expiry`)",
                   request=LoginSerializer,
                   responses={200: TokenSerializer, 400: OpenApiResponse(description="Bad credentials"),
                              429: OpenApiResponse(description="Throttled")})
    def post(self, request, *args, **kwargs):
        ser = LoginSerializer(data=request.data, context={"request": request})
        ser.is_valid(raise_exception=True)
        token, expiry = issue_token(ser.validated_data["user"])
        return Response({"token": token, "expiry": expiry})

    @extend_schema(summary="Revoke the token this request is authenticated with (logout)", request=None,
                   responses={204: None, 401: OpenApiResponse(description="Not authenticated (by token)"),
                              429: OpenApiResponse(description="Throttled")})
    def delete(self, request, *args, **kwargs):
        token = request.auth  # set by ExpiringTokenAuthentication only
        if not isinstance(token, AuthToken):
            raise NotAuthenticated("send the token to revoke as `Authorization: Token <token>`")
        token.delete()
        return Response(status=status.HTTP_204_NO_CONTENT)
