"""REST API views: thin. Validation in serializers, domain logic in the apps' services, ownership in
controlplane.access (another user's object answers 404, hiding its existence)."""
from __future__ import annotations

import io
import logging

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpResponse, StreamingHttpResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, extend_schema_view
from rest_framework import generics, mixins, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.parsers import MultiPartParser
from rest_framework.renderers import BaseRenderer, JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_datasets, visible_endpoints, visible_jobs
from controlplane.datasets import services as dataset_services
from controlplane.jobs.replica_load import replica_load
from controlplane.endpoints.tasks import enqueue as enqueue_endpoint_task
from controlplane.jobs import history as job_history
from controlplane.jobs import services as job_services
from controlplane.disclosure import error_for, shown_for
from controlplane.jobs.export import iter_export_lines, streamed_for
from controlplane.jobs import versions as job_versions
from controlplane.jobs import profile as job_profile
from controlplane.jobs.models import JobMetricSample, Rollout
from controlplane.jobs.verification import start_verification
from controlplane.jobs.verification import summary as verification_summary
from controlplane.jobs.workers import job_workers

from . import serializers as s
from controlplane.rest.conventions import READ_ERRORS, ApiMixin, errors, query_params
from controlplane.rest.exceptions import Conflict
from .pagination import IdCursorPagination, JobCursorPagination, ListCursorPagination, MetricCursorPagination
from controlplane.rest.parsers import JSONLinesParser, JSONParser, NDJSONParser, NDJSONRenderer

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


_query = query_params


# ---------------------------------------------------------------------------------------------- datasets


@extend_schema_view(
    list=extend_schema(summary="List datasets (newest first)", parameters=[s.DatasetListQuerySerializer],
                       responses={200: s.DatasetSerializer(many=True), **errors(400, 401, 429)}),
    retrieve=extend_schema(summary="Dataset detail (with the validation report)",
                           responses={200: s.DatasetDetailSerializer, **errors(*READ_ERRORS)}),
    destroy=extend_schema(summary="Delete a dataset (409 while jobs use it)",
                          responses={204: None, **errors(401, 404, 409, 429)}),
)
class DatasetViewSet(ApiMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin,
                     viewsets.GenericViewSet):
    parser_classes = [MultiPartParser, NDJSONParser, JSONLinesParser]
    pagination_class = ListCursorPagination

    def get_queryset(self):
        qs = visible_datasets(self.request.user).select_related("owner")
        if self.action != "retrieve":
            qs = qs.defer("validation_report")  # up to a thousand bad lines each: only the detail shows it
        if self.action == "list":
            q = _query(s.DatasetListQuerySerializer, self.request)
            for key in ("sha256", "status", "name"):
                if key in q:
                    qs = qs.filter(**{key: q[key]})
        return qs

    def get_serializer_class(self):
        return s.DatasetDetailSerializer if self.action == "retrieve" else s.DatasetSerializer

    @extend_schema(
        summary="Upload a NeMo Gym JSONL dataset (multipart `file`, or a raw application/x-ndjson body)",
        description="The body is validated while streaming. With bad lines the file is rejected whole (400 with "
                    "every bad line and its reason) unless accept_partial=true, which keeps the good lines.",
        request={"multipart/form-data": s.DatasetUploadSerializer, NDJSON: OpenApiTypes.BINARY},
        parameters=[s.DatasetUploadQuerySerializer],
        responses={201: s.DatasetDetailSerializer,
                   400: OpenApiResponse(s.DatasetRejectedSerializer, description="Rejected: the bad-line report, "
                                        "or field errors"),
                   **errors(401, 429)},
    )
    def create(self, request, *args, **kwargs):
        if request.content_type.split(";")[0].strip() in (NDJSONParser.media_type, JSONLinesParser.media_type):
            params = _query(s.DatasetUploadQuerySerializer, request)
            fileobj = request.data.get("file") or io.BytesIO(b"")  # an empty body has no stream
            source_filename = ""
        else:
            # A plain dict of the parts: QueryDict.copy() deep-copies, which a spooled upload cannot survive.
            data = {key: request.data.get(key) for key in request.data.keys()}
            for key, value in request.query_params.items():  # query fallbacks for the form fields
                data.setdefault(key, value)
            ser = s.DatasetUploadSerializer(data=data)
            ser.is_valid(raise_exception=True)
            params = ser.validated_data
            fileobj = params["file"]
            source_filename = getattr(fileobj, "name", "") or ""
        name = (params.get("name") or source_filename or f"upload {timezone.now():%Y-%m-%d %H:%M:%S}")[:200]
        if params.get("verifier"):  # an unknown verifier is refused before the body is read
            try:
                dataset_services.verifier_fields(params["verifier"])
            except ValueError as exc:
                raise ValidationError({"verifier": [str(exc)]}) from None
        try:
            dataset = dataset_services.ingest_jsonl(fileobj, name=name, owner=request.user,
                                            accept_partial=params.get("accept_partial", False),
                                            source_filename=source_filename[:500],
                                            verifier=params.get("verifier") or "")
        except dataset_services.DatasetValidationError as exc:
            return Response(_rejection_body(exc), status=status.HTTP_400_BAD_REQUEST)
        if params.get("description") and not dataset.description:
            dataset.description = params["description"]
            dataset.save(update_fields=["description"])
        return Response(s.DatasetDetailSerializer(dataset).data, status=status.HTTP_201_CREATED)

    def perform_destroy(self, instance):
        n = instance.jobs.count()
        if n:
            raise Conflict(f"dataset {instance.pk} is used by {n} job(s); delete those jobs first")
        dataset_services.delete_dataset(instance)  # ProtectedError from a job created meanwhile also answers 409

    @extend_schema(summary="Preview dataset rows", parameters=[s.RowsQuerySerializer],
                   responses={200: s.DatasetRowsSerializer, **errors(400, *READ_ERRORS)})
    @action(detail=True, methods=["get"])
    def rows(self, request, pk=None):
        dataset = self.get_object()
        q = _query(s.RowsQuerySerializer, request)
        start = q["offset"]
        rows, next_offset = dataset_services.bounded_rows(dataset, start, q["limit"])  # big rows cut, page bounded
        return Response({"dataset": dataset.pk, "row_count": dataset.row_count, "offset": start,
                         "limit": q["limit"], "next_offset": next_offset, "rows": rows})


def _rejection_body(exc) -> dict:
    """DatasetValidationError -> {"detail", "bad_lines": [{"line", "reason"}], "bad_line_count", "truncated"}."""
    report = getattr(exc, "report", None)
    if not isinstance(report, dict):
        report = {}
    bad_lines = getattr(exc, "bad_lines", None)
    if bad_lines is None:
        bad_lines = report.get("bad_lines", [])
    bad_lines = [
        {"line": int(b.get("line", 0)), "reason": str(b.get("reason", ""))} if isinstance(b, dict)
        else {"line": int(b[0]), "reason": str(b[1])}
        for b in bad_lines
    ]
    count = getattr(exc, "bad_line_count", None)
    if count is None:
        count = report.get("bad_line_count", len(bad_lines))
    body = {"detail": str(exc) or "the file has bad lines", "bad_lines": bad_lines, "bad_line_count": int(count)}
    truncated = getattr(exc, "truncated", report.get("truncated"))
    if truncated is not None:
        body["truncated"] = bool(truncated)
    return body


# ---------------------------------------------------------------------------------------------- endpoints


@extend_schema_view(
    list=extend_schema(summary="List endpoints (newest first)",
                       responses={200: s.EndpointSerializer(many=True), **errors(400, 401, 429)}),
    retrieve=extend_schema(summary="Endpoint detail", responses={200: s.EndpointSerializer, **errors(*READ_ERRORS)}),
    create=extend_schema(summary="Create an endpoint (api_key is write-only)",
                         responses={201: s.EndpointSerializer, **errors(400, 401, 429)}),
    update=extend_schema(responses={200: s.EndpointSerializer, **errors(400, *READ_ERRORS)}),
    partial_update=extend_schema(responses={200: s.EndpointSerializer, **errors(400, *READ_ERRORS)}),
    destroy=extend_schema(summary="Delete an endpoint (409 while jobs use it)",
                          responses={204: None, **errors(401, 404, 409, 429)}),
)
class EndpointViewSet(ApiMixin, viewsets.ModelViewSet):
    serializer_class = s.EndpointSerializer
    parser_classes = [JSONParser]
    pagination_class = ListCursorPagination

    def get_queryset(self):
        return visible_endpoints(self.request.user).select_related("owner")

    def perform_create(self, serializer):
        serializer.save(owner=self.request.user)

    def perform_destroy(self, instance):
        n = instance.jobs.count()
        if n:
            raise Conflict(f"endpoint {instance.pk} is used by {n} job(s); delete those jobs first")
        instance.delete()

    def _enqueue(self, kind, **params):
        endpoint = self.get_object()
        try:
            enqueue_endpoint_task(kind, endpoint, **params)
        except Exception as exc:  # noqa: BLE001 - broker down: nothing was sent
            log.warning("could not enqueue %s of endpoint %s: %s", kind, endpoint.pk, exc)
            return Response({"detail": "The task queue is unavailable; try again shortly.", "code": "unavailable"},
                            status=status.HTTP_503_SERVICE_UNAVAILABLE)
        return Response({"endpoint": endpoint.pk, "queued": kind,
                         "last_health": shown_for(self.request.user, endpoint.last_health),
                         "last_health_at": endpoint.last_health_at,
                         "last_prewarm": shown_for(self.request.user, endpoint.last_prewarm)},
                        status=status.HTTP_202_ACCEPTED)

    @extend_schema(summary="Per-replica load: in flight, requests, errors, in or out of rotation and since when "
                           "(summed over the runs that used the endpoint in the last REPLICA_LOAD_WINDOW_S)",
                   responses={200: s.ReplicaLoadSerializer, **errors(*READ_ERRORS)})
    @action(detail=True, methods=["get"])
    def replicas(self, request, pk=None):
        return Response(shown_for(request.user, replica_load(self.get_object())))

    @extend_schema(summary="Check the endpoint's health (in a worker; the result lands in last_health)",
                   request=None, responses={202: s.EndpointQueuedSerializer, **errors(*READ_ERRORS, 503)})
    @action(detail=True, methods=["post"])
    def health(self, request, pk=None):
        return self._enqueue("health")

    @extend_schema(summary="Pre-warm the endpoint with `count` tiny requests spread over the replicas (in a "
                           "worker; the result lands in last_prewarm)",
                   request=s.EndpointPrewarmRequestSerializer,
                   responses={202: s.EndpointQueuedSerializer, **errors(400, *READ_ERRORS, 503)})
    @action(detail=True, methods=["post"])
    def prewarm(self, request, pk=None):
        params = s.EndpointPrewarmRequestSerializer(data=request.data)  # a non-object body is a 400
        params.is_valid(raise_exception=True)
        return self._enqueue("prewarm", n=params.validated_data["count"])


# ---------------------------------------------------------------------------------------------- jobs

IDEMPOTENCY_HEADER = OpenApiParameter(
    "Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER, required=False,
    description="A client-chosen key (≤ 200 chars). Retrying with the same key returns the job created the first "
                "time (200) instead of starting a second one (201).")


def _job_params_match(job, data) -> bool:
    return job.dataset_id == data["dataset"].pk and job.endpoint_id == data["endpoint"].pk


@extend_schema_view(
    list=extend_schema(summary="List jobs (newest first)", parameters=[s.JobListQuerySerializer],
                       responses={200: s.JobSerializer(many=True), **errors(400, 401, 404, 429)}),
    retrieve=extend_schema(summary="Job detail: progress, aggregate metrics, timing summary",
                           responses={200: s.JobDetailSerializer, **errors(*READ_ERRORS)}),
)
class JobViewSet(ApiMixin, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Collection jobs. Another user's job answers 404."""

    parser_classes = [JSONParser]
    pagination_class = JobCursorPagination

    def get_queryset(self):
        qs = visible_jobs(self.request.user).select_related("owner")
        if self.action == "list":
            q = _query(s.JobListQuerySerializer, self.request)
            if q.get("state"):
                qs = qs.filter(state__in=q["state"])
            if "dataset" in q:
                qs = qs.filter(dataset_id=q["dataset"])
            if "endpoint" in q:
                qs = qs.filter(endpoint_id=q["endpoint"])
            if "created_after" in q:
                qs = qs.filter(created_at__gte=q["created_after"])
            if "created_before" in q:
                qs = qs.filter(created_at__lt=q["created_before"])
        return qs

    def get_serializer_class(self):
        if self.action == "create":
            return s.JobCreateSerializer
        return s.JobDetailSerializer if self.action != "list" else s.JobSerializer

    def retrieve(self, request, *args, **kwargs):
        # The latest verification run is read before the job row: a run stores the job's metrics before it marks
        # itself done, so a reply saying "done" carries them. Read after the job row, a run that finished in
        # between paired "done" with the metrics from before it (a client polling for "done" then read stale ones).
        try:
            verification = verification_summary(int(kwargs[self.lookup_field]))
        except (TypeError, ValueError):
            verification = None
        job = self.get_object()  # another user's job: 404 here, before anything read above is shown
        return Response(s.JobDetailSerializer(job, context={**self.get_serializer_context(),
                                                            "verification": verification}).data)

    @extend_schema(
        summary="Create (and launch) a collection job",
        parameters=[IDEMPOTENCY_HEADER],
        request=s.JobCreateSerializer,
        responses={201: s.JobDetailSerializer,
                   200: OpenApiResponse(s.JobDetailSerializer, description="Idempotency-Key seen before: that job"),
                   **errors(400, 401, 409, 429)},
    )
    def create(self, request, *args, **kwargs):
        key = request.headers.get("Idempotency-Key") or None
        if key is not None and (len(key) > 200 or "\x00" in key):
            raise ValidationError({"Idempotency-Key": ["at most 200 characters"]})
        ser = s.JobCreateSerializer(data=request.data, context=self.get_serializer_context())
        ser.is_valid(raise_exception=True)
        data = ser.validated_data
        try:
            job, created = job_services.get_or_create_job(owner=request.user, idempotency_key=key, launch=True, **data)
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict if hasattr(exc, "error_dict") else
                                  {"non_field_errors": exc.messages}) from exc
        except ValueError as exc:
            raise ValidationError({"non_field_errors": [str(exc)]}) from exc
        if not created:
            return self._replay(job, data)
        return Response(s.JobDetailSerializer(job).data, status=status.HTTP_201_CREATED)

    def _replay(self, job, data):
        if not _job_params_match(job, data):
            raise Conflict(f"Idempotency-Key already used for job {job.pk} with a different dataset or endpoint")
        return Response(s.JobDetailSerializer(job).data, status=status.HTTP_200_OK)

    def _transition(self, request, service_name):
        job = self.get_object()
        self._job_for_error = job
        getattr(job_services, service_name)(job)
        job.refresh_from_db()
        return Response(s.JobDetailSerializer(job).data)

    @extend_schema(summary="The worker processes running (or that ran) the job: host, pid, chunks held, "
                           "rollouts/s, last heartbeat", responses={200: s.JobWorkersSerializer, **errors(401, 404)})
    @action(detail=True, methods=["get"])
    def workers(self, request, pk=None):
        job = self.get_object()
        return Response({"job": job.pk, "workers": job_workers(job)})

    @extend_schema(summary="Cancel (queued, running or paused jobs)", request=None,
                   responses={200: s.JobDetailSerializer, **errors(401, 404, 409, 429)})
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        return self._transition(request, "cancel_job")

    @extend_schema(summary="Stop an open-ended job: the chunks in flight finish, no more start, then it completes "
                           "(cancel stops at once)", request=None,
                   responses={200: s.JobDetailSerializer, **errors(401, 404, 409, 429)})
    @action(detail=True, methods=["post"])
    def stop(self, request, pk=None):
        return self._transition(request, "stop_job")

    @extend_schema(summary="Pause (queued or running jobs)", request=None,
                   responses={200: s.JobDetailSerializer, **errors(401, 404, 409, 429)})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        return self._transition(request, "pause_job")

    @extend_schema(summary="Resume a paused, failed or cancelled job (exactly-once)", request=None,
                   responses={200: s.JobDetailSerializer, **errors(401, 404, 409, 429)})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        return self._transition(request, "resume_job")

    @extend_schema(summary="Collect the failed rollouts again (finished jobs)", request=None,
                   responses={200: s.JobDetailSerializer, **errors(401, 404, 409, 429)})
    @action(detail=True, methods=["post"], url_path="retry-failed")
    def retry_failed(self, request, pk=None):
        return self._transition(request, "retry_failed")

    @extend_schema(summary="Verify this job: a batch run over its stored rollouts (deferred or fast jobs, or to "
                           "re-verify), updating rewards in place and re-aggregating", request=s.VerifyRequestSerializer,
                   responses={202: s.JobDetailSerializer, **errors(400, 401, 404, 409, 429)})
    @action(detail=True, methods=["post"])
    def verify(self, request, pk=None):
        job = self.get_object()
        self._job_for_error = job
        ser = s.VerifyRequestSerializer(data=request.data or {})
        ser.is_valid(raise_exception=True)
        start_verification(job, verifier=ser.validated_data["verifier"] or None,
                           verifier_options=ser.validated_data["verifier_options"])
        job.refresh_from_db()
        return Response(s.JobDetailSerializer(job).data, status=status.HTTP_202_ACCEPTED)

    @extend_schema(
        summary="Export rollouts as NeMo Gym JSONL (streamed)",
        parameters=[s.ExportQuerySerializer],
        responses={(200, NDJSON): OpenApiResponse(OpenApiTypes.STR, description="One NeMo Gym output row per line"),
                   **errors(400, *READ_ERRORS)},
    )
    @action(detail=True, methods=["get"], renderer_classes=[JSONRenderer, NDJSONRenderer])
    def export(self, request, pk=None):
        job = self.get_object()
        q = _query(s.ExportQuerySerializer, request)
        lines = iter_export_lines(job, which=q["which"], error_view=lambda text: error_for(request.user, text),
                                  filters=s.export_filters(q))
        response = StreamingHttpResponse(streamed_for(request, _encode_lines(lines)),
                                         content_type=f"{NDJSON}; charset=utf-8")
        suffix = {"ok": "", "failed": "_failures", "all": "_all"}[q["which"]]
        response["Content-Disposition"] = f'attachment; filename="job-{job.pk}{suffix}.jsonl"'
        response["X-Job-State"] = job.state
        return response


EXPORT_CHUNK_BYTES = 64 * 1024


def _encode_lines(lines, chunk_bytes=EXPORT_CHUNK_BYTES):
    """Lines -> ~64 KiB byte chunks (one socket write each, not one per rollout); memory stays bounded."""
    buf, size = [], 0
    for line in lines:
        if isinstance(line, str):
            line = line.encode("utf-8")
        if not line.endswith(b"\n"):
            line += b"\n"
        buf.append(line)
        size += len(line)
        if size >= chunk_bytes:
            yield b"".join(buf)
            buf, size = [], 0
    if buf:
        yield b"".join(buf)


class _JobChildList(ApiMixin, generics.ListAPIView):
    # Lists under /jobs/<id>/...: 404 for a job the user cannot see.

    def get_job(self):
        job = visible_jobs(self.request.user).filter(pk=self.kwargs["job_id"]).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        return job


@extend_schema_view(get=extend_schema(summary="A job's rollouts (keyset pagination on id; filters)",
                                      parameters=[s.RolloutQuerySerializer],
                                      responses={200: s.RolloutSerializer(many=True), **errors(400, *READ_ERRORS)}))
class JobRolloutsView(_JobChildList):
    serializer_class = s.RolloutSerializer
    pagination_class = IdCursorPagination

    def get_queryset(self):
        job = self.get_job()
        q = _query(s.RolloutQuerySerializer, self.request)
        return Rollout.objects.filter(job=job).matching(**q)


@extend_schema_view(get=extend_schema(summary="A job's metric time series (samples/s, tokens/s, in flight, errors)",
                                      parameters=[s.MetricQuerySerializer],
                                      responses={200: s.JobMetricSampleSerializer(many=True),
                                                 **errors(400, *READ_ERRORS)}))
class JobMetricsView(_JobChildList):
    serializer_class = s.JobMetricSampleSerializer
    pagination_class = MetricCursorPagination

    def get_queryset(self):
        job = self.get_job()
        q = _query(s.MetricQuerySerializer, self.request)
        qs = JobMetricSample.objects.filter(job=job)
        if "since" in q:
            qs = qs.filter(t__gte=q["since"])
        if "worker" in q:
            qs = qs.filter(worker=q["worker"])
        return qs


class CSVRenderer(BaseRenderer):
    media_type, format = "text/csv", "csv"  # ?format=csv (or Accept: text/csv): the view writes the CSV itself

    def render(self, data, accepted_media_type=None, renderer_context=None):
        return data if isinstance(data, bytes) else JSONRenderer().render(data)


@extend_schema(summary="History: every job you ran with its throughput (rollouts/s, tokens/s, output tokens/s) and "
                       "mean reward, oldest first - the History page and its throughput_log.csv",
               parameters=[s.HistoryQuerySerializer],
               responses={200: OpenApiTypes.OBJECT, **errors(400, *READ_ERRORS)})
class HistoryView(ApiMixin, APIView):
    renderer_classes = [JSONRenderer, CSVRenderer]

    def get(self, request):
        q = _query(s.HistoryQuerySerializer, request)
        rows = job_history.history_rows(visible_jobs(request.user), q.get("days") or None)
        if q.get("format") == "csv" or request.accepted_renderer.format == "csv":
            resp = HttpResponse(content_type="text/csv")
            resp["Content-Disposition"] = 'attachment; filename="throughput_log.csv"'
            job_history.write_csv(rows, resp)
            return resp
        return Response({"count": len(rows), "results": [job_history.as_json(r) for r in rows]})


@extend_schema(summary="Per-task reward profile: each task's rollouts, mean reward, variance, pass rate and range, "
                       "with how many tasks have zero variance, always pass or never pass (JSON, or CSV)",
               parameters=[s.TaskProfileQuerySerializer],
               responses={200: OpenApiTypes.OBJECT, (200, "text/csv"): OpenApiResponse(OpenApiTypes.STR),
                          **errors(400, *READ_ERRORS)})
class JobTaskProfileView(ApiMixin, APIView):
    renderer_classes = [JSONRenderer, CSVRenderer]

    def get(self, request, job_id: str):
        q = _query(s.TaskProfileQuerySerializer, request)
        job = visible_jobs(request.user).filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        if q["format"] == "csv" or request.accepted_renderer.format == "csv":
            resp = StreamingHttpResponse(job_profile.iter_csv(job, pass_threshold=q["pass_threshold"],
                                                              order=q["order"]), content_type="text/csv")
            resp["Content-Disposition"] = f'attachment; filename="job-{job.pk}-task_profile.csv"'
            return resp
        out = job_profile.task_profile(job, pass_threshold=q["pass_threshold"], order=q["order"], limit=q["limit"],
                                       offset=q["offset"])
        return Response({"job": job.pk, **out})


class ApiNotFound(ApiMixin, APIView):
    """Anything under /api/ that no route matches: a JSON 404, not the HTML page."""

    permission_classes = []
    schema = None

    def dispatch(self, request, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.request = self.initialize_request(request, *args, **kwargs)
        self.headers = self.default_response_headers
        response = Response({"detail": "Not found."}, status=status.HTTP_404_NOT_FOUND)
        self.response = self.finalize_response(self.request, response, *args, **kwargs)
        return self.response


class JobWeightVersionsView(ApiMixin, APIView):
    @extend_schema(summary="A job's rollouts per weight version, and their version lag (staleness)",
                   responses={200: OpenApiTypes.OBJECT, **errors(*READ_ERRORS)})
    def get(self, request, job_id: str):
        job = visible_jobs(request.user).filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        return Response({"job": job.pk, **job_versions.job_versions(job)})
