"""rolloutctl shows an API error in words, not the raw JSON body, and takes a cut-off stream batch again."""
import pytest

from rolloutctl.client import _describe


def test_api_error_bodies_read_as_text():
    assert _describe({"detail": "cannot pause a job that is completed", "code": "invalid_state"}) == \
        "cannot pause a job that is completed"
    assert _describe({"num_samples_in_parallel": ["Ensure this value is less than or equal to 512."],
                      "dataset": ["Invalid pk \"9\" - object does not exist."]}) == \
        'num_samples_in_parallel: Ensure this value is less than or equal to 512.; dataset: Invalid pk "9" - object does not exist.'
    assert _describe(["a", "b"]) == "a; b"
    assert _describe("<html>\n<title>502 Bad Gateway</title>\n</html>") == "502 Bad Gateway"
    assert "{" not in _describe({"detail": {"field": ["bad"]}})


@pytest.mark.parametrize("lines", [True, False])
def test_a_stream_batch_cut_off_mid_body_is_taken_again(lines):
    """A take whose answer is cut off (the connection lost inside the body) is retried like one lost before the
    answer: the same pending batch comes again, whole; as JSON lines (a body without its last line is cut off
    too) and as one document."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rolloutctl.client import Client
    from rolloutctl.stream import RolloutStream

    head = {"job": 7, "consumer": "c", "token": "ab", "cursor": 4, "redelivered": False, "count": 2,
            "skipped_stale": 0, "skipped_equal": 0, "current_version": None, "groups": None}
    rows = [{"id": 3, "data": "x" * 100_000}, {"id": 4, "data": "y"}]
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            asked_lines = self.headers.get("Accept") == "application/x-ndjson"
            seen.append(asked_lines)
            if asked_lines:
                body = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
                whole = body + json.dumps({"batch": head}).encode() + b"\n"
            else:
                whole = json.dumps({**head, "rollouts": rows}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(whole)))
            self.end_headers()
            if len(seen) == 1:  # the first answer: half, then hang up
                self.wfile.write(whole[:50_000])
            elif len(seen) == 2 and asked_lines:  # every row but no last line (a server stopped mid-take)
                self.wfile.write(body)
            else:
                self.wfile.write(whole)
            self.close_connection = True

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        stream = RolloutStream(base, "t", 7, "c", client=Client(base, "t", retries=3, backoff_s=0.01), lines=lines)
        batch = stream.take(wait=0)
        assert batch is not None and batch.token == "ab" and batch.cursor == 4 and batch.rollouts == rows
        assert seen == ([True] * 3 if lines else [False] * 2)
    finally:
        server.shutdown()
        server.server_close()


def test_a_batch_decodes_exactly_what_json_reads():
    """rolloutctl decodes with orjson, which refuses integers past 64 bits and NaN: such a row (a dataset's own
    field) still comes whole, as the standard library reads it, in lines and in one document."""
    import json
    import math

    from rolloutctl.stream import decode_batch, decode_lines

    row = b'{"id": 3, "data": {"seed": 123456789012345678901234567890, "score": NaN, "text": "\\u00e9\\ud83d\\ude00"}}'
    plain = b'{"id": 4, "data": {"seed": 1}}'
    head = b'{"batch": {"token": "ab", "count": 2}}'
    got = decode_lines([row[:20], row[20:] + b"\n" + plain + b"\n", head + b"\n"])
    assert got["token"] == "ab" and got["rollouts"][1] == json.loads(plain)
    first = got["rollouts"][0]
    assert first["data"]["seed"] == 123456789012345678901234567890 and math.isnan(first["data"]["score"])
    assert first["data"]["text"] == json.loads(row)["data"]["text"]
    doc = decode_batch(b'{"count": 1, "rollouts": [' + row + b"]}")
    assert doc["rollouts"][0]["data"]["seed"] == 123456789012345678901234567890
    assert decode_lines([row + b"\n"]) is None  # no last line: cut off
