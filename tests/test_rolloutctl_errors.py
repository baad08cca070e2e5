"""rolloutctl shows an API error in words, not the raw JSON body."""
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


def test_a_stream_batch_cut_off_mid_body_is_taken_again():
    """A take whose answer is cut off (the connection lost inside the body) is retried like one lost before the
    answer: the same pending batch comes again, whole."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from rolloutctl.client import Client
    from rolloutctl.stream import RolloutStream

    body = json.dumps({"job": 7, "consumer": "c", "token": "ab", "cursor": 3, "redelivered": False, "count": 1,
                       "skipped_stale": 0, "skipped_equal": 0, "current_version": None, "groups": None,
                       "rollouts": [{"id": 3, "data": "x" * 100_000}]}).encode()
    seen = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body if len(seen) > 1 else body[:50_000])  # the first answer: half, then hang up
            self.close_connection = True

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        stream = RolloutStream(base, "t", 7, "c", client=Client(base, "t", retries=2, backoff_s=0.01))
        batch = stream.take(wait=0)
        assert batch is not None and batch.token == "ab" and batch.rollouts[0]["data"] == "x" * 100_000
        assert len(seen) == 2  # the cut-off answer, then the whole one
    finally:
        server.shutdown()
        server.server_close()
