"""Forms: dataset upload, endpoint, job launch (every ng_collect_rollouts parameter), rollout filters."""
from __future__ import annotations


from django import forms

from controlplane.endpoints.models import Endpoint
from controlplane.jsonsafe import loads as json_loads_bounded
from controlplane.jobs.models import CollectionJob
from controlplane.datasets.services import verifier_fields
from controlplane.jobs.services import mlflow_targets
from controlplane.operator import worker_queues

FAILURE_CLASSES = ["http_429", "http_5xx", "http_4xx", "timeout", "connection", "bad_response",
                   "verifier_error", "cancelled"]


class JSONDictField(forms.CharField):
    widget = forms.Textarea(attrs={"rows": 2, "placeholder": "{}"})

    def to_python(self, value):
        value = (value or "").strip()
        if not value:
            return {}
        try:
            obj = json_loads_bounded(value)
        except ValueError as e:  # JSONDecodeError, or nested too deeply
            raise forms.ValidationError(f"not valid JSON: {e}") from e
        if not isinstance(obj, dict):
            raise forms.ValidationError("must be a JSON object")
        return obj


class DatasetUploadForm(forms.Form):
    file = forms.FileField(help_text="NeMo Gym JSONL: one task per line")
    name = forms.CharField(max_length=200, required=False, help_text="defaults to the file name")
    accept_partial = forms.BooleanField(required=False, help_text="keep the good lines when some are bad")
    verifier = forms.CharField(max_length=300, required=False,
                               help_text="optional: rows lacking a field this verifier reads are bad lines")

    def clean_verifier(self):
        name = (self.cleaned_data.get("verifier") or "").strip()
        if name:
            try:
                verifier_fields(name)
            except ValueError as exc:
                raise forms.ValidationError(str(exc)) from None
        return name


class EndpointForm(forms.ModelForm):
    base_url = forms.URLField(max_length=500, assume_scheme="http",
                              help_text="e.g. http://127.0.0.1:8000 (the /v1 prefix is added)")
    replica_urls_text = forms.CharField(required=False, label="Replica URLs", widget=forms.Textarea(attrs={"rows": 2}),
                                        help_text="one extra base URL per line")

    class Meta:
        model = Endpoint
        fields = ["name", "kind", "base_url", "model_name", "api_flavor", "worker_queue", "api_key",
                  "request_timeout_s", "connect_timeout_s", "max_retries", "rpm_limit", "tpm_limit", "replica_affinity"]
        widgets = {"api_key": forms.PasswordInput(render_value=False)}

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the operator's queues only (Endpoint.clean checks it again); a value saved earlier stays listed
        current = self.instance.worker_queue if self.instance and self.instance.pk else ""
        choices = [("", "default (JOBS_ENDPOINT_QUEUES, else the default queue)")]
        choices += [(q, q) for q in worker_queues()]
        if current and current not in dict(choices):
            choices.append((current, f"{current} (not one of the operator's queues)"))
        self.fields["worker_queue"] = forms.ChoiceField(choices=choices, required=False,
                                                        help_text=Endpoint._meta.get_field("worker_queue").help_text)

    def clean_replica_urls_text(self):
        urls = [u.strip() for u in (self.cleaned_data.get("replica_urls_text") or "").splitlines() if u.strip()]
        v = forms.URLField(assume_scheme="http")
        return [v.clean(u) for u in urls]

    def clean(self):
        # The model's clean() (operator limits, allowed hosts) then checks the replicas too.
        self.instance.replica_urls = self.cleaned_data.get("replica_urls_text") or []
        return super().clean()


class LaunchJobForm(forms.Form):
    name = forms.CharField(max_length=200, required=False)
    endpoint = forms.ModelChoiceField(queryset=Endpoint.objects.none())
    limit = forms.IntegerField(min_value=1, required=False, help_text="keep the first N dataset rows")
    num_repeats = forms.IntegerField(min_value=1, initial=1)
    num_samples_in_parallel = forms.IntegerField(min_value=1, initial=16)
    parallelism_auto = forms.BooleanField(required=False, label="Adaptive parallelism")
    temperature = forms.FloatField(required=False, min_value=0)
    top_p = forms.FloatField(required=False, min_value=0, max_value=1)
    max_output_tokens = forms.IntegerField(required=False, min_value=1)
    service_tier = forms.CharField(required=False, max_length=50)
    extra_params = JSONDictField(required=False, label="Other responses_create_params",
                                 help_text='JSON object merged into every row, e.g. {"seed": 1}')
    verifier = forms.CharField(max_length=300, initial="math",
                               widget=forms.TextInput(attrs={"list": "verifier-names", "autocomplete": "off"}),
                               help_text="a built-in or registered one (list), or by dotted path into a module "
                                         "the operator listed (VERIFIER_PATH_MODULES)")
    verifier_options = JSONDictField(required=False)
    verify_mode = forms.ChoiceField(choices=CollectionJob.VerifyMode.choices, initial="inline")
    verify_cache = forms.ChoiceField(choices=[("job", "per job"), ("global", "across jobs"), ("off", "off")],
                                     initial="job", required=False)
    chunk_size = forms.IntegerField(min_value=1, initial=5000, help_text="dataset rows per chunk (unit of distribution)")
    profiling_enabled = forms.BooleanField(required=False)
    profile_servers = forms.BooleanField(required=False, label="Profile NeMo Gym servers",
                                         help_text="a NeMo Gym endpoint's own servers (ng_run +profiling_enabled=true), "
                                                   "found through its head server; their tables show on the job page")
    mlflow_tracking_uri = forms.ChoiceField(required=False, label="MLflow", choices=[("", "off")],
                                            help_text="export the job as an MLflow run to one of the deployment's "
                                                      "tracking servers")
    idempotency_key = forms.CharField(required=False, max_length=200)

    def __init__(self, *args, endpoints=None, **kwargs):
        super().__init__(*args, **kwargs)
        if endpoints is not None:
            self.fields["endpoint"].queryset = endpoints
        targets = sorted(mlflow_targets())  # names only: the URIs are the deployment's business
        if targets:
            self.fields["mlflow_tracking_uri"].choices = [("", "off"), *((n, n) for n in targets)]
        else:
            del self.fields["mlflow_tracking_uri"]
        from workers.verifiers import known_names

        self.verifier_names = known_names()

    def job_kwargs(self) -> dict:
        d = self.cleaned_data
        rcp = dict(d.get("extra_params") or {})
        for k in ("temperature", "top_p", "max_output_tokens", "service_tier"):
            if d.get(k) not in (None, ""):
                rcp[k] = d[k]
        return {
            "endpoint": d["endpoint"],
            "name": d.get("name") or "",
            "limit": d.get("limit"),
            "num_repeats": d["num_repeats"],
            "num_samples_in_parallel": d["num_samples_in_parallel"],
            "parallelism_auto": d.get("parallelism_auto", False),
            "responses_create_params": rcp,
            "verifier": d["verifier"],
            "verifier_options": d.get("verifier_options") or {},
            "verify_mode": d["verify_mode"],
            "verify_cache": d.get("verify_cache") or "job",
            "chunk_size": d["chunk_size"],
            "profiling_enabled": d.get("profiling_enabled", False),
            "profile_servers": d.get("profile_servers", False),
            "idempotency_key": d.get("idempotency_key") or None,
            "mlflow_tracking_uri": d.get("mlflow_tracking_uri") or "",
        }


class RolloutFilterForm(forms.Form):
    status = forms.ChoiceField(required=False, choices=[("", "any"), ("ok", "ok"), ("failed", "failed")])
    failure_class = forms.ChoiceField(required=False, choices=[("", "any")] + [(c, c) for c in FAILURE_CLASSES])
    reward_min = forms.FloatField(required=False)
    reward_max = forms.FloatField(required=False)
    latency_min = forms.FloatField(required=False, label="wall ms ≥")
    latency_max = forms.FloatField(required=False, label="wall ms ≤")
    task = forms.IntegerField(required=False, min_value=0, label="task index")
    trace = forms.CharField(required=False, max_length=60, label="trace id",
                            help_text="the trace id of a model request's traceparent (or the whole header)")

    def apply(self, qs):
        if not self.is_valid():
            return qs
        d = self.cleaned_data
        return qs.matching(status=d.get("status"), failure_class=d.get("failure_class"),
                           reward_min=d.get("reward_min"), reward_max=d.get("reward_max"),
                           wall_ms_min=d.get("latency_min"), wall_ms_max=d.get("latency_max"),
                           task_index=d.get("task"), trace_id=d.get("trace"))

    def is_filtered(self):
        return self.is_valid() and any(v not in (None, "") for v in self.cleaned_data.values())
