"""Every HTTP client in the product goes through the outbound gate (workers/outbound.py: gated_session).

An AST walk over controlplane/, workers/ and rolloutctl/ fails on any other way to open a connection:
`aiohttp.ClientSession(` / `TCPConnector(` / `aiohttp.request(`, `requests`, `httpx`, `urllib.request`,
`http.client`, `urllib3`, raw `socket.create_connection` / `asyncio.open_connection`.

rolloutctl is the CLI users run on their own machines: it calls only the control plane's API at the URL its
user gives, with that user's token, and holds none of the deployment's secrets, so the gate (which protects
what the workers and the web process can reach) does not apply; its one client stays in rolloutctl/client.py.
"""
from __future__ import annotations

import ast
import pytest
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GATE = "workers/outbound.py"
ALLOWED = {GATE: {"aiohttp-client"}, "rolloutctl/client.py": {"requests"}}

BANNED_MODULES = {"requests": "requests", "httpx": "httpx", "urllib.request": "urllib.request",
                  "http.client": "http.client", "urllib3": "urllib3", "aiohttp.client": "aiohttp-client",
                  "aiohttp.connector": "aiohttp-client"}
BANNED_CALLS = {"ClientSession": "aiohttp-client", "TCPConnector": "aiohttp-client", "UnixConnector": "aiohttp-client",
                "create_connection": "raw socket", "open_connection": "raw socket", "urlopen": "urllib.request"}


def offences(source: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    """(line, kind, text) of every client made outside the gate in this source."""
    out = []
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                for mod, kind in BANNED_MODULES.items():
                    if a.name == mod or a.name.startswith(mod + "."):
                        out.append((node.lineno, kind, f"import {a.name}"))
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for mod, kind in BANNED_MODULES.items():
                if any(n == mod or n.startswith(mod + ".") for n in names):
                    out.append((node.lineno, kind, f"from {node.module} import ..."))
                    break
            if node.module == "aiohttp" and any(a.name in BANNED_CALLS for a in node.names):
                out.append((node.lineno, "aiohttp-client", "from aiohttp import ClientSession/TCPConnector"))
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in BANNED_CALLS:
                out.append((node.lineno, BANNED_CALLS[name], ast.unparse(f)))
            if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "aiohttp" \
                    and f.attr == "request":
                out.append((node.lineno, "aiohttp-client", "aiohttp.request"))
    return out


def product_files():
    for top in ("controlplane", "workers", "rolloutctl"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if "migrations" not in path.parts:
                yield path


@pytest.mark.slow
def test_every_http_client_in_product_code_is_the_gate():
    found = []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        for line, kind, text in offences(path.read_text(), rel):
            if kind not in ALLOWED.get(rel, set()):
                found.append(f"{rel}:{line}: {text} ({kind}): call out through workers.outbound.gated_session / fetch")
    assert not found, "\n".join(found)


def test_the_check_sees_each_way_around_the_gate():
    """The walk is not vacuous: each way to open a connection outside the gate is reported."""
    samples = {
        "import requests\nrequests.get('http://x')": "requests",
        "import httpx": "httpx",
        "import urllib.request\nurllib.request.urlopen('http://x')": "urllib.request",
        "from urllib.request import urlopen": "urllib.request",
        "import aiohttp\naiohttp.ClientSession()": "aiohttp-client",
        "from aiohttp import ClientSession": "aiohttp-client",
        "import aiohttp\naiohttp.TCPConnector(limit=1)": "aiohttp-client",
        "import aiohttp\naiohttp.request('GET', 'http://x')": "aiohttp-client",
        "import asyncio\nasyncio.open_connection('h', 1)": "raw socket",
        "import socket\nsocket.create_connection(('h', 1))": "raw socket",
        "import http.client": "http.client",
    }
    for src, kind in samples.items():
        assert kind in {k for _, k, _ in offences(src)}, src
    assert offences("from workers import outbound\noutbound.gated_session()\nimport aiohttp\naiohttp.ClientTimeout(1)") == []


def test_the_gate_is_the_one_place_a_session_is_made():
    src = (ROOT / GATE).read_text()
    assert "def gated_session(" in src
    kinds = {k for _, k, _ in offences(src, GATE)}
    assert kinds == {"aiohttp-client"}  # it is where the (one) client is built
