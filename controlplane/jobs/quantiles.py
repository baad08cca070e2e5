"""Order statistics of a job's stored rollouts, fetched from the database (ORDER BY ... LIMIT 2 OFFSET k), so
the end-of-job summary (services.compute_summaries) needs no per-rollout values in the worker.

The ranks and the interpolation are the engine's (`quantile_ranks` / `quantile_from_ranks`: linear, numpy's
default), so the figures are the ones `workers.engine.aggregate.describe` / `timing_percentiles` give over
the same values. Numeric fields of the output rows are read with the engine's rules: top-level JSON numbers
(not booleans), and `response.usage` counts where the row has no top-level key of that name."""
from __future__ import annotations

from django.db import connection

from workers.engine.aggregate import USAGE_KEYS, AggregateAccumulator, quantile, quantile_from_ranks, quantile_ranks
from workers.engine.types import TIMING_FIELDS

from .models import Rollout

_USAGE_PATHS = dict(USAGE_KEYS)
_PG_MAX = str(2**1024 - 2**970)  # from here json.loads gives inf: such values are left out, as the engine does


def _at_ranks(sql: str, params: list, lo: int, hi: int) -> tuple[float, float]:
    with connection.cursor() as cur:
        cur.execute(f"{sql} LIMIT %s OFFSET %s", [*params, hi - lo + 1, lo])
        got = [float(r[0]) for r in cur.fetchall()]
    return got[0], got[-1]


def _quantile(sql: str, params: list, n: int, q: float) -> float:
    lo, hi, frac = quantile_ranks(n, q)
    a, b = _at_ranks(sql, params, lo, hi)
    return quantile_from_ranks(a, b, frac)


def timing_percentiles(job_id: int, name: str, n: int) -> dict[str, float]:
    """{p50, p90, p99} of a timing column (None excluded) over the job's n rollouts with a value."""
    if name not in TIMING_FIELDS:
        raise ValueError(name)
    table = Rollout._meta.db_table
    sql = f'SELECT "{name}" FROM "{table}" WHERE job_id = %s AND "{name}" IS NOT NULL ORDER BY "{name}"'
    return {key: _quantile(sql, [job_id], n, q) for key, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))}


def _field_sql(key: str) -> tuple[str, list] | None:
    """(SELECT of a numeric field's values over a job's ok rows, ordered; its params), or None when this
    database cannot address the key (a SQLite JSON path cannot hold a double quote)."""
    table = Rollout._meta.db_table
    usage = _USAGE_PATHS.get(key)
    if connection.vendor == "postgresql":
        expr = "CASE WHEN jsonb_typeof(data -> %s) = 'number' THEN (data ->> %s)::numeric"
        params: list = [key, key]
        if usage:
            path = ["response", "usage", *usage]
            expr += (" WHEN NOT jsonb_exists(data, %s) AND jsonb_typeof(data #> %s) = 'number'"
                     " THEN (data #>> %s)::numeric")
            params += [key, path, path]
        expr += " END"
        where = f"abs(v) < {_PG_MAX}"
    elif connection.vendor == "sqlite":
        if '"' in key or any('"' in p for p in usage or ()):
            return None
        top = f'$."{key}"'
        expr = "CASE WHEN json_type(data, %s) IN ('integer', 'real') THEN json_extract(data, %s)"
        params = [top, top]
        if usage:
            path = "$.response.usage." + ".".join(f'"{p}"' for p in usage)
            expr += (" WHEN json_type(data, %s) IS NULL AND json_type(data, %s) IN ('integer', 'real')"
                     " THEN json_extract(data, %s)")
            params += [top, path, path]
        expr += " END"
        where = "abs(v) <= 1.7976931348623157e308"
    else:
        return None
    sql = (f'SELECT v FROM (SELECT {expr} AS v FROM "{table}" WHERE job_id = %s AND status = %s) AS vals'
           f" WHERE v IS NOT NULL AND {where} ORDER BY v")
    return sql, params


def field_median(job_id: int, key: str, n: int) -> float:
    """The median of a numeric field over the job's ok rows (n values). A key this database cannot address
    falls back to reading that one field's values into memory (8 bytes a value, that field only)."""
    got = _field_sql(key)
    if got is None:
        values = []
        rows = Rollout.objects.filter(job_id=job_id, status=Rollout.Status.OK).values_list("data", flat=True)
        for data in rows.iterator(chunk_size=2000):
            acc = AggregateAccumulator()
            acc.add(data)
            if key in acc.fields:
                values.extend(acc.fields[key])
        return quantile(sorted(values), 0.5)
    sql, params = got
    return _quantile(sql, [*params, job_id, Rollout.Status.OK.value], n, 0.5)
