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
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_jobs
from controlplane.rest.conventions import READ_ERRORS, ApiMixin, errors, query_params
from controlplane.rest.parsers import JSONParser
from controlplane.rest.fields import StrictJSONTypes

from . import comparison, exports, services
from .models import ProfileSession, ProfileSnapshot


class _Base(ApiMixin, APIView):
    parser_classes = [JSONParser]


BIGINT = 2**63 - 1


class SessionQuerySerializer(serializers.Serializer):
    session = serializers.IntegerField(min_value=1, max_value=BIGINT, required=False,
                                       help_text="a profiling session of this job (default: the newest)")


class ExportQuerySerializer(SessionQuerySerializer):
    type = serializers.ChoiceField(choices=["pstats", "callgrind", "tree"], default="pstats")


class CompareQuerySerializer(serializers.Serializer):
    a = serializers.IntegerField(min_value=1, max_value=BIGINT, help_text="the baseline job")
    b = serializers.IntegerField(min_value=1, max_value=BIGINT, help_text="the optimized job")


def _job(request, job_id):
    job = visible_jobs(request.user).filter(pk=int(job_id)).first()
    if job is None:
        raise NotFound("No CollectionJob matches the given query.")
    return job


# The length bound is in the pattern, not in maxLength: generators build boundary-length strings that ignore
# the pattern.
URL_PATTERN = r"^https?://[^\x00\ud800-\udfff]{1,2000}$"
NO_NUL_PATTERN = r"^[^\x00\ud800-\udfff]*$"


class StatsUrlSerializer(StrictJSONTypes, serializers.Serializer):
    """A NeMo Gym server's /stats URL, and optionally its server.log (pulled into the same rows)."""
    url = serializers.RegexField(URL_PATTERN, trim_whitespace=False)
    log = serializers.RegexField(NO_NUL_PATTERN, max_length=1000, required=False, allow_blank=True,
                                 trim_whitespace=False)


class ProfileStartSerializer(StrictJSONTypes, serializers.Serializer):
    seconds = serializers.FloatField(required=False, allow_null=True, min_value=1, max_value=services.MAX_SECONDS)
    scope = serializers.ChoiceField(choices=["verify", "worker"], default="verify",
                                    help_text="verify: your job's verifier calls; worker: the whole worker process "
                                              "(every tenant's work on it): staff only")
    clock = serializers.ChoiceField(choices=["wall", "cpu"], default="wall")
    budget_pct = serializers.FloatField(default=2.0, min_value=0.1, max_value=100,
                                        help_text="verify scope: the throughput cost the sampling aims at, in %; "
                                                  "100 profiles every verification (exact call counts)")
    window_s = serializers.FloatField(default=5.0, min_value=1, max_value=600)
    stats_urls = StatsUrlSerializer(many=True, required=False, default=list, max_length=16)

    def validate_stats_urls(self, value):
        return [{"url": v["url"], **({"log": v["log"]} if v.get("log") else {})} for v in value]


class JobProfileView(_Base):
    @extend_schema(summary="The job's profile: merged rows of every worker, red flags, overhead",
                   parameters=[SessionQuerySerializer],
                   responses={200: OpenApiTypes.OBJECT, **errors(400, *READ_ERRORS)})
    def get(self, request, job_id: str):
        job = _job(request, job_id)
        q = query_params(SessionQuerySerializer, request)
        session = None
        if "session" in q:
            session = ProfileSession.objects.filter(job=job, pk=q["session"]).first()
            if session is None:
                raise NotFound("No profiling session with this id for this job.")
        return Response(services.job_profile(job, session))

    @extend_schema(summary="Switch profiling on for a queued or running job (profile for N seconds)",
                   request=ProfileStartSerializer,
                   responses={201: OpenApiTypes.OBJECT, **errors(400, *READ_ERRORS),
                              403: OpenApiResponse(description="scope 'worker' is for staff only"),
                              409: OpenApiResponse(description="The job is finished")})
    def post(self, request, job_id: str):
        job = _job(request, job_id)
        ser = ProfileStartSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        try:
            session = services.start(job, user=request.user, **ser.validated_data)
        except services.ProfilingForbidden as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_403_FORBIDDEN)
        except services.ProfilingError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(services._session_payload(session), status=status.HTTP_201_CREATED)

    @extend_schema(summary="Switch profiling off (the job keeps running)", request=None,
                   responses={200: OpenApiTypes.OBJECT, **errors(*READ_ERRORS)})
    def delete(self, request, job_id: str):
        job = _job(request, job_id)
        return Response({"stopped": services.stop(job)})


class JobProfileExportView(_Base):
    @extend_schema(summary="Export the job's profile: pstats (snakeviz), callgrind (KCachegrind), or a call tree",
                   parameters=[ExportQuerySerializer],
                   responses={(200, "application/octet-stream"): OpenApiResponse(OpenApiTypes.BINARY, description="pstats"),
                              (200, "text/plain"): OpenApiResponse(OpenApiTypes.STR, description="callgrind"),
                              (200, "application/json"): OpenApiResponse(OpenApiTypes.OBJECT, description="call tree"),
                              **errors(400, *READ_ERRORS)})
    def get(self, request, job_id: str):
        job = _job(request, job_id)
        q = query_params(ExportQuerySerializer, request)  # "type", not "format": DRF reads that one
        snaps = ProfileSnapshot.objects.filter(job=job)
        if "session" in q:
            snaps = snaps.filter(session_id=q["session"])
        rows = services.rows_of(list(snaps))
        if not rows:
            raise NotFound("This job has no profile yet.")
        if q["type"] == "pstats":
            resp = HttpResponse(exports.to_pstats(rows), content_type="application/octet-stream")
            resp["Content-Disposition"] = f'attachment; filename="job{job.pk}.pstats"'
            return resp
        if q["type"] == "callgrind":
            resp = HttpResponse(exports.to_callgrind(rows, title=f"job {job.pk}"), content_type="text/plain")
            resp["Content-Disposition"] = f'attachment; filename="callgrind.out.job{job.pk}"'
            return resp
        return Response(exports.call_tree(rows))


class ProfileCompareView(_Base):
    @extend_schema(summary="Compare two jobs' profiles per function (baseline a, optimized b)",
                   parameters=[CompareQuerySerializer], responses={200: OpenApiTypes.OBJECT, **errors(400, *READ_ERRORS)})
    def get(self, request):
        q = query_params(CompareQuerySerializer, request)
        return Response(comparison.compare_jobs(_job(request, q["a"]), _job(request, q["b"])))
