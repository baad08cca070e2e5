"""REST: a user's webhooks (the secret is shown once, when created), their delivery log, and a job's gate
failure reported by CI (rolloutctl) so its webhooks hear of it. Mounted under /api/ (controlplane.api.urls)."""
from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane import notices
from controlplane.access import visible_endpoints, visible_jobs
from controlplane.rest.conventions import READ_ERRORS, ApiMixin, errors
from controlplane.rest.fields import StrictJSONTypes
from controlplane.rest.parsers import JSONParser

from . import services
from .models import EVENTS, Webhook, WebhookDelivery


class WebhookSerializer(StrictJSONTypes, serializers.ModelSerializer):
    events = serializers.ListField(child=serializers.ChoiceField(choices=[e for e, _ in EVENTS]), required=False,
                                   help_text="Events to send; empty: all")

    class Meta:
        model = Webhook
        fields = ["id", "name", "url", "endpoint", "events", "enabled", "created_at"]
        read_only_fields = ["id", "created_at"]

    def validate_url(self, url):
        if why := services.url_problem(url):
            raise serializers.ValidationError(f"this receiver URL is refused: {why}")
        return url

    def validate_endpoint(self, endpoint):
        if endpoint is not None and not visible_endpoints(self.context["request"].user).filter(pk=endpoint.pk).exists():
            raise serializers.ValidationError("no such endpoint")
        return endpoint


class DeliverySerializer(serializers.ModelSerializer):
    class Meta:
        model = WebhookDelivery
        fields = ["id", "event", "job", "state", "attempts", "response_status", "error", "duration_ms", "created_at",
                  "finished_at", "payload"]


class _Base(ApiMixin, APIView):
    parser_classes = [JSONParser]


class WebhookListView(_Base):
    @extend_schema(summary="Your webhooks", responses={200: WebhookSerializer(many=True), **errors(401, 429)})
    def get(self, request):
        return Response(WebhookSerializer(Webhook.objects.filter(owner=request.user).order_by("id"), many=True).data)

    @extend_schema(summary="Add a webhook (Slack-compatible JSON, signed: X-Rollout-Signature = v1=HMAC-SHA256 of "
                           "'<X-Rollout-Timestamp>.<body>' with the secret, returned once here)",
                   request=WebhookSerializer, responses={201: WebhookSerializer, **errors(400, 401, 429)})
    def post(self, request):
        ser = WebhookSerializer(data=request.data, context={"request": request})
        ser.is_valid(raise_exception=True)
        secret = services.new_secret()
        hook = ser.save(owner=request.user, secret=secret)
        return Response({**WebhookSerializer(hook).data, "secret": secret}, status=status.HTTP_201_CREATED)


def _own(request, hook_id) -> Webhook:
    hook = Webhook.objects.filter(owner=request.user, pk=int(hook_id)).first()
    if hook is None:
        raise NotFound("No Webhook matches the given query.")
    return hook


class WebhookDetailView(_Base):
    @extend_schema(summary="Delete a webhook", responses={204: None, **errors(*READ_ERRORS)})
    def delete(self, request, hook_id: str):
        _own(request, hook_id).delete()
        return Response(status=status.HTTP_204_NO_CONTENT)


class WebhookDeliveriesView(_Base):
    @extend_schema(summary="A webhook's delivery log, newest first (the last 100)",
                   responses={200: DeliverySerializer(many=True), **errors(*READ_ERRORS)})
    def get(self, request, hook_id: str):
        hook = _own(request, hook_id)
        return Response(DeliverySerializer(hook.deliveries.all()[:100], many=True).data)


class GateFailedSerializer(StrictJSONTypes, serializers.Serializer):
    reason = serializers.CharField(max_length=2000, allow_blank=True, trim_whitespace=False)  # maxLength as sent


class JobGateFailedView(_Base):
    @extend_schema(summary="Report that a CI gate failed on this job (rolloutctl does): its webhooks are told",
                   request=GateFailedSerializer, responses={202: None, **errors(400, *READ_ERRORS)})
    def post(self, request, job_id: str):
        job = visible_jobs(request.user).filter(pk=int(job_id)).first()
        if job is None:
            raise NotFound("No CollectionJob matches the given query.")
        ser = GateFailedSerializer(data=request.data)
        ser.is_valid(raise_exception=True)
        notices.emit("job.gate_failed", job_id=job.pk, job_name=job.name, owner_id=job.owner_id,
                     requested_by_id=request.user.pk, endpoint_id=job.endpoint_id, state=str(job.state),
                     detail=ser.validated_data["reason"] or "a CI gate failed")
        return Response(status=status.HTTP_202_ACCEPTED)
