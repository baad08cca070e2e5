"""A hostile user's judge options: `verdict_regex` `(a+)+$` froze a whole worker (catastrophic backtracking
holds the GIL) and a template width spec built 190 MB strings. Verdict patterns are matched by RE2 (linear
time) and templates are plain `{field}` substitution, refused otherwise at the API and again where used."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from controlplane.jobs.models import CollectionJob
from workers.verifiers.judge import JudgeError, render_prompt

from .conftest import make_dataset, make_endpoint

REPO = Path(__file__).resolve().parents[2]
EVIL_ANSWER = "a" * 60 + "!"  # (a+)+$ against this backtracks 2^60 ways in Python's re


@pytest.fixture
def judge_server():
    """An OpenAI-compatible judge on 127.0.0.1 whose every verdict is EVIL_ANSWER."""
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": EVIL_ANSWER}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


# A worker process: the judge verification on its event loop, and a heartbeat on the same loop that notes
# the longest stall (a frozen loop, or a thread holding the GIL, shows here).
WORKER = textwrap.dedent('''
    import asyncio, json, sys, time
    sys.path.insert(0, REPO)
    from workers.verifiers.execution import VerifyExecutor

    async def main():
        gaps, last = [0.0], [time.monotonic()]
        async def beat():
            while True:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps[0] = max(gaps[0], now - last[0])
                last[0] = now
        hb = asyncio.ensure_future(beat())
        ex = VerifyExecutor("judge", {"base_url": JUDGE, "verdict_regex": "(a+)+$"}, cache="off")
        t0 = time.monotonic()
        try:
            res = await ex.verify({"question": "q", "expected_answer": "1"}, "1")
            out = {"reward": res.reward}
        except Exception as exc:
            out = {"raised": type(exc).__name__, "error": str(exc)[:300]}
        out.update(elapsed=time.monotonic() - t0, max_gap=gaps[0])
        hb.cancel()
        await ex.aclose()
        print(json.dumps(out))

    asyncio.run(main())
''')


def test_a_catastrophic_verdict_pattern_does_not_freeze_the_worker(judge_server):
    script = f"REPO = {str(REPO)!r}\nJUDGE = {judge_server!r}\n" + WORKER
    try:
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail("the worker froze on the judge's verdict pattern (killed after 60 s)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out.get("raised") == "JudgeError" and "unparseable" in out["error"], out
    assert out["elapsed"] < 5 and out["max_gap"] < 1.0, out


@pytest.mark.parametrize("options,fragment", [
    ({"verdict_regex": r"(a)\1"}, "RE2"),                        # a backreference: not linear-time
    ({"verdict_regex": r"(?<=x)y"}, "RE2"),                      # a lookbehind
    ({"verdict_regex": "a" * 5000}, "longer than"),
    ({"prompt_template": "{response:>200000000}"}, "not a plain {name}"),
    ({"prompt_template": "{response!r}"}, "not a plain {name}"),
    ({"prompt_template": "{question.__class__.__mro__}"}, "not a plain {name}"),
    ({"prompt_template": "{expected_answer[0]}"}, "not a plain {name}"),
])
def test_api_refuses_unsafe_patterns_and_templates(api, mallory, options, fragment):
    ds, ep = make_dataset(mallory), make_endpoint(mallory)
    r = api.post("/api/jobs/", {"dataset": ds.pk, "endpoint": ep.pk, "verifier": "judge",
                                "verifier_options": {"base_url": "http://127.0.0.1:9", **options}}, format="json")
    assert r.status_code == 400, r.content
    assert fragment in " ".join(r.json()["verifier_options"]), r.json()
    assert not CollectionJob.objects.exists()


def test_templates_substitute_plain_fields_only_where_used():
    row = {"question": "What is 1 + 1?", "expected_answer": "2"}
    prompt = render_prompt("Q: {question} A: {expected_answer} R: {response} {{literal}}", row, "two")
    assert prompt == "Q: What is 1 + 1? A: 2 R: two {literal}"
    # a template stored before the checks: refused where the worker renders it, no 200 MB string built
    for bad in ("{response:>200000000}", "{response.__class__}", "{response!r}"):
        with pytest.raises(JudgeError, match="not a plain"):
            render_prompt(bad, row, "x")
