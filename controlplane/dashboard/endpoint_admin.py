"""The endpoint page: admin operations (buttons), their timings per kind (p50/p95/p99 of queue, rpc,
wall), an alert when an operation queued longer than ADMIN_QUEUE_ALERT_MS on the client side, the
weight-version history and the operation log, searchable by trace id. Thin: logic in
controlplane.endpoints.admin_ops."""
from __future__ import annotations

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from controlplane.access import visible_endpoints
from controlplane.endpoints import admin_ops
from controlplane.endpoints.models import AdminOperation, WeightVersion
from controlplane.endpoints.replica_load import replica_load


@login_required
@require_GET
def endpoint_detail(request, endpoint_id):
    ep = get_object_or_404(visible_endpoints(request.user), pk=endpoint_id)
    trace = request.GET.get("trace", "").strip()[:64]
    kind = request.GET.get("kind", "")
    kind = kind if kind in admin_ops.KINDS else ""
    return render(request, "dashboard/endpoint_detail.html", {
        "ep": ep, "trace": trace, "kind": kind, "kinds": AdminOperation.Kind.choices,
        "log": list(admin_ops.operations(ep, trace_id=trace, kind=kind, limit=200)),
        "stats": admin_ops.timing_stats(ep), "alerts": list(admin_ops.queue_alerts(ep, limit=10)),
        "threshold": admin_ops.queue_alert_ms(),
        "versions": list(WeightVersion.objects.filter(endpoint=ep)[:20]),
        "current_version": admin_ops.current_version(ep),
        "load": replica_load(ep),
    })


def _int(v):
    try:
        return int(v) if v not in (None, "") else None
    except (TypeError, ValueError):
        raise admin_ops.AdminOpError(f"not an integer: {v!r}") from None


@login_required
@require_POST
def endpoint_admin_action(request, endpoint_id, kind):
    ep = get_object_or_404(visible_endpoints(request.user), pk=endpoint_id)
    p = request.POST
    try:
        if kind == "update_weights":
            out = admin_ops.update_weights(ep, path=p.get("path", ""), checkpoint_id=p.get("checkpoint_id", ""),
                                           version=_int(p.get("version")), user=request.user, source="dashboard")
            ok = out["applied"] and out["ok"]
            msg = (f"weights updated to version {out['version']}" if ok else
                   f"weight update failed on {', '.join(out['failed_replicas']) or 'a replica'}"
                   f"{' (no answer: ' + ', '.join(out['unanswered_replicas']) + ')' if out['unanswered_replicas'] else ''}"
                   f"{'; resumed' if not out['not_resumed'] else '; NOT resumed: ' + ', '.join(out['not_resumed'])}")
        else:
            out = admin_ops.run_operation(ep, kind, mode=p.get("mode") or None, level=_int(p.get("level")),
                                          count=_int(p.get("count")), user=request.user, source="dashboard")
            ok = out["ok"]
            failed = [o for o in out["operations"] if not o["ok"]]
            detail = "; ".join(f"{o['replica']}: {o['error']}" for o in failed[:3])
            msg = f"{kind}: ok" if ok else f"{kind}: {len(failed)} of {len(out['operations'])} request(s) failed: {detail}"
    except admin_ops.AdminOpError as e:
        messages.error(request, str(e))
        return redirect("dashboard:endpoint", endpoint_id=ep.pk)
    (messages.success if ok else messages.error)(request, f"{msg} (trace {out['trace_id']})")
    return redirect(reverse("dashboard:endpoint", args=[ep.pk]) + "?trace=" + out["trace_id"])
