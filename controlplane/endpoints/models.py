"""Model endpoints: vLLM or any OpenAI-compatible server, with one or several replicas."""
from django.conf import settings
from django.db import models


class Endpoint(models.Model):
    class Flavor(models.TextChoices):
        CHAT = "chat_completions", "Chat completions"
        COMPLETIONS = "completions", "Completions"
        RESPONSES = "responses", "Responses API"

    class Kind(models.TextChoices):
        VLLM = "vllm", "vLLM (has /metrics and admin routes)"
        OPENAI = "openai", "Hosted OpenAI-compatible API"
        NEMO_GYM = "nemo_gym", "NeMo Gym deployment (head server; agents discovered)"
        NEMO_GYM_AGENT = "nemo_gym_agent", "NeMo Gym agent server (/run)"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="endpoints")
    name = models.CharField(max_length=200)
    kind = models.CharField(max_length=20, choices=Kind.choices, default=Kind.VLLM)
    base_url = models.URLField(max_length=500, help_text="e.g. http://127.0.0.1:8000 (the /v1 prefix is added)")
    replica_urls = models.JSONField(default=list, blank=True, help_text="Extra replica base URLs; requests are spread over all")
    model_name = models.CharField(max_length=300)
    api_flavor = models.CharField(max_length=30, choices=Flavor.choices, default=Flavor.CHAT)
    api_key = models.CharField(max_length=500, blank=True)  # write-only everywhere it is exposed
    request_timeout_s = models.FloatField(default=600.0)
    connect_timeout_s = models.FloatField(default=10.0)
    max_retries = models.PositiveIntegerField(default=5, help_text="Retries per request before the row is recorded as failed")
    rpm_limit = models.PositiveIntegerField(null=True, blank=True)
    tpm_limit = models.PositiveIntegerField(null=True, blank=True)
    last_health = models.JSONField(default=dict, blank=True)
    last_health_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return f"{self.name} ({self.model_name} @ {self.base_url})"

    @property
    def all_base_urls(self):
        return [self.base_url, *[u for u in self.replica_urls if u and u != self.base_url]]

    @property
    def is_nemo_gym(self):
        """An environment endpoint: rows go to NeMo Gym agents' /run (model_name is the default agent's name)."""
        return self.kind in (self.Kind.NEMO_GYM, self.Kind.NEMO_GYM_AGENT)

    @property
    def has_api_key(self):
        return bool(self.api_key)
