"""Two profiles set against each other, function by function: matched by module and name (or by name alone
when a function moved), with a verdict per function and, for two jobs, their throughput and the warnings a
reader needs (one side unprofiled, few profiled verifications behind the scaled figures)."""
from __future__ import annotations

from django.utils import timezone

from .models import ProfileSnapshot
from .services import is_harness, sample_figures, short_module


def _match(a_rows, b_rows):
    a = {(short_module(r.module), r.name): r for r in a_rows}
    b = {(short_module(r.module), r.name): r for r in b_rows}
    pairs = [(k, a.get(k), b.get(k)) for k in dict.fromkeys(list(a) + list(b))]
    # a function that moved to another module (a fixed copy of the verifier) matches by name when unique
    only_a = [(k, x) for k, x, y in pairs if y is None]
    only_b = [(k, y) for k, x, y in pairs if x is None]
    names_a = {}
    for k, x in only_a:
        names_a.setdefault(x.name, []).append(k)
    names_b = {}
    for k, y in only_b:
        names_b.setdefault(y.name, []).append(k)
    merged = {}
    for name, ka in names_a.items():
        kb = names_b.get(name)
        if len(ka) == 1 and kb and len(kb) == 1 and not is_harness(a[ka[0]]):
            merged[ka[0]] = kb[0]
    out = []
    used_b = set(merged.values())
    for k, x, y in pairs:
        if x is None and k in used_b:
            continue
        if y is None and k in merged:
            y = b[merged[k]]
        out.append((x, y))
    return out


def compare(a_rows, b_rows, *, a_total=None, b_total=None, a_units=None, b_units=None,
            tolerance=0.1) -> list[dict]:
    """Per function: Δttot, Δtavg, Δncall, share of total in each, verdict faster / slower / same / new / gone
    (or "not profiled" when one side has no profile at all).

    With the number of verifications behind each profile (a_units, b_units), the verdict compares a
    function's time per verification: a cache or a hoisted call lowers that while each remaining call
    costs the same, so per-call averages alone would call it "same" or even "slower". Without them the
    verdict compares the average time per call.
    """
    a_total = a_total or sum(max(0.0, r.tsub) for r in a_rows) or 1.0
    b_total = b_total or sum(max(0.0, r.tsub) for r in b_rows) or 1.0
    per_unit = bool(a_units and b_units)

    def cost(row, units):
        return row.ttot / units if per_unit else row.tavg

    out = []
    for x, y in _match(a_rows, b_rows):
        r = y or x
        if x is None:  # a side with no rows at all sampled nothing: its functions are unknown, not gone
            verdict = "not profiled" if not a_rows else "new"
        elif y is None:
            verdict = "not profiled" if not b_rows else "gone"
        elif cost(y, b_units) < cost(x, a_units) * (1 - tolerance):
            verdict = "faster"
        elif cost(y, b_units) > cost(x, a_units) * (1 + tolerance):
            verdict = "slower"
        else:
            verdict = "same"
        out.append({
            "name": r.name, "module": short_module(r.module), "line": r.line, "verdict": verdict,
            "a": None if x is None else {"ncall": round(x.ncall), "tsub": x.tsub, "ttot": x.ttot, "tavg": x.tavg,
                                         "share": x.ttot / a_total,
                                         "per_verification": x.ttot / a_units if per_unit else None},
            "b": None if y is None else {"ncall": round(y.ncall), "tsub": y.tsub, "ttot": y.ttot, "tavg": y.tavg,
                                         "share": y.ttot / b_total,
                                         "per_verification": y.ttot / b_units if per_unit else None},
            "d_ttot": (y.ttot if y else 0.0) - (x.ttot if x else 0.0),
            "d_tavg": (y.tavg if y else 0.0) - (x.tavg if x else 0.0),
            "d_ncall": round((y.ncall if y else 0) - (x.ncall if x else 0)),
        })
    out.sort(key=lambda d: -max(abs(d["d_ttot"]), (d["a"] or {}).get("ttot", 0), (d["b"] or {}).get("ttot", 0)))
    return out


def job_throughput(job) -> float | None:
    """Rollouts per second over the job's run (completed jobs; running ones up to now)."""
    if job.started_at is None:
        return None
    end = job.finished_at or timezone.now()
    dt = (end - job.started_at).total_seconds()
    return (job.completed_count + job.failed_count) / dt if dt > 0 else None


def job_figures(job) -> dict:
    """sample_figures of all the job's profiled windows (every session): what a comparison takes."""
    return sample_figures(list(ProfileSnapshot.objects.filter(job=job)))


def compare_jobs(a_job, b_job, *, a: dict | None = None) -> dict:
    """Two jobs per function, each from all of its profiled windows (every session), the rows and the
    verifications behind them from the same snapshots. `a`: a_job's job_figures when the caller has them
    (the compare page sets one job against several)."""
    a = a if a is not None else job_figures(a_job)
    b = job_figures(b_job)
    sides = ((a_job, a), (b_job, b))
    unprofiled = [str(j.pk) for j, f in sides if not f["rows"]]
    thin = [f"job {j.pk}: {f['profiled']} of {f['verifications']}" for j, f in sides if f["few_samples"]]
    warnings = []
    if unprofiled:
        warnings.append(f"job {' and '.join(unprofiled)} has no profile (profiling was not on while it verified): "
                        "its functions cannot be compared")
    if thin:
        warnings.append(f"call counts and times are scaled from few profiled verifications ({'; '.join(thin)}): "
                        "they may be far off; profile longer, or with budget_pct 100 for exact counts")
    ta, tb = job_throughput(a_job), job_throughput(b_job)

    def side(job, f, throughput):
        return {"job": job.pk, "verifier": job.verifier, "throughput": throughput, "total_s": f["total_s"],
                "verifications": f["verifications"], "profiled": f["profiled"], "overhead_pct": f["overhead_pct"]}

    return {
        "a": side(a_job, a, ta),
        "b": side(b_job, b, tb),
        "warning": " ".join(warnings),
        "throughput_ratio": (tb / ta) if ta and tb else None,
        "functions": compare(a["rows"], b["rows"], a_units=a["verifications"], b_units=b["verifications"]),
    }
