"""REST of the rollout stream for trainers (controlplane.jobs.stream): long-poll a batch, acknowledge it, list
the consumers. Thin: validation here, the cursor logic in the jobs app."""
from __future__ import annotations

import json

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.http import HttpResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access import visible_jobs
from controlplane.disclosure import shown_for
from controlplane.jobs import stream
from controlplane.jobs.export import streamed_for
from controlplane.rest.conventions import READ_ERRORS, ApiMixin, errors, query_params
from controlplane.rest.exceptions import Conflict
from controlplane.rest.fields import StrictJSONTypes
from controlplane.rest.parsers import JSONParser, NDJSONRenderer

from .serializers import FiniteFloatField, RolloutSerializer

CONSUMER_REGEX = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"
TOKEN_REGEX = r"^[0-9a-f]{1,64}$"
# what a stream row holds (a rollout less its trajectory, plus the lag) and what ?fields= may name, comma-separated
STREAM_FIELDS = [*(f for f in RolloutSerializer.Meta.fields if f != "trajectory"), "lag"]
_NAME = "(?:" + "|".join(STREAM_FIELDS) + ")"
FIELDS_REGEX = rf"^ *{_NAME} *(?:, *{_NAME} *)*$"
NDJSON = NDJSONRenderer.media_type


def _consumer_field(**kw):
    return serializers.RegexField(CONSUMER_REGEX, max_length=100,
                                  help_text="The consumer's name (letters, digits, . _ -): its durable cursor", **kw)


class StreamQuerySerializer(serializers.Serializer):
    consumer = _consumer_field()
    max = serializers.IntegerField(min_value=1, max_value=stream.MAX_BATCH, default=100,
                                   help_text="At most this many rollouts (groups mode: whole groups only, at least one)")
    wait = FiniteFloatField(min_value=0, max_value=stream.MAX_WAIT_S, default=0,
                            help_text="Long-poll: wait up to this many seconds for rollouts to land")
    groups = serializers.BooleanField(default=False, help_text="Complete groups only: all repeats of a task together "
                                                               "(fixed when the consumer is first used)")
    skip_equal = serializers.BooleanField(default=False, help_text="Groups mode: leave out groups whose rewards are "
                                                                   "all equal (fixed when the consumer is first used)")
    ack = serializers.RegexField(TOKEN_REGEX, max_length=64, required=False,
                                 help_text="Acknowledge this batch token first (as POST .../stream/ack/ would): one "
                                           "request per batch")
    fields = serializers.RegexField(
        FIELDS_REGEX, required=False, max_length=1000,
        help_text="Only these fields of each rollout, comma-separated (`id` always comes); default all. A trainer "
                  "that takes only what it trains on (e.g. `id,task_index,rollout_index,reward,weight_version,data`) "
                  "gets smaller batches, faster. Which rollouts come, and the cursor, do not depend on it. Names: "
                  "any of the `rollouts` fields below")

    def validate_fields(self, value: str) -> list[str]:
        names = [n.strip() for n in value.split(",") if n.strip()]
        unknown = sorted({n for n in names if n not in ALL_FIELDS})
        if unknown:
            raise serializers.ValidationError(f"unknown field(s): {', '.join(unknown)}; "
                                              f"known: {', '.join(ALL_FIELDS)}")
        if not names:
            raise serializers.ValidationError("name at least one field")
        return [f for f in ALL_FIELDS if f == "id" or f in names]  # the documented order, once each


class StreamRolloutSerializer(RolloutSerializer):
    lag = serializers.SerializerMethodField(help_text="Version lag when handed out (current - version at dispatch)")
    trajectory = None  # derived from `data`, which a trainer gets whole; the database writes the stream's rows

    class Meta(RolloutSerializer.Meta):
        fields = STREAM_FIELDS
        read_only_fields = fields

    def get_lag(self, obj) -> int | None:
        return stream.lag_of(obj.weight_version, self.context.get("current_version"))


class StreamBatchSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    consumer = serializers.CharField()
    token = serializers.CharField(help_text="Acknowledge the batch with it (POST .../stream/ack/); '' = no batch")
    cursor = serializers.IntegerField(help_text="Where the consumer's cursor goes once the batch is acknowledged")
    redelivered = serializers.BooleanField(help_text="The batch was handed out before and not acknowledged")
    count = serializers.IntegerField()
    skipped_stale = serializers.IntegerField(help_text="Rollouts past max_version_lag settled by this take")
    skipped_equal = serializers.IntegerField(help_text="Groups with all rewards equal left out by this take")
    current_version = serializers.IntegerField(allow_null=True)
    groups = serializers.ListField(child=serializers.ListField(child=serializers.IntegerField()), allow_null=True,
                                   help_text="Groups mode: the batch's groups, each the ids of all repeats of a task")
    rollouts = StreamRolloutSerializer(many=True)


class StreamAckSerializer(StrictJSONTypes, serializers.Serializer):
    consumer = _consumer_field()
    token = serializers.RegexField(TOKEN_REGEX, max_length=64, help_text="The batch's token")


class StreamAckResultSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    consumer = serializers.CharField()
    cursor = serializers.IntegerField()
    acked = serializers.IntegerField(help_text="Rollouts acknowledged by this call (0: acknowledged before)")
    delivered = serializers.IntegerField(help_text="Rollouts the consumer acknowledged in all")


class StreamConsumerSerializer(serializers.Serializer):
    name = serializers.CharField()
    groups = serializers.BooleanField()
    skip_equal = serializers.BooleanField()
    cursor = serializers.IntegerField()
    delivered = serializers.IntegerField()
    pending = serializers.IntegerField()
    updated_at = serializers.DateTimeField()


class StreamConsumersSerializer(serializers.Serializer):
    job = serializers.IntegerField()
    consumers = StreamConsumerSerializer(many=True)


ROW_FIELDS = [f for f in StreamRolloutSerializer.Meta.fields if f not in ("data", "lag")]
ALL_FIELDS = list(StreamRolloutSerializer.Meta.fields)  # what ?fields= may name; ROW_FIELDS + data + lag


class _JobStreamView(ApiMixin, APIView):
    parser_classes = [JSONParser]

    def get_job(self, job_id):
        job = visible_jobs(self.request.user).filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        return job


class JobStreamView(_JobStreamView):
    renderer_classes = [JSONRenderer, NDJSONRenderer]  # Accept: application/x-ndjson: the batch as JSON lines

    @extend_schema(summary="Take the consumer's next batch of verified rollouts (long-poll); exactly once per "
                           "consumer: the batch comes again until acknowledged",
                   description="`Accept: application/x-ndjson` (rows, not groups): the batch as JSON lines, sent "
                               "while the database reads it: one rollout per line, then one last line "
                               "`{\"batch\": {...}}` holding the fields of the JSON answer but `rollouts`. A body "
                               "without that last line was cut off: nothing was handed out or acknowledged by it; "
                               "take again.",
                   parameters=[StreamQuerySerializer],
                   responses={(200, "application/json"): StreamBatchSerializer,
                              (200, NDJSON): OpenApiResponse(OpenApiTypes.STR, description="A rollout per line, then "
                                                             "{\"batch\": {...}}"),
                              **errors(400, 409, *READ_ERRORS)})
    def get(self, request, job_id: str):
        job = self.get_job(job_id)
        q = query_params(StreamQuerySerializer, request)
        names = q.get("fields") or ALL_FIELDS
        fields = [f for f in names if f != "lag"]  # lag is worked out here, not read
        with_error, with_lag = "error" in names, "lag" in names
        if request.accepted_renderer.media_type == NDJSON and not q["groups"]:
            return self._lines(request, job, q, fields, with_lag, with_error)
        try:
            batch = stream.take(job, q["consumer"], max_n=q["max"], wait_s=q["wait"], groups=q["groups"],
                                skip_equal=q["skip_equal"], fields=fields, ack_token=q.get("ack"))
        except stream.StreamConflict as exc:
            raise Conflict(str(exc)) from exc
        # The body is written here, not by a serializer and the renderer: each row comes as the JSON text
        # PostgreSQL writes (its stored `data` never decoded and encoded again), read in the same pass that plans
        # the batch, and the body is one join of those texts (a ModelSerializer per row and the jsonb round trip
        # cost more than the rest of the request at 1,000 rows a batch). Same fields as StreamRolloutSerializer,
        # which documents them (?fields=: a subset of them).
        rows = batch["rows"] if batch["rows"] is not None else stream.rows_json(batch["ids"], fields)
        current = batch["current_version"]
        head = {"job": job.pk, "consumer": q["consumer"], "token": batch["token"], "cursor": batch["cursor"],
                "redelivered": batch["redelivered"], "count": len(rows), "skipped_stale": batch["skipped_stale"],
                "skipped_equal": batch["skipped_equal"], "current_version": current,
                "groups": stream.group_ids(job, rows) if q["groups"] else None}
        texts = _row_texts(rows, current, with_lag, with_error, request.user, ", ")
        return HttpResponse("".join([_dumps(head)[:-1], ', "rollouts": [', texts, "]}"]).encode(),
                            content_type="application/json")

    def _lines(self, request, job, q, fields, with_lag, with_error):
        """The batch as JSON lines, streamed while the database reads it (stream.take_streamed): a line per
        rollout (the fields of StreamRolloutSerializer), then one line {"batch": {...}} with what the JSON body's
        head holds (token, cursor, count ...), sent once the batch is the consumer's pending one. A body without
        that last line was cut off: take again (the same rows come)."""
        kw = {"max_n": q["max"], "wait_s": q["wait"], "fields": fields, "ack_token": q.get("ack")}
        steps = (stream.take_streamed(job, q["consumer"], **kw) if connection.vendor == "postgresql"
                 else _steps_of_take(job, q["consumer"], kw))
        try:
            first = next(steps)  # the consumer locked and the ack applied: a conflict is a 409, not a cut body
        except stream.StreamConflict as exc:
            raise Conflict(str(exc)) from exc
        user, consumer = request.user, q["consumer"]

        def body():
            current, count = first[1], 0
            try:
                for kind, value in steps:
                    if kind == "current":
                        current = value
                    elif kind == "rows":
                        count += len(value)
                        yield (_row_texts(value, current, with_lag, with_error, user, "\n") + "\n").encode()
                    else:
                        head = {"job": job.pk, "consumer": consumer, "token": value["token"],
                                "cursor": value["cursor"], "redelivered": value["redelivered"], "count": count,
                                "skipped_stale": value["skipped_stale"], "skipped_equal": value["skipped_equal"],
                                "current_version": value["current_version"], "groups": None}
                        yield (_dumps({"batch": head}) + "\n").encode()
            finally:  # a client gone: the take's transaction rolled back now, not when the generator is collected
                steps.close()

        return StreamingHttpResponse(streamed_for(request, body()), content_type=f"{NDJSON}; charset=utf-8")


def _steps_of_take(job, consumer: str, kw: dict):
    """stream.take() (not streamed: another database than PostgreSQL) as take_streamed's steps."""
    batch = stream.take(job, consumer, **kw)
    yield "current", batch["current_version"]
    rows = batch["rows"] if batch["rows"] is not None else stream.rows_json(batch["ids"], kw["fields"])
    if rows:
        yield "rows", rows
    yield "end", batch


def _row_texts(rows, current, with_lag: bool, with_error: bool, user, sep: str) -> str:
    """The rows (stream.rows_json's tuples) as JSON objects joined by `sep`: each row's text, its `lag` and
    `error` when asked for, its closing brace."""
    text_at = stream.ROW_TEXT
    if not (with_lag or with_error):
        return ("}" + sep).join([r[text_at] for r in rows]) + "}" if rows else ""
    lags: dict[str, str] = {}  # the tail of each weight version's rows: `, "lag": n}`
    parts: list[str] = []
    for i, row in enumerate(rows):
        tail = "}"
        if with_lag:
            wv = row[stream.ROW_VERSION]
            tail = lags.get(wv)
            if tail is None:
                lag = stream.lag_of(wv, current)
                tail = lags[wv] = ', "lag": ' + ("null" if lag is None else str(lag)) + "}"
        if with_error:
            error = row[stream.ROW_ERROR]
            parts += (sep if i else "", row[text_at], ', "error": ', _dumps(shown_for(user, error)) if error else '""',
                      tail)
        else:
            parts += (sep if i else "", row[text_at], tail)
    return "".join(parts)


def _dumps(obj) -> str:
    return json.dumps(obj, cls=DjangoJSONEncoder, ensure_ascii=False)


class JobStreamAckView(_JobStreamView):
    @extend_schema(summary="Acknowledge the consumer's batch: its cursor moves past it for good",
                   request=StreamAckSerializer,
                   responses={200: StreamAckResultSerializer, **errors(400, 409, *READ_ERRORS)})
    def post(self, request, job_id: str):
        job = self.get_job(job_id)
        ser = StreamAckSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        try:
            out = stream.ack(job, ser.validated_data["consumer"], ser.validated_data["token"])
        except stream.StreamConflict as exc:
            raise Conflict(str(exc)) from exc
        return Response({"job": job.pk, "consumer": ser.validated_data["consumer"], **out})


class JobStreamConsumersView(_JobStreamView):
    @extend_schema(summary="The job's stream consumers: cursor, rollouts acknowledged, batch pending",
                   responses={200: StreamConsumersSerializer, **errors(*READ_ERRORS)})
    def get(self, request, job_id: str):
        job = self.get_job(job_id)
        return Response({"job": job.pk, "consumers": stream.consumers(job)})

