"""Does the shared (Redis) verification cache pay for itself? (issue 28, "caches that pay for themselves")

The engine collects from the simulator at zero latency (the engine's CPU is the limit, the worst case for the
cache) and verifies each answer in its process pool, with the verification cache in three arms, interleaved
in a rotated order each round, each run in a fresh cache scope:

* local     the run's own cache (no Redis);
* shared    Redis shared by every run of the job, kept whatever it costs (VERIFY_CACHE_SHARED=always);
* measured  the default: Redis while it pays, measured over the run's first 256 lookups, then local
            (workers/verifiers/execution.py).

Two verifier costs (math-verify, ~0.1 ms; the same after 5 ms of CPU: `--burn-ms`), and two hit rates: "0 %"
(a fresh scope: no run has stored anything) and "warm" (another run of the job -- another worker's chunk -- has
stored the first half of the rows' answers, so about half the lookups find theirs). Per arm the median over
the rounds of the ratio to the "local" run of the same round: rollouts/s and the engine process's CPU per
rollout (its own threads; the pool's CPU is the verifier's and is the same in every arm). The "choice" column
is what the measured arm chose (its stats).

    .venv/bin/python -m bench.bench_verify_cache                    # 3 rounds x 4 scenarios x 3 arms, ~4 min
    .venv/bin/python -m bench.bench_verify_cache --rounds 5 -n 3000 --json bench/results/verify_cache.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("VERIFIER_PATH_MODULES", "bench.verify_cache_verifiers")  # lets the engine name the costly one

from bench._common import CountingSink, table_lines  # noqa: E402
from tests.fixtures_simulator import start_simulator  # noqa: E402
from workers.diagnosis.scenarios import task_items  # noqa: E402
from workers.engine.runner import run_collection  # noqa: E402
from workers.engine.types import CollectionSpec, EndpointSpec  # noqa: E402

ARMS = ("local", "shared", "measured")
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")


class StatsSink(CountingSink):
    """Counts, and keeps the last progress tick's verification stats (the cache's choice and hits)."""

    def __init__(self):
        super().__init__()
        self.stats = {}
        self.first_error = ""

    async def rollout(self, r):
        await super().rollout(r)
        if not r.ok and not self.first_error:
            self.first_error = f"{r.failure_class}: {r.error}"[:200]

    async def progress(self, t):
        self.stats = dict(getattr(t, "extra", {}) or {})


async def one_run(arm, url, model, rows, *, verifier, options, c, scope, prefill_rows=None) -> dict:
    def spec(shared_choice):
        return CollectionSpec(endpoint=EndpointSpec(base_urls=[url], model=model), parallelism=c, verifier=verifier,
                              verifier_options=options, verify_cache="job", progress_interval_s=0.5,
                              verify_cache_url=None if arm == "local" else REDIS_URL, verify_cache_scope=scope,
                              verify_cache_shared_choice=shared_choice)

    choice = "always" if arm == "shared" else "measured"
    if prefill_rows:  # another run of the job stored these first (always, so that it stores every one)
        await run_collection(spec("always") if arm != "local" else spec(choice), task_items(prefill_rows),
                             CountingSink(), None)
    sink = StatsSink()
    cpu0, t0 = time.process_time(), time.monotonic()
    summary = await run_collection(spec(choice), task_items(rows), sink, None)
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    st = sink.stats
    return {"arm": arm, "ok": sink.ok, "failed": summary.failed, "wall_s": wall, "rps": sink.ok / wall,
            "cpu_ms": 1000 * cpu / max(1, sink.ok), "shared_hits": st.get("verify_cache_shared_hits", 0),
            "lookups": st.get("verify_cache_lookups", 0), "choice": st.get("verify_cache_choice", ""),
            "first_error": sink.first_error}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="rollouts per run (default 2000)")
    ap.add_argument("-c", type=int, default=64, help="concurrency (default 64)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--burn-ms", type=float, default=5.0, help="CPU per verification of the costly verifier")
    ap.add_argument("--json", help="write the runs and the table here")
    args = ap.parse_args()
    scenarios = [("math-verify", "math", {}, False), ("math-verify", "math", {}, True),
                 (f"costly ({args.burn_ms:g} ms)", "bench.verify_cache_verifiers:costly_math",
                  {"burn_ms": args.burn_ms}, False),
                 (f"costly ({args.burn_ms:g} ms)", "bench.verify_cache_verifiers:costly_math",
                  {"burn_ms": args.burn_ms}, True)]
    # four tokens, always right: the answer is exactly "The answer is \\boxed{N}", the same for the same question
    # in every run, so that another run's stored results can be found (the simulator's longer texts differ)
    sim = start_simulator(seed=0, ttft_ms=0, itl_ms=0, jitter=0, output_len_min=4, output_len_max=4, math_accuracy=1.0)
    rows = [{"responses_create_params": {"input": [{"role": "user", "content": f"What is {i} + 1000?"}]},
             "expected_answer": str(i + 1000)} for i in range(args.n)]  # every answer distinct: no hit within a run
    warm_half = random.Random(7).sample(rows, len(rows) // 2)  # another run stored these: hits spread over the run
    runs = []
    try:
        asyncio.run(one_run("measured", sim.url, sim.model, rows[:300], verifier="math", options={}, c=args.c,
                            scope=f"bench:{uuid.uuid4().hex}"))  # warm: imports, pool, connections
        for r in range(args.rounds):
            for s, (label, verifier, options, warm) in enumerate(scenarios):
                order = ARMS[(r + s) % 3:] + ARMS[:(r + s) % 3]
                for arm in order:
                    res = asyncio.run(one_run(arm, sim.url, sim.model, rows, verifier=verifier, options=options,
                                              c=args.c, scope=f"bench:{uuid.uuid4().hex}",
                                              prefill_rows=warm_half if warm else None))
                    res.update(round=r, scenario=s)
                    runs.append(res)
                    print(f"round {r} {label:18s} {'warm' if warm else '0 %':4s} {arm:8s} {res['rps']:8.1f}/s "
                          f"{res['cpu_ms']:6.3f} CPU ms  hits {res['shared_hits']}/{res['lookups']}  {res['choice'][:60]} {res['first_error']}",
                          flush=True)
    finally:
        sim.stop()

    def ratio(s, arm, key):
        base = {x["round"]: x for x in runs if x["scenario"] == s and x["arm"] == "local"}
        return statistics.median(x[key] / base[x["round"]][key] for x in runs if x["scenario"] == s and x["arm"] == arm)

    table = []
    for s, (label, _, _, warm) in enumerate(scenarios):
        mine = [x for x in runs if x["scenario"] == s and x["arm"] == "measured"]
        hits = statistics.median(x["shared_hits"] / max(1, x["lookups"]) for x in mine)
        choices = sorted({x["choice"].split(":")[0] or "(none yet)" for x in mine})
        table.append([label, "warm" if warm else "0 %", f"{hits:.0%}",
                      *(f"{ratio(s, a, 'rps'):.2f}" for a in ("shared", "measured")),
                      *(f"{ratio(s, a, 'cpu_ms'):.2f}" for a in ("shared", "measured")), "/".join(choices)])
    print(f"\nVerification cache: {args.rounds} rounds x {args.n} rollouts at concurrency {args.c}, simulator at 0 ms; "
          f"ratios to the local cache in the same round (medians); load {os.getloadavg()[0]:.1f}\n")
    header = ["verifier", "hits", "measured hit rate", "rollouts/s shared", "rollouts/s measured",
              "engine CPU shared", "engine CPU measured", "measured chose"]
    print("\n".join(table_lines(header, table, left=2)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "table": table}, f, indent=1)


if __name__ == "__main__":
    main()
