"""Ingest numbering is not quadratic on the SQLite default (issue 28): `number_tasks` once scanned every row
of the dataset per distinct line there (268 s at 30k rows).

The laptop default runs in a subprocess of its own on a fresh SQLite file (the suite's database is
PostgreSQL). The work is counted, not timed: SQLite's progress handler counts virtual-machine steps, so a
quadratic plan shows as ~16x the steps for 4x the rows, whatever the machine's load; the numbers the rows get
are checked against the in-memory numbering NeMo Gym's rules give (workers.task_index.TaskIndexer)."""
from __future__ import annotations

import pytest

from tests.sqlite_child import run_on_sqlite


CHILD = r"""
import io, json, os, random, sys, time
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from django.db import connection
from controlplane.datasets import services
from controlplane.datasets.models import DatasetRow
from workers.task_index import TaskIndexer

steps = {"n": 0}
orig = services.number_tasks
def counted(ds):
    connection.ensure_connection()
    def tick():
        steps["n"] += 1
        return 0
    connection.connection.set_progress_handler(tick, 100)
    try:
        orig(ds)
    finally:
        connection.connection.set_progress_handler(None, 0)
services.number_tasks = counted
services._RowWriter.NUMBER_IN_MEMORY_MAX_ROWS = 0  # the database's numbering, as for a file past the bound

def lines(n):
    rng = random.Random(n)
    out = []
    for i in range(n):
        row = {"responses_create_params": {"input": [{"role": "user", "content": f"q{rng.randrange(n)}"}]},
               "expected_answer": "1"}
        if i % 50 == 7:
            row["_ng_task_index"] = rng.randrange(n // 3)
        out.append(json.dumps(row))
    return out

result = {}
for n in (2000, 8000):
    ls = lines(n)
    steps["n"] = 0
    t0 = time.perf_counter()
    ds = services.ingest_jsonl(io.BytesIO(("\n".join(ls) + "\n").encode()), name=f"n{n}")
    secs = time.perf_counter() - t0
    ix = TaskIndexer()
    want = [ix.assign(json.loads(l), l) for l in ls]
    got = list(DatasetRow.objects.filter(dataset=ds).order_by("index").values_list("task_index", "occurrence"))
    result[n] = {"steps": steps["n"], "secs": secs, "same": got == want, "rows": ds.row_count,
                 "shared": sum(1 for _, k in got if k)}
print("RESULT " + json.dumps(result))
"""


@pytest.mark.slow
def test_sqlite_ingest_numbering_is_linear_and_matches_nemo_gym(tmp_path):
    res = {int(k): v for k, v in run_on_sqlite(CHILD, tmp_path).items()}
    for n, r in res.items():
        assert r["rows"] == n and r["same"], (n, r)  # NeMo Gym's numbers, identical lines and own indices shared
        assert r["shared"] > n // 10  # the file does repeat lines, so the numbering had work to do
    ratio = res[8000]["steps"] / res[2000]["steps"]
    # 4x the rows: ~4-5x the steps when linear (N log N), ~16x when each distinct line rescans the rows
    assert ratio < 7, res


SAME_ROWS_CHILD = r"""
import io, json
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from controlplane.datasets import services
from controlplane.datasets.models import DatasetRow

def row(q, **extra):
    return {"responses_create_params": {"input": [{"role": "user", "content": q}]}, "expected_answer": "1", **extra}

lines = [
    json.dumps(row("plain")),
    json.dumps(row("caf\u00e9 \U0001F600 escaped")),  # \\u escapes, a surrogate pair included
    json.dumps(row("caf\u00e9 \U0001F600 raw"), ensure_ascii=False),
    '{ "responses_create_params" : {"input": [{"role": "user", "content": "spaced"}]}, "expected_answer":"1" }\r',
    json.dumps(row("numbers", big=123456789012345678901234567890, f=1e-7, g=2.5e300, neg=-0.0, nested={"a": [1, {"b": None}]})),
    json.dumps(row("own index", _ng_task_index=7)),
    json.dumps(row("plain")),  # an identical line: shares the first one's task index
    json.dumps(row("quote \" and \\ backslash")),
]
blob = ("\n".join(lines) + "\n").encode()
stored = {}
for text in (True, False):
    services._RowWriter.SQLITE_TEXT = text
    ds = services.ingest_jsonl(io.BytesIO(blob), name=f"text={text}")
    rows = list(DatasetRow.objects.filter(dataset=ds).order_by("index").values_list(
        "index", "line_number", "data", "task_index", "occurrence", "line_digest"))
    found = DatasetRow.objects.filter(dataset=ds, data__responses_create_params__input__0__content="spaced").count()
    stored[text] = {"rows": [[i, n, d, t, o, dg.hex() if dg is not None else None] for i, n, d, t, o, dg in rows],
                    "found": found}
want = [json.loads(line) for line in lines]
print("RESULT " + json.dumps({"text": stored[True], "orm": stored[False],
                              "as_read": [r[2] for r in stored[True]["rows"]] == want}))
"""


@pytest.mark.slow
def test_sqlite_ingest_stores_the_rows_the_orm_would(tmp_path):
    """On SQLite the validated line texts go into the rows with one executemany (no model instance, no second
    json.dumps): every stored row, its numbers and digest are what bulk_create stored, for lines with escapes,
    raw non-ASCII, odd spacing and a CR, big and small numbers, an own index and a repeated line; a JSON key
    lookup finds them alike."""
    res = run_on_sqlite(SAME_ROWS_CHILD, tmp_path)
    assert res["as_read"], res["text"]["rows"]
    assert res["text"]["rows"] == res["orm"]["rows"]
    assert res["text"]["found"] == res["orm"]["found"] == 1
    numbers = [r[3:5] for r in res["text"]["rows"]]
    assert numbers[0] == numbers[6][:1] + [0] and numbers[6][1] == 1 and numbers[5] == [7, 0], numbers
