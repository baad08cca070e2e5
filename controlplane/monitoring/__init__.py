"""Operators' monitoring of the control plane itself: Prometheus `/metrics` and `/healthz`.

metrics.py   event counters and histograms recorded by web and worker processes (prometheus-client's
             multi-process mode: one mmap file per process under PROMETHEUS_MULTIPROC_DIR, summed at
             scrape time), and the state-like figures read from the database when scraped.
views.py     /metrics (token or network allow-list) and /healthz (database + Redis reachable).
middleware.py  answers those two paths before host validation and the HTTPS redirect: probes and
             Prometheus reach a web container by its internal name over plain HTTP.
"""
