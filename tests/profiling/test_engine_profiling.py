"""Engine side of profiling: yappi in the verifier pool, sampled within a budget, switched on and off by the
control while a run goes on, snapshots as events; NeMo Gym's profile log parsed."""
from __future__ import annotations

import time

import pytest

from workers.engine.materialize import materialize
from workers.engine.runner import run_collection
from workers.engine.verify_pool import SHARED_VERIFY_POOL
from workers.verifiers.execution import verify_items
from workers.profiling import core
from workers.profiling.control import ProfilingControl, ProfilingSink
from workers.profiling.core import FuncRow, ProfileConfig, _profiled_batch, merge_rows
from workers.profiling.nemo_gym import parse_log

from tests.workers.test_engine import ListSink, math_rows, spec_for


def _items(n):
    return [("math", {"expected_answer": str(i)}, f"so \\boxed{{{i}}}", {}, False) for i in range(n)]


def _under_yappi(work, read):
    """work() profiled by yappi in this process (CPU clock, builtins); returns read() of the stats, then clears them."""
    import yappi

    yappi.stop()
    yappi.clear_stats()
    yappi.set_clock_type("cpu")
    yappi.start(builtins=True, profile_threads=False)
    try:
        work()
    finally:
        yappi.stop()
    try:
        return read()
    finally:
        yappi.clear_stats()


def test_pool_side_profiles_every_call_in_worker_scope_and_rows_have_the_columns():
    core._STATE.__init__()
    cfg = ProfileConfig(session="t-all", scope="worker").pool_args()
    mark, out, first = _profiled_batch(verify_items, _items(20), cfg)  # rows come back at most once a second
    assert mark == core._MARK and [o[1].reward for o in out] == [1.0] * 20
    # the session ends: the last rows come back with the next batch
    mark, out, last = _profiled_batch(verify_items, _items(1), None)
    payloads = [p for p in (first, last) if p]
    assert last["session"] == "t-all" and last["final"]
    assert sum(p["items"] for p in payloads) == 20 == sum(p["profiled"] for p in payloads)
    rows: dict = {}
    for p in payloads:
        core.payload_rows(p, into=rows)
    verify = next(r for r in rows.values() if r.name == "MathVerifier.verify")
    assert verify.ncall == 20 and verify.ttot >= verify.tsub > 0 and verify.tavg == pytest.approx(verify.ttot / 20)
    assert verify.module.endswith("workers/verifiers/math.py") and verify.line > 0
    assert verify.children and all(len(c) == 5 for c in verify.children)


@pytest.mark.slow
def test_verify_scope_samples_within_the_budget_and_scales_to_all_calls():
    core._STATE.__init__()
    cfg = ProfileConfig(session="t-sample", budget_pct=2.0).pool_args()
    st = core._STATE
    # batches until some verifications were profiled: how many calls the budget needs first depends on how
    # fast this machine verifies (1 % of the verification time must cover the first read of the stats)
    payloads = [_profiled_batch(verify_items, _items(30), cfg)[2] for _ in range(40)]
    deadline = time.monotonic() + 60
    while st.n_prof_all < 3 and time.monotonic() < deadline:
        payloads.append(_profiled_batch(verify_items, _items(30), cfg)[2])
    total = 30 * len(payloads)
    u, p = st.per_item()
    # both means measured (a profiled call is slower, which the budget limits; but a few profiled calls of
    # varied items beside thousands of plain ones order the two means by chance: 4.33 against 4.44 ms once)
    assert p > 0 and u > 0, (p, u, st.n_plain, st.n_prof_all)
    # the extra time spent profiling (slower calls, reading the stats) stays near 2 % of the verification time:
    # over by at most one call and one read of the stats
    assert st.spent <= 0.03 * st.t_all
    assert 0 < st.n_prof_all < total / 10  # a share is profiled (how many follows from the budget) ...
    payloads = [p for p in payloads + [_profiled_batch(verify_items, _items(1), None)[2]] if p]
    assert sum(p["items"] for p in payloads) == total  # ... every verification is counted
    assert sum(p["profiled"] for p in payloads) == st.n_prof_all
    measured = [(p["items"], p["overhead_pct"]) for p in payloads if p["overhead_pct"] is not None]
    # each window's own figure stays bounded; over the session, weighted by the window's verifications as the
    # Profiler reports it (a short last window holding one profiled call and the final read of the stats may read
    # ~13 % on its own: 12.8 % beside 0.01 % under a parallel run's load)
    assert measured and max(o for _, o in measured) < 25
    assert sum(n * o for n, o in measured) / sum(n for n, _ in measured) < 6, measured


@pytest.mark.slow
def test_a_verifier_too_fast_for_the_budget_still_gets_one_profiled_call_per_session():
    """The budget alone would never pay for one read of the stats (1 % of a few ms of verification): the
    session's first verification after the baseline is profiled anyway, so the session has a profile; the
    rest stay unprofiled."""
    core._STATE.__init__()
    cfg = ProfileConfig(session="t-floor", budget_pct=2.0, window_s=1.0).pool_args()
    st = core._STATE
    fast = lambda items: [(True, None, "") for _ in items]  # noqa: E731  (microseconds per call)
    payloads = [_profiled_batch(fast, [None] * 10, cfg)[2] for _ in range(3)]
    assert st.n_prof_all == 1  # the baseline (5 plain calls) first, then one
    time.sleep(1.05)
    payloads += [_profiled_batch(fast, [None] * 10, cfg)[2] for _ in range(30)]
    assert st.n_prof_all == 1  # only one: the budget decides the rest
    handed = [p for p in payloads if p]
    assert len(handed) == 1 and handed[0]["profiled"] == 1 and handed[0]["items"] == 40  # its window closed
    final = _profiled_batch(fast, [None], None)[2]
    assert final["final"] and sum(p["items"] for p in handed + [final]) == 330  # every verification of the session
    rows: dict = {}
    core.payload_rows(handed[0], into=rows)
    assert any(r.name == "<lambda>" for r in rows.values())


def _inner_normalize():
    return sum(range(20_000))  # about 0.2 ms, in C: the profiler adds little to it


def _cache_like_verify(items):
    """A verifier with a cache: an item seen for the first time ("cold") normalizes twice, a repeat once."""
    out = []
    for kind in items:
        for _ in range(2 if kind == "cold" else 1):
            _inner_normalize()
        out.append((True, None, ""))
    return out


@pytest.mark.slow
def test_sample_does_not_favour_the_first_item_of_a_batch():
    """The pool sends a batch of one when idle, then everything that waited: in RL collection the lone one is
    often a task's first repeat, the one that misses a verifier's cache. Profiling the first item of each batch
    would count the cold path on half the samples (1.5 calls per verification here, against 1.1); the sample
    is counted in verifications across batches, so the scaled count lands near the truth."""
    core._STATE.__init__()
    cfg = ProfileConfig(session="t-bias", budget_pct=1.0, window_s=1.0).pool_args()
    st = core._STATE
    payloads, rounds = [], 0
    deadline = time.monotonic() + 60
    while (st.n_prof_all < 40 or rounds < 100) and time.monotonic() < deadline:
        payloads.append(_profiled_batch(_cache_like_verify, ["cold"], cfg)[2])
        payloads.append(_profiled_batch(_cache_like_verify, ["warm"] * 9, cfg)[2])
        rounds += 1
    payloads.append(_profiled_batch(_cache_like_verify, ["warm"], None)[2])
    total = 10 * rounds + 1
    assert st.n_prof_all >= 40, st.n_prof_all  # enough samples for the estimate below
    assert st.n_prof_all < total / 4  # and sampled, not every verification
    # the samples' calls scaled by one factor for the session (all verifications / profiled ones): what the
    # sample says of the mix. Scaled window by window instead, a loaded machine's window of one sample among
    # thousands of verifications decides its window alone (1.2-1.5x the truth in 3 of 15 runs beside busy loops)
    rows: dict = {}
    shown = [p for p in payloads if p]
    for p in shown:
        core.payload_rows(p, into=rows)
    scale = sum(p["items"] for p in shown) / sum(p["profiled"] for p in shown)
    calls = scale * sum(r.ncall for r in rows.values() if r.name == "_inner_normalize")
    true_calls = 11 * rounds + 1  # 2 per cold item, 1 per warm one
    assert calls == pytest.approx(true_calls, rel=0.2), (calls, true_calls, st.n_prof_all)


def _python_heavy():
    return sum(_tiny(i) for i in range(3000))  # many Python calls: the profiler makes it several times slower


def _tiny(i):
    return i * 2


@pytest.mark.slow
def test_a_slow_warm_up_does_not_make_profiling_look_free():
    """The pool's first verifications can be slow (imports, cold caches). Were the unprofiled time per call
    left at that, every profiled call would look cheaper than an unprofiled one and the gate would let every
    verification be profiled, at several times its cost; the unprofiled time keeps being measured and starts
    again from a fast run, so the true extra cost stays within the budget."""
    core._STATE.__init__()
    cfg = ProfileConfig(session="t-warm", budget_pct=2.0, window_s=1.0).pool_args()
    st = core._STATE
    warm = {"done": False}

    def verify(items):
        if not warm["done"]:
            warm["done"] = True
            time.sleep(1.5)  # the warm-up, in the baseline's first run: its 1 % pays for a read of the stats
        return [(True, None, _python_heavy()) for _ in items]

    for _ in range(100):
        _profiled_batch(verify, [None] * 10, cfg)
    _profiled_batch(verify, [None], None)
    t = time.perf_counter()
    for _ in range(20):
        verify([None] * 10)
    plain = (time.perf_counter() - t) / 200  # what a verification costs unprofiled, timed here
    true_extra = st.t_prof_all - st.n_prof_all * plain
    assert st.n_prof_all < 200, st.n_prof_all  # of 1,000
    assert true_extra <= 0.03 * st.t_all, (true_extra, st.t_all, st.n_prof_all)
    assert st.per_item()[0] < 0.01  # the unprofiled time per call is the fast one, not the warm-up's


def test_merge_scales_and_sums_children():
    a = FuncRow("m.py", 3, "f", 2, 0.1, 0.3, 0.15, [["m.py", 9, "g", 2, 0.2]])
    into = merge_rows({}, [a], scale=10)
    merge_rows(into, [a])
    r = into[("m.py", 3, "f")]
    assert r.ncall == 22 and r.ttot == pytest.approx(3.3) and r.tavg == pytest.approx(0.15)
    assert r.children == [["m.py", 9, "g", 22, pytest.approx(2.2)]]


def test_fast_stats_reader_gives_what_get_func_stats_gives():
    """The pool reads its stats through yappi's C enumerator (cheaper, inside the budget); same rows, same
    children, same figures as the public API, including code compiled per call (one row per name)."""
    import yappi

    def work():
        verify_items(_items(15))
        for i in range(3):
            exec(compile(f"x = {i} * 2", "<string>", "exec"), {})  # three code objects, one (module, line, name)

    fast, slow = _under_yappi(work, lambda: ({r.key: r for r in core.read_yappi_rows()},
                                             {r.key: r for r in core.rows_from_yappi(yappi.get_func_stats())}))
    assert fast.keys() == slow.keys() and len(fast) > 50
    for k, s in slow.items():
        f = fast[k]
        assert (f.ncall, f.tsub, f.ttot) == (s.ncall, pytest.approx(s.tsub), pytest.approx(s.ttot)), k
        assert sorted(tuple(c[:4]) for c in f.children) == sorted(tuple(c[:4]) for c in s.children), k
    assert fast[("<string>", 1, "<module>")].ncall >= 3  # ours, and sympy's own exec'd strings
    verify = next(r for r in fast.values() if r.name == "MathVerifier.verify")
    assert verify.ncall == 15 and verify.children


def test_hand_backs_merge_in_the_engine_scaled_to_all_verifications():
    """Pool processes hand back yappi's raw entries; the engine makes the rows when the window closes (not
    when the batch's results arrive), each process's rows scaled by its verifications / profiled."""
    import pickle

    blob = _under_yappi(lambda: verify_items(_items(10)), lambda: pickle.dumps(core.read_yappi_raw()))
    prof = core.Profiler("test-host")
    prof.config = ProfileConfig(session="t-merge")
    prof.add({"session": "t-merge", "stats": blob, "items": 40, "profiled": 10, "overhead_pct": 1.0})
    prof.add({"session": "t-merge", "stats": blob, "items": 10, "profiled": 10, "overhead_pct": 3.0})
    assert prof.w_rows == {}  # nothing built on the event loop
    (snap,) = prof.drain(final=True)
    verify = next(r for r in snap.rows if r.name == "MathVerifier.verify")
    assert verify.ncall == 40 + 10 and snap.verifications == 50 and snap.profiled == 20
    once = next(r for r in core.merge_raw({}, pickle.loads(blob)).values() if r.name == "MathVerifier.verify")
    assert once.ncall == 10 and verify.ttot == pytest.approx(5 * once.ttot) and verify.tavg == pytest.approx(once.tavg)
    kids = {tuple(c[:3]): c for c in once.children}
    assert verify.children and all(c[3] == 5 * kids[tuple(c[:3])][3] for c in verify.children)
    assert snap.overhead_pct == pytest.approx((40 * 1.0 + 10 * 3.0) / 50)  # weighted by verifications

@pytest.mark.slow
def test_verifications_handed_back_with_none_profiled_count_at_the_sessions_profile():
    """A process's last hand-back (or a loaded machine's, where the budget afforded no profiled call) carries
    verifications but no rows: they stand for that many calls at the session's profile per call, not for none
    (a run's estimate of MathVerifier.verify fell to 0.35 of its verifications on a loaded machine)."""
    import pickle

    from workers.profiling.core import Profiler

    def hand_back(items, profiled, ncall=0):
        rows = [FuncRow("m.py", 1, "verify", ncall, 0.5 * ncall, 1.0 * ncall).as_list()] if profiled else None
        return {"session": "s", "items": items, "profiled": profiled, "stats_format": "rows",
                "stats": pickle.dumps(rows) if rows else None}

    prof = Profiler("w")
    prof.config = ProfileConfig(session="s", scope="verify", window_s=1000.0)
    prof.add(hand_back(10, 2, ncall=2))  # 2 of 10 profiled: 10 calls, 1 s each
    prof.add(hand_back(30, 0))  # the process's last 30, none profiled
    [snap] = prof.drain(final=True)
    [row] = snap.rows
    assert snap.verifications == 40 and row.ncall == pytest.approx(40) and row.ttot == pytest.approx(40.0)


async def test_profiling_switched_on_and_off_while_the_run_goes_on(simulator):
    """A ProfilingControl turns profiling on after a moment and off again; the run never stops, and the
    snapshots name the verifier's functions with the verifications they stand for."""
    sink = ListSink()
    snaps = []
    # a budget that surely lets some of the ~600 verifications be profiled (the budget itself: tests above)
    cfg = ProfileConfig(session="t-run", scope="verify", budget_pct=25.0, window_s=1.0)

    def source():  # on from the 100th rollout to the 700th
        return cfg if 100 <= len(sink.results) < 700 else None

    # the pool, as a job's profiling gets it: the session's last rows are collected from it when it ends
    ctl = ProfilingControl(None, source, snaps.extend, worker="test-host", pool=lambda: SHARED_VERIFY_POOL._executor)
    spec = spec_for(simulator, parallelism=16, verifier="math", verify_processes=2,
                    responses_create_params={"max_output_tokens": 8})
    rows = list(math_rows(1200))
    summary = await run_collection(spec, materialize(iter(rows), 1), ProfilingSink(sink, ctl), ctl)
    assert summary.completed == 1200 and not summary.cancelled and not summary.fatal_error
    assert snaps and all(s.session == "t-run" and s.worker == "test-host" for s in snaps)
    assert sum(1 for s in snaps if s.final) == 1
    verifications = sum(s.verifications for s in snaps)
    assert 100 < verifications < 1100  # only while it was on
    merged = merge_rows({}, [r for s in snaps for r in s.rows])
    verify = [r for r in merged.values() if r.name == "MathVerifier.verify"]
    assert verify, sorted({r.name for r in merged.values()})[:20]
    # scaled: the estimate of the verifier's calls is near the verifications of the windows
    assert 0.5 * verifications <= verify[0].ncall <= 1.5 * verifications
    assert core._ACTIVE is None and not core._REGISTRY


LOG = """name                                                                     ncall   tsub      ttot      tavg      
/srv/resources_servers/library_judge_math/app.py:118 LibraryJudgeMathResourcesServer.verify      1024    0.009755  17.98387  0.017562
/srv/resources_servers/library_judge_math/app.py:145 LibraryJudgeMathResourcesServer._verify_answer              1024    0.002933  17.87998  0.017461
/srv/resources_servers/library_judge_math/app.py:191 <genexpr>                             2339/12    0.001695  0.029082  0.000012
"""


def test_nemo_gym_log_rows_and_a_bad_line_named():
    rows = parse_log(LOG)
    assert [(r.name, r.ncall, r.line) for r in rows] == [
        ("LibraryJudgeMathResourcesServer.verify", 1024, 118),
        ("LibraryJudgeMathResourcesServer._verify_answer", 1024, 145), ("<genexpr>", 2339, 191)]
    assert rows[0].ttot == pytest.approx(17.98387) and rows[0].module.endswith("library_judge_math/app.py")
    with pytest.raises(ValueError, match="line 3"):
        parse_log(LOG.replace("1024    0.002933", "lots 0.002933"), source="x.log")


def test_nemo_gym_stats_pulled_as_the_change_since_the_last_pull(tmp_path):
    """A stand-in for a NeMo Gym server started with +profiling_enabled=true: GET /stats answers with an empty
    body and (re)writes <dir>/<server>.log, yappi's table, cumulative since start-up (recorded format)."""
    import http.server
    import threading

    from workers.profiling.nemo_gym import StatsPuller

    log_path = tmp_path / "library_judge_math.log"
    calls = {"n": 0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            calls["n"] += 1
            k = calls["n"]
            log_path.write_text(LOG.replace("1024    0.009755  17.98387", f"{1024 * k}    0.009755  {17.98387 * k}"))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/stats"
        puller = StatsPuller([{"url": url, "log": str(log_path)}], session="s1", window_s=0, log_dir=str(tmp_path))
        assert puller.poll() == []  # the first pull is the baseline
        snaps = puller.poll()
        assert calls["n"] == 2 and len(snaps) == 1
        snap = snaps[0]
        assert snap.source == "nemo-gym" and snap.worker == url and snap.session == "s1"
        rows = {r.name: r for r in snap.rows}
        assert rows["LibraryJudgeMathResourcesServer.verify"].ncall == 1024  # 2048 - 1024
        assert rows["LibraryJudgeMathResourcesServer.verify"].ttot == pytest.approx(17.98387)
        assert "<genexpr>" not in rows  # unchanged since the last pull
        # an unreachable server is logged and skipped, never raised into the job
        dead = StatsPuller([{"url": "http://127.0.0.1:9/stats", "log": str(log_path)}], session="s1", window_s=0,
                           timeout_s=2)
        assert dead.poll() == []
    finally:
        srv.shutdown()
