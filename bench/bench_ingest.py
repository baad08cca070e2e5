"""Dataset ingest time against the file's size, on SQLite and PostgreSQL (issue 28): linear or not.

Each database runs in a subprocess of its own (DATABASE_URL set, migrated first, not timed): a fresh SQLite
file under a temporary folder, and a PostgreSQL database `<name>_bench_ingest` created and dropped here.
Files are NeMo Gym math rows (scripts/make_math_dataset.py; the random questions repeat now and then, so
identical lines get shared task indices) plus, with `--explicit`, a share of rows carrying `_ng_task_index`.
Sizes run in the order given, `--rounds` times with the databases alternating; the table gives per database
and size the median seconds, rows/s and the ratio of seconds to the smallest size's (linear: ~ the size ratio).

    .venv/bin/python -m bench.bench_ingest                       # 1k, 10k, 100k rows on both
    .venv/bin/python -m bench.bench_ingest --sizes 1000,4000,16000 --db sqlite
    .venv/bin/python -m bench.bench_ingest --db sqlite,sqlite-orm     # SQLite's row writer against bulk_create
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_file(path: Path, n: int, explicit_every: int = 0) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_math_dataset import make_rows

    with open(path, "w") as f:
        for i, row in enumerate(make_rows(n, seed=n)):
            if explicit_every and i % explicit_every == 0:
                row["_ng_task_index"] = i // explicit_every
            f.write(json.dumps(row) + "\n")


CHILD = r"""
import json, os, sys, time
import django
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from controlplane.datasets import services
from controlplane.datasets.services import ingest_jsonl
services._RowWriter.SQLITE_TEXT = os.environ.get("BENCH_INGEST_WRITER") != "orm"
from controlplane.datasets.models import DatasetRow
out = []
for path in sys.argv[1:]:
    t0 = time.perf_counter()
    ds = ingest_jsonl(path, name=os.path.basename(path))
    dt = time.perf_counter() - t0
    shared = DatasetRow.objects.filter(dataset=ds, occurrence__gt=0).count()
    out.append({"rows": ds.row_count, "secs": dt, "repeats": shared})
print("RESULT " + json.dumps(out))
"""


def run_child(db_url: str, files: list[Path], writer: str = "") -> list[dict]:
    env = {**os.environ, "DATABASE_URL": db_url, "BENCH_INGEST_WRITER": writer}
    p = subprocess.run([sys.executable, "-c", CHILD, *map(str, files)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=3600)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"ingest child failed ({p.returncode}):\n{p.stderr[-3000:]}")


def pg_admin(base_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(base_url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
        conn.execute(sql)


def load() -> str:
    return "%.1f %.1f %.1f" % os.getloadavg()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--db", default="sqlite,postgres",
                    help="comma-separated: sqlite, postgres, sqlite-orm (SQLite with the rows written by bulk_create, "
                         "as before the line texts went in with one executemany)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--explicit", type=int, default=0, help="every K-th row carries its own _ng_task_index")
    ap.add_argument("--pg", default=os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/controlplane"))
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    dbs = args.db.split(",")
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench_ingest_") as tmp:
        tmp = Path(tmp)
        files = []
        for n in sizes:
            f = tmp / f"rows_{n}.jsonl"
            make_file(f, n, args.explicit)
            files.append(f)
        pg_url = args.pg.rsplit("/", 1)[0] + "/" + args.pg.rsplit("/", 1)[1].split("?")[0] + "_bench_ingest"
        for r in range(args.rounds):
            for db in (dbs if r % 2 == 0 else dbs[::-1]):
                if db.startswith("sqlite"):
                    url = f"sqlite:///{tmp}/r{r}-{db}.sqlite3"
                else:
                    pg_admin(args.pg, f'DROP DATABASE IF EXISTS "{pg_url.rsplit("/", 1)[1]}"')
                    pg_admin(args.pg, f'CREATE DATABASE "{pg_url.rsplit("/", 1)[1]}"')
                    url = pg_url
                before = load()
                try:
                    out = run_child(url, files, "orm" if db == "sqlite-orm" else "")
                finally:
                    if not db.startswith("sqlite"):
                        pg_admin(args.pg, f'DROP DATABASE IF EXISTS "{pg_url.rsplit("/", 1)[1]}"')
                for n, o in zip(sizes, out):
                    results.setdefault((db, n), []).append(o["secs"])
                    print(f"round {r} {db:10s} {n:>8d} rows {o['secs']:8.2f} s  rows sharing a task index: "
                          f"{o['repeats']}  load before {before}", flush=True)
    print()
    print(f"{'database':10s} {'rows':>8s} {'median s':>9s} {'rows/s':>9s} {'x time':>7s} {'x rows':>7s}")
    for db in dbs:
        base = statistics.median(results[(db, sizes[0])])
        for n in sizes:
            m = statistics.median(results[(db, n)])
            print(f"{db:10s} {n:>8d} {m:9.2f} {n / m:9.0f} {m / base:7.1f} {n / sizes[0]:7.1f}")
    print(f"load at end: {load()} (2 cores, shared)")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{d}:{n}": v for (d, n), v in results.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
