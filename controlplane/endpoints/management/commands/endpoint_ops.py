"""manage.py endpoint_ops ENDPOINT OPERATION [options]: model-server operations on every replica of an endpoint.

    manage.py endpoint_ops my-vllm health
    manage.py endpoint_ops 3 prewarm --count 16
    manage.py endpoint_ops 3 pause --mode keep        (then: resume)
    manage.py endpoint_ops 3 update_weights --path /ckpt/step-1200 [--weight-version 7]
    manage.py endpoint_ops 3 stats                    p50/p95/p99 of queue/rpc/wall per kind
    manage.py endpoint_ops 3 log [--trace ID]         the operation log

ENDPOINT is an id or a name. Exit status 1 when an operation failed on a replica.
"""
from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from controlplane.endpoints import ops
from controlplane.endpoints.models import Endpoint

OPERATIONS = [*ops.SIMPLE_KINDS, "update_weights", "stats", "log"]


class Command(BaseCommand):
    help = __doc__.split("\n\n")[0]

    def add_arguments(self, parser):
        parser.add_argument("endpoint", help="endpoint id or name")
        parser.add_argument("operation", choices=OPERATIONS)
        parser.add_argument("--mode", choices=["keep", "wait", "abort"], help="pause mode (default keep)")
        parser.add_argument("--level", type=int, choices=[1, 2], help="sleep level (default 1)")
        parser.add_argument("--count", type=int, help="pre-warm: how many tiny requests (default 4 per replica)")
        parser.add_argument("--path", default="", help="update_weights: directory of the new weights")
        parser.add_argument("--checkpoint-id", default="", help="update_weights: checkpoint id")
        parser.add_argument("--weight-version", dest="weight_version", type=int, help="update_weights: version to tag (default last + 1)")
        parser.add_argument("--trace", default="", help="log: a trace id or its prefix")
        parser.add_argument("--json", action="store_true", help="print the full result as JSON")

    def _endpoint(self, ref: str) -> Endpoint:
        ep = Endpoint.objects.filter(pk=int(ref)).first() if ref.isdigit() else None
        if ep is None:
            matches = list(Endpoint.objects.filter(name=ref)[:2])
            if len(matches) > 1:
                raise CommandError(f"several endpoints are named {ref!r}: use the id")
            ep = matches[0] if matches else None
        if ep is None:
            raise CommandError(f"no endpoint {ref!r}")
        return ep

    def handle(self, *args, **o):
        ep = self._endpoint(o["endpoint"])
        op = o["operation"]
        if op == "stats":
            stats = ops.timing_stats(ep)
            if o["json"]:
                return self.stdout.write(json.dumps(stats, indent=1))
            self.stdout.write(f"{'kind':<20}{'n':>6}{'queue p50':>11}{'p95':>9}{'p99':>9}{'rpc p50':>9}{'p99':>9}"
                              f"{'wall p50':>10}{'p99':>9}")
            f = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
            for s in stats:
                self.stdout.write(f"{s['kind']:<20}{s['n']:>6}{f(s['queue_ms_p50']):>11}{f(s['queue_ms_p95']):>9}"
                                  f"{f(s['queue_ms_p99']):>9}{f(s['rpc_ms_p50']):>9}{f(s['rpc_ms_p99']):>9}"
                                  f"{f(s['wall_ms_p50']):>10}{f(s['wall_ms_p99']):>9}")
            return
        if op == "log":
            for row in ops.operations(ep, trace_id=o["trace"], limit=200):
                d = ops.operation_dict(row)
                self.stdout.write(json.dumps(d) if o["json"] else
                                  f"{d['created_at']} {d['trace_id']} {d['kind']:<18} {d['replica']} {d['status']} "
                                  f"queue {d['queue_ms']} rpc {d['rpc_ms']} wall {d['wall_ms']} {d['error']}")
            return
        try:
            if op == "update_weights":
                out = ops.update_weights(ep, path=o["path"], checkpoint_id=o["checkpoint_id"],
                                         version=o["weight_version"], source="command")
                ok = out["applied"] and out["ok"]
            else:
                out = ops.run_operation(ep, op, mode=o["mode"], level=o["level"], count=o["count"],
                                        source="command")
                ok = out["ok"]
        except ops.OpsError as e:
            raise CommandError(str(e)) from None
        if o["json"]:
            self.stdout.write(json.dumps(out, indent=1))
        else:
            for r in out["operations"]:
                self.stdout.write(f"{r['kind']:<18} {r['replica']:<40} {r['status']:<9} queue {r['queue_ms']} ms, "
                                  f"rpc {r['rpc_ms']} ms, wall {r['wall_ms']} ms{'  ' + r['error'] if r['error'] else ''}")
            extra = f", version {out['version']}" if op == "update_weights" else ""
            self.stdout.write(f"trace {out['trace_id']}: {'ok' if ok else 'FAILED'}{extra}")
        if not ok:
            raise CommandError(f"{op} failed on a replica (trace {out['trace_id']})")
