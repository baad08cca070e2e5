"""The probes' look at the database: one round trip, bounded by the caller's timeout whatever the pool does.

Django's pool (psycopg_pool) lends a connection within DB_POOL_TIMEOUT_S (30 s) and keeps retrying a database
that is down in the meantime: a probe that went through it answered after 30 s (/healthz) or 60 s (/metrics, two
collectors), past any orchestrator's probe timeout and Prometheus' scrape timeout. A probe asks the pool itself
with its own bound; without a pool, libpq's connect_timeout (settings: DB_CONNECT_TIMEOUT_S) bounds a connect.
"""
from __future__ import annotations

from django.db import connection
from django.db.utils import OperationalError

PROBE_TIMEOUT_S = 2.0


def check_database(timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise (OperationalError when no connection came within `timeout_s`) unless the database answers SELECT 1."""
    pool = connection.pool if connection.vendor == "postgresql" else None
    if pool is None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        return
    from psycopg_pool import PoolTimeout

    pool.open()  # as Django does before its first getconn (a no-op once open)
    try:
        conn = pool.getconn(timeout=timeout_s)
    except PoolTimeout as exc:
        raise OperationalError(f"no database connection within {timeout_s:g} s") from exc
    try:
        conn.execute("SELECT 1").fetchone()
    finally:
        pool.putconn(conn)


def database_answers(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    try:
        check_database(timeout_s)
    except Exception:  # noqa: BLE001 - any failure means the figures cannot be read now
        return False
    return True
