"""The API's conventions, shared by every app's API views: authentication, the id pattern in URLs, the
exception handler and the documented error responses."""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse
from rest_framework.authentication import SessionAuthentication

from .authentication import ExpiringTokenAuthentication
from .exceptions import api_exception_handler
from .fields import ErrorSerializer

ID_REGEX = r"[0-9]{1,18}"  # fits a bigint; anything else is a 404, never a database error


def errors(*codes):
    """Documented error responses (DRF bodies: {"detail": ...}; 400 carries field errors)."""
    out = {}
    for code in codes:
        if code == 400:
            out[400] = OpenApiResponse(OpenApiTypes.OBJECT, description="Validation errors, by field")
        else:
            out[code] = OpenApiResponse(ErrorSerializer, description={
                401: "Not authenticated", 403: "Forbidden", 404: "Not found (or another user's object)",
                409: "Conflicts with the object's current state", 429: "Throttled",
                503: "Temporarily unavailable (the task queue is down)"}.get(code, ""))
    return out


READ_ERRORS = (401, 404, 429)


def query_params(serializer_cls, request):
    """Validate query parameters. An empty value (`?since=`) is an error, not "absent"."""
    from rest_framework.exceptions import ValidationError

    ser = serializer_cls(data=request.query_params)
    ser.is_valid(raise_exception=True)
    blank = {name: ["This parameter may not be blank."] for name, field in ser.fields.items()
             if request.query_params.get(name) == "" and not getattr(field, "allow_blank", False)}
    if blank:
        raise ValidationError(blank)
    return ser.validated_data


class ApiMixin:
    # Token first, so an anonymous request gets 401 with `WWW-Authenticate: Token`.
    authentication_classes = [ExpiringTokenAuthentication, SessionAuthentication]
    lookup_value_regex = ID_REGEX

    def get_exception_handler(self):
        return api_exception_handler
