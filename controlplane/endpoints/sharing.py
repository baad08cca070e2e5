"""Servers are shared: several endpoint records (of several users) may point at one model server. Reading one
(health, pre-warm) is the record's owner's business; an operation that changes the server (pause, resume,
sleep, wake up, reset the prefix cache, new weights) changes it for every record, so it needs the right to
every endpoint record that points at any of the same servers (their base and replica URLs, normalised), or
staff.

Two URLs point at the same server when they name the same port on the same host: compared by the host as
written (lower case, no trailing dot, IDNA), by the addresses it resolves to (`localhost`, `127.0.0.1`,
`2130706433` and `[::ffff:127.0.0.1]` are one), and every loopback address counts as one host.
"""
from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from .models import Endpoint

# What changes a model server (the record's own right is not enough): see the module docstring.
CHANGING_KINDS = frozenset({"pause", "resume", "sleep", "wake_up", "reset_prefix_cache", "update_weights"})


class SharedServerDenied(PermissionError):
    """The user may not change this server: another user's endpoint record points at it (the API answers 403)."""


def _canonical_ip(ip) -> str:
    if getattr(ip, "ipv4_mapped", None):
        ip = ip.ipv4_mapped
    return "loopback" if ip.is_loopback else str(ip)


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(str(url).strip())
        host = (parts.hostname or "").lower().rstrip(".")
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        pass
    return host, port


def server_keys(url: str, *, resolve: bool = True, _cache: dict | None = None) -> set[str]:
    """The identities of the server at `url`: `name:<host>:<port>` and `ip:<address>:<port>` for each address
    the host is or resolves to (an unresolvable name keeps its name only)."""
    hp = _host_port(url)
    if hp is None:
        return set()
    host, port = hp
    keys = {f"name:{host}:{port}"}
    try:
        keys.add(f"ip:{_canonical_ip(ipaddress.ip_address(host))}:{port}")
        return keys
    except ValueError:
        pass
    if host == "localhost" or host.endswith(".localhost"):
        keys.add(f"ip:loopback:{port}")
    if resolve:
        cache = {} if _cache is None else _cache
        if host not in cache:
            try:
                infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
            except (OSError, UnicodeError):
                infos = []
            addrs = set()
            for info in infos:
                try:
                    addrs.add(_canonical_ip(ipaddress.ip_address(info[4][0].split("%")[0])))
                except ValueError:
                    continue
            cache[host] = addrs
        keys |= {f"ip:{a}:{port}" for a in cache[host]}
    return keys


def endpoint_server_keys(endpoint, *, _cache: dict | None = None) -> set[str]:
    keys: set[str] = set()
    for url in endpoint.all_base_urls:
        keys |= server_keys(url, _cache=_cache)
    return keys


def records_sharing_servers(endpoint, *, exclude_owner=None) -> list[Endpoint]:
    """The other endpoint records that point at any server of `endpoint` (other owners' only, with
    exclude_owner). Names are resolved only for records on one of the same ports."""
    cache: dict = {}
    target = endpoint_server_keys(endpoint, _cache=cache)
    ports = {k.rsplit(":", 1)[1] for k in target}
    qs = Endpoint.objects.exclude(pk=endpoint.pk)
    if exclude_owner is not None:
        qs = qs.exclude(owner=exclude_owner)
    out = []
    for other in qs.only("pk", "owner", "base_url", "replica_urls").iterator(chunk_size=500):
        urls = [u for u in other.all_base_urls if (hp := _host_port(u)) and str(hp[1]) in ports]
        if urls and any(server_keys(u, _cache=cache) & target for u in urls):
            out.append(other)
    return out


def change_refusal(user, endpoint) -> str | None:
    """Why `user` may not change the servers `endpoint` points at, or None. No user (a management command,
    the operator's) and staff may; anyone else needs the right to every record that points at them."""
    if user is None or getattr(user, "is_staff", False):
        return None
    if not getattr(user, "is_authenticated", False) or endpoint.owner_id != user.pk:
        return "you do not own this endpoint"
    shared = records_sharing_servers(endpoint, exclude_owner=user)
    if not shared:
        return None
    return (f"this server is shared: {len(shared)} endpoint record(s) of other users or of the operator "
            f"point at the same server, and an operation that changes the server (pause, resume, "
            f"sleep, wake up, reset prefix cache, weights) changes it for them too; ask an administrator")


def check_may_change(user, endpoint, kind: str) -> None:
    """Raise SharedServerDenied when `kind` changes the server and `user` lacks the right to all its records."""
    if kind in CHANGING_KINDS and (why := change_refusal(user, endpoint)):
        raise SharedServerDenied(why)
