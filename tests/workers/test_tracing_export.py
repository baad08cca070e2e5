"""The OTLP exporter process (workers/tracing_export.py) against a real OTLP/HTTP collector: spans handed over as
tuples arrive as OTLP spans; a killed exporter is restarted; a stalled one makes the worker drop and count
spans without waiting; spans still queued when the worker exits are flushed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.otlp_collector import start_collector
from workers import tracing_export
from workers.tracing_export import Exporter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def collector():
    col = start_collector()
    yield col
    col.close()


def span(name: str, i: int = 1, error: str = "", pad: int = 0) -> tuple:
    now = time.time_ns()
    attributes = {"n": i, "none": None, **({"pad": "x" * pad} if pad else {})}
    return (name, 0xABC0 + i, 0x10 + i, 0x7, 2, now - 1000, now, attributes, error, ((0x1, 0x2),))


@pytest.mark.slow
def test_a_killed_exporter_is_restarted_and_spans_still_arrive(collector):
    exp = Exporter(collector.url, {}, "svc")
    try:
        assert exp.send([span("a", 1, "boom")])
        assert exp.flush(20)["exported"] == 1
        (a,) = collector.by_name("a")
        assert (a.trace_id, a.span_id, a.parent_span_id) == (f"{0xABC1:032x}", f"{0x11:016x}", f"{0x7:016x}")
        assert a.attributes == {"n": 1} and a.status_code == 2 and a.service == "svc"
        assert a.links == [(f"{1:032x}", f"{2:016x}")]

        first = exp.stats()["pid"]
        os.kill(first, signal.SIGKILL)
        exp._proc.wait(10)  # noqa: SLF001
        assert exp.send([span("b", 2)])
        assert exp.flush(20) is not None
        assert exp.stats()["restarts"] == 1 and exp.stats()["pid"] != first
        assert [s.span_id for s in collector.by_name("b")] == [f"{0x12:016x}"]
    finally:
        exp.stop()


@pytest.mark.slow
def test_a_stalled_exporter_makes_the_worker_drop_and_count_never_wait(collector, monkeypatch):
    monkeypatch.setattr(tracing_export, "QUEUE_BATCHES", 2)
    exp = Exporter(collector.url, {}, "svc")
    try:
        exp.send([span("warm")])
        assert exp.flush(20) is not None
        pid = exp.stats()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            # 50 batches of ~20 KB: more than the 2 queued batches and the 64 KB pipe hold
            results = [exp.send([span("s", i, pad=2000) for i in range(10)]) for _ in range(50)]
            took = time.monotonic() - t0
        finally:
            os.kill(pid, signal.SIGCONT)
        assert took < 1.0
        assert results.count(True) <= 8 and exp.dropped == 10 * results.count(False) >= 420
        assert exp.flush(20) is not None
        assert len(collector.by_name("s")) == 10 * results.count(True) == exp.sent - 1
    finally:
        exp.stop()


@pytest.mark.slow
def test_spans_still_queued_are_flushed_when_the_worker_exits(collector):
    code = textwrap.dedent(f"""
        import time
        from workers.tracing_export import exporter
        exp = exporter({collector.url!r}, {{}}, "svc")
        now = time.time_ns()
        assert exp.send([("late", 5, i + 1, 0, 0, now, now, {{}}, "", ()) for i in range(300)])
    """)  # no flush: the atexit handler sends them
    _run_worker(code)
    assert len(collector.by_name("late")) == 300


@pytest.mark.slow
def test_spans_handed_over_arrive_after_the_worker_leaves_without_teardown(collector):
    """The drop-in ends with os._exit (no atexit): what `handed` confirmed is in the exporter process's pipe, which
    exports it after the worker is gone."""
    code = textwrap.dedent(f"""
        import os, time
        from workers.tracing_export import exporter
        exp = exporter({collector.url!r}, {{}}, "svc")
        now = time.time_ns()
        for b in range(6):
            assert exp.send([("gone", 5, b * 100 + i + 1, 0, 0, now, now, {{"pad": "x" * 200}}, "", ()) for i in range(100)])
        assert exp.handed(10)
        os._exit(0)
    """)
    _run_worker(code)
    assert len(collector.wait_for("gone", 600)) == 600


@pytest.mark.slow
def test_a_dead_collector_never_keeps_the_exporter_long_after_the_worker():
    """Three export requests' worth of spans for a collector that refuses connections, then the worker leaves:
    the exporter process gives up within DRAIN_AFTER_EXIT_S (each request alone retried for EXPORT_TIMEOUT_S)."""
    code = textwrap.dedent("""
        import os, time
        from workers.tracing_export import EXPORT_BATCH_SPANS, exporter
        exp = exporter("http://127.0.0.1:9/v1/traces", {}, "svc")
        now = time.time_ns()
        for b in range(3):
            assert exp.send([("x", 5, b * EXPORT_BATCH_SPANS + i + 1, 0, 0, now, now, {}, "", ())
                             for i in range(EXPORT_BATCH_SPANS)])
        assert exp.handed(10)
        print(exp.stats()["pid"], flush=True)
        os._exit(0)
    """)
    # the exporter inherits the worker's stderr: not a pipe here, or reading the worker's output would wait for it
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO
    )
    pid = int(proc.stdout.readline())
    assert proc.wait(60) == 0
    t0 = time.monotonic()
    budget = tracing_export.DRAIN_AFTER_EXIT_S + 5  # + the request in flight when the drain ends
    while _alive(pid) and time.monotonic() - t0 < 4 * tracing_export.EXPORT_TIMEOUT_S:
        time.sleep(0.1)
    took = time.monotonic() - t0
    assert not _alive(pid) and took < budget, took


def _run_worker(code: str) -> None:
    """`code` in a fresh interpreter at the repository's root: a worker process with its own exporter."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
