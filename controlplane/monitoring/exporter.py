"""Serve one host's multi-process counters over HTTP, without Django (for worker hosts).

    python -m controlplane.monitoring.exporter --dir /app/var/prometheus --port 9808 [--addr 0.0.0.0]

The web's /metrics sums the files of ITS host; counters recorded by workers on another machine live in that
machine's PROMETHEUS_MULTIPROC_DIR and are scraped here. Also started inside a Celery worker when
WORKER_METRICS_PORT is set (controlplane.monitoring.worker)."""
from __future__ import annotations

import argparse
import os
import threading

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector


def serve(path: str, port: int, addr: str = "127.0.0.1"):
    """Start the HTTP server in a daemon thread; returns (server, thread). OSError when the port is taken."""
    os.makedirs(path, exist_ok=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    return start_http_server(port, addr=addr, registry=registry)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=os.environ.get("PROMETHEUS_MULTIPROC_DIR", "var/prometheus"),
                        help="the directory the host's processes write (PROMETHEUS_MULTIPROC_DIR)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("WORKER_METRICS_PORT") or 9808))
    parser.add_argument("--addr", default=os.environ.get("WORKER_METRICS_ADDR", "127.0.0.1"))
    args = parser.parse_args(argv)
    serve(args.dir, args.port, args.addr)
    print(f"serving {args.dir} on http://{args.addr}:{args.port}/metrics", flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
