"""Dataset domain logic: database ingest, range reads, preview, chunking.

Ingest streams a NeMo Gym JSONL file through the Django-free validation in `workers.nemo_jsonl` (the rules
for blank lines, BOM, line endings and the bad-line report are there) and bulk-inserts good rows in batches.

- A file with any bad line is rejected whole (no rows kept) unless accept_partial=True, in which case the
  good rows are kept and the report is stored. A file with no good rows at all is always rejected.
- Uploaded for a verifier (`verifier=`), a row lacking a field that verifier reads is a bad line too (its
  line number and the missing fields), so the error comes at upload rather than at launch.
- Every upload also records which verifiers its rows can serve (`validation_report["verifiers"]`: per
  verifier, the rows lacking its fields and their first line numbers), computed as the rows stream past.
"""
from __future__ import annotations

import json
import os
from typing import Iterator

from django.conf import settings
from django.db import connection, transaction
from django.db.models import TextField
from django.db.models.functions import Cast, Length, Substr

from controlplane import operator as knobs

from workers.nemo_jsonl import Report, StreamStats, classify_lines, iter_chunks
from workers.verifiers.registry import FieldFit, describe_fit, has_field, fit_candidates, resolve

from workers.task_index import TaskIndexer, line_digest

from .models import DESCRIPTION_MAX_CHARS, Dataset, DatasetRow

INSERT_BATCH_ROWS = 1000


def iter_rows(dataset, start: int = 0, end: int | None = None, chunk_size: int = 1000) -> Iterator[tuple[int, dict]]:
    """Yield (index, row) for dataset rows in [start, end), in order, in constant memory."""
    qs = DatasetRow.objects.filter(dataset=dataset, index__gte=start)
    if end is not None:
        qs = qs.filter(index__lt=end)
    yield from qs.order_by("index").values_list("index", "data").iterator(chunk_size=chunk_size)


def _task_row_values(dataset, start: int, end: int | None, chunk_size: int, data_field="data"):
    """(index, data_field, task index, occurrence) of the rows in [start, end), in order."""
    qs = DatasetRow.objects.filter(dataset=dataset, index__gte=start)
    if end is not None:
        qs = qs.filter(index__lt=end)
    if data_field != "data":
        qs = qs.annotate(**{data_field: Cast("data", TextField())})
    rows = qs.order_by("index").values_list("index", data_field, "task_index", "occurrence")
    if end is None or end - start > chunk_size:  # a server-side cursor only where the range may be large: for a
        rows = rows.iterator(chunk_size=chunk_size)  # page (ChunkTasks) it cost a DECLARE/FETCH/CLOSE each
    return rows


def _own_task_index(data, index: int) -> int:
    """A row stored before the numbers were kept: its `_ng_task_index`, else its position."""
    return data.get("_ng_task_index", index) if isinstance(data, dict) else index


def iter_task_rows(dataset, start: int = 0, end: int | None = None,
                   chunk_size: int = 1000) -> Iterator[tuple[int, int, dict]]:
    """Yield (task index, occurrence, row) for dataset rows in [start, end), in order, as NeMo Gym numbers
    them (workers/task_index.py); rows stored before that was kept: `_ng_task_index` or the position, 0."""
    for index, data, task_index, occurrence in _task_row_values(dataset, start, end, chunk_size):
        yield (_own_task_index(data, index) if task_index is None else task_index), occurrence, data


def iter_task_row_texts(dataset, start: int = 0, end: int | None = None,
                        chunk_size: int = 1000) -> Iterator[tuple[int, int, str]]:
    """As iter_task_rows, each row as the JSON text the database holds (SQLite: the file's line as validated;
    PostgreSQL: jsonb's rendering), not decoded."""
    for index, text, task_index, occurrence in _task_row_values(dataset, start, end, chunk_size, "text"):
        yield (_own_task_index(json.loads(text), index) if task_index is None else task_index), occurrence, text


def iter_task_rows_at(dataset, indices: list[int]) -> Iterator[tuple[int, int, dict]]:
    """As iter_task_rows, for the rows at `indices` (any order, e.g. a shuffled pass), in that order."""
    by_index = {index: (task_index, occurrence, data) for index, data, task_index, occurrence in
                DatasetRow.objects.filter(dataset=dataset, index__in=list(indices))
                .values_list("index", "data", "task_index", "occurrence")}
    for index in indices:
        if index in by_index:
            task_index, occurrence, data = by_index[index]
            yield (_own_task_index(data, index) if task_index is None else task_index), occurrence, data


# ------------------------------------------------------------------------------------------------
# Errors and reports
# ------------------------------------------------------------------------------------------------
class DatasetValidationError(Exception):
    """Raised when a file is rejected. Carries the report (and the rejected Dataset, when one was
    saved) so the API can answer 400 with the bad lines and the dashboard can list them."""

    def __init__(self, message: str, report: dict, dataset: Dataset | None = None):
        super().__init__(message)
        self.message = message
        self.report = report
        self.dataset = dataset

    @property
    def bad_lines(self) -> list[dict]:
        return self.report.get("bad_lines", [])

    def as_dict(self) -> dict:
        return {"detail": self.message, **self.report}


class _RowWriter:
    """Buffers good rows and writes them in batches: COPY on PostgreSQL (the validated line text goes
    straight into jsonb, no re-serialization), one executemany of the line texts on SQLite, bulk_create
    elsewhere."""

    SQLITE_TEXT = True  # False: bulk_create on SQLite too (bench_ingest's "sqlite-orm", the way it was)

    # rows are numbered as they stream (TaskIndexer: ~130 bytes per distinct line, 13 MB at most) up to this
    # many; a longer file is numbered in the database afterwards, in constant memory (number_tasks)
    NUMBER_IN_MEMORY_MAX_ROWS = 100_000

    def __init__(self, dataset, batch_rows: int):
        self.dataset = dataset
        self.batch_rows = batch_rows
        self.buf: list[tuple[int, int, dict, str, int, int, bytes | None]] = []
        self.use_copy = connection.vendor == "postgresql"
        self.use_text = self.SQLITE_TEXT and connection.vendor == "sqlite"
        self._indexer: TaskIndexer | None = TaskIndexer()

    @property
    def numbered(self) -> bool:
        """Every row went in with NeMo Gym's numbers: number_tasks has nothing to do (its two passes over the
        stored rows took 0.27-0.39 s of a 30,000-row ingest on SQLite)."""
        return self._indexer is not None

    def add(self, index: int, line_number: int, row: dict, text: str):
        own = "_ng_task_index" in row
        digest = None if own else line_digest(text)
        indexer = self._indexer
        if indexer is not None and index >= self.NUMBER_IN_MEMORY_MAX_ROWS:
            indexer = self._indexer = None
        if indexer is not None:
            task_index, occurrence = indexer.assign_own(row["_ng_task_index"]) if own else indexer.assign_line(digest)
        else:  # placeholders: a row's own index is kept, other rows get their position (number_tasks corrects them)
            task_index, occurrence = (row["_ng_task_index"] if own else index), 0
        self.buf.append((index, line_number, row, text, task_index, occurrence, digest))
        if len(self.buf) >= self.batch_rows:
            self.flush()

    def discard(self):
        self.buf = []

    def flush(self):
        if not self.buf:
            return
        if self.use_copy or self.use_text:
            # the validated line's text as the JSON column's text: no model instance per row and no second
            # json.dumps (bulk_create's per-field preparation was half of a 30k-row SQLite ingest)
            columns = '(dataset_id, "index", line_number, data, task_index, occurrence, line_digest)'
            ds_id = self.dataset.pk
            rows = [(ds_id, index, line_number, text, task_index, occurrence, digest)
                    for index, line_number, _row, text, task_index, occurrence, digest in self.buf]
            with transaction.atomic(), connection.cursor() as cur:
                if self.use_copy:
                    with cur.cursor.copy(f'COPY "{DatasetRow._meta.db_table}" {columns} FROM STDIN') as cp:
                        for row in rows:
                            cp.write_row(row)
                else:
                    cur.executemany(f'INSERT INTO "{DatasetRow._meta.db_table}" {columns} VALUES '
                                    f'(%s, %s, %s, %s, %s, %s, %s)', rows)
        else:
            DatasetRow.objects.bulk_create(
                [DatasetRow(dataset=self.dataset, index=i, line_number=n, data=row, task_index=t, occurrence=k,
                            line_digest=d)
                 for i, n, row, _text, t, k, d in self.buf]
            )
        self.buf = []


def number_tasks(dataset) -> None:
    """Give the stored rows NeMo Gym's task indices and occurrences (workers/task_index.py), in the database:
    rows without their own index are numbered by the first appearance of their line (identical lines share
    one), then each row counts the earlier rows with its task index. Only rows whose numbers change are
    written (none, for the usual file of distinct lines without explicit indices).

    O(N log N) on every database: PostgreSQL hash-joins the first appearances to the rows; SQLite would scan
    the dataset's rows once per distinct line for the same statement (its planner loops over the derived
    table outside), so there the first appearances go into a temporary table keyed by digest and each row
    looks its number up (268 s -> ~1 s at 30k rows)."""
    table = DatasetRow._meta.db_table
    firsts_sql = (f'SELECT line_digest, ROW_NUMBER() OVER (ORDER BY MIN("index")) - 1 AS t FROM "{table}" '
                  f'WHERE dataset_id = %s AND line_digest IS NOT NULL GROUP BY line_digest')
    with transaction.atomic(), connection.cursor() as cur:
        if connection.vendor == "sqlite":
            cur.execute("DROP TABLE IF EXISTS temp.ng_firsts")
            cur.execute("CREATE TEMP TABLE ng_firsts (line_digest BLOB PRIMARY KEY, t INTEGER NOT NULL) WITHOUT ROWID")
            try:
                cur.execute(f"INSERT INTO temp.ng_firsts (line_digest, t) {firsts_sql}", [dataset.pk])
                cur.execute(f'''
                    UPDATE "{table}" SET task_index = (
                        SELECT f.t FROM temp.ng_firsts AS f WHERE f.line_digest = "{table}".line_digest)
                    WHERE dataset_id = %s AND line_digest IS NOT NULL AND task_index <> (
                        SELECT f.t FROM temp.ng_firsts AS f WHERE f.line_digest = "{table}".line_digest)''',
                            [dataset.pk])
            finally:
                cur.execute("DROP TABLE IF EXISTS temp.ng_firsts")
        else:
            cur.execute(f'''
                UPDATE "{table}" SET task_index = firsts.t FROM ({firsts_sql}) AS firsts
                WHERE "{table}".dataset_id = %s AND "{table}".line_digest = firsts.line_digest
                  AND "{table}".task_index <> firsts.t''', [dataset.pk, dataset.pk])
        cur.execute(f'''
            UPDATE "{table}" SET occurrence = seen.k
            FROM (SELECT id, ROW_NUMBER() OVER (PARTITION BY task_index ORDER BY "index") - 1 AS k
                  FROM "{table}" WHERE dataset_id = %s) AS seen
            WHERE "{table}".id = seen.id AND seen.k > 0''', [dataset.pk])


class AgentCounter:
    """Which NeMo Gym agents a file routes to: rows per `agent_ref.name`, and rows naming none (those go to
    the job's agent name)."""

    MAX_NAMES = 200  # a file naming more agents than this keeps the 200 first seen, and says so

    def __init__(self):
        self.counts: dict[str, int] = {}
        self.without = 0
        self.dropped = 0

    def add(self, row) -> None:
        ref = row.get("agent_ref") if isinstance(row, dict) else None
        name = ref.get("name") if isinstance(ref, dict) else None
        if not isinstance(name, str) or not name:
            self.without += 1
        elif name in self.counts or len(self.counts) < self.MAX_NAMES:
            self.counts[name] = self.counts.get(name, 0) + 1
        else:
            self.dropped += 1

    def as_dict(self) -> dict:
        return {"by_name": dict(sorted(self.counts.items())), "without_agent_ref": self.without,
                "rows_of_unlisted_agents": self.dropped}


def dataset_agents(dataset) -> dict:
    """{"agents": [{"name", "rows"}] most rows first, "without_agent_ref": n} for the agents the dataset's rows
    name in `agent_ref` (counted at ingest; for a dataset stored before, counted now and kept in its report)."""
    report = dataset.validation_report if isinstance(dataset.validation_report, dict) else {}
    info = report.get("agents")
    if info is None:
        from django.db.models import Count

        counter = AgentCounter()
        named = (DatasetRow.objects.filter(dataset=dataset).values("data__agent_ref__name")
                 .annotate(n=Count("id")).values_list("data__agent_ref__name", "n"))
        for name, n in named:
            if isinstance(name, str) and name:
                counter.counts[name] = n
            else:
                counter.without += n
        info = counter.as_dict()
        if dataset.pk is not None and dataset.status == Dataset.Status.READY:
            Dataset.objects.filter(pk=dataset.pk).update(validation_report={**report, "agents": info})
    agents = [{"name": n, "rows": c} for n, c in (info.get("by_name") or {}).items()]
    return {"agents": sorted(agents, key=lambda r: (-r["rows"], r["name"])),
            "without_agent_ref": info.get("without_agent_ref", 0),
            "rows_of_unlisted_agents": info.get("rows_of_unlisted_agents", 0)}


def format_hint(first_line: str) -> str:
    """A file that is not JSON Lines at all, named from its first line: a JSON array or CSV."""
    head = (first_line or "").lstrip("\ufeff \t")[:500]
    if head.startswith("["):
        return ("this looks like a JSON array, not JSON Lines: put one JSON object per line "
                "(e.g. jq -c '.[]' data.json > data.jsonl)")
    if not head.startswith("{") and head.count(",") >= 1 and "\t" not in head:
        return ("this looks like CSV, not JSON Lines: each line must be one JSON object with "
                "responses_create_params.input (convert it first, e.g. with pandas: "
                "read_csv(...).to_json('data.jsonl', orient='records', lines=True), then map the prompt column)")
    if not head.startswith("{") and "\t" in head:
        return "this looks like TSV, not JSON Lines: each line must be one JSON object"
    return ""


def ingest_jsonl(
    fileobj_or_path,
    *,
    name: str,
    owner=None,
    accept_partial: bool = False,
    source_filename: str = "",
    description: str = "",
    raise_on_reject: bool = True,
    batch_rows: int = INSERT_BATCH_ROWS,
    verifier: str = "",
    verifier_options: dict | None = None,
    operator: bool = False,
) -> Dataset:
    """Stream a NeMo Gym JSONL file into a new Dataset.

    Returns the Dataset (status "ready"). When the file is rejected — any bad line without
    accept_partial, or no good row at all — the Dataset is saved with status "rejected", no rows and
    the report in `validation_report`, and DatasetValidationError(message, report, dataset) is raised
    (or, with raise_on_reject=False, the rejected Dataset is returned).

    `verifier` (a name, entry point or dotted path, with its `verifier_options`): rows lacking a field it
    reads are bad lines. An unknown verifier, one a user may not name (a dotted path; `operator`: the
    operator's load_dataset may) or bad options raise ValueError before anything is stored.
    """
    needed = verifier_fields(verifier, verifier_options, operator=operator) if verifier else ()
    if not source_filename:
        if isinstance(fileobj_or_path, (str, os.PathLike)):
            source_filename = os.path.basename(os.fspath(fileobj_or_path))
        else:
            source_filename = os.path.basename(getattr(fileobj_or_path, "name", "") or "")
    dataset = Dataset.objects.create(
        owner=owner, name=name[:200], description=description[:DESCRIPTION_MAX_CHARS], source_filename=source_filename[:500],
        status=Dataset.Status.VALIDATING,
    )
    report = Report()
    stats = StreamStats()
    writer = _RowWriter(dataset, batch_rows)
    inserting = True  # stop inserting at the first bad line unless accept_partial
    chunks, close = iter_chunks(fileobj_or_path)
    agents = AgentCounter()
    fit = FieldFit(fit_candidates([verifier] if verifier else []))
    head: list[bytes] = []  # the file's first bytes: a whole file of the wrong format says so on its first line

    def peek(it):
        for c in it:
            if not head:
                head.append(bytes(c[:4096]))
            yield c

    try:
        for lineno, row, text, err in classify_lines(peek(chunks), stats, report):
            if err is None and needed:  # a row the verifier cannot serve is a bad line
                missing = [f for f in needed if not has_field(row, f)]
                if missing:
                    err = f"lacks {', '.join(missing)}, which verifier {verifier!r} needs"
            if err is None:
                agents.add(row)
                fit.add(lineno, row)
                if inserting:
                    writer.add(report.good_rows, lineno, row, text)
                report.good_rows += 1
                continue
            report.add_bad(lineno, err)
            if not accept_partial and inserting:
                inserting = False
                writer.discard()
        if inserting:
            writer.flush()
            if not writer.numbered:
                number_tasks(dataset)
    except BaseException:
        # A read error or an interrupt: leave nothing half-loaded behind.
        DatasetRow.objects.filter(dataset=dataset).delete()
        dataset.delete()
        raise
    finally:
        close()

    dataset.size_bytes = stats.size
    dataset.sha256 = stats.sha.hexdigest()
    dataset.bad_line_count = report.bad_line_count
    rejected = False
    if report.good_rows == 0:
        rejected = True
        message = "the file has no valid rows" if report.bad_line_count else "the file is empty (no rows)"
    elif report.bad_line_count and not accept_partial:
        rejected = True
        message = (
            f"rejected: {report.bad_line_count} bad line(s) out of {report.total_lines}; fix them, "
            "or accept only the good lines (accept_partial)"
        )
    elif report.bad_line_count:
        message = f"accepted {report.good_rows} good row(s); {report.bad_line_count} bad line(s) skipped"
    else:
        message = f"accepted {report.good_rows} row(s)"

    first_line = next((ln for ln in (head[0] if head else b"").decode("utf-8", "replace").splitlines() if ln.strip()), "")
    hint = format_hint(first_line) if report.good_rows == 0 and report.bad_line_count else ""
    if hint:
        message = f"{message}: {hint}"

    if rejected:
        DatasetRow.objects.filter(dataset=dataset).delete()
        dataset.row_count = 0
        dataset.status = Dataset.Status.REJECTED
    else:
        dataset.row_count = report.good_rows
        dataset.status = Dataset.Status.READY
    dataset.validation_report = report.as_dict(
        accepted_partial=bool(accept_partial and report.bad_line_count and not rejected),
        rejected=rejected, message=message,
    )
    if not rejected:
        dataset.validation_report["verifiers"] = fit.result()
        dataset.validation_report["verifier_fit"] = describe_fit(dataset.validation_report["verifiers"])
    if verifier:
        dataset.validation_report["verifier"] = verifier
    dataset.validation_report["agents"] = agents.as_dict()
    dataset.save()
    if rejected and raise_on_reject:
        raise DatasetValidationError(message, dataset.validation_report, dataset)
    return dataset


def verifier_fields(verifier: str, options: dict | None = None, *, operator: bool = False) -> tuple[str, ...]:
    """The row fields `verifier` reads with these options; ValueError for an unknown verifier, bad options, or
    a name a user may not give (unless `operator`): checked before anything is imported."""
    if not operator:
        knobs.check_user_verifier(verifier)
    v = resolve(verifier)
    return tuple(v.required(v.validate_options(options or {})))


def verifier_fit(dataset) -> dict:
    """{verifier: {"fits", "lacking_rows", "lines", "missing", "required"}} recorded at upload ({} for
    datasets uploaded before the fit was recorded)."""
    return (dataset.validation_report or {}).get("verifiers") or {}


# ------------------------------------------------------------------------------------------------
# Queries and helpers
# ------------------------------------------------------------------------------------------------
EXCERPT_CHARS = 4000


def bounded_rows(dataset, start: int = 0, limit: int = 20, *, max_row_chars: int | None = None,
                 max_total_chars: int | None = None) -> tuple[list[dict], int | None]:
    """Rows [start, start + limit) for people and the API, in bounded memory and size: a row whose JSON is longer
    than max_row_chars (DATASET_ROW_MAX_CHARS) comes as {"index", "line_number", "data": None, "truncated": True,
    "size_chars", "excerpt": its first EXCERPT_CHARS characters}, read as such by the database; the page stops
    before max_total_chars (DATASET_ROWS_MAX_CHARS; at least one row). Returns (rows, next_offset or None)."""
    max_row_chars = settings.DATASET_ROW_MAX_CHARS if max_row_chars is None else max_row_chars
    max_total_chars = settings.DATASET_ROWS_MAX_CHARS if max_total_chars is None else max_total_chars
    text = Cast("data", TextField())
    sizes = list(DatasetRow.objects.filter(dataset=dataset, index__gte=start, index__lt=start + max(0, limit))
                 .order_by("index").annotate(size=Length(text)).values_list("index", "line_number", "size"))
    small = [i for i, _, size in sizes if size <= max_row_chars]
    data = dict(DatasetRow.objects.filter(dataset=dataset, index__in=small).values_list("index", "data")) if small else {}
    big = [i for i, _, size in sizes if size > max_row_chars]
    excerpts = dict(DatasetRow.objects.filter(dataset=dataset, index__in=big).annotate(
        excerpt=Substr(text, 1, EXCERPT_CHARS)).values_list("index", "excerpt")) if big else {}
    rows, total = [], 0
    for index, line_number, size in sizes:
        cost = size if size <= max_row_chars else EXCERPT_CHARS
        if rows and total + cost > max_total_chars:
            return rows, index
        total += cost
        if size <= max_row_chars:
            rows.append({"index": index, "line_number": line_number, "data": data[index]})
        else:
            rows.append({"index": index, "line_number": line_number, "data": None, "truncated": True,
                         "size_chars": size, "excerpt": excerpts.get(index, "")})
    end = start + max(0, limit)
    return rows, (end if rows and end < dataset.row_count else None)


def preview_rows(dataset, n: int = 20) -> list[dict]:
    """The first n rows as [{"index", "line_number", "data"}] (big rows cut: see bounded_rows)."""
    return bounded_rows(dataset, 0, n)[0]


def find_by_sha256(owner, sha256: str) -> Dataset | None:
    """The newest ready dataset of this owner (None: ownerless) with this content hash."""
    qs = Dataset.objects.filter(sha256=sha256, status=Dataset.Status.READY)
    qs = qs.filter(owner__isnull=True) if owner is None else qs.filter(owner=owner)
    return qs.order_by("-created_at", "-pk").first()


def split_into_chunks(dataset, chunk_rows: int, limit: int | None = None) -> list[tuple[int, int]]:
    """[(start, end), ...] half-open row-index ranges covering the dataset (or its first `limit` rows)."""
    if chunk_rows <= 0:
        raise ValueError("chunk_rows must be positive")
    total = dataset.row_count if limit is None else min(dataset.row_count, max(0, limit))
    return [(s, min(s + chunk_rows, total)) for s in range(0, total, chunk_rows)]


def delete_dataset(dataset) -> None:
    """Delete a dataset and its rows. Raises django.db.models.ProtectedError when jobs use it."""
    with transaction.atomic():
        # Raises ProtectedError before anything is removed when a job references the dataset.
        from django.db.models import ProtectedError

        if dataset.jobs.exists():
            raise ProtectedError(f"dataset {dataset.pk} is used by {dataset.jobs.count()} job(s)", set(dataset.jobs.all()[:10]))
        DatasetRow.objects.filter(dataset=dataset).delete()
        dataset.delete()
