"""The endpoint page: model-server operations (buttons), their timings per kind (p50/p95/p99 of queue, rpc,
wall), an alert when an operation queued longer than OPS_QUEUE_ALERT_MS on the client side, the
weight-version history and the operation log, searchable by trace id. Thin: logic in
controlplane.endpoints.ops."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from controlplane.access import visible_endpoints, visible_sweeps
from controlplane.diagnostics import services as diagnostics
from controlplane.endpoints import ops
from controlplane.endpoints.models import AdminAction, AdminOperation, WeightVersion
from controlplane.jobs.replica_load import replica_load


@login_required
@require_GET
def endpoint_detail(request, endpoint_id):
    ep = get_object_or_404(visible_endpoints(request.user), pk=endpoint_id)
    return _detail(request, ep)


def _detail(request, ep, status=200):
    trace = request.GET.get("trace", "").strip()[:64]
    kind = request.GET.get("kind", "")
    kind = kind if kind in ops.KINDS else ""
    return render(request, "dashboard/endpoint_detail.html", {
        "ep": ep, "trace": trace, "kind": kind, "kinds": AdminOperation.Kind.choices,
        "log": _shown(request.user, ops.operations(ep, trace_id=trace, kind=kind, limit=200)),
        "stats": ops.timing_stats(ep), "alerts": list(ops.queue_alerts(ep, limit=10)),
        "threshold": ops.queue_alert_ms(), "slow_actions": list(ops.slow_actions(ep, limit=10)),
        "versions": list(WeightVersion.objects.filter(endpoint=ep)[:20]),
        "current_version": ops.current_version(ep),
        "actions": [(a, ops.action_summary(a, request.user)) for a in AdminAction.objects.filter(endpoint=ep)[:10]],
        "load": ops.result_for(request.user, replica_load(ep)),
        "sweeps": list(visible_sweeps(request.user).filter(endpoint=ep).defer("verifier_options",
                                                                              "responses_create_params")[:10]),
    }, status=status)


def _shown(user, operations) -> list:
    """The log rows with each error as this user may read it (status codes only unless staff)."""
    rows = list(operations)
    for o in rows:
        o.error = ops.error_for(user, o.error)
    return rows


def _int(v):
    try:
        return int(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        raise ops.OpsError(f"not an integer: {v!r}") from None


@login_required
@require_POST
def endpoint_ops_action(request, endpoint_id, kind):
    """Queue the operation (a worker calls the model servers; the web process never does) and come back to
    the endpoint page, where the action's state and outcome show under "Actions"."""
    ep = get_object_or_404(visible_endpoints(request.user), pk=endpoint_id)
    p = request.POST
    try:
        if kind == "update_weights":
            raw = {"path": p.get("path", "").strip(), "checkpoint_id": p.get("checkpoint_id", "").strip(),
                   "version": _int(p.get("version"))}
        else:
            raw = {"mode": p.get("mode") or None, "level": _int(p.get("level")), "count": _int(p.get("count"))}
        action = ops.submit(ep, kind, user=request.user, source="dashboard", **raw)
    except ops.OpsError as e:
        messages.error(request, str(e))
        return redirect("dashboard:endpoint", endpoint_id=ep.pk)
    except ops.SharedServerDenied as e:  # the page again, with the reason, as a 403
        messages.error(request, f"{kind} refused: {e}")
        return _detail(request, ep, status=403)
    except ops.QueueUnavailable as e:
        messages.error(request, str(e))
        return redirect("dashboard:endpoint", endpoint_id=ep.pk)
    if action.state in AdminAction.FINISHED:  # eager tasks: already done
        ok = action.state == AdminAction.State.SUCCEEDED
        (messages.success if ok else messages.error)(request, f"{ops.action_summary(action, request.user)} "
                                                              f"(trace {action.trace_id})")
    else:
        messages.info(request, f"{kind} queued (trace {action.trace_id}); its outcome shows under Actions")
    return redirect(reverse("dashboard:endpoint", args=[ep.pk]) + "?trace=" + action.trace_id)


@login_required
@require_POST
def sweep_cancel(request, sweep_id):
    """Cancel one of the user's parallelism sweeps (a running one stops within seconds), back to its endpoint."""
    sweep = get_object_or_404(visible_sweeps(request.user), pk=sweep_id)
    if diagnostics.cancel_sweep(sweep):
        messages.success(request, f"sweep {sweep.pk} cancelled")
    else:
        messages.error(request, f"sweep {sweep.pk} is {sweep.state}: it has already ended")
    return redirect("dashboard:endpoint", endpoint_id=sweep.endpoint_id)
