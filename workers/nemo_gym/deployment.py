"""A NeMo Gym deployment as seen from its head server.

`GET {head}/global_config_dict_yaml` answers a JSON string holding the whole merged config as YAML. Each
server instance is a top-level entry `name: {server_type: {impl_name: {host, port, ...}}}` where
server_type is `responses_api_agents`, `resources_servers` or `responses_api_models`. The config also holds
`policy_api_key` and other secrets in clear: only names, types and addresses are kept from it, and
nothing of it is logged.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import aiohttp
import yaml

from workers import outbound

SERVER_TYPES = {"responses_api_agents": "agent", "resources_servers": "resources", "responses_api_models": "model"}
DEFAULT_HEAD_HOST = "127.0.0.1"  # NeMo Gym's head_server defaults
DEFAULT_HEAD_PORT = 11000


class DeploymentError(Exception):
    """The head server cannot be reached or does not answer like a NeMo Gym head server."""


@dataclass
class Server:
    name: str
    kind: str  # agent | resources | model
    url: str  # http://host:port
    impl: str = ""  # e.g. simple_agent, math_with_judge, vllm_model
    refs: dict[str, str] = field(default_factory=dict)  # an agent's resources_server / model_server names
    upstream: list[str] = field(default_factory=list)  # a model server's own model endpoints (its base_url)


@dataclass
class Deployment:
    head_url: str
    servers: dict[str, Server]
    # ng_run's own profiling keys (+profiling_enabled, +profiling_results_dirpath) and its +config_paths: where
    # each server writes <server>.log when /stats is called (workers.profiling.nemo_gym.server_log_dirs)
    profiling: dict = field(default_factory=dict)

    def by_kind(self, kind: str) -> dict[str, Server]:
        return {n: s for n, s in self.servers.items() if s.kind == kind}

    @property
    def agents(self) -> dict[str, str]:
        """agent name -> base URL"""
        return {n: s.url for n, s in self.servers.items() if s.kind == "agent"}

    def model_upstreams(self, agents=None) -> list[str]:
        """The model endpoints (e.g. vLLM) behind the model servers the given agents use (all agents: None)."""
        names = {s.refs.get("model_server") for n, s in self.servers.items()
                 if s.kind == "agent" and (agents is None or n in agents)}
        out: list[str] = []
        for n in sorted(x for x in names if x):
            for u in getattr(self.servers.get(n), "upstream", None) or []:
                if u not in out:
                    out.append(u)
        return out

    def public(self) -> dict:
        """Names, kinds and addresses only (safe to store and show)."""
        return {"head_url": self.head_url,
                "servers": [{"name": s.name, "kind": s.kind, "impl": s.impl, "url": s.url, "refs": s.refs}
                            for s in self.servers.values()]}


def head_url(host: str | None = None, port: int | str | None = None) -> str:
    return f"http://{host or DEFAULT_HEAD_HOST}:{int(port or DEFAULT_HEAD_PORT)}"


def _host_for_url(host: str, head: str) -> str:
    # servers bound to all interfaces are reached at the head server's host
    if host in ("0.0.0.0", "::", ""):
        from urllib.parse import urlsplit

        return urlsplit(head).hostname or "127.0.0.1"
    return host


def _interpolated(value, cfg: dict):
    """`${policy_base_url}` (an OmegaConf interpolation the head server may leave unresolved) -> its value."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        node = cfg
        for part in value[2:-1].split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node
    return value


def parse_config(head: str, payload) -> Deployment:
    """The deployment from the body of /global_config_dict_yaml (a JSON string of YAML, or the YAML text)."""
    text = payload
    if isinstance(payload, (bytes, bytearray)):
        text = payload.decode("utf-8", "replace")
    if isinstance(text, str):
        try:
            decoded = json.loads(text)
            text = decoded if isinstance(decoded, str) else text
        except ValueError:
            pass
    try:
        cfg = yaml.safe_load(text) if isinstance(text, str) else text
    except yaml.YAMLError as exc:
        raise DeploymentError(f"{head}/global_config_dict_yaml is not YAML: {type(exc).__name__}") from None
    if not isinstance(cfg, dict):
        raise DeploymentError(f"{head}/global_config_dict_yaml does not hold a config mapping")
    servers: dict[str, Server] = {}
    for name, entry in cfg.items():
        if not isinstance(entry, dict) or len(entry) != 1:
            continue
        (stype, impls), = entry.items()
        if stype not in SERVER_TYPES or not isinstance(impls, dict) or not impls:
            continue
        impl, inner = next(iter(impls.items()))
        if not isinstance(inner, dict) or "host" not in inner or "port" not in inner:
            continue
        refs = {}
        for key in ("resources_server", "model_server"):
            ref = inner.get(key)
            if isinstance(ref, dict) and isinstance(ref.get("name"), str):
                refs[key] = ref["name"]
        upstream = inner.get("base_url") if stype == "responses_api_models" else None
        upstream = [upstream] if isinstance(upstream, str) else upstream if isinstance(upstream, list) else []
        upstream = [_interpolated(u, cfg) for u in upstream]
        servers[str(name)] = Server(name=str(name), kind=SERVER_TYPES[stype], impl=str(impl), refs=refs,
                                    url=f"http://{_host_for_url(str(inner['host']), head)}:{int(inner['port'])}",
                                    upstream=[u for u in upstream if isinstance(u, str) and u.startswith("http")])
    if not servers:
        raise DeploymentError(f"{head} lists no NeMo Gym servers in its config")
    paths = cfg.get("config_paths")
    paths = [p for p in (paths if isinstance(paths, list) else [paths]) if isinstance(p, str)]
    dirpath = cfg.get("profiling_results_dirpath")
    profiling = {"enabled": cfg.get("profiling_enabled") is True,
                 "dirpath": dirpath if isinstance(dirpath, str) else None, "config_paths": paths}
    return Deployment(head_url=head, servers=servers, profiling=profiling)


CONFIG_MAX_BYTES = 4 * 1024 * 1024  # a head server's config (YAML in a JSON string) is small


def _unreachable(head: str, exc: BaseException) -> DeploymentError:
    _fc, reason, _detail, _retry = outbound.describe(exc)  # the product's words: never what the server said
    return DeploymentError(f"cannot reach the NeMo Gym head server {head}: {reason}")


async def resolve(head: str, *, timeout_s: float = 10.0, session=None) -> Deployment:
    """The deployment behind a head server URL (async; `session`: a gated session to reuse). Every server it
    lists is called through the outbound gate later, so a config cannot point the workers anywhere the
    operator does not allow."""
    head = head.rstrip("/")
    url = f"{head}/global_config_dict_yaml"
    try:
        if session is None:
            reply = await outbound.fetch("GET", url, timeout_s=timeout_s, max_bytes=CONFIG_MAX_BYTES)
            status, body = reply.status, reply.body
        else:
            async with session.get(url, timeout_s=timeout_s, max_bytes=CONFIG_MAX_BYTES) as resp:
                status, body = resp.status, await resp.read()
    except (outbound.OutboundError, aiohttp.ClientError, OSError, TimeoutError) as exc:
        raise _unreachable(head, exc) from None
    if status != 200:
        raise DeploymentError(f"{url} answered HTTP {status}")
    return parse_config(head, body)


def resolve_sync(head: str, *, timeout_s: float = 10.0) -> Deployment:
    """The deployment behind a head server URL (blocking, for Celery tasks and commands)."""
    head = head.rstrip("/")
    try:
        reply = outbound.fetch_sync("GET", f"{head}/global_config_dict_yaml", timeout_s=timeout_s,
                                    max_bytes=CONFIG_MAX_BYTES)
    except outbound.OutboundError as exc:
        raise _unreachable(head, exc) from None
    if reply.status != 200:
        raise DeploymentError(f"{head}/global_config_dict_yaml answered HTTP {reply.status}")
    return parse_config(head, reply.body)

