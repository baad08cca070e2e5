"""The dedicated ops client and the endpoint-wide model-server operations, against the simulator."""
from __future__ import annotations

import socket
import time

import pytest

from workers.ops import OpsClient, parse_server_timing, replicas


def _run(coro_fn, **kw):
    return replicas.run(coro_fn, **kw)


def test_server_timing_parsing():
    assert parse_server_timing("rpc;dur=12.5") == 12.5
    assert parse_server_timing("db;dur=3, rpc;desc=\"x\";dur=7") == 7.0
    assert parse_server_timing("cache;dur=3") is None
    assert parse_server_timing(None) is None


def test_every_op_sends_a_trace_id_and_is_timed(simulator):
    res = _run(lambda c: replicas.simple(c, [simulator.url], "reset_prefix_cache", trace_id="trace-abc"))
    (r,) = res
    assert r.ok and r.status == 200 and r.attempts == 1
    assert r.trace_id == "trace-abc"
    assert r.rpc_source == "server-timing"
    assert r.wall_ms >= r.rpc_ms >= 0
    assert r.queue_ms == pytest.approx(r.wall_ms - r.rpc_ms, abs=0.01)


def test_rpc_ms_is_the_server_time_not_the_client_wait(simulator_factory):
    sim = simulator_factory(update_weights_ms=300)
    (r,) = _run(lambda c: replicas.simple(c, [sim.url], "health"))
    assert r.ok
    res = _run(lambda c: c.call(sim.url, "POST", "/update_weights", kind="update_weights", json_body={}))
    assert res.ok and res.body["weight_version"] == 1
    assert 280 <= res.rpc_ms <= res.wall_ms
    assert res.queue_ms < res.rpc_ms  # an idle server: the wait is on the server side


def test_update_is_pause_keep_update_resume_and_bumps_the_version(simulator):
    rep = _run(lambda c: replicas.update_weights(c, [simulator.url], server="simulator", version=7, checkpoint_id="ck-7"))
    assert rep.ok, rep.to_dict()
    assert [(s.kind, s.ok) for s in rep.steps] == [("pause", True), ("update_weights", True), ("resume", True)]
    assert rep.steps[0].body["mode"] == "keep"
    assert len({s.trace_id for s in rep.steps}) == 1
    assert simulator.get_json("/weight_version")["weight_version"] == 7
    assert simulator.get_json("/is_paused")["is_paused"] is False


def test_resume_is_sent_when_the_update_fails(simulator_factory):
    sim = simulator_factory()
    sim.configure(admin_faults={"update_weights": "500"})
    rep = _run(lambda c: replicas.update_weights(c, [sim.url], server="simulator", version=3), max_retries=2,
               backoff_s=0.01)
    assert not rep.ok
    kinds = [(s.kind, s.ok, s.status) for s in rep.steps]
    assert kinds == [("pause", True, 200), ("update_weights", False, 500), ("resume", True, 200)]
    assert rep.steps[1].attempts == 3  # 5xx is retried, bounded
    assert "simulated admin fault" in rep.steps[1].error
    assert rep.failed_replicas == [sim.url] and rep.not_resumed == []
    assert sim.get_json("/is_paused")["is_paused"] is False  # the server is generating again
    assert sim.get_json("/weight_version")["weight_version"] == 0


def test_4xx_is_not_retried(simulator_factory):
    sim = simulator_factory()
    sim.configure(admin_faults={"update_weights": "400"})
    r = _run(lambda c: c.call(sim.url, "POST", "/update_weights", kind="update_weights", json_body={}),
             max_retries=3, backoff_s=0.01)
    assert not r.ok and r.status == 400 and r.attempts == 1


@pytest.mark.slow
def test_a_replica_that_does_not_answer_is_reported_not_waited_on(simulator_factory):
    good, stuck = simulator_factory(), simulator_factory()
    stuck.configure(admin_faults={"pause": "stall", "health": "stall"})
    with socket.socket() as s:  # a port nobody listens on: refused
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    t0 = time.monotonic()
    rep = _run(lambda c: replicas.update_weights(c, [good.url, stuck.url, dead], server="simulator", version=2),
               timeouts={"pause": 1.5}, max_retries=1, backoff_s=0.01)
    took = time.monotonic() - t0
    assert took < 10
    assert not rep.ok
    assert rep.unanswered_replicas == [stuck.url]
    assert set(rep.failed_replicas) == {stuck.url, dead}
    by = {(s.replica, s.kind): s for s in rep.steps}
    assert by[(stuck.url, "pause")].timed_out and "no answer within 1.5 s" in by[(stuck.url, "pause")].error
    assert by[(dead, "pause")].attempts == 2 and "cannot connect" in by[(dead, "pause")].error
    assert by[(stuck.url, "resume")].ok  # still resumed
    assert good.get_json("/weight_version")["weight_version"] == 2
    # health: the stuck replica is reported within its timeout
    res = _run(lambda c: replicas.simple(c, [good.url, stuck.url], "health"), timeouts={"health": 1.0})
    assert [r.ok for r in res] == [True, False] and res[1].timed_out


def test_prewarm_sends_the_requested_count_spread_over_replicas(simulator_factory):
    a, b = simulator_factory(), simulator_factory()
    res = _run(lambda c: replicas.prewarm(c, [a.url, b.url], 5, model=a.model))
    assert len(res) == 5 and all(r.ok for r in res)
    assert [r.replica for r in res].count(a.url) == 3
    assert "vllm:request_success_total" in a.metrics_text()
    with pytest.raises(ValueError):
        _run(lambda c: replicas.prewarm(c, [a.url], -1, model=a.model))


def test_fresh_connection_per_op(simulator):
    async def go(c: OpsClient):
        await c.call(simulator.url, "GET", "/health", kind="health")
        await c.call(simulator.url, "GET", "/health", kind="health")
        return c._session.connector
    conn = _run(go)
    assert conn.force_close  # no keep-alive: each operation opens its own connection


def test_redirects_are_not_followed_and_answers_are_capped():
    """A 307 is the answer (the client never calls where it points); an answer over the cap is not kept."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from workers.ops.client import MAX_BODY_BYTES

    hits = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _answer(self):
            hits.append(self.path)
            if self.path.startswith("/pause"):
                self.send_response(307)
                self.send_header("Location", "/internal-page")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:  # /reset_prefix_cache: a huge answer
                body = b"x" * (MAX_BODY_BYTES + 10)
                self.send_response(500)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        do_GET = do_POST = _answer

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        (r,) = _run(lambda c: replicas.pause(c, [url], "keep"), max_retries=0)
        assert not r.ok and r.status == 307 and r.error.startswith("HTTP 307")
        (big,) = _run(lambda c: replicas.simple(c, [url], "reset_prefix_cache"), max_retries=0)
        assert not big.ok and big.status == 500 and "over 1048576 bytes" in big.error and big.body is None
        assert "/internal-page" not in hits and len(hits) == 2
    finally:
        server.shutdown()
