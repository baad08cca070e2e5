"""Does the API's JSONL export stream in constant memory? 20k vs 200k rollouts through GET /api/jobs/<id>/export/.

For each size, Rollout rows shaped like the engine's (input row, a Responses-API `response` with ~600
characters of text, usage, reward, verifier fields; ~1.2 KB of JSON each) are bulk-inserted into a
throwaway job, then the export is requested through Django's full request stack (URL routing, token auth,
throttling, the DRF view) with the test client, and its StreamingHttpResponse is consumed chunk by chunk
the way a WSGI/ASGI server would. Measured around the request *and* the consumption:

- tracemalloc peak: every Python allocation made while serving the export (reset before each run);
- RSS growth: the process's resident memory sampled every 5 ms, peak minus the value before the request
  (this also sees C-level buffers, e.g. libpq's, which tracemalloc cannot).

Constant memory = both figures about the same at 20k and at 200k rows while the bytes sent grow 10x.
The database is a throwaway one created (and dropped) by the script, on the server of DATABASE_URL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/controlplane .venv/bin/python -m bench.bench_export
    ... -m bench.bench_export --sizes 20000,200000 --which ok
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

import psutil  # noqa: E402
from django.db import connection  # noqa: E402
from django.test import Client  # noqa: E402

from bench._common import throwaway_api  # noqa: E402

TEXT = ("Let me work through this step by step. First I add the tens, then the units, and I carry the one "
        "where needed so that the final sum comes out right. ") * 4


def make_row(task: int, rep: int) -> dict:
    a, b = task % 997, (task * 7) % 991
    question = f"What is {a} + {b}?"
    return {
        "responses_create_params": {"input": [{"role": "user", "content": question + " Put the answer in \\boxed{}."}],
                                    "temperature": 0.7, "max_output_tokens": 256},
        "question": question, "expected_answer": str(a + b),
        "response": {"id": f"resp-{task}-{rep}", "object": "response", "status": "completed",
                     "output": [{"type": "message", "role": "assistant", "id": f"msg-{task}-{rep}",
                                 "content": [{"type": "output_text", "text": f"{TEXT} \\boxed{{{a + b}}}"}]}],
                     "usage": {"input_tokens": 31, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 140,
                               "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 171}},
        "reward": 1.0, "extracted_answer": str(a + b), "library_reward": 1.0,
        "_ng_task_index": task, "_ng_rollout_index": rep,
    }


def fill_job(job, n: int, batch: int = 5000) -> float:
    from controlplane.jobs.models import Rollout

    t0 = time.perf_counter()
    for start in range(0, n, batch):
        Rollout.objects.bulk_create([
            Rollout(job=job, task_index=i, rollout_index=0, status="ok", reward=1.0, data=make_row(i, 0),
                    wall_ms=50.0, input_tokens=31, output_tokens=140)
            for i in range(start, min(n, start + batch))])
    return time.perf_counter() - t0


class RssSampler(threading.Thread):
    def __init__(self, interval=0.005):
        super().__init__(daemon=True)
        self.proc, self.interval = psutil.Process(), interval
        self.base = self.peak = self.proc.memory_info().rss
        self.stop_event = threading.Event()

    def run(self):
        while not self.stop_event.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(self.interval)

    def stop(self):
        self.stop_event.set()
        self.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)
        return self.peak - self.base


def measure_export(client, token: str, job_id: int, which: str) -> dict:
    tracemalloc.start()
    tracemalloc.reset_peak()
    sampler = RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    resp = client.get(f"/api/jobs/{job_id}/export/?which={which}", HTTP_AUTHORIZATION=f"Token {token}")
    assert resp.status_code == 200 and resp.streaming, resp.status_code
    n_bytes = n_lines = n_chunks = 0
    for chunk in resp.streaming_content:  # what the server does: write each chunk to the socket, keep nothing
        n_bytes += len(chunk)
        n_lines += chunk.count(b"\n")
        n_chunks += 1
    resp.close()
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss_growth = sampler.stop()
    return {"lines": n_lines, "bytes": n_bytes, "chunks": n_chunks, "wall_s": wall, "py_peak": peak,
            "rss_growth": rss_growth}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20000,200000", help="rollout counts, comma-separated")
    ap.add_argument("--which", default="ok", choices=["ok", "failed", "all"])
    ap.add_argument("--repeat", type=int, default=2, help="exports per size (the table shows the last)")
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",")]

    with throwaway_api("bench_export", max(sizes)) as (user, token, ds, ep):
        from controlplane.jobs.models import CollectionJob

        client = Client()
        results = []
        for n in sizes:
            job = CollectionJob.objects.create(owner=user, dataset=ds, endpoint=ep, state="completed",
                                               total_rollouts=n, completed_count=n)
            fill_s = fill_job(job, n)
            print(f"inserted {n} rollouts in {fill_s:.1f} s", file=sys.stderr, flush=True)
            runs = [measure_export(client, token, job.pk, args.which) for _ in range(args.repeat)]
            r = runs[-1]
            r["rss_growth_first"] = runs[0]["rss_growth"]
            assert all(x["lines"] == n for x in runs), [x["lines"] for x in runs]
            results.append((n, r))

        print(f"\nGET /api/jobs/<id>/export/?which={args.which} on {connection.vendor} "
              f"(Django test client, full request stack; last of {args.repeat} runs; "
              f"the first run also warms the process)\n")
        print(f"{'rollouts':>9} {'MiB sent':>9} {'chunks':>8} {'wall s':>7} {'rows/s':>8} "
              f"{'py peak MiB':>12} {'RSS growth MiB (1st run / last)':>32}")
        for n, r in results:
            print(f"{n:>9,} {r['bytes'] / 2**20:>9.1f} {r['chunks']:>8,} {r['wall_s']:>7.1f} "
                  f"{n / r['wall_s']:>8,.0f} {r['py_peak'] / 2**20:>12.2f} "
                  f"{r['rss_growth_first'] / 2**20:>23.1f} / {r['rss_growth'] / 2**20:.1f}")
        if len(results) >= 2:
            (n0, a), (n1, b) = results[0], results[-1]
            print(f"\n{n1 // n0}x the rows, {b['bytes'] / a['bytes']:.1f}x the bytes: python peak x"
                  f"{b['py_peak'] / max(1, a['py_peak']):.2f}, RSS growth {a['rss_growth'] / 2**20:.1f} -> "
                  f"{b['rss_growth'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
