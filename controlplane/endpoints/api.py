"""REST API for admin operations on model servers and weight versions (thin: logic in admin_ops/versions).

    POST /api/endpoints/<id>/weights/              one weight update (what a trainer calls after each
                                                   checkpoint): {"path" | "checkpoint_id", "version"?,
                                                   "pause_mode"?: keep} -> pause -> update -> resume
                                                   (always); 200 when every replica took the weights,
                                                   502 with the same report when one did not
    POST /api/endpoints/<id>/admin/<kind>/         health | prewarm {"count"} | reset_prefix_cache |
                                                   pause {"mode"} | resume | sleep {"level"} | wake_up
    GET  /api/endpoints/<id>/admin/operations/     the operation log (?trace_id=prefix, ?kind=, ?limit=)
    GET  /api/endpoints/<id>/admin/stats/          p50/p95/p99 of queue/rpc/wall per kind, alert threshold
    GET  /api/jobs/<id>/weight-versions/           rollouts per weight version and their version lag
"""
from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.authentication import SessionAuthentication

from controlplane.api.authentication import ExpiringTokenAuthentication
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.parsers import JSONParser
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_endpoints, visible_jobs

from workers.admin.ops import PAUSE_MODES

from . import admin_ops, versions

ERRORS = {401: OpenApiResponse(description="Not authenticated"),
          404: OpenApiResponse(description="Not found (or another user's endpoint)")}


class _Base(APIView):
    authentication_classes = [ExpiringTokenAuthentication, SessionAuthentication]
    parser_classes = [JSONParser]

    def endpoint(self, request, endpoint_id):
        ep = visible_endpoints(request.user).filter(pk=int(endpoint_id)).first()
        if ep is None:
            raise NotFound("No Endpoint matches the given query.")
        return ep


class WeightUpdateSerializer(serializers.Serializer):
    path = serializers.CharField(max_length=1000, required=False, allow_blank=True, default="",
                                 help_text="directory of the new weights (as the model server sees it)")
    checkpoint_id = serializers.CharField(max_length=300, required=False, allow_blank=True, default="")
    version = serializers.IntegerField(min_value=0, max_value=2**62, required=False, allow_null=True, default=None,
                                       help_text="the weight version to tag rollouts with (default: last + 1)")
    pause_mode = serializers.ChoiceField(choices=PAUSE_MODES, default="keep")
    server = serializers.ChoiceField(choices=["simulator", "vllm"], required=False, allow_null=True, default=None,
                                     help_text="how to send the update (default: detected from /version)")

    def validate(self, data):
        if not data["path"].strip() and not data["checkpoint_id"].strip():
            raise serializers.ValidationError({"path": "give the new weights: a path or a checkpoint_id"})
        return data


class OperationSerializer(serializers.Serializer):
    kind = serializers.CharField()
    replica = serializers.CharField()
    status = serializers.CharField()
    ok = serializers.BooleanField()
    http_status = serializers.IntegerField(allow_null=True)
    error = serializers.CharField()
    wall_ms = serializers.FloatField(allow_null=True)
    rpc_ms = serializers.FloatField(allow_null=True)
    queue_ms = serializers.FloatField(allow_null=True)
    attempts = serializers.IntegerField()
    timed_out = serializers.BooleanField()


class WeightUpdateResultSerializer(serializers.Serializer):
    trace_id = serializers.CharField()
    ok = serializers.BooleanField()
    applied = serializers.BooleanField()
    server = serializers.CharField()
    version = serializers.CharField()
    previous_version = serializers.CharField()
    requested_version = serializers.CharField()
    failed_replicas = serializers.ListField(child=serializers.CharField())
    unanswered_replicas = serializers.ListField(child=serializers.CharField())
    not_resumed = serializers.ListField(child=serializers.CharField())
    operations = OperationSerializer(many=True)


class WeightUpdateView(_Base):
    @extend_schema(summary="Update the weights on every replica: pause(keep) -> update -> resume (always)",
                   request=WeightUpdateSerializer,
                   responses={200: WeightUpdateResultSerializer,
                              400: OpenApiResponse(OpenApiTypes.OBJECT, description="Validation errors"),
                              502: WeightUpdateResultSerializer, **ERRORS})
    def post(self, request, id: str):
        ep = self.endpoint(request, id)
        ser = WeightUpdateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        try:
            out = admin_ops.update_weights(ep, path=d["path"], checkpoint_id=d["checkpoint_id"], version=d["version"],
                                           pause_mode=d["pause_mode"], server=d["server"], user=request.user,
                                           source="api")
        except admin_ops.AdminOpError as e:
            raise ValidationError({"detail": str(e)}) from None
        return Response(out, status=200 if out["applied"] and out["ok"] else 502)


class OperationRequestSerializer(serializers.Serializer):
    mode = serializers.ChoiceField(choices=PAUSE_MODES, required=False, help_text="pause only")
    level = serializers.ChoiceField(choices=[1, 2], required=False, help_text="sleep only")
    count = serializers.IntegerField(min_value=0, max_value=admin_ops.MAX_PREWARM, required=False,
                                     help_text="prewarm only: how many tiny requests (default 4 per replica)")


class OperationResultSerializer(serializers.Serializer):
    trace_id = serializers.CharField()
    kind = serializers.CharField()
    params = serializers.JSONField()
    ok = serializers.BooleanField()
    operations = OperationSerializer(many=True)
    unanswered = serializers.ListField(child=serializers.CharField())


class OperationView(_Base):
    @extend_schema(summary="Run an admin operation on every replica (health, prewarm, reset_prefix_cache, pause, "
                           "resume, sleep, wake_up)", request=OperationRequestSerializer,
                   responses={200: OperationResultSerializer,
                              400: OpenApiResponse(OpenApiTypes.OBJECT, description="Validation errors"), **ERRORS})
    def post(self, request, id: str, kind: str):
        ep = self.endpoint(request, id)
        if kind not in admin_ops.SIMPLE_KINDS:
            raise NotFound(f"unknown operation {kind!r}; known: {', '.join(admin_ops.SIMPLE_KINDS)}")
        ser = OperationRequestSerializer(data=request.data if isinstance(request.data, dict) else {})
        ser.is_valid(raise_exception=True)
        d = ser.validated_data
        try:
            out = admin_ops.run_operation(ep, kind, mode=d.get("mode"), level=d.get("level"), count=d.get("count"),
                                          user=request.user, source="api")
        except admin_ops.AdminOpError as e:
            raise ValidationError({"detail": str(e)}) from None
        return Response(out)


class OperationLogView(_Base):
    @extend_schema(summary="The endpoint's admin operation log, newest first",
                   parameters=[OpenApiParameter("trace_id", str, description="a trace id or its prefix"),
                               OpenApiParameter("kind", str), OpenApiParameter("limit", int)],
                   responses={200: OpenApiTypes.OBJECT, **ERRORS})
    def get(self, request, id: str):
        ep = self.endpoint(request, id)
        try:
            limit = max(1, min(int(request.query_params.get("limit", 200)), 1000))
        except ValueError:
            raise ValidationError({"limit": "must be an integer"}) from None
        kind = request.query_params.get("kind", "")
        if kind and kind not in admin_ops.KINDS:
            raise ValidationError({"kind": f"one of {', '.join(admin_ops.KINDS)}"})
        rows = admin_ops.operations(ep, trace_id=request.query_params.get("trace_id", "")[:64], kind=kind, limit=limit)
        return Response({"endpoint": ep.pk, "operations": [admin_ops.operation_dict(o) for o in rows]})


class OperationStatsView(_Base):
    @extend_schema(summary="p50/p95/p99 of queue_ms, rpc_ms and wall_ms per operation kind, with queue alerts",
                   responses={200: OpenApiTypes.OBJECT, **ERRORS})
    def get(self, request, id: str):
        ep = self.endpoint(request, id)
        return Response({"endpoint": ep.pk, "queue_alert_ms": admin_ops.queue_alert_ms(),
                         "current_weight_version": admin_ops.current_version(ep),
                         "stats": admin_ops.timing_stats(ep),
                         "alerts": [admin_ops.operation_dict(o) for o in admin_ops.queue_alerts(ep)]})


class JobWeightVersionsView(APIView):
    authentication_classes = [ExpiringTokenAuthentication, SessionAuthentication]

    @extend_schema(summary="A job's rollouts per weight version, and their version lag (staleness)",
                   responses={200: OpenApiTypes.OBJECT, **ERRORS})
    def get(self, request, job_id: str):
        job = visible_jobs(request.user).filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        return Response({"job": job.pk, **versions.job_versions(job)})
