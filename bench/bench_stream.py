"""The rollout stream for trainers: delivery latency (stored -> the trainer has it) and throughput beside the
JSONL export, with the process's memory.

1. Throughput, for each size: a job of N stored rollouts (~1.2 KB of JSON each, as bench_export) is
   (a) exported through GET /api/jobs/<id>/export/ and (b) drained by one consumer through
   GET /api/jobs/<id>/stream/?max=B&ack=<previous token> per batch (the take acknowledges the batch before),
   both through Django's full request stack (test client: routing, token auth, throttling, the DRF views), and
   both decoded by the reader (each JSONL line / each batch's body, the way rolloutctl.stream decodes it), as a
   trainer must. Rows/s and RSS growth of each (the process's peak RSS minus its RSS before that read).
   With `--fields` (default: rolloutctl.stream.TRAIN_FIELDS), (c) a second consumer drains the same rows with
   `&fields=...` (only what a trainer trains on), in the same run, beside (a) and (b).
2. Latency: a writer thread stores rollouts the way the job sink does (its transaction: the job-row lock,
   COPY insert, counters), `--rate` rows/s in batches every `--flush-s`, while a consumer long-polls
   (wait=5) and acknowledges. Per rollout: the time the consumer had it - the time its batch committed.
   p50 / p95 / max.

3. With `--http`: the same reads as a trainer makes them, through the product's web server (uvicorn, as `make
   demo` and docker/compose.yml run it, in a process of its own) and rolloutctl's client in this one: the export
   with `Client.iter_export` (each line decoded; "export held": the decoded rows also held a batch at a time, as
   a trainer holds what it trains on and the stream's reader holds its batch), the stream with `RolloutStream.take(ack=...)` batch after batch,
   as JSON lines (the client's default) and as one JSON document a batch ("doc").
   `--rounds` times each, the arms' order rotated each round; rows/s per arm and round, and each arm's median
   share of the export's rows/s. Server and reader in separate processes, as in use: the export's server writes
   while the reader decodes; so does the stream's as JSON lines, within each batch (as a document, the take and
   the decode alternate).

The database is a throwaway one created (and dropped) by the script, on the server of DATABASE_URL.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/controlplane .venv/bin/python -m bench.bench_stream
    ... -m bench.bench_stream --sizes 20000,200000 --batch 1000 --latency-s 20 --rate 500
    ... -m bench.bench_stream --sizes 1000000 --batch 2000 --latency-s 20     # 1M rows: filled by fill_fast
    ... -m bench.bench_stream --sizes 200000 --batch 2000 --http --rounds 3     # through uvicorn, as a trainer
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.test import Client  # noqa: E402

from bench._common import throwaway_api  # noqa: E402
from bench.bench_export import RssSampler, fill_job, make_row, measure_export  # noqa: E402
try:  # as the trainer's client decodes a batch (before it had decode_batch: requests' .json(), json.loads)
    from rolloutctl.stream import decode_batch  # noqa: E402
except ImportError:
    from json import loads as decode_batch  # noqa: E402
try:  # an export line decoded as rolloutctl decodes a stream's (orjson where it has it): the same decoder each arm
    from rolloutctl.client import loads  # noqa: E402
except ImportError:
    from json import loads  # noqa: E402


def rss_marks(total: int):
    """RSS (MiB) of this process (server and client both: the test client) as rows reach 10 %, 50 %, 100 %."""
    import psutil

    proc, todo, marks = psutil.Process(), [(0.1, "10%"), (0.5, "50%"), (1.0, "100%")], {}

    def at(n: int) -> None:
        while todo and n >= todo[0][0] * total:
            marks[todo.pop(0)[1]] = proc.memory_info().rss / 2**20
    return marks, at


def export_parsed(client, token, job_id, total: int = 0) -> dict:
    """GET /api/jobs/<id>/export/?which=ok, every line decoded (what a trainer reading the export does)."""
    marks, at = rss_marks(total)
    sampler = RssSampler()
    sampler.start()
    t0 = time.perf_counter()
    resp = client.get(f"/api/jobs/{job_id}/export/?which=ok", HTTP_AUTHORIZATION=f"Token {token}")
    assert resp.status_code == 200 and resp.streaming, resp.status_code
    n, rest = 0, b""
    for chunk in resp.streaming_content:
        lines = (rest + chunk).split(b"\n")
        rest = lines.pop()
        for line in lines:
            loads(line)
            n += 1
        at(n)
    resp.close()
    return {"lines": n, "wall_s": time.perf_counter() - t0, "rss_growth": sampler.stop(), "rss_at": marks}


def drain(client, token, job_id, consumer, batch, fields: str = "", total: int = 0) -> dict:
    marks, at = rss_marks(total)
    sampler = RssSampler()
    sampler.start()
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    t0 = time.perf_counter()
    n = batches = 0
    extra = {"fields": fields} if fields else {}
    params = {"consumer": consumer, "max": batch, **extra}
    while True:  # each take acknowledges the batch before it (?ack=token), as rolloutctl.stream does
        r = client.get(f"/api/jobs/{job_id}/stream/", params, **auth)
        assert r.status_code == 200, r.content[:500]
        # the test client's response (cyclic: r.client, r.wsgi_request ...) let go before the decode, as
        # rolloutctl's reader holds no cyclic garbage at a take: else the decode's handover of what is alive to
        # the oldest generation keeps each one (the body twice, ~15 MB) until a full collection
        content, r = r.content, None
        body = decode_batch(content)  # as rolloutctl.stream decodes a batch
        if not body["count"]:
            break
        n += body["count"]
        batches += 1
        at(n)
        params = {"consumer": consumer, "max": batch, "ack": body["token"], **extra}
    wall = time.perf_counter() - t0
    return {"rows": n, "batches": batches, "wall_s": wall, "rss_growth": sampler.stop(), "rss_at": marks}


def interleaved(client, token, job_id, batch, fields: str = "") -> dict:
    """The export and the stream read in turns, in one process: per round `batch` export lines (decoded), one
    stream batch (decoded), one `fields=` batch when given, the arms' order rotated each round, until every
    arm has read every row. A shared machine's load comes and goes in seconds; in turns it slows every arm
    alike, so the ratios hold where back-to-back runs differ by 2x. Seconds and rows per arm."""
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    resp = client.get(f"/api/jobs/{job_id}/export/?which=ok", **auth)
    chunks, rest = iter(resp.streaming_content), [b""]

    def export_step() -> int:
        n = 0
        while n < batch:
            chunk = next(chunks, None)
            if chunk is None:
                return n
            lines = (rest[0] + chunk).split(b"\n")
            rest[0] = lines.pop()
            for line in lines:
                loads(line)
                n += 1
        return n

    tokens: dict[str, str] = {}

    def stream_step(arm: str) -> int:
        params = {"consumer": "turns-lean" if arm == "fields=" else "turns", "max": batch, **({"fields": fields} if arm == "fields=" else {})}
        if tokens.get(arm):
            params["ack"] = tokens[arm]
        body = decode_batch(client.get(f"/api/jobs/{job_id}/stream/", params, **auth).content)
        tokens[arm] = body["token"]
        return body["count"]

    arms = ["export", "stream", *(["fields="] if fields else [])]
    out = {a: {"s": 0.0, "rows": 0} for a in arms}
    for k in range(10**9):
        got = 0
        for a in arms[k % len(arms):] + arms[:k % len(arms)]:
            t0 = time.perf_counter()
            n = export_step() if a == "export" else stream_step(a)
            out[a]["s"] += time.perf_counter() - t0
            out[a]["rows"] += n
            got += n
        if not got:
            break
    resp.close()
    return out


@contextlib.contextmanager
def web_server():
    """The product's web server (uvicorn, controlplane.asgi, as `make demo` starts it) on a free port, serving
    this process's (throwaway) database with the API's throttles off: yields its base URL and its pid."""
    import socket
    import subprocess

    import requests

    db = connection.settings_dict
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    env = {**os.environ, "DATABASE_URL": url, "API_THROTTLE_USER_RATE": "100000000/min",
           "DJANGO_SETTINGS_MODULE": "controlplane.settings"}
    proc = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "uvicorn"), "controlplane.asgi:application",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"], env=env, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                requests.get(f"{base}/healthz", timeout=2)
                break
            except requests.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the web server did not start") from None
                time.sleep(0.2)
        yield base, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


def export_http(base, token, job_id, hold: int = 0) -> int:
    """The export as rolloutctl reads it (Client.iter_export), every line decoded: rows read. `hold` ("export held"):
    the decoded rows kept in lists of `hold`, each let go as the next one is full, with the collector paused as
    rolloutctl.stream pauses it while decoding a batch: what a trainer holding a batch of the export pays, as the
    stream's reader does (decoded rows dropped at once reuse memory still in the caches: 2.4x cheaper per row)."""
    import gc

    from rolloutctl.client import Client as ApiClient

    n, rest, held = 0, b"", []
    paused = hold and gc.isenabled()
    if paused:
        gc.disable()
    try:
        for chunk in ApiClient(base, token).iter_export(job_id):
            lines = (rest + chunk).split(b"\n")
            rest = lines.pop()
            for line in lines:
                row = loads(line)
                n += 1
                if hold:
                    held.append(row)
                    if len(held) == hold:
                        held = []
    finally:
        if paused:
            gc.enable()
    return n


def drain_http(base, token, job_id, consumer, batch, fields: str = "", lines: bool = True) -> int:
    """The stream as a trainer reads it: RolloutStream.take(ack=the batch before) until none is left; each batch
    as JSON lines (the client's default), or as one JSON document (`lines=False`)."""
    from rolloutctl.stream import RolloutStream

    st = RolloutStream(base, token, job_id, consumer, max=batch, wait=0,
                       fields=fields.split(",") if fields else None, lines=lines)
    n, prev = 0, None
    while (got := st.take(ack=prev)) is not None:
        n += len(got)
        prev = got
    if prev is not None:
        st.ack(prev)
    return n


def _use_decoder(name: str) -> None:
    """Every reader of this bench (export lines, stream batches) decodes with `name`: "orjson" (rolloutctl's own)
    or "json" (the standard library's, what rolloutctl used before)."""
    import json

    import rolloutctl.stream

    global loads
    loads = rolloutctl.stream.loads = json.loads if name == "json" else _ROLLOUTCTL_LOADS


_ROLLOUTCTL_LOADS = loads


HTTP_ARMS = ("export", "export held", "stream", "fields=", "stream doc", "fields= doc")


def over_http(token, job_id, n, batch, fields, rounds, decoders=("orjson",), only=HTTP_ARMS) -> dict:
    """`rounds` reads of every arm through the web server, the order rotated each round: {arm: [seconds...]}.
    With more than one decoder, every arm once with each (named "<arm> <decoder>"). Also the RSS (MiB) of the
    reader (this process) and of the web server after each read: {arm: [(reader, server)...]}."""
    import psutil

    base_arms = [a for a in HTTP_ARMS if a in only and (fields or not a.startswith("fields="))]
    arms = base_arms if len(decoders) == 1 else [f"{a} {d}" for d in decoders for a in base_arms]
    out = {a: [] for a in arms}
    cpu = {a: [] for a in arms}  # this process's (the reader's) CPU seconds per run
    rss = {a: [] for a in arms}
    reader = psutil.Process()
    with web_server() as (base, server_pid):
        server = psutil.Process(server_pid)
        export_http(base, token, job_id)  # warms the server process and the table's pages
        for k in range(rounds):
            for a in arms[k % len(arms):] + arms[:k % len(arms)]:
                _use_decoder(a.rsplit(" ", 1)[1] if len(decoders) > 1 else decoders[0])
                a_base = a.rsplit(" ", 1)[0] if len(decoders) > 1 else a
                c0, t0 = time.process_time(), time.perf_counter()
                if a_base.startswith("export"):
                    got = export_http(base, token, job_id, hold=batch if a_base == "export held" else 0)
                else:
                    name = f"http-{a.replace('=', '').replace(' ', '-')}-{k}"
                    got = drain_http(base, token, job_id, name, batch, fields if a.startswith("fields=") else "",
                                     lines=not a_base.endswith(" doc"))
                out[a].append(time.perf_counter() - t0)
                cpu[a].append(time.process_time() - c0)
                rss[a].append((reader.memory_info().rss / 2**20, server.memory_info().rss / 2**20))
                assert got == n, (a, got, n)
            print("  round %d: " % (k + 1) + ", ".join(f"{a} {n / t[-1]:,.0f} rows/s" for a, t in out.items()),
                  file=sys.stderr, flush=True)
    return {"wall": out, "cpu": cpu, "rss": rss}


def fill_fast(job, n: int, template: int = 2000) -> float:
    """fill_job for large sizes: `template` rows as bench_export writes them, then the rest copied from them by
    the database (INSERT ... SELECT, task i from template row i % template, its `_ng_task_index` set to i): the
    same shape and size of row, in seconds rather than the minutes bulk_create takes for 1M rows."""
    from controlplane.jobs.models import Rollout

    t0 = time.perf_counter()
    fill_job(job, min(n, template))
    if n > template:
        meta = Rollout._meta
        qn = connection.ops.quote_name
        cols = [f.column for f in meta.concrete_fields if f.column != meta.pk.column]
        exprs = {"task_index": "g.i", "data": "jsonb_set(r.data, '{_ng_task_index}', to_jsonb(g.i))"}
        sel = ", ".join(exprs.get(c, f"r.{qn(c)}") for c in cols)
        with connection.cursor() as cur:
            for lo in range(template, n, 100_000):
                hi = min(n, lo + 100_000)
                cur.execute(f"INSERT INTO {qn(meta.db_table)} ({', '.join(qn(c) for c in cols)}) SELECT {sel} "
                            f"FROM generate_series(%s, %s) AS g(i) JOIN {qn(meta.db_table)} r "
                            f"ON r.job_id = %s AND r.task_index = g.i %% %s AND r.rollout_index = 0 ORDER BY g.i",
                            [lo, hi - 1, job.pk, template])
    return time.perf_counter() - t0


def write_like_the_sink(job, rate: float, flush_s: float, seconds: float, committed: dict, stop: threading.Event):
    """Rows stored as DbSink._write_batch stores them; committed[(task, rep)] = the commit time."""
    from django.db.models import F
    from django.utils import timezone

    from controlplane.jobs.models import CollectionJob
    from controlplane.jobs.sink import insert_rollouts
    from controlplane.jobs.stream import lock_job_for_insert

    per = max(1, round(rate * flush_s))
    task = 10_000_000
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end and not stop.is_set():
            t_next = time.monotonic() + flush_s
            now = timezone.now()
            rows = [{"job": job.pk, "task_index": task + i, "rollout_index": 0, "status": "ok", "failure_class": "",
                     "error": "", "reward": 1.0, "data": make_row(task + i, 0), "queue_ms": 0.0, "ttft_ms": 1.0,
                     "generation_ms": 1.0, "verify_ms": 0.1, "wall_ms": 50.0, "input_tokens": 31, "output_tokens": 140,
                     "attempts": 1, "weight_version": "", "completed_version": "", "spans_update": False, "stale": False,
                     "worker": "bench", "created_at": now, "trace_id": ""} for i in range(per)]
            with transaction.atomic():
                lock_job_for_insert(job.pk)
                inserted = insert_rollouts(rows)
                CollectionJob.objects.filter(pk=job.pk).update(completed_count=F("completed_count") + len(inserted))
            t = time.time()
            for i in range(per):
                committed[task + i] = t
            task += per
            time.sleep(max(0.0, t_next - time.monotonic()))
    finally:
        connection.close()


def latency(client, token, job, args) -> dict:
    committed: dict[int, float] = {}
    stop = threading.Event()
    writer = threading.Thread(target=write_like_the_sink,
                              args=(job, args.rate, args.flush_s, args.latency_s, committed, stop), daemon=True)
    auth = {"HTTP_AUTHORIZATION": f"Token {token}"}
    lat = []
    writer.start()
    end = time.monotonic() + args.latency_s + 2
    params = {"consumer": "latency", "max": args.batch, "wait": 5}
    try:
        while time.monotonic() < end:
            body = decode_batch(client.get(f"/api/jobs/{job.pk}/stream/", params, **auth).content)
            t = time.time()
            for row in body["rollouts"]:
                c = committed.get(row["task_index"])
                if c is not None:
                    lat.append(max(0.0, t - c))
            if body["count"]:
                params = {**params, "ack": body["token"]}
            else:
                params.pop("ack", None)
                if not writer.is_alive():
                    break
    finally:
        stop.set()
        writer.join()
    lat.sort()

    def q(p):
        return lat[min(len(lat) - 1, int(p * len(lat)))] * 1000 if lat else float("nan")

    return {"n": len(lat), "stored": len(committed), "p50_ms": q(0.5), "p95_ms": q(0.95), "max_ms": q(1.0) if lat else 0}


def print_http(results, args) -> None:
    import statistics

    print(f"\nThrough the web server (uvicorn, its own process; rolloutctl's client here), stream batches of "
          f"{args.batch}, each take acknowledging the batch before; {args.rounds} rounds, order rotated\n")
    arms = list(results[0][1]["wall"]) if results else []
    streams = [a for a in arms if not a.startswith("export")]
    held = "export held" in arms  # one decoder: the held export's column beside the export's
    print(f"{'rollouts':>9} " + " ".join(f"{a + ' rows/s':>16}" for a in arms) + " "
          + " ".join(f"{a + '/export':>16}" for a in streams)
          + ("  " + " ".join(f"{a + '/held':>16}" for a in streams) if held else ""))

    def export_of(arm: str) -> str:  # the export read with the arm's decoder
        suffix = arm.rsplit(" ", 1)[-1]
        return f"export {suffix}" if f"export {suffix}" in arms else "export"

    for n, out in results:
        med = {a: statistics.median(t) for a, t in out["wall"].items()}
        print(f"{n:>9,} " + " ".join(f"{n / med[a]:>16,.0f}" for a in arms) + " "
              + " ".join(f"{med[export_of(a)] / med[a]:>16.2f}" for a in streams)
              + ("  " + " ".join(f"{med['export held'] / med[a]:>16.2f}" for a in streams) if held else ""))
    print("stream / fields=: each batch as JSON lines (rolloutctl's default, decoded as they arrive); "
          "doc: as one JSON document" + (f"; fields= is ?fields={args.fields}" if args.fields else "")
          + f"; export held: the export's decoded rows held {args.batch} at a time, as a trainer holds a batch"
          + "; medians of the rounds")
    print("\nThe reader's CPU (this process: rolloutctl's client, decoding), µs per rollout, median of the rounds:")
    for n, out in results:
        print(f"{n:>9,} " + " ".join(f"{a}: {statistics.median(c) / n * 1e6:.1f}" for a, c in out["cpu"].items()))
    print("\nRSS MiB after each read, in the order read (reader: this process; server: uvicorn):")
    for n, out in results:
        for a, marks in out["rss"].items():
            print(f"{n:>9,} {a:>12}: reader " + " ".join(f"{r:.0f}" for r, _ in marks)
                  + ", server " + " ".join(f"{w:.0f}" for _, w in marks))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="20000,200000", help="rollout counts, comma-separated")
    ap.add_argument("--batch", type=int, default=1000, help="the stream's max per batch")
    ap.add_argument("--latency-s", type=float, default=20.0)
    ap.add_argument("--rate", type=float, default=500.0, help="rollouts stored per second during the latency run")
    ap.add_argument("--flush-s", type=float, default=0.2, help="the writer's batch interval (the sink's flush)")
    ap.add_argument("--fill-fast-over", type=int, default=200_000,
                    help="sizes above this are filled by the database from 2,000 written rows (fill_fast)")
    ap.add_argument("--interleave", action="store_true",
                    help="also read the export and the stream in turns (batch by batch, one process): their ratio "
                         "on a shared, noisy machine")
    ap.add_argument("--fields", default="id,task_index,rollout_index,reward,weight_version,data",
                    help="a third arm: the stream with ?fields=these (comma-separated); '' to leave it out")
    ap.add_argument("--http", action="store_true",
                    help="only the reads through the web server (uvicorn) with rolloutctl's client, as a trainer "
                         "makes them (no in-process reads, no latency run)")
    ap.add_argument("--rounds", type=int, default=3, help="--http: reads of each arm, the order rotated")
    ap.add_argument("--decoders", default="orjson", help="--http: the readers' JSON decoders, comma-separated: "
                    "orjson (rolloutctl's), json (the standard library's); more than one: every arm with each")
    ap.add_argument("--arms", default=",".join(HTTP_ARMS),
                    help="--http: the arms to read, comma-separated, of: " + ", ".join(HTTP_ARMS))
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]

    with throwaway_api("bench_stream", max(sizes or [1])) as (user, token, ds, ep):
        from controlplane.jobs.models import CollectionJob

        client = Client()
        results = []
        for n in sizes:
            job = CollectionJob.objects.create(owner=user, dataset=ds, endpoint=ep, state="completed",
                                               total_rollouts=n, completed_count=n)
            fill_s = fill_job(job, n) if n <= args.fill_fast_over else fill_fast(job, n)
            with connection.cursor() as cur:
                cur.execute("ANALYZE jobs_rollout")
            print(f"inserted {n} rollouts in {fill_s:.1f} s", file=sys.stderr, flush=True)
            if args.http:
                results.append((n, over_http(token, job.pk, n, args.batch, args.fields, args.rounds,
                                             tuple(args.decoders.split(",")), tuple(args.arms.split(",")))))
                continue
            measure_export(client, token, job.pk, "ok")  # warms the process and the table's pages
            exp = export_parsed(client, token, job.pk, n)
            st = drain(client, token, job.pk, "drain", args.batch, total=n)
            lean = drain(client, token, job.pk, "drain-lean", args.batch, args.fields, n) if args.fields else None
            assert exp["lines"] == n and st["rows"] == n and (lean is None or lean["rows"] == n), (exp["lines"], st["rows"])
            turns = interleaved(client, token, job.pk, args.batch, args.fields) if args.interleave else None
            assert turns is None or all(t["rows"] == n for t in turns.values()), turns
            results.append((n, exp, st, lean, turns))
            print(f"  export {n / exp['wall_s']:,.0f} rows/s, stream {n / st['wall_s']:,.0f} rows/s"
                  + (f", stream fields= {n / lean['wall_s']:,.0f} rows/s" if lean else ""), file=sys.stderr, flush=True)

        if args.http:
            print_http(results, args)
            return
        live = CollectionJob.objects.create(owner=user, dataset=ds, endpoint=ep, state="running", total_rollouts=10**8)
        lat = latency(client, token, live, args)

        print(f"\nThroughput on {connection.vendor} (Django test client, full request stack; stream batches of "
              f"{args.batch}, each take acknowledging the batch before)\n")
        print(f"{'rollouts':>9} {'export rows/s':>14} {'stream rows/s':>14} {'stream/export':>14} "
              f"{'export RSS MiB':>15} {'stream RSS MiB':>15}"
              + (f" {'fields= rows/s':>15} {'fields=/export':>15} {'fields= RSS MiB':>16}" if args.fields else ""))
        for n, exp, st, lean, _ in results:
            print(f"{n:>9,} {n / exp['wall_s']:>14,.0f} {n / st['wall_s']:>14,.0f} "
                  f"{exp['wall_s'] / st['wall_s']:>14.2f} {exp['rss_growth'] / 2**20:>15.1f} "
                  f"{st['rss_growth'] / 2**20:>15.1f}"
                  + (f" {n / lean['wall_s']:>15,.0f} {exp['wall_s'] / lean['wall_s']:>15.2f} "
                     f"{lean['rss_growth'] / 2**20:>16.1f}" if lean else ""))
        if args.fields:
            print(f"fields= is ?fields={args.fields}")
        if args.interleave:
            print("\nIn turns (export lines, stream batch, fields= batch, batch by batch; order rotated each round):")
            for n, _, _, _, turns in results:
                ex = turns["export"]["s"]
                print(f"  {n:>9,}: " + ", ".join(f"{a} {n / t['s']:,.0f} rows/s ({ex / t['s']:.2f})"
                                                for a, t in turns.items()))
        print("\nRSS MiB of the process (server and client in one: the test client) at 10 % / 50 % / 100 % of rows read:")
        for n, exp, st, lean, _ in results:
            for name, r in (("export", exp), ("stream", st), ("fields=", lean)):
                if r is not None:
                    m = r["rss_at"]
                    print(f"  {n:>9,} {name:>8}: " + " / ".join(f"{m.get(k, float('nan')):.0f}" for k in ("10%", "50%", "100%")))
        print(f"\nDelivery latency (batch committed -> consumer has it), {args.rate:.0f} rollouts/s stored in batches "
              f"every {args.flush_s} s for {args.latency_s:.0f} s, long-poll wait=5:")
        print(f"  {lat['n']:,} of {lat['stored']:,} delivered: p50 {lat['p50_ms']:.0f} ms, p95 {lat['p95_ms']:.0f} ms, "
              f"max {lat['max_ms']:.0f} ms")


if __name__ == "__main__":
    main()
