"""REST API for profiling (thin: logic in services).

    GET    /api/jobs/<id>/profile/          the job's profile (newest session): rows, red flags, overhead,
                                            the session now on (if any); ?session=<id> for another one
    POST   /api/jobs/<id>/profile/          switch profiling on: {"seconds": 60, "scope": "verify"|"worker",
                                            "clock": "wall"|"cpu", "budget_pct": 2, "window_s": 5,
                                            "stats_urls": [{"url": ".../stats", "log": ".../server.log"}]}
    DELETE /api/jobs/<id>/profile/          switch it off (the job keeps running)
    GET    /api/jobs/<id>/profile/export/?type=pstats|callgrind|tree
    GET    /api/profiles/compare/?a=<job>&b=<job>   per function: Δttot, Δtavg, Δncall, shares, verdicts
"""
from __future__ import annotations

from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.authentication import SessionAuthentication

from controlplane.api.authentication import ExpiringTokenAuthentication
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_jobs

from . import services
from .models import ProfileSession, ProfileSnapshot


class _Base(APIView):
    authentication_classes = [ExpiringTokenAuthentication, SessionAuthentication]


def _job(request, job_id):
    job = visible_jobs(request.user).filter(pk=int(job_id)).first()
    if job is None:
        raise NotFound("No CollectionJob matches the given query.")
    return job


class ProfileStartSerializer(serializers.Serializer):
    seconds = serializers.FloatField(required=False, allow_null=True, min_value=1, max_value=services.MAX_SECONDS)
    scope = serializers.ChoiceField(choices=["verify", "worker"], default="verify")
    clock = serializers.ChoiceField(choices=["wall", "cpu"], default="wall")
    budget_pct = serializers.FloatField(default=2.0, min_value=0.1, max_value=100)
    window_s = serializers.FloatField(default=5.0, min_value=1, max_value=600)
    stats_urls = serializers.ListField(child=serializers.JSONField(), required=False, default=list, max_length=16)

    def validate_stats_urls(self, value):
        out = []
        for i, v in enumerate(value):
            if isinstance(v, str):
                v = {"url": v}
            if not isinstance(v, dict) or not isinstance(v.get("url"), str) or not v["url"].startswith(("http://", "https://")):
                raise ValidationError(f"item {i}: expected an http(s) URL or {{\"url\": ..., \"log\": ...}}")
            if "log" in v and not isinstance(v["log"], str):
                raise ValidationError(f"item {i}: log must be a path")
            out.append({"url": v["url"], **({"log": v["log"]} if v.get("log") else {})})
        return out


class JobProfileView(_Base):
    @extend_schema(summary="The job's profile: merged rows of every worker, red flags, overhead",
                   parameters=[OpenApiParameter("session", int, required=False)],
                   responses={200: OpenApiTypes.OBJECT, 404: OpenApiResponse(description="Not found")})
    def get(self, request, job_id: str):
        job = _job(request, job_id)
        session = None
        if request.query_params.get("session"):
            try:
                session = ProfileSession.objects.filter(job=job, pk=int(request.query_params["session"])).first()
            except ValueError:
                raise ValidationError({"session": "must be an integer"}) from None
            if session is None:
                raise NotFound("No profiling session with this id for this job.")
        return Response(services.job_profile(job, session))

    @extend_schema(summary="Switch profiling on for a queued or running job (profile for N seconds)",
                   request=ProfileStartSerializer,
                   responses={201: OpenApiTypes.OBJECT, 400: OpenApiResponse(description="Invalid"),
                              409: OpenApiResponse(description="The job is finished")})
    def post(self, request, job_id: str):
        job = _job(request, job_id)
        ser = ProfileStartSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        try:
            session = services.start(job, user=request.user, **ser.validated_data)
        except services.ProfilingError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(services._session_payload(session), status=status.HTTP_201_CREATED)

    @extend_schema(summary="Switch profiling off (the job keeps running)", request=None,
                   responses={200: OpenApiTypes.OBJECT})
    def delete(self, request, job_id: str):
        job = _job(request, job_id)
        return Response({"stopped": services.stop(job)})


class JobProfileExportView(_Base):
    @extend_schema(summary="Export the job's profile: pstats (snakeviz), callgrind (KCachegrind), or a call tree",
                   parameters=[OpenApiParameter("type", str, enum=["pstats", "callgrind", "tree"]),
                               OpenApiParameter("session", int, required=False)],
                   responses={200: OpenApiTypes.BINARY})
    def get(self, request, job_id: str):
        job = _job(request, job_id)
        fmt = request.query_params.get("type", "pstats")  # not "format": DRF reads that one
        snaps = ProfileSnapshot.objects.filter(job=job)
        if request.query_params.get("session"):
            try:
                snaps = snaps.filter(session_id=int(request.query_params["session"]))
            except ValueError:
                raise ValidationError({"session": "must be an integer"}) from None
        rows = services.rows_of(list(snaps))
        if not rows:
            raise NotFound("This job has no profile yet.")
        if fmt == "pstats":
            resp = HttpResponse(services.to_pstats(rows), content_type="application/octet-stream")
            resp["Content-Disposition"] = f'attachment; filename="job{job.pk}.pstats"'
            return resp
        if fmt == "callgrind":
            resp = HttpResponse(services.to_callgrind(rows, title=f"job {job.pk}"), content_type="text/plain")
            resp["Content-Disposition"] = f'attachment; filename="callgrind.out.job{job.pk}"'
            return resp
        if fmt == "tree":
            return Response(services.call_tree(rows))
        raise ValidationError({"type": "one of pstats, callgrind, tree"})


class ProfileCompareView(_Base):
    @extend_schema(summary="Compare two jobs' profiles per function (baseline a, optimized b)",
                   parameters=[OpenApiParameter("a", int), OpenApiParameter("b", int)],
                   responses={200: OpenApiTypes.OBJECT})
    def get(self, request):
        ids = {}
        for k in ("a", "b"):
            try:
                ids[k] = int(request.query_params.get(k, ""))
            except ValueError:
                raise ValidationError({k: "a job id is required"}) from None
        return Response(services.compare_jobs(_job(request, ids["a"]), _job(request, ids["b"])))
