"""Listeners on 127.0.0.1 for the hostile-user tests: each records what reaches it (connections, request lines,
headers, bytes it managed to send) and answers the way a test needs (a JSON route table, a redirect, an endless
body, a non-HTTP banner). Plain threads and sockets: nothing of the product's own HTTP stack is involved."""
from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Hit:
    method: str
    path: str
    headers: dict
    body: bytes


@dataclass
class Listener:
    """`answer(hit) -> (status, headers, body | iterator of chunks)`; None closes without answering."""
    answer: object
    host: str = "127.0.0.1"
    hits: list = field(default_factory=list)
    connections: int = 0
    sent: int = 0  # body bytes written before the client hung up

    def __post_init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{self.host}:{self.port}"
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn):
        conn.settimeout(10)
        try:
            while True:
                hit = _read_request(conn)
                if hit is None:
                    return
                self.hits.append(hit)
                out = self.answer(hit)
                if out is None:
                    return
                if isinstance(out, bytes):  # raw bytes: not HTTP at all
                    conn.sendall(out)
                    time.sleep(0.2)
                    return
                status, headers, body = out
                if isinstance(body, (bytes, str)):
                    data = body.encode() if isinstance(body, str) else body
                    head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(data)}\r\n"
                    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                    conn.sendall(head.encode() + b"\r\n" + data)
                    self.sent += len(data)
                else:  # an iterator of chunks, sent chunked until it ends or the client hangs up
                    head = f"HTTP/1.1 {status} X\r\nTransfer-Encoding: chunked\r\n"
                    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
                    conn.sendall(head.encode() + b"\r\n")
                    for chunk in body:
                        conn.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                        self.sent += len(chunk)
                    conn.sendall(b"0\r\n\r\n")
        except OSError:
            return
        finally:
            conn.close()

    def paths(self) -> list[str]:
        return [h.path for h in self.hits]

    def close(self):
        self._stop = True
        self.sock.close()


def _read_request(conn) -> Hit | None:
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head, _, rest = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = (lines[0].split(" ") + ["", ""])[:3]
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length") or 0)
    while len(rest) < n:
        data = conn.recv(65536)
        if not data:
            break
        rest += data
    return Hit(method, path, headers, rest[:n])


def json_answer(obj, status=200):
    return status, {"Content-Type": "application/json"}, json.dumps(obj)


def endless(chunk_size=1 << 20, total=256 << 20):
    """Chunks of a body far larger than any cap (`total` bytes in all)."""
    chunk = b"x" * chunk_size
    for _ in range(total // chunk_size):
        yield chunk


def chat_answer(text: str, model: str = "m"):
    return json_answer({"id": "c1", "object": "chat.completion", "model": model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                     "finish_reason": "stop"}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
