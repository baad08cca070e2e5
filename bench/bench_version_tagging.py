#!/usr/bin/env python3
"""What tagging weight versions onto stored rollouts costs after each weight update, against the number of
rollouts already stored (issue: one UPDATE per past version over all the endpoint's rollouts, 4-15 s at 70k).

    DATABASE_URL=postgres://... .venv/bin/python -m bench.bench_version_tagging [--sizes 10000,100000] [--updates 5]

In a throwaway database (created and dropped here), for each size N: one endpoint with a weight-version history
and N stored rollouts (vLLM-style: the server reports no version, the sink tagged each row at write time), plus
200 rows written while the measured update ran. Then, per update, the time of:
* before: the full pass this replaced (`versions.tag_stored` over every rollout of the endpoint);
* after: `versions.after_update` (rows written since the update's pause only: a primary-key range).
Medians over --updates updates. The two columns should be flat in N for "after".
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--updates", type=int, default=5)
    args = ap.parse_args(argv)
    import django

    django.setup()
    from django.db import connection
    from django.test.utils import setup_test_environment

    setup_test_environment()
    old_name = connection.settings_dict["NAME"]
    connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    try:
        rows = [run_size(int(n), args.updates) for n in args.sizes.split(",")]
    finally:
        connection.creation.destroy_test_db(old_name, verbosity=0)
    print(f"\n{'stored rollouts':>16} | {'before: full pass (ms)':>22} | {'after: since the pause (ms)':>27} | retagged")
    for n, before, after, retagged in rows:
        print(f"{n:>16,} | {before:>22.1f} | {after:>27.1f} | {retagged}")
    return 0


def run_size(n: int, updates: int):
    from django.contrib.auth import get_user_model
    from django.utils import timezone

    from controlplane.datasets.models import Dataset
    from controlplane.jobs import versions
    from controlplane.endpoints.models import Endpoint, WeightVersion
    from controlplane.jobs.models import CollectionJob, Rollout

    user, _ = get_user_model().objects.get_or_create(username="bench-tagging")
    ep = Endpoint.objects.create(owner=user, name=f"bench-{n}", base_url="http://127.0.0.1:9", model_name="m")
    ds = Dataset.objects.create(owner=user, name=f"bench-{n}", status=Dataset.Status.READY, row_count=n)
    job = CollectionJob.objects.create(owner=user, dataset=ds, endpoint=ep, num_repeats=1)
    now = timezone.now()
    start = now - timedelta(hours=1)
    WeightVersion.objects.create(endpoint=ep, version="1", previous_version="", trace_id="b", started_at=start,
                                 applied_at=start)
    batch = 5000
    for i in range(0, n, batch):
        Rollout.objects.bulk_create([Rollout(job=job, task_index=j, rollout_index=0, data={}, wall_ms=100.0,
                                             weight_version="1", created_at=start + timedelta(seconds=j * 3000 / n))
                                     for j in range(i, min(n, i + batch))])
    befores, afters, retagged = [], [], 0
    for u in range(updates):
        version = str(u + 2)
        pause = timezone.now()
        since_id = versions.last_rollout_id()
        # rows written while the update ran: their sink tagged them with the version before it
        Rollout.objects.bulk_create([Rollout(job=job, task_index=n + u * 200 + j, rollout_index=0, data={},
                                             wall_ms=1.0, weight_version=str(u + 1),
                                             created_at=pause + timedelta(milliseconds=50 + j))
                                     for j in range(200)])
        WeightVersion.objects.create(endpoint=ep, version=version, previous_version=str(u + 1), trace_id="b",
                                     started_at=pause, applied_at=timezone.now())
        t0 = time.perf_counter()
        versions.tag_stored(Rollout.objects.filter(job__endpoint_id=ep.pk), versions._history(ep.pk))
        befores.append((time.perf_counter() - t0) * 1000)
        t0 = time.perf_counter()
        retagged = versions.after_update(ep.pk, since_id)
        afters.append((time.perf_counter() - t0) * 1000)
        assert Rollout.objects.filter(job=job, task_index__gte=n + u * 200, weight_version=version).count() == 200
    print(f"{n}: before {befores}, after {afters}", flush=True)
    return n, statistics.median(befores), statistics.median(afters), retagged


if __name__ == "__main__":
    sys.exit(main())
