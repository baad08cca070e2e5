"""One error shape for the whole API.

DRF's own errors keep their usual bodies ({"detail": ...} or {"field": ["..."]}); domain errors are
mapped here so that bad input never becomes a 500:
- jobs.models.InvalidTransition -> 409 {"detail": "cannot pause a job that is completed", "code": "invalid_state"}
- ProtectedError / IntegrityError -> 409 {"detail": ..., "code": "conflict"}
- Django ValidationError / ValueError raised by a service on user input -> 400 {"detail": ...}
"""
from __future__ import annotations

import logging

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import IntegrityError
from django.db.models import ProtectedError
from rest_framework import status
from rest_framework.exceptions import APIException
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from controlplane.rest.errors import InvalidTransition  # noqa: F401  (defined DRF-free; raised by the models)

log = logging.getLogger(__name__)


class Conflict(APIException):
    status_code = status.HTTP_409_CONFLICT
    default_detail = "The request conflicts with the current state of the resource."
    default_code = "conflict"


def api_exception_handler(exc, context):
    response = drf_exception_handler(exc, context)
    if response is not None:
        return response
    if isinstance(exc, InvalidTransition):
        job = getattr(context.get("view"), "_job_for_error", None)
        body = {"detail": str(exc), "code": "invalid_state"}
        if job is not None:
            body["state"] = job.state
        return Response(body, status=status.HTTP_409_CONFLICT)
    if isinstance(exc, ProtectedError):
        return Response({"detail": "This object is in use and cannot be deleted.", "code": "conflict"},
                        status=status.HTTP_409_CONFLICT)
    if isinstance(exc, IntegrityError):
        log.warning("integrity error turned into 409: %s", exc)
        return Response({"detail": "The request conflicts with existing data.", "code": "conflict"},
                        status=status.HTTP_409_CONFLICT)
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"detail": exc.messages}
        return Response(detail, status=status.HTTP_400_BAD_REQUEST)
    return None
