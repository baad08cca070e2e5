"""REST API for diagnostics (thin: logic in services).

    GET  /api/jobs/<id>/diagnosis/   verdict, confidence, evidence (with thresholds), recommendations,
                                     detected conditions, the adaptive controller's decisions, latest sweep
    GET  /api/sweeps/                the user's parallelism sweeps
    POST /api/sweeps/                {"endpoint": id, "dataset": id | "job": id, "sample_size", "start_parallelism",
                                      "max_parallelism", "levels"} -> 201, runs in a Celery worker
    GET  /api/sweeps/<id>/           one sweep with its curve
    POST /api/sweeps/<id>/cancel/    cancel a queued or running sweep (409 once it has ended)

Sweeps are under the jobs' caps and per-user quotas (services.create_sweep).
"""
from __future__ import annotations

from django.core.exceptions import ValidationError as DjangoValidationError
from django.db import transaction
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound

from controlplane.rest.exceptions import Conflict
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_datasets, visible_endpoints, visible_jobs, visible_sweeps
from controlplane.rest.conventions import ApiMixin

from . import services
from .tasks import run_sweep_task


class _Base(ApiMixin, APIView):
    pass


class DiagnosisSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    state = serializers.CharField()
    computed_at = serializers.CharField()
    diagnosis = serializers.JSONField()
    parallelism_auto = serializers.BooleanField()
    adaptive_decisions = serializers.JSONField()
    sweep = serializers.JSONField(allow_null=True)


class JobDiagnosisView(_Base):
    @extend_schema(summary="Bottleneck diagnosis of a job (evidence, recommendations, conditions)",
                   responses={200: DiagnosisSerializer, 401: OpenApiResponse(description="Not authenticated"),
                              404: OpenApiResponse(description="Not found (or another user's job)")})
    def get(self, request, job_id: str):
        job = visible_jobs(request.user).select_related("endpoint").filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        return Response(services.diagnosis_payload(job))


class SweepCreateSerializer(serializers.Serializer):
    endpoint = serializers.IntegerField(min_value=1, max_value=2**62)
    dataset = serializers.IntegerField(min_value=1, max_value=2**62, required=False)
    job = serializers.IntegerField(min_value=1, max_value=2**62, required=False)
    sample_size = serializers.IntegerField(min_value=1, max_value=10000, default=64)
    # JOBS_MAX_PARALLELISM bounds every level (services.sweep_errors); these bounds are the schema's
    start_parallelism = serializers.IntegerField(min_value=1, max_value=16384, default=1)
    max_parallelism = serializers.IntegerField(min_value=1, max_value=16384, default=512)
    levels = serializers.ListField(child=serializers.IntegerField(min_value=1, max_value=16384), required=False,
                                   max_length=64, default=list)

    def validate(self, data):
        if not data.get("dataset") and not data.get("job"):
            raise serializers.ValidationError({"dataset": "give a dataset, or a job to take it from"})
        if data["start_parallelism"] > data["max_parallelism"]:
            raise serializers.ValidationError({"start_parallelism": "must be <= max_parallelism"})
        return data


class SweepSerializer(serializers.Serializer):
    id = serializers.IntegerField()
    state = serializers.CharField()
    endpoint = serializers.IntegerField()
    dataset = serializers.IntegerField(allow_null=True)
    job = serializers.IntegerField(allow_null=True)
    sample_size = serializers.IntegerField()
    points = serializers.JSONField()
    knee = serializers.IntegerField(allow_null=True)
    recommended = serializers.IntegerField(allow_null=True)
    best_rollouts_per_s = serializers.FloatField(allow_null=True)
    speedup = serializers.FloatField(allow_null=True)
    hint = serializers.CharField()
    interpretation = serializers.CharField()
    stopped_reason = serializers.CharField()
    error = serializers.CharField()
    created_at = serializers.CharField(allow_null=True)
    finished_at = serializers.CharField(allow_null=True)


class SweepListView(_Base):
    @extend_schema(summary="List parallelism sweeps", responses={200: SweepSerializer(many=True)})
    def get(self, request):
        sweeps = visible_sweeps(request.user).order_by("-created_at")[:100]
        return Response([services.sweep_payload(s) for s in sweeps])

    @extend_schema(summary="Start a parallelism sweep (runs in a Celery worker)", request=SweepCreateSerializer,
                   responses={201: SweepSerializer, 400: OpenApiResponse(OpenApiTypes.OBJECT, description="Validation errors")})
    def post(self, request):
        ser = SweepCreateSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        data = ser.validated_data
        endpoint = visible_endpoints(request.user).filter(pk=data["endpoint"]).first()
        if endpoint is None:
            raise serializers.ValidationError({"endpoint": "no such endpoint"})
        job = dataset = None
        if data.get("job"):
            job = visible_jobs(request.user).filter(pk=data["job"]).first()
            if job is None:
                raise serializers.ValidationError({"job": "no such job"})
        if data.get("dataset"):
            dataset = visible_datasets(request.user).filter(pk=data["dataset"]).first()
            if dataset is None:
                raise serializers.ValidationError({"dataset": "no such dataset"})
        try:
            sweep = services.create_sweep(endpoint=endpoint, dataset=dataset, job=job, owner=request.user,
                                          sample_size=data["sample_size"], levels=data["levels"],
                                          start_parallelism=data["start_parallelism"],
                                          max_parallelism=data["max_parallelism"])
        except DjangoValidationError as e:
            raise serializers.ValidationError(e.message_dict if hasattr(e, "error_dict") else {"detail": e.messages})
        except ValueError as e:
            raise serializers.ValidationError({"detail": str(e)})
        transaction.on_commit(lambda: run_sweep_task.delay(sweep.pk))
        return Response(services.sweep_payload(sweep), status=status.HTTP_201_CREATED)


class SweepDetailView(_Base):
    @extend_schema(summary="One parallelism sweep with its curve",
                   responses={200: SweepSerializer, 401: OpenApiResponse(description="Not authenticated"),
                              404: OpenApiResponse(description="Not found (or another user's sweep)")})
    def get(self, request, sweep_id: str):
        sweep = visible_sweeps(request.user).filter(pk=int(sweep_id)).first()
        if sweep is None:
            raise NotFound("No ParallelismSweep matches the given query.")
        return Response(services.sweep_payload(sweep))


class SweepCancelView(_Base):
    @extend_schema(summary="Cancel a queued or running parallelism sweep (a running one stops within seconds)",
                   request=None,
                   responses={200: SweepSerializer, 401: OpenApiResponse(description="Not authenticated"),
                              404: OpenApiResponse(description="Not found (or another user's sweep)"),
                              409: OpenApiResponse(description="The sweep has already ended")})
    def post(self, request, sweep_id: str):
        sweep = visible_sweeps(request.user).filter(pk=int(sweep_id)).first()
        if sweep is None:
            raise NotFound("No ParallelismSweep matches the given query.")
        if not services.cancel_sweep(sweep):
            raise Conflict(f"sweep {sweep.pk} is {sweep.state}: only a queued or running sweep can be cancelled")
        return Response(services.sweep_payload(sweep))
