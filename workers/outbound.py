"""The outbound-URL gate: every HTTP call a worker or the web process makes goes through `gated_session`.

    from workers import outbound

    async with outbound.gated_session(limit=64, headers=...) as s:          # an aiohttp-like session
        async with s.post(url, json=body, timeout_s=30, max_bytes=1 << 20) as resp:
            data = await resp.json()                                         # reads are capped
    reply = await outbound.fetch("GET", url, timeout_s=5)                   # one call, body read (capped)
    reply = outbound.fetch_sync("GET", url, timeout_s=5)                    # the same, from a thread without a loop
    why = outbound.url_problem(url)                                         # at the edge: None or the reason

`gated_session` is the only place in the product that makes an HTTP client (tests/test_outbound_clients.py
fails on any other `aiohttp.ClientSession(`, `requests.`, `urllib.request`, `httpx`), so grep for it to find
every call out. What it checks, on every request:

* the URL: scheme http or https, a host, a valid port, no userinfo (`user:pass@`);
* the policy's allow-list (`OutboundPolicy.allow`): `*`, `host`, `host:port`, `host:8000-8100`, `.domain` (the
  domain and its subdomains, any of them with a port), an address or network (`10.0.0.5`, `10.0.0.0/8:8000`,
  `[::1]:8000`). A name entry admits that name; an address entry admits what the host resolves to;
* never a cloud-metadata, link-local, multicast, unspecified or reserved address, written or resolved;
* the connection goes to the addresses that were checked: the check runs in the connector's resolver, whose
  answer is what aiohttp connects to, so DNS cannot answer one address to the check and another to the connect
  (rebinding);
* no redirects (a 3xx is the answer; `allow_redirects=True` is refused), no proxy from the environment;
* at most `max_bytes` read of an answer (`ResponseTooLarge` past it; a larger Content-Length is refused
  before reading), and a total deadline per call (`timeout_s`, or the `timeout` given; never unbounded).

The policy: the control plane builds one from its settings in one place (controlplane/outbound.py) and
installs it with `use_policy`; outside the control plane (the engine's CLI, benches) the default admits any
host (metadata and link-local addresses never). `describe(exc)` turns an exception of a call into a failure
class, a product-written reason and the far side's detail (workers.disclosure keeps the two apart).
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp
import attr
from aiohttp.abc import AbstractResolver
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from .disclosure import with_detail

DEFAULT_MAX_BYTES = 16 * 1024 * 1024
DEFAULT_TIMEOUT_S = 60.0

# Cloud metadata services (AWS/GCP/Azure/OpenStack: 169.254.169.254, link-local anyway; AWS IPv6, Alibaba,
# Oracle) and the names they answer to.
METADATA_ADDRESSES = frozenset(ipaddress.ip_address(a) for a in
                               ("169.254.169.254", "169.254.170.2", "fd00:ec2::254", "100.100.100.200", "192.0.0.192"))
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal"})


# ----------------------------------------------------------------------------------------------- errors
class OutboundError(Exception):
    """A call out failed. `failure_class` (connection, timeout, bad_response, refused), `reason` (the
    product's words, safe to show anyone) and `detail` (what the far side said: operators only)."""

    failure_class = "connection"
    retryable = True

    def __init__(self, reason: str, detail: str = "", *, failure_class: str | None = None,
                 retryable: bool | None = None):
        super().__init__(with_detail(reason, detail))
        self.reason, self.detail = reason, detail
        if failure_class is not None:
            self.failure_class = failure_class
        if retryable is not None:
            self.retryable = retryable


class OutboundRefused(OutboundError, aiohttp.ClientConnectionError):
    """The gate refused the URL or the address it resolves to: nothing was sent."""

    failure_class = "refused"
    retryable = False


class ResponseTooLarge(OutboundError, aiohttp.ClientPayloadError):
    """The answer is larger than the call's `max_bytes` (it is not read further)."""

    failure_class = "bad_response"
    retryable = False


def describe(exc: BaseException) -> tuple[str, str, str, bool]:
    """(failure_class, reason, detail, retryable) of an exception raised by a call out. The reason never quotes
    the far side (a body, a banner); the detail may."""
    if isinstance(exc, OutboundError):
        return exc.failure_class, exc.reason, exc.detail, exc.retryable
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return "connection", "connect timed out", "", True
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = getattr(exc, "os_error", None)
        why = _strerror(os_error) or type(exc).__name__
        return "connection", f"cannot connect: {why}", "", True
    if isinstance(exc, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return "timeout", "no answer in time", "", True
    if isinstance(exc, aiohttp.ContentTypeError):
        return "bad_response", "the answer is not JSON", "", False
    if isinstance(exc, aiohttp.ClientResponseError):  # the parser's: what came back is not HTTP
        return "connection", "not an HTTP answer", str(exc.message), True
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "connection", "server disconnected", "", True
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "connection", "answer cut off", str(exc), True
    if isinstance(exc, (aiohttp.ClientError, ConnectionError, OSError)):
        why = _strerror(exc) if isinstance(exc, OSError) else ""
        return "connection", why or f"connection error ({type(exc).__name__})", str(exc), True
    return "bad_response", type(exc).__name__, str(exc), False


def _strerror(os_error) -> str:
    if not isinstance(os_error, OSError):
        return ""
    if isinstance(os_error.errno, int) and os_error.errno > 0:
        return os.strerror(os_error.errno)
    return str(os_error.strerror or "")


# ----------------------------------------------------------------------------------------------- policy
@dataclass(frozen=True)
class _Entry:
    kind: str  # any | name | suffix | net
    value: Any = None
    ports: tuple[int, int] | None = None  # inclusive range; None: any port

    def port_ok(self, port: int) -> bool:
        return self.ports is None or self.ports[0] <= port <= self.ports[1]


def _ports(text: str) -> tuple[int, int] | None:
    if text in ("", "*"):
        return None
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not (0 < lo_i <= hi_i < 65536):
        raise ValueError(f"bad port range {text!r}")
    return lo_i, hi_i


def parse_entry(text: str) -> _Entry:
    """One allow-list entry (see the module docstring); ValueError for a malformed one."""
    try:
        return _parse_entry(text)
    except ValueError:
        raise ValueError(f"bad allow-list entry {text!r} (host, host:port, host:lo-hi, .domain, network)") from None


def _parse_entry(text: str) -> _Entry:
    raw = text.strip().lower()
    if not raw:
        raise ValueError("empty allow-list entry")
    host, ports = raw, ""
    if raw.startswith("["):  # [v6]:port
        end = raw.index("]")
        host, rest = raw[1:end], raw[end + 1:]
        if rest:
            if not rest.startswith(":"):
                raise ValueError(f"bad allow-list entry {text!r}")
            ports = rest[1:]
    elif raw.count(":") == 1:
        host, ports = raw.split(":")
    port_range = _ports(ports)
    if host == "*":
        return _Entry("any", None, port_range)
    try:
        return _Entry("net", ipaddress.ip_network(host, strict=False), port_range)
    except ValueError:
        pass
    if host.startswith("."):
        return _Entry("suffix", host.rstrip("."), port_range)
    return _Entry("name", host.rstrip("."), port_range)


@dataclass(frozen=True)
class OutboundPolicy:
    """Where calls may go. `allow`: allow-list entries (module docstring); `default_max_bytes` and
    `default_timeout_s`: a call's cap and deadline when it names none."""

    allow: tuple[str, ...] = ("*",)
    default_max_bytes: int = DEFAULT_MAX_BYTES
    default_timeout_s: float = DEFAULT_TIMEOUT_S
    # public_only: private, loopback and shared (CGNAT) addresses only when an entry names them (a host or a
    # network, not `*`): for URLs anyone may give, such as webhook receivers
    public_only: bool = False
    entries: tuple[_Entry, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "entries", tuple(parse_entry(e) for e in self.allow if e.strip()))

    def admits_name(self, host: str, port: int) -> bool:
        for e in self.entries:
            if not e.port_ok(port):
                continue
            if e.kind == "any" or (e.kind == "name" and host == e.value) or (
                    e.kind == "suffix" and (host.endswith(e.value) or host == e.value[1:])):
                return True
        return False

    def admits_address(self, ip, port: int) -> bool:
        return any(e.port_ok(port) and (e.kind == "any" or (e.kind == "net" and ip.version == e.value.version
                                                            and ip in e.value)) for e in self.entries)

    def names_explicitly(self, host: str, ip, port: int) -> bool:
        """An entry other than `*` admits this host by name or this address by network."""
        for e in self.entries:
            if not e.port_ok(port) or e.kind == "any":
                continue
            if (e.kind == "name" and host == e.value) or (e.kind == "suffix" and (host.endswith(e.value)
                                                                                   or host == e.value[1:])):
                return True
            if e.kind == "net" and ip is not None and ip.version == e.value.version and ip in e.value:
                return True
        return False

    def private_refused(self, host: str, ip, port: int) -> str | None:
        """Why a public-only policy refuses this private address (None: not private, or named explicitly)."""
        if not self.public_only:
            return None
        if getattr(ip, "ipv4_mapped", None):
            ip = ip.ipv4_mapped
        if (ip.is_private or ip.is_loopback or ip in _SHARED_NET) and not self.names_explicitly(host, ip, port):
            return f"{_hostport(str(ip), port)} is a private address (not allowed unless named in the allow-list)"
        return None

    @property
    def has_address_entries(self) -> bool:
        return any(e.kind == "net" for e in self.entries)


_SHARED_NET = ipaddress.ip_network("100.64.0.0/10")
_policy_source: Callable[[], OutboundPolicy] = OutboundPolicy


def use_policy(source: OutboundPolicy | Callable[[], OutboundPolicy]) -> None:
    """Install the process's policy: a policy, or a callable returning the current one (the control plane's
    reads its settings, so a changed setting applies to the next session or call)."""
    global _policy_source
    _policy_source = source if callable(source) and not isinstance(source, OutboundPolicy) else (lambda: source)


def current_policy() -> OutboundPolicy:
    return _policy_source()


# ----------------------------------------------------------------------------------------------- checks
def forbidden_address(ip) -> str | None:
    """Why an address is never called (whatever the allow-list says), or None."""
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    if ip in METADATA_ADDRESSES:
        return "a cloud metadata address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_multicast or ip.is_unspecified or (ip.is_reserved and not ip.is_loopback):  # ::1 sits in ::/8
        return "not a unicast address"
    return None


def _host_of(url) -> tuple[URL, str, int]:
    try:
        u = url if isinstance(url, URL) else URL(str(url))
        host = (u.raw_host or "").lower().rstrip(".")
        port = u.port
    except (ValueError, TypeError, UnicodeError):
        raise OutboundRefused("not a valid URL") from None
    if u.scheme not in ("http", "https") or not host:
        raise OutboundRefused("must be an http(s) URL with a host")
    if u.raw_user is not None or u.raw_password is not None:
        raise OutboundRefused("credentials in the URL are not allowed (user:password@)")
    if port is None or not 0 < port < 65536:
        raise OutboundRefused("not a valid port")
    return u, host, port


def check_url(url, policy: OutboundPolicy | None = None) -> URL:
    """The URL, checked without resolving it (the resolver checks the addresses at connect time); raises
    OutboundRefused."""
    policy = policy or current_policy()
    u, host, port = _host_of(url)
    if host in METADATA_NAMES:
        raise OutboundRefused(f"{host} is a cloud metadata service")
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is not None:
        if why := forbidden_address(literal):
            raise OutboundRefused(f"{host} is {why}")
        if why := policy.private_refused(host, literal, port):
            raise OutboundRefused(why)
        if policy.admits_address(literal, port) or policy.admits_name(host, port):
            return u
    elif policy.admits_name(host, port) or policy.has_address_entries:
        return u  # a name admitted by name, or perhaps by the addresses it resolves to (the resolver decides)
    raise OutboundRefused(f"{_hostport(host, port)} is not an allowed host (ENDPOINT_ALLOWED_HOSTS)")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def check_addresses(host: str, port: int, addresses, policy: OutboundPolicy) -> None:
    """Raise OutboundRefused unless every address `host` resolved to may be called."""
    by_name = policy.admits_name(host, port)
    for a in addresses:
        try:
            ip = ipaddress.ip_address(str(a).split("%")[0])
        except ValueError:
            raise OutboundRefused(f"{host} resolves to something that is not an address") from None
        if why := forbidden_address(ip):
            raise OutboundRefused(f"{host} resolves to {ip}, {why}")
        if why := policy.private_refused(host, ip, port):
            raise OutboundRefused(f"{host} resolves to {why}")
        if not by_name and not policy.admits_address(ip, port):
            raise OutboundRefused(f"{host} resolves to {_hostport(str(ip), port)}, not an allowed address "
                                  f"(ENDPOINT_ALLOWED_HOSTS)")


def url_problem(url: str, policy: OutboundPolicy | None = None, *, resolve: bool = True) -> str | None:
    """Why `url` may not be called, or None (checked where users give URLs; the gate checks again on every
    call). A name that does not resolve (yet) is not a problem here: the call reports it."""
    policy = policy or current_policy()
    try:
        u = check_url(url, policy)
        host, port = u.raw_host.lower().rstrip("."), u.port
        if resolve:
            try:
                ipaddress.ip_address(host)
            except ValueError:
                try:
                    infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
                except (OSError, UnicodeError):
                    return None
                check_addresses(host, port, [i[4][0] for i in infos], policy)
    except OutboundRefused as exc:
        return exc.reason
    return None


class GateResolver(AbstractResolver):
    """Resolves with the system resolver and refuses any answer the policy does not admit. aiohttp connects to
    exactly the addresses returned here (and caches them as given), so what was checked is what is called."""

    def __init__(self, policy: OutboundPolicy):
        self.policy = policy
        self._inner: ThreadedResolver | None = None

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        if self._inner is None:
            self._inner = ThreadedResolver()
        name = host.lower().rstrip(".")
        if name in METADATA_NAMES:
            raise OutboundRefused(f"{name} is a cloud metadata service")
        infos = await self._inner.resolve(host, port, family)
        check_addresses(name, port, [i["host"] for i in infos], self.policy)
        return infos

    async def close(self) -> None:
        if self._inner is not None:
            await self._inner.close()


# ----------------------------------------------------------------------------------------------- reads
class _CappedStream:
    """A response's `content` that raises ResponseTooLarge past `cap` bytes, whatever way it is read."""

    def __init__(self, inner, cap: int, announced: int | None = None):
        self._inner, self._cap, self.seen = inner, cap, 0
        self._announced = announced if announced is not None and announced > cap else None

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def _count(self, data: bytes) -> bytes:
        if self._announced is not None:  # a Content-Length over the cap: refused before reading any of it
            raise ResponseTooLarge(f"answer over {self._cap} bytes ({self._announced} announced; not read)")
        self.seen += len(data)
        if self.seen > self._cap:
            raise ResponseTooLarge(f"answer over {self._cap} bytes (not read further)")
        return data

    async def read(self, n: int = -1) -> bytes:
        self._count(b"")
        if n is None or n < 0:
            chunks = []
            while True:
                chunk = await self._inner.readany()
                if not chunk:
                    return b"".join(chunks)
                chunks.append(self._count(chunk))
        return self._count(await self._inner.read(min(n, self._cap - self.seen + 1)))

    async def readany(self) -> bytes:
        if self._announced is not None:
            self._count(b"")
        data = await self._inner.readany()
        self.seen += len(data)
        if self.seen > self._cap:
            self._count(b"")
        return data

    async def readline(self) -> bytes:
        self._count(b"")
        return self._count(await self._inner.readline())

    async def readuntil(self, separator: bytes = b"\n") -> bytes:
        self._count(b"")
        return self._count(await self._inner.readuntil(separator))

    async def readexactly(self, n: int) -> bytes:
        self._count(b"")
        return self._count(await self._inner.readexactly(n))

    async def readchunk(self) -> tuple[bytes, bool]:
        self._count(b"")
        data, end = await self._inner.readchunk()
        return self._count(data), end

    async def iter_any(self):  # the engine's streaming loop: kept lean
        if self._announced is not None:
            self._count(b"")
        readany, cap = self._inner.readany, self._cap
        while True:
            chunk = await readany()
            if not chunk:
                return
            self.seen += len(chunk)
            if self.seen > cap:
                self._count(b"")
            yield chunk

    async def iter_chunked(self, n: int):
        while True:
            chunk = await self.read(n)
            if not chunk:
                return
            yield chunk

    def __aiter__(self):
        return self._lines()

    async def _lines(self):
        while True:
            line = await self.readline()
            if not line:
                return
            yield line


# ----------------------------------------------------------------------------------------------- session
class _GatedRequest:
    def __init__(self, gs: "GatedSession", method: str, url, kw: dict, timeout_s, max_bytes):
        self.gs, self.method, self.url, self.kw = gs, method, url, kw
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self._cm = None

    async def __aenter__(self):
        gs = self.gs
        u = gs.check(self.url)
        kw = self.kw
        if kw.pop("allow_redirects", False):
            raise ValueError("the outbound gate follows no redirect")
        if "proxy" in kw:
            raise ValueError("the outbound gate sends nothing through a proxy")
        given = kw.get("timeout")
        kw["timeout"] = gs.timeout if given is None and self.timeout_s is None else gs.deadline(given, self.timeout_s)
        cap = int(self.max_bytes or gs.max_bytes)
        self._cm = gs.session.request(self.method, u, allow_redirects=False, **kw)
        resp = await self._cm.__aenter__()
        resp.content = _CappedStream(resp.content, cap, resp.content_length)  # status and headers stay readable
        return resp

    async def __aexit__(self, *exc):
        if self._cm is not None:
            return await self._cm.__aexit__(*exc)
        return None


class GatedSession:
    """An aiohttp session behind the gate: `get/post/request(...)` take aiohttp's arguments plus `timeout_s`
    and `max_bytes`, and are used as `async with`. Make one with `gated_session()`."""

    def __init__(self, *, policy: OutboundPolicy | None = None, limit: int = 100, force_close: bool = False,
                 timeout: aiohttp.ClientTimeout | None = None, headers: dict | None = None,
                 max_bytes: int | None = None, trace_configs=None, ttl_dns_cache: int | None = 10):
        self.policy = policy or current_policy()
        self.max_bytes = int(max_bytes or self.policy.default_max_bytes)
        self.timeout = self.deadline(timeout, None)  # every request's unless it names its own
        self.connector = aiohttp.TCPConnector(limit=limit, limit_per_host=0, force_close=force_close,
                                              ttl_dns_cache=ttl_dns_cache, resolver=GateResolver(self.policy))
        self.session = aiohttp.ClientSession(connector=self.connector, headers=headers, trust_env=False,
                                             trace_configs=trace_configs, timeout=self.timeout)
        self._checked: dict[str, URL] = {}

    def check(self, url) -> URL:
        key = str(url)
        u = self._checked.get(key)
        if u is None:
            u = check_url(url, self.policy)
            if len(self._checked) < 4096:
                self._checked[key] = u
        return u

    def deadline(self, timeout: aiohttp.ClientTimeout | None, timeout_s: float | None) -> aiohttp.ClientTimeout:
        """A ClientTimeout with a total: the one given, or `timeout_s`, or the policy's default."""
        if timeout is None:
            total = float(timeout_s or self.policy.default_timeout_s)
            return aiohttp.ClientTimeout(total=total, sock_connect=min(total, 10.0))
        if timeout.total is None:
            return attr.evolve(timeout, total=float(timeout_s or self.policy.default_timeout_s))
        return timeout

    def request(self, method: str, url, *, timeout_s: float | None = None, max_bytes: int | None = None, **kw):
        return _GatedRequest(self, method, url, kw, timeout_s, max_bytes)

    def get(self, url, **kw):
        return self.request("GET", url, **kw)

    def post(self, url, **kw):
        return self.request("POST", url, **kw)

    @property
    def closed(self) -> bool:
        return self.session.closed

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> "GatedSession":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def gated_session(**kw) -> GatedSession:
    """THE way to make an HTTP client in the product (see the module docstring). Keyword arguments: policy,
    limit (connections), force_close, timeout (aiohttp.ClientTimeout; a total is always set), headers,
    max_bytes (the per-call default cap), trace_configs, ttl_dns_cache. Must be called on an event loop."""
    return GatedSession(**kw)


# ----------------------------------------------------------------------------------------------- one call
@dataclass
class Reply:
    status: int
    headers: dict
    body: bytes
    elapsed_ms: float

    def json(self):
        import json

        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


async def fetch(method: str, url: str, *, headers: dict | None = None, json: Any = None, data: Any = None,
                params: dict | None = None, timeout_s: float | None = None, connect_timeout_s: float | None = None,
                max_bytes: int | None = None, policy: OutboundPolicy | None = None) -> Reply:
    """One call through the gate on a fresh connection, its body read (at most max_bytes). Raises OutboundError
    (OutboundRefused, ResponseTooLarge, or a transport failure with its class, reason and detail)."""
    policy = policy or current_policy()
    total = float(timeout_s or policy.default_timeout_s)
    timeout = aiohttp.ClientTimeout(total=total, sock_connect=min(total, connect_timeout_s or total))
    t0 = time.perf_counter()
    try:
        async with gated_session(policy=policy, limit=1, force_close=True, max_bytes=max_bytes) as s:
            async with s.request(method, url, headers=headers, json=json, data=data, params=params,
                                 timeout=timeout) as resp:
                body = await resp.content.read()
                return Reply(resp.status, dict(resp.headers), body, (time.perf_counter() - t0) * 1000.0)
    except OutboundError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        fc, reason, detail, retryable = describe(exc)
        raise OutboundError(reason, detail, failure_class=fc, retryable=retryable) from None


def fetch_sync(method: str, url: str, **kw) -> Reply:
    """`fetch` from synchronous code (Celery tasks, management commands, threads): a fresh event loop per call.
    Not for code that runs on an event loop (use `fetch` there)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(fetch(method, url, **kw))
    raise RuntimeError("outbound.fetch_sync called on a running event loop; await outbound.fetch instead")
