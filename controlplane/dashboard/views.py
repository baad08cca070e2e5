"""Dashboard pages. Thin: they read through controlplane.access (ownership rule), call the domain
services for anything that changes state, and render templates."""
from __future__ import annotations

import json

from django.contrib import messages
from django.core.exceptions import ValidationError
from django.utils.http import url_has_allowed_host_and_scheme
from controlplane.endpoints.tasks import enqueue as enqueue_endpoint_task
from django.contrib.auth.decorators import login_required
from django.http import Http404, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from controlplane import lanes
from controlplane.access import can_see, visible_datasets, visible_endpoints, visible_jobs
from controlplane.datasets.services import DatasetValidationError, dataset_agents, ingest_jsonl, preview_rows
from controlplane.jobs import history as job_history
from controlplane.jobs import services as job_services, verification
from controlplane.jobs.models import CollectionJob, InvalidTransition, JobState, Rollout
from workers.nemo_gym.trajectory import trajectory

from . import compare as compare_mod
from controlplane import panels

from . import heartbeat, live, stats
from .excerpts import attach_excerpts
from .forms import DatasetUploadForm, EndpointForm, LaunchJobForm, RolloutFilterForm
from .pagination import keyset_page

RECENT_JOBS = 20


def _wants_json(request) -> bool:
    return request.headers.get("x-requested-with") == "XMLHttpRequest" or "application/json" in request.headers.get("accept", "")


def _job_row(job, user) -> dict:
    snap = live.job_snapshot(job, user=user)
    return {"job": job, "snapshot": snap}


# --- Overview ---------------------------------------------------------------------------------
def _overview_jobs(user):
    jobs = visible_jobs(user).select_related("dataset", "endpoint")
    active = list(jobs.filter(state__in=JobState.UNFINISHED).order_by("-created_at")[:50])
    recent = list(jobs.exclude(state__in=JobState.UNFINISHED).order_by("-created_at")[:RECENT_JOBS])
    return active, recent


@login_required
@require_GET
def overview(request):
    active, recent = _overview_jobs(request.user)
    ctx = {
        "active": [_job_row(j, request.user) for j in active],
        "recent": [_job_row(j, request.user) for j in recent],
        "endpoints": list(visible_endpoints(request.user)[:50]),
        "workers": list(heartbeat.alive_workers()),
        "alive_after_s": heartbeat.ALIVE_AFTER_S,
        "active_ids": [j.pk for j in active],
        "control_lane": lanes.control_served(),
    }
    return render(request, "dashboard/overview.html", ctx)


@login_required
@require_GET
def overview_state(request):
    active, recent = _overview_jobs(request.user)
    return JsonResponse({
        "jobs": [live.job_snapshot(j, user=request.user) for j in active + recent],
        "active_ids": [j.pk for j in active],
        "workers": [
            {"name": w.name, "host": w.host, "cpu_percent": w.cpu_percent, "memory_percent": w.memory_percent,
             "gpus": w.gpus, "last_seen": w.last_seen.isoformat()}
            for w in heartbeat.alive_workers()
        ],
        "control_lane": lanes.control_served(),
    })


# --- Job page ---------------------------------------------------------------------------------
def _get_job(request, job_id):
    return get_object_or_404(visible_jobs(request.user).select_related("dataset", "endpoint"), pk=job_id)


@login_required
@require_GET
def job_detail(request, job_id):
    job = _get_job(request, job_id)
    snapshot = live.job_snapshot(job, user=request.user)
    series = live.metric_series(job)
    ctx = {
        "job": job,
        "snapshot": snapshot,
        "series": series,
        "timing": stats.timing_breakdown(job),
        "agent_split": stats.agent_split(job),
        "rewards": stats.reward_metrics(job),
        "failures": stats.failures_by_class(job),
        "panels": panels.render_list(request, job),
        **{f"can_{name}": offered for name, offered in job.offered_actions().items()},
        "action_states": CollectionJob.action_states(),
        "ws_path": f"/ws/jobs/{job.pk}/",
    }
    return render(request, "dashboard/job_detail.html", ctx)


@login_required
@require_GET
def job_state(request, job_id):
    """Current state for a (re)connecting page: the progress snapshot and, with ?series=1, the charts."""
    job = _get_job(request, job_id)
    out = {"snapshot": live.job_snapshot(job, user=request.user)}
    if request.GET.get("series"):
        out["series"] = live.metric_series(job)
    return JsonResponse(out)


JOB_ACTIONS = {"cancel": "cancel_job", "pause": "pause_job", "resume": "resume_job", "retry": "retry_failed",
               "stop": "stop_job",  # an open-ended job (the open-ended panel's button)
               "verify": None}  # verify: controlplane.jobs.verification


@login_required
@require_POST
def job_action(request, job_id, action):
    job = _get_job(request, job_id)
    if action not in JOB_ACTIONS:
        raise Http404("unknown action")
    fn = verification.start_verification if action == "verify" else getattr(job_services, JOB_ACTIONS[action])
    try:
        fn(job)
    except InvalidTransition as e:
        messages.error(request, str(e))
    except ValidationError as e:
        messages.error(request, "; ".join(e.messages))
    except NotImplementedError:
        messages.error(request, f"{action} is not available yet")
    else:
        messages.success(request, f"{action}: done")
    return redirect("dashboard:job", job_id=job.pk)


# --- Rollouts ---------------------------------------------------------------------------------
PREVIEW_ROW_CHARS = 4000
LIST_FIELDS = ["id", "job_id", "task_index", "rollout_index", "status", "failure_class", "reward", "wall_ms",
               "ttft_ms", "output_tokens", "attempts", "created_at"]


def _int_or_none(v, lo=None, hi=None):
    """An int from a query parameter, clamped to [lo, hi] when given; None when absent or not a number."""
    try:
        n = int(v) if v not in (None, "") else None
    except ValueError:
        return None
    if n is not None and lo is not None:
        n = max(lo, n)
    if n is not None and hi is not None:
        n = min(hi, n)
    return n


@login_required
@require_GET
def rollouts(request, job_id):
    job = _get_job(request, job_id)
    form = RolloutFilterForm(request.GET or None)
    qs = form.apply(Rollout.objects.filter(job=job).only(*LIST_FIELDS)) if request.GET else Rollout.objects.filter(job=job).only(*LIST_FIELDS)
    after = _int_or_none(request.GET.get("after"), lo=0, hi=2**63 - 1)  # ids are bigints
    before = _int_or_none(request.GET.get("before"), lo=0, hi=2**63 - 1)
    size = _int_or_none(request.GET.get("size")) or 50
    page = keyset_page(qs, after=after, before=before, size=size)
    attach_excerpts(page.rows, Rollout.objects.filter(job=job))
    page_no = _int_or_none(request.GET.get("page")) or 1
    params = request.GET.copy()
    for k in ("after", "before", "page"):
        params.pop(k, None)
    base_qs = params.urlencode()
    ctx = {
        "job": job,
        "form": form if request.GET else RolloutFilterForm(),
        "page": page,
        "page_no": page_no,
        "base_qs": base_qs,
        "filtered": form.is_filtered() if request.GET else False,
    }
    return render(request, "dashboard/rollouts.html", ctx)


@login_required
@require_GET
def rollout_by_trace(request, trace):
    """A trace id (or a whole `traceparent`) from a tracing backend: the rollout's page, in whichever job the
    user can see (the partial index rollout_trace_id)."""
    parts = trace.strip().lower().split("-")
    trace_id = parts[1] if len(parts) == 4 else parts[0]
    if len(trace_id) != 32 or any(c not in "0123456789abcdef" for c in trace_id):
        raise Http404("not a trace id")
    r = Rollout.objects.filter(trace_id=trace_id, job__in=visible_jobs(request.user)).only("id").first()
    if r is None:
        raise Http404("no rollout with this trace id")
    return redirect("dashboard:rollout", rollout_id=r.pk)


@login_required
@require_GET
def rollout_detail(request, rollout_id):
    r = get_object_or_404(Rollout.objects.select_related("job"), pk=rollout_id)
    if not can_see(request.user, r.job):
        raise Http404("no such rollout")
    data = r.data or {}
    rcp = data.get("responses_create_params") or {}
    inp = rcp.get("input")
    if isinstance(inp, str):
        messages_in = [{"role": "user", "content": inp}]
    elif isinstance(inp, list):
        # copies: the display keys set below must not leak into the raw JSON shown further down
        messages_in = [dict(m) if isinstance(m, dict) else {"role": "?", "content": m} for m in inp]
    else:
        messages_in = []
    for m in messages_in:
        m.setdefault("role", m.get("type", "?"))
        c = m.get("content")
        if isinstance(c, list):  # content parts
            m["content_text"] = "\n".join(str(p.get("text", p)) if isinstance(p, dict) else str(p) for p in c)
        else:
            m["content_text"] = "" if c is None else str(c)
    response = data.get("response") or {}
    output_texts, reasoning = [], []
    for item in response.get("output") or []:
        if not isinstance(item, dict):
            continue
        parts = item.get("content") or item.get("summary") or []
        texts = [p.get("text", "") for p in parts if isinstance(p, dict)] if isinstance(parts, list) else [str(parts)]
        (reasoning if item.get("type") == "reasoning" else output_texts).append("\n".join(t for t in texts if t))
    skip = {"responses_create_params", "response", "_ng_task_index", "_ng_rollout_index", "reward"}
    verifier_fields = {k: v for k, v in data.items() if k not in skip}
    other_params = {k: v for k, v in rcp.items() if k != "input"}
    prev_id = Rollout.objects.filter(job_id=r.job_id, id__lt=r.id).order_by("-id").values_list("id", flat=True).first()
    next_id = Rollout.objects.filter(job_id=r.job_id, id__gt=r.id).order_by("id").values_list("id", flat=True).first()
    ctx = {
        "r": r,
        "job": r.job,
        "messages_in": messages_in,
        "other_params": json.dumps(other_params, indent=2, ensure_ascii=False),
        "output_text": "\n\n".join(output_texts),
        "reasoning_text": "\n\n".join(t for t in reasoning if t),
        "usage": {k: (json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else v)
                  for k, v in (response.get("usage") or {}).items()},
        "verifier_fields": [(k, v if isinstance(v, (str, int, float, bool, type(None))) else json.dumps(v, ensure_ascii=False))
                            for k, v in sorted(verifier_fields.items())],
        "response_status": response.get("status"),
        "trajectory": trajectory(data),
        "raw": json.dumps(data, indent=2, ensure_ascii=False),
        "timings": [(f, getattr(r, f)) for f in stats.TIMING_FIELDS],
        "prev_id": prev_id,
        "next_id": next_id,
    }
    return render(request, "dashboard/rollout_detail.html", ctx)


# --- Datasets ---------------------------------------------------------------------------------
def _dataset_list(user) -> list:
    """The newest 200 datasets, without their validation reports (up to a thousand bad lines each)."""
    return list(visible_datasets(user).defer("validation_report")[:200])


@login_required
def datasets(request):
    return render(request, "dashboard/datasets.html", {
        "datasets": _dataset_list(request.user),
        "form": DatasetUploadForm(), "verifier_names": _verifier_names(),
    })


def _verifier_names():
    from workers.verifiers import known_names

    return [n for n in known_names() if n != "none"]


@login_required
@require_POST
def dataset_upload(request):
    form = DatasetUploadForm(request.POST, request.FILES)
    if not form.is_valid():
        if _wants_json(request):
            message = "; ".join(f"{field}: {' '.join(errs)}" for field, errs in form.errors.items())
            return JsonResponse({"ok": False, "message": f"invalid form: {message}", "errors": form.errors}, status=400)
        return render(request, "dashboard/datasets.html", {"datasets": _dataset_list(request.user), "form": form,
                                                           "verifier_names": _verifier_names()}, status=400)
    f = form.cleaned_data["file"]
    name = form.cleaned_data.get("name") or f.name.rsplit(".", 1)[0]
    try:
        ds = ingest_jsonl(f, name=name, owner=request.user, accept_partial=form.cleaned_data.get("accept_partial", False),
                          source_filename=f.name, verifier=form.cleaned_data.get("verifier") or "")
    except DatasetValidationError as e:
        report = getattr(e, "report", {}) or {}
        rejected = getattr(e, "dataset", None)
        payload = {"ok": False, "message": str(e), "report": report,
                   "dataset_url": reverse("dashboard:dataset", args=[rejected.pk]) if rejected else None}
        if _wants_json(request):
            return JsonResponse(payload, status=400)
        return render(request, "dashboard/datasets.html", {
            "datasets": _dataset_list(request.user), "form": form, "upload_error": payload,
            "verifier_names": _verifier_names()}, status=400)
    url = reverse("dashboard:dataset", args=[ds.pk])
    if _wants_json(request):
        return JsonResponse({"ok": True, "dataset_id": ds.pk, "url": url, "row_count": ds.row_count,
                             "report": ds.validation_report})
    return redirect(url)


@login_required
def dataset_detail(request, dataset_id):
    ds = get_object_or_404(visible_datasets(request.user), pk=dataset_id)
    endpoints = visible_endpoints(request.user)
    if request.method == "POST":
        form = LaunchJobForm(request.POST, endpoints=endpoints)
        if form.is_valid():
            try:
                job = job_services.create_job(owner=request.user, dataset=ds, **form.job_kwargs())
            except ValidationError as e:
                for field, errs in (e.message_dict.items() if hasattr(e, "error_dict") else [(None, e.messages)]):
                    form.add_error(field if field in form.fields else None, errs)
            except (ValueError, InvalidTransition) as e:
                form.add_error(None, str(e))
            else:
                messages.success(request, f"job {job.pk} launched")
                return redirect("dashboard:job", job_id=job.pk)
    else:
        form = LaunchJobForm(endpoints=endpoints, initial={"endpoint": endpoints.first()})
    preview = preview_rows(ds, 10)
    for p in preview:
        # a multi-megabyte row would make the page unusable (and a big one is read as an excerpt only)
        text = p["excerpt"] if p.get("truncated") else json.dumps(p["data"], ensure_ascii=False, indent=1)
        size = p.get("size_chars", len(text))
        if p.get("truncated") or len(text) > PREVIEW_ROW_CHARS:
            text = (text[:PREVIEW_ROW_CHARS] + f"\n… {size - min(len(text), PREVIEW_ROW_CHARS):,} more characters "
                    "(too long to show whole)")
        p["json"] = text
    report = ds.validation_report or {}
    return render(request, "dashboard/dataset_detail.html", {
        "ds": ds, "preview": preview, "report": report, "form": form,
        "agents": dataset_agents(ds) if ds.status == ds.Status.READY else None,
        "jobs": list(visible_jobs(request.user).filter(dataset=ds)[:20]),
    }, status=200 if request.method == "GET" or form.is_valid() else 400)


# --- Endpoints --------------------------------------------------------------------------------
@login_required
def endpoints(request):
    if request.method == "POST":
        form = EndpointForm(request.POST)
        if form.is_valid():
            ep = form.save(commit=False)
            ep.owner = request.user
            ep.replica_urls = form.cleaned_data.get("replica_urls_text") or []
            ep.save()
            messages.success(request, f"endpoint {ep.name} saved")
            return redirect("dashboard:endpoints")
    else:
        form = EndpointForm()
    return render(request, "dashboard/endpoints.html", {"endpoints": list(visible_endpoints(request.user)), "form": form})


@login_required
@require_POST
def endpoint_health(request, endpoint_id):
    ep = get_object_or_404(visible_endpoints(request.user), pk=endpoint_id)
    try:
        enqueue_endpoint_task("health", ep)  # a worker calls the server; the result shows on the page when done
        messages.info(request, f"health check of {ep.name} queued; reload to see the result")
    except Exception:  # noqa: BLE001 - broker down: say so, the page stays up
        messages.error(request, "the task queue is unavailable; try again shortly")
    nxt = request.POST.get("next") or ""
    if nxt.startswith("/") and url_has_allowed_host_and_scheme(nxt, allowed_hosts={request.get_host()},
                                                               require_https=request.is_secure()):
        return HttpResponseRedirect(nxt)  # only a path of this site, never a view name or another host
    return redirect("dashboard:endpoints")


# --- Compare ----------------------------------------------------------------------------------
@login_required
@require_GET
def compare(request):
    ids = []
    for v in request.GET.getlist("jobs"):
        ids += [int(x) for x in v.replace(",", " ").split() if x.isdigit() and len(x) <= 18]  # fits a bigint
    ids = list(dict.fromkeys(ids))
    visible = visible_jobs(request.user).select_related("dataset", "endpoint")
    choices = list(visible.order_by("-created_at")[:100])
    if len(ids) < 2:
        return render(request, "dashboard/compare.html", {"choices": choices, "selected": ids, "result": None})
    by_id = {j.pk: j for j in visible.filter(pk__in=ids)}
    if len(by_id) != len(ids):
        raise Http404("no such job")
    jobs = [by_id[i] for i in ids]
    return render(request, "dashboard/compare.html", {
        "choices": choices, "selected": ids, "jobs": jobs, "result": compare_mod.compare_jobs(jobs),
        "sections": panels.render_compare_sections(request, jobs)})


# --- History ----------------------------------------------------------------------------------
@login_required
@require_GET
def history(request):
    days = _int_or_none(request.GET.get("days"), lo=0, hi=36500)  # timedelta overflows near 10**9 days
    rows = job_history.history_rows(visible_jobs(request.user), days)
    if request.GET.get("format") == "csv":
        resp = HttpResponse(content_type="text/csv")
        resp["Content-Disposition"] = 'attachment; filename="throughput_log.csv"'
        job_history.write_csv(rows, resp)
        return resp
    chart = {
        "t": [int(r["date"].timestamp()) for r in rows],
        "samples_per_s": [r["samples_per_s"] for r in rows],
        "tokens_per_s": [r["tokens_per_s"] for r in rows],
        "mean_reward": [r["mean_reward"] for r in rows],
        "labels": [f"job {r['job'].pk}" for r in rows],
    }
    return render(request, "dashboard/history.html", {"rows": list(reversed(rows)), "chart": chart, "days": days})
