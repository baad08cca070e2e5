"""REST API for model-server operations ("ops") and weight versions (thin: logic in ops/versions).

Operations run in a Celery worker, never in the web process: a POST validates the request, stores an
`AdminAction` and answers 202 with its URL (also in `Location`); the report lands on the action.

    POST /api/endpoints/<id>/weights/              one weight update (what a trainer calls after each
                                                   checkpoint): {"path" | "checkpoint_id", "version"?,
                                                   "pause_mode"?: keep} -> pause -> update -> resume
                                                   (always) on every replica
    POST /api/endpoints/<id>/ops/<kind>/           health | prewarm {"count"} | reset_prefix_cache |
                                                   pause {"mode"} | resume | sleep {"level"} | wake_up
    GET  /api/endpoints/<id>/ops/actions/<n>/      the action: state (queued, running, succeeded,
                                                   failed) and, once finished, its report
    GET  /api/endpoints/<id>/ops/log/              the operation log (?trace_id=prefix, ?kind=, ?limit=)
    GET  /api/endpoints/<id>/ops/stats/            p50/p95/p99 of queue/rpc/wall per kind, alert threshold

The old `/admin/...` paths (`/admin/operations/` for the log) are deprecated aliases of the same views:
they answer `Deprecation: true` and `Link: <ops url>; rel="successor-version"` (RFC 9745 / 8594).
"""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.response import Response
from rest_framework.reverse import reverse
from rest_framework.views import APIView

from controlplane.access import visible_endpoints
from controlplane.rest.conventions import READ_ERRORS, ApiMixin, errors, query_params
from controlplane.rest.parsers import JSONParser
from controlplane.rest.fields import NO_NUL, StrictJSONTypes

from workers.ops.replicas import PAUSE_MODES, SERVER_KINDS

from . import ops
from .models import AdminAction, AdminOperation

OBJECT = {"type": "object", "additionalProperties": {}}


class _Base(ApiMixin, APIView):
    parser_classes = [JSONParser]

    def endpoint(self, request, endpoint_id):
        ep = visible_endpoints(request.user).filter(pk=int(endpoint_id)).first()
        if ep is None:
            raise NotFound("No Endpoint matches the given query.")
        return ep


# ------------------------------------------------------------------------------------ actions
class AdminActionSerializer(serializers.ModelSerializer):
    url = serializers.SerializerMethodField(help_text="poll this until `state` is succeeded or failed")
    params = serializers.SerializerMethodField(help_text="the parameters it runs with (defaults filled in)")
    result = serializers.SerializerMethodField(
        help_text="once finished: the report. An operation: {trace_id, kind, params, ok, operations, unanswered "
                  "(, sent, succeeded)}; a weight update: {trace_id, ok, applied, server, version, previous_version, "
                  "requested_version, failed_replicas, unanswered_replicas, not_resumed, operations}. Each "
                  "operation: one request to one replica with its status and wall/rpc/queue ms.")
    summary = serializers.SerializerMethodField()

    class Meta:
        model = AdminAction
        fields = ["id", "url", "endpoint", "trace_id", "kind", "state", "params", "result", "error", "summary",
                  "source", "created_at", "started_at", "finished_at", "dispatch_ms", "total_ms"]
        read_only_fields = fields

    def get_url(self, action) -> str:
        return reverse("api:endpoints:ops-action", kwargs={"id": action.endpoint_id, "action_id": action.pk},
                       request=self.context.get("request"))

    @extend_schema_field(OBJECT)
    def get_params(self, action):
        return action.params

    def _user(self):
        request = self.context.get("request")
        return getattr(request, "user", None)

    @extend_schema_field({**OBJECT, "nullable": True})
    def get_result(self, action):
        return ops.result_for(self._user(), action.result)

    def to_representation(self, action):
        data = super().to_representation(action)
        data["error"] = ops.error_for(self._user(), data.get("error") or "")
        return data

    def get_summary(self, action) -> str:
        return ops.action_summary(action, self._user())


def _accepted(request, action) -> Response:
    body = AdminActionSerializer(action, context={"request": request}).data
    return Response(body, status=status.HTTP_202_ACCEPTED, headers={"Location": body["url"]})


class WaitQuerySerializer(serializers.Serializer):
    wait = serializers.FloatField(min_value=0, max_value=ops.MAX_WAIT_S, required=False,
                                  help_text="answer when the action ends (200), or after this many seconds (202)")


def _submit(request, ep, kind, trace_id=None, **params):
    q = query_params(WaitQuerySerializer, request)
    header = request.headers.get("X-Trace-Id")  # the trainer's own trace id, sent on to the servers
    if header is not None:
        if not ops.TRACE_ID.fullmatch(header):  # a header sent blank or malformed is an error, not "none"
            raise ValidationError({"X-Trace-Id": ["must be 8 to 64 hex digits or dashes (a uuid, a W3C trace id)"]})
        trace_id = header
    try:
        action = ops.submit(ep, kind, user=request.user, source="api", trace_id=trace_id, **params)
    except ops.StaleVersion as e:
        return Response({"detail": str(e), "code": "stale_version"}, status=status.HTTP_409_CONFLICT)
    except ops.OpsError as e:
        raise ValidationError({"detail": str(e)}) from None
    except ops.SharedServerDenied as e:
        raise PermissionDenied(str(e)) from None
    except ops.QueueUnavailable as e:
        return Response({"detail": str(e), "code": "unavailable"}, status=status.HTTP_503_SERVICE_UNAVAILABLE)
    if q.get("wait"):
        action = ops.wait_finished(action, q["wait"])
        if action.state in AdminAction.FINISHED:
            body = AdminActionSerializer(action, context={"request": request}).data
            return Response(body, status=status.HTTP_200_OK, headers={"Location": body["url"]})
    return _accepted(request, action)


# What ops.check_trace_id accepts, stated in the schema so that a client (and the schema fuzzer) knows.
TRACE_ID_PATTERN = r"^" + ops.TRACE_ID.pattern + r"$"


# 403: the operation changes a server another user's endpoint record points at (sharing.py); 409 (code
# stale_version): a weight update below the current version; 200: finished within ?wait=S.
ACTION_RESPONSES = {200: AdminActionSerializer, 202: AdminActionSerializer, **errors(400, 403, 409, *READ_ERRORS, 503)}
TRACE_PARAMETERS = [
    OpenApiParameter("X-Trace-Id", str, OpenApiParameter.HEADER, required=False, pattern=TRACE_ID_PATTERN,
                     description="your trace id (8-64 hex digits or dashes): stored on the action, sent to the model "
                                 "servers in X-Trace-Id and logged"),
    WaitQuerySerializer,
]


class WeightUpdateSerializer(StrictJSONTypes, serializers.Serializer):
    """At least one of path and checkpoint_id (the schema says so with anyOf: see schema_hooks)."""
    # Sent as given (not trimmed): the model server is the judge of a path or an id.
    path = serializers.CharField(min_length=1, max_length=1000, required=False, trim_whitespace=False,
                                 validators=[NO_NUL], help_text="directory of the new weights (as the model server sees it)")
    checkpoint_id = serializers.CharField(min_length=1, max_length=300, required=False, trim_whitespace=False,
                                          validators=[NO_NUL])
    version = serializers.IntegerField(min_value=0, max_value=2**62, required=False, allow_null=True, default=None,
                                       help_text="the weight version to tag rollouts with (default: last + 1)")
    pause_mode = serializers.ChoiceField(choices=PAUSE_MODES, default="keep")
    server = serializers.ChoiceField(choices=SERVER_KINDS, required=False, allow_null=True, default=None,
                                     help_text="how to send the update (default: detected from /version)")
    trace_id = serializers.RegexField(TRACE_ID_PATTERN, max_length=64, required=False,
                                      help_text="your trace id, 8-64 hex digits or dashes (or the X-Trace-Id "
                                                "header, which wins)")

    def validate(self, data):
        if "path" not in data and "checkpoint_id" not in data:
            raise serializers.ValidationError({"path": "give the new weights: a path or a checkpoint_id"})
        return data


class WeightUpdateView(_Base):
    @extend_schema(summary="Update the weights on every replica: pause(keep) -> update -> resume (always), in a "
                           "worker; poll the action's URL for the report",
                   request=WeightUpdateSerializer, responses=ACTION_RESPONSES, parameters=TRACE_PARAMETERS)
    def post(self, request, id: str):
        ep = self.endpoint(request, id)
        ser = WeightUpdateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        return _submit(request, ep, "update_weights", path=d.get("path", ""), checkpoint_id=d.get("checkpoint_id", ""),
                       version=d["version"], pause_mode=d["pause_mode"], server=d["server"], trace_id=d.get("trace_id"))


class OperationRequestSerializer(StrictJSONTypes, serializers.Serializer):
    mode = serializers.ChoiceField(choices=PAUSE_MODES, required=False, help_text="pause only (default keep)")
    level = serializers.IntegerField(min_value=1, max_value=2, required=False, help_text="sleep only (default 1)")
    count = serializers.IntegerField(min_value=0, max_value=ops.MAX_PREWARM, required=False,
                                     help_text="prewarm only: how many tiny requests (default 4 per replica)")


class OperationView(_Base):
    @extend_schema(summary="Run an operation on every replica, in a worker (health, prewarm, "
                           "reset_prefix_cache, pause, resume, sleep, wake_up); poll the action's URL for the report",
                   parameters=[OpenApiParameter("kind", str, OpenApiParameter.PATH, enum=list(ops.SIMPLE_KINDS)),
                               *TRACE_PARAMETERS],
                   request=OperationRequestSerializer, responses=ACTION_RESPONSES)
    def post(self, request, id: str, kind: str):
        ep = self.endpoint(request, id)
        if kind not in ops.SIMPLE_KINDS:
            raise NotFound(f"unknown operation {kind!r}; known: {', '.join(ops.SIMPLE_KINDS)}")
        ser = OperationRequestSerializer(data=request.data)  # a body that is not an object is a 400
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        return _submit(request, ep, kind, mode=d.get("mode"), level=d.get("level"), count=d.get("count"))


class ActionView(_Base):
    @extend_schema(summary="An ops action: its state and, once finished, its report",
                   responses={200: AdminActionSerializer, **errors(*READ_ERRORS)})
    def get(self, request, id: str, action_id: str):
        ep = self.endpoint(request, id)
        action = AdminAction.objects.filter(endpoint=ep, pk=int(action_id)).first()
        if action is None:
            raise NotFound("No ops action with this id for this endpoint.")
        return Response(AdminActionSerializer(action, context={"request": request}).data)


# ------------------------------------------------------------------------------------ reading back
class OperationLogQuerySerializer(serializers.Serializer):
    trace_id = serializers.CharField(max_length=64, required=False, help_text="a trace id or its prefix")
    kind = serializers.ChoiceField(choices=ops.KINDS, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=1000, default=200)


class OperationEntrySerializer(serializers.Serializer):
    id = serializers.IntegerField()
    endpoint = serializers.IntegerField()
    trace_id = serializers.CharField()
    kind = serializers.ChoiceField(choices=AdminOperation.Kind.choices)
    replica = serializers.CharField()
    status = serializers.ChoiceField(choices=AdminOperation.Status.choices)
    http_status = serializers.IntegerField(allow_null=True)
    error = serializers.CharField(allow_blank=True)
    wall_ms = serializers.FloatField(allow_null=True)
    rpc_ms = serializers.FloatField(allow_null=True)
    queue_ms = serializers.FloatField(allow_null=True)
    connect_ms = serializers.FloatField(allow_null=True)
    rpc_source = serializers.CharField(allow_blank=True)
    attempts = serializers.IntegerField()
    params = serializers.JSONField()
    source = serializers.CharField(allow_blank=True)
    created_at = serializers.DateTimeField()


class OperationLogSerializer(serializers.Serializer):
    endpoint = serializers.IntegerField()
    operations = OperationEntrySerializer(many=True)


class OperationLogView(_Base):
    @extend_schema(summary="The endpoint's operation log (one row per request to a replica), newest first",
                   parameters=[OperationLogQuerySerializer],
                   responses={200: OperationLogSerializer, **errors(400, *READ_ERRORS)})
    def get(self, request, id: str):
        ep = self.endpoint(request, id)
        q = query_params(OperationLogQuerySerializer, request)
        rows = ops.operations(ep, trace_id=q.get("trace_id", ""), kind=q.get("kind", ""), limit=q["limit"])
        return Response({"endpoint": ep.pk, "operations": [ops.operation_dict(o, request.user) for o in rows]})


class OperationStatsView(_Base):
    @extend_schema(summary="p50/p95/p99 of queue_ms, rpc_ms and wall_ms per operation kind, with queue alerts",
                   responses={200: OpenApiTypes.OBJECT, **errors(*READ_ERRORS)})
    def get(self, request, id: str):
        ep = self.endpoint(request, id)
        return Response({"endpoint": ep.pk, "queue_alert_ms": ops.queue_alert_ms(),
                         "current_weight_version": ops.current_version(ep),
                         "stats": ops.timing_stats(ep),
                         "slow_actions": [AdminActionSerializer(a, context={"request": request}).data
                                          for a in ops.slow_actions(ep, limit=10)],
                         "alerts": [ops.operation_dict(o, request.user) for o in ops.queue_alerts(ep)]})


# ------------------------------------------------------------------------------------ deprecated aliases
_SUCCESSOR = {"operations": "log"}  # old /admin/<segment>/ -> new /ops/<segment>/ where the name changed


def successor_path(path: str) -> str:
    """The /ops/ path that replaces a deprecated /api/endpoints/<id>/admin/... path."""
    head, sep, tail = path.partition("/admin/")
    segment, slash, rest = tail.partition("/")
    return f"{head}/ops/{_SUCCESSOR.get(segment, segment)}{slash}{rest}" if sep else path


def deprecated_alias(view_cls):
    """The same view under its old /admin/ path: marked deprecated in the schema, and each answer
    carries `Deprecation: true` and a `Link` to the successor /ops/ URL."""
    methods = [m for m in ("get", "post") if hasattr(view_cls, m)]

    class Alias(view_cls):
        def finalize_response(self, request, response, *args, **kwargs):
            response = super().finalize_response(request, response, *args, **kwargs)
            response["Deprecation"] = "true"
            response["Link"] = f'<{request.build_absolute_uri(successor_path(request.path))}>; rel="successor-version"'
            return response

    Alias.__name__ = Alias.__qualname__ = f"Deprecated{view_cls.__name__}"
    return extend_schema_view(**{m: extend_schema(deprecated=True) for m in methods})(Alias)
