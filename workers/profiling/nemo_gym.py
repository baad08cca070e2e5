"""NeMo Gym resources servers started with `+profiling_enabled=true`: their yappi profile, pulled into the
same rows while a job runs.

Such a server profiles itself with yappi (CPU clock) from start-up. `GET /stats` makes it write its
profile to `<profiling_results_dirpath>/<server key>/<server name>.log` (and `.callgrind`) and answers
with an empty body; the log is yappi's table with the columns name, ncall, tsub, ttot, tavg, where name is
"<file>:<line> <function>". The puller calls /stats (through the outbound gate, its answer capped), reads the
log (the directory must be readable from the worker: same host or a shared volume), and turns the change since
its last pull into a snapshot. A log is read only under `log_dir` (the operator's PROFILING_STATS_LOG_DIR; none:
no log is read), after symlinks are resolved, and at most LOG_MAX_BYTES of it.
"""
from __future__ import annotations

import logging
import os
import re
import time

from workers import outbound

from .core import FuncRow, ProfileSnapshot, _delta, merge_rows

log = logging.getLogger(__name__)
STATS_MAX_BYTES = 1024 * 1024  # /stats answers an empty body
LOG_MAX_BYTES = 16 * 1024 * 1024


def log_path_problem(path: str, log_dir: str | None) -> str | None:
    """Why the worker may not read this profile log, or None: only files under `log_dir` (symlinks resolved)."""
    if not log_dir:
        return "profile logs are read only under the operator's PROFILING_STATS_LOG_DIR, which is not set"
    root = os.path.realpath(log_dir)
    real = os.path.realpath(path) if isinstance(path, str) and "\x00" not in path else ""
    if not real or os.path.commonpath([root, real]) != root or real == root:
        return f"a profile log must be a file under {log_dir}"
    return None

_ROW = re.compile(r"^(?P<name>.+?)\s+(?P<ncall>\d+(?:/\d+)?)\s+(?P<tsub>[\d.eE+-]+)\s+(?P<ttot>[\d.eE+-]+)\s+"
                  r"(?P<tavg>[\d.eE+-]+)\s*$")
_FULL = re.compile(r"^(?P<module>.*):(?P<line>\d+) (?P<func>.+)$")


def parse_log(text: str, source: str = "log") -> list[FuncRow]:
    """Rows of a yappi `print_all` table (NeMo Gym's <server>.log). Raises ValueError naming the line for
    a line that is not a row."""
    rows, header = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if not header:
            if line.split()[:1] == ["name"]:
                header = True
            continue
        m = _ROW.match(line)
        if m is None:
            raise ValueError(f"{source} line {n}: not a profile row (name ncall tsub ttot tavg): {line[:120]!r}")
        name = m["name"].strip()
        fm = _FULL.match(name)
        module, lineno, func = (fm["module"], int(fm["line"]), fm["func"]) if fm else ("", 0, name)
        ncall = int(m["ncall"].split("/")[0])
        ttot = float(m["ttot"])
        rows.append(FuncRow(module, lineno, func, ncall, float(m["tsub"]), ttot, float(m["tavg"])))
    if not header:
        raise ValueError(f"{source}: no 'name ncall tsub ttot tavg' header found")
    return rows


# NeMo Gym's <server>.log (nemo_gym.profiling.Profiler.dump): yappi's print_all with these columns
LOG_COLUMNS = {0: ("name", 200), 1: ("ncall", 10), 2: ("tsub", 8), 3: ("ttot", 8), 4: ("tavg", 8)}


def format_log(rows: list[FuncRow], clock: str = "cpu") -> str:
    """`rows` as NeMo Gym writes `<profiling_results_dirpath>/<server>.log`: yappi's own table (its column
    widths, trimming and number format), ordered by total time, so `diff` of two such files lines up."""
    import io

    import yappi

    out = io.StringIO()
    sep, gap = yappi.LINESEP, " " * yappi.COLUMN_GAP
    out.write(f"{sep}Clock type: {clock.upper()}{sep}Ordered by: totaltime, desc{sep}{sep}")
    for _, (title, size) in sorted(LOG_COLUMNS.items()):
        out.write(title + " " * (yappi.COLUMN_GAP + size - len(title)))
    out.write(sep)
    for r in sorted(rows, key=lambda r: (-r.ttot, r.module, r.line, r.name)):
        ncall = max(int(round(r.ncall)), 0)
        # the row's own mean (every FuncRow keeps ttot / ncall; a parsed one, yappi's printed figure): worked out
        # again from the printed, rounded ttot it can differ in its last digit from what yappi wrote
        tavg = r.tavg if r.tavg or not ncall else r.ttot / ncall
        full = f"{r.module}:{r.line} {r.name}" if r.module else r.name
        cells = [yappi.StatString(full).ltrim(200), yappi.StatString(ncall).rtrim(10)]
        cells += [yappi.StatString(yappi._fft(v, 8)).rtrim(8) for v in (r.tsub, r.ttot, tavg)]
        out.write(gap.join(cells) + sep)
    return out.getvalue()


class StatsPuller:
    """Pulls each source every `window_s`: sources are {"url": ".../stats", "log": "/path/<server>.log"}."""

    def __init__(self, sources, session: str, window_s: float = 5.0, timeout_s: float = 10.0,
                 log_dir: str | None = None, url_check=None):
        self.sources = [s if isinstance(s, dict) else {"url": s} for s in sources]
        # url_check(url) -> why it may not be pulled, or None (the control plane's: the job's own servers only)
        self.url_check = url_check
        self.log_dir = log_dir
        self.session = session
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.prev: dict[str, dict] = {}
        self.last = 0.0
        self.last_t: dict[str, float] = {}

    def poll(self) -> list[ProfileSnapshot]:
        now = time.time()
        if now - self.last < self.window_s:
            return []
        self.last = now
        out = []
        for src in self.sources:
            try:
                out.extend(self._pull(src, now))
            except Exception as exc:  # noqa: BLE001  (one unreachable server never stops the job)
                log.warning("profiling: pulling %s failed: %s", src.get("url"), exc)
        return out

    def _pull(self, src: dict, now: float) -> list[ProfileSnapshot]:
        url = src["url"]
        if self.url_check is not None and (why := self.url_check(url)):
            raise ValueError(why)
        reply = outbound.fetch_sync("GET", url, timeout_s=self.timeout_s, max_bytes=STATS_MAX_BYTES)  # dumps its profile
        if reply.status != 200:  # a redirect is an answer, never followed (the gate)
            raise ValueError(f"{url} answered HTTP {reply.status}")
        path = src.get("log")
        if not path:
            return []
        if why := log_path_problem(path, self.log_dir):
            raise ValueError(why)
        with open(os.path.realpath(path), "rb") as f:
            data = f.read(LOG_MAX_BYTES + 1)
        if len(data) > LOG_MAX_BYTES:
            raise ValueError(f"{path} is over {LOG_MAX_BYTES} bytes")
        rows = parse_log(data.decode("utf-8", "replace"), source=path)
        cur: dict = {}
        merge_rows(cur, rows)
        before = self.prev.get(url)
        self.prev[url] = cur
        start = self.last_t.get(url, now)
        self.last_t[url] = now
        if before is None:  # first pull: the baseline (the server has profiled since it started)
            return []
        delta = [r for r in _delta(cur, before) if r.ncall > 0]
        return [ProfileSnapshot(session=self.session, scope="verify", clock="cpu", worker=url, window_start=start,
                                window_end=now, rows=delta, source="nemo-gym")]


# --------------------------------------------------------------------- a NeMo Gym deployment's own servers
def server_of(worker: str, source: str) -> str | None:
    """The NeMo Gym server a profile snapshot is of ("nemo-gym:<name>" from collect_rollouts' profiling, the
    host:port of a stats_urls pull), or None for the product's own verifiers."""
    if not str(source).startswith("nemo-gym"):
        return None
    if worker.startswith("nemo-gym:"):
        return worker.split(":", 1)[1]
    return worker.rstrip("/").rsplit("/", 2)[-2]


SERVER_TYPE_DIRS = {"agent": "responses_api_agents", "resources": "resources_servers", "model": "responses_api_models"}


def server_log_dirs(server, profiling: dict) -> list[str]:
    """Where a NeMo Gym server started by ng_run with `+profiling_enabled=true` writes its profile when /stats is
    called: `WORKING_DIR / profiling_results_dirpath / "<ServerClass>___<name>" / "<name>.log"`
    (nemo_gym.server_utils.setup_profiling). WORKING_DIR is the server's own working directory, which ng_run
    sets to `<root>/<server type>/<impl>` (`cd {dir_path} && ...`), or the repository root for an editable
    install; <root> is found from the deployment's `config_paths`. An absolute dirpath is itself. Returns the
    directories that hold a `*___<name>` folder (the class name is not in the config)."""
    dirpath = profiling.get("dirpath")
    if not dirpath:
        return []
    if os.path.isabs(dirpath):
        bases = [dirpath]
    else:
        roots = []
        for p in profiling.get("config_paths") or []:
            parts = os.path.normpath(p).split(os.sep) if os.path.isabs(p) else []
            for stype in SERVER_TYPE_DIRS.values():  # <root>/<server type>/<impl>/configs/<file>.yaml
                if stype in parts:
                    root = os.sep.join(parts[:len(parts) - 1 - parts[::-1].index(stype)]) or os.sep
                    if root not in roots:
                        roots.append(root)
        stype = SERVER_TYPE_DIRS.get(server.kind, "")
        bases = [os.path.join(r, stype, server.impl, dirpath) for r in roots if server.impl]
        bases += [os.path.join(r, dirpath) for r in roots]
    found = []
    for base in bases:
        try:
            names = os.listdir(base)
        except OSError:
            continue
        if any(n.endswith(f"___{server.name}") for n in names):
            found.append(base)
    return found


def parse_callgrind(text: str) -> list[FuncRow]:
    """Rows of yappi's CALLGRIND file (`<name>.callgrind`, which nemo-gym 0.4.0's Profiler.dump saves beside a
    `<name>.log` that holds only the table's header: its filter keeps rows only with a `required_str`, never set).
    yappi writes each function's own time (`<line> <tsub µs>`) and, per callee, `calls=<n>` and the callee's
    inclusive time along that edge: a function's ncall and ttot are the sums over the edges into it (a function
    nothing called: one call, its own time plus its callees')."""
    names: dict[int, tuple[str, int, str]] = {}
    tsub: dict[int, float] = {}
    calls_in: dict[int, int] = {}
    ttot_in: dict[int, float] = {}
    ttot_out: dict[int, float] = {}
    cur = child = None
    expect_cost = False
    for line in text.splitlines():
        if line.startswith("fn=(") and ") " in line:  # a definition: fn=(i) name module:lineno
            idx, rest = line[4:].split(") ", 1)
            head, _, lineno = rest.rpartition(":")
            name, _, module = head.partition(" ")
            names[int(idx)] = (module, int(lineno) if lineno.isdigit() else 0, name)
        elif line.startswith("fn=("):
            cur, child, expect_cost = int(line[4:].rstrip(")")), None, True
        elif line.startswith("cfn=("):
            child = int(line[5:].rstrip(")"))
        elif line.startswith("calls=") and child is not None:
            calls_in[child] = calls_in.get(child, 0) + int(line[6:].split()[0])
        elif cur is not None and line[:1].isdigit():
            a, _, b = line.partition(" ")
            if expect_cost:  # the function's own cost line
                tsub[cur] = tsub.get(cur, 0.0) + int(b or 0) / 1e6
                expect_cost = False
            elif child is not None:  # the inclusive time of the edge into `child`
                t = int(b or 0) / 1e6
                ttot_in[child] = ttot_in.get(child, 0.0) + t
                ttot_out[cur] = ttot_out.get(cur, 0.0) + t
    rows = []
    for idx, (module, lineno, name) in names.items():
        own = tsub.get(idx, 0.0)
        ncall = calls_in.get(idx, 1)
        ttot = ttot_in[idx] if idx in ttot_in else own + ttot_out.get(idx, 0.0)
        rows.append(FuncRow(module, lineno, name, ncall, own, max(ttot, own), ttot / ncall if ncall else 0.0))
    return rows


def server_log(server, profiling: dict) -> str | None:
    """The newest `<name>.log` the server wrote (server_log_dirs), or None."""
    best = None
    for base in server_log_dirs(server, profiling):
        for d in os.listdir(base):
            if not d.endswith(f"___{server.name}"):
                continue
            path = os.path.join(base, d, f"{server.name}.log")
            try:
                mtime = os.stat(path).st_mtime
            except OSError:
                continue
            if best is None or mtime > best[0]:
                best = (mtime, path)
    return best[1] if best else None


def pull_server_profile(server, profiling: dict, *, url_check=None, timeout_s: float = 30.0):
    """Ask a NeMo Gym server for its own profile as ng_run's profiling does: `GET <server>/stats` (through the
    outbound gate: its answer capped, a redirect never followed; `url_check(url)` says why a URL may not be
    called) makes it write its `<name>.log`, which is then read (at most LOG_MAX_BYTES) and parsed.
    Returns (rows or None, a note saying why there are none)."""
    url = f"{server.url.rstrip('/')}/stats"
    if url_check is not None and (why := url_check(url)):
        return None, f"{url} not called: {why}"
    try:
        reply = outbound.fetch_sync("GET", url, timeout_s=timeout_s, max_bytes=STATS_MAX_BYTES)
    except outbound.OutboundError as exc:
        return None, f"{url}: {exc.reason}"
    if reply.status != 200:
        return None, (f"it does not profile itself (/stats answered HTTP {reply.status}: start ng_run with "
                      "+profiling_enabled=true +profiling_results_dirpath=DIR)")
    path = server_log(server, profiling)
    if path is None:
        return None, (f"it profiles itself, but its {server.name}.log was not found (ng_run's "
                      f"+profiling_results_dirpath={profiling.get('dirpath')!r} under its working directory)")
    try:
        with open(path, "rb") as f:
            data = f.read(LOG_MAX_BYTES + 1)
    except OSError as exc:
        return None, f"{path}: {exc.strerror or type(exc).__name__}"
    if len(data) > LOG_MAX_BYTES:
        return None, f"{path} is over {LOG_MAX_BYTES} bytes"
    try:
        rows = parse_log(data.decode("utf-8", "replace"), source=path)
    except ValueError as exc:
        return None, str(exc)
    if rows:
        return rows, ""
    # nemo-gym 0.4.0 writes the table's header only: the figures are in <name>.callgrind beside it
    grind = os.path.join(os.path.dirname(path), f"{server.name}.callgrind")
    try:
        with open(grind, "rb") as f:
            data = f.read(LOG_MAX_BYTES + 1)
    except OSError:
        return rows, ""
    if len(data) > LOG_MAX_BYTES:
        return None, f"{grind} is over {LOG_MAX_BYTES} bytes"
    return parse_callgrind(data.decode("utf-8", "replace")), ""


def profile_change(before: list[FuncRow] | None, after: list[FuncRow]) -> list[FuncRow]:
    """What a server did between two pulls (its profile is cumulative since it started): every function's
    counts and times after minus before; the whole profile when there was no pull before."""
    cur: dict = {}
    merge_rows(cur, after)
    if before is None:
        return [r for r in cur.values() if r.ncall > 0]
    prev: dict = {}
    merge_rows(prev, before)
    return [r for r in _delta(cur, prev) if r.ncall > 0]


class ServerPuller:
    """A job's `profile_servers`: every server of the NeMo Gym deployment whose head server is `head` (discovered
    from its config once, as collect_rollouts' +profiling_enabled does), pulled every `window_s` through
    pull_server_profile (the outbound gate; `url_check(url)`: the control plane's check that it is the job's own
    server). Each pull after the first is what the server did since the one before, as a snapshot of worker
    "nemo-gym:<name>" (server_of), so the job page shows it as the drop-in's `<server>.log`."""

    def __init__(self, head: str, session: str, window_s: float = 5.0, url_check=None, timeout_s: float = 10.0):
        self.head, self.session, self.window_s = head, session, window_s
        self.url_check, self.timeout_s = url_check, timeout_s
        self.dep = None
        self.prev: dict[str, list] = {}
        self.last_t: dict[str, float] = {}
        self.last = 0.0
        self.said: set[str] = set()

    def poll(self, force: bool = False) -> list[ProfileSnapshot]:
        now = time.time()
        if not force and now - self.last < self.window_s:
            return []
        self.last = now
        if self.dep is None:
            from workers.nemo_gym.deployment import DeploymentError, resolve_sync

            try:
                self.dep = resolve_sync(self.head, timeout_s=self.timeout_s)
            except (DeploymentError, ValueError) as exc:
                log.warning("profiling: the NeMo Gym deployment at %s was not read: %s", self.head, exc)
                return []
        out = []
        for srv in sorted(self.dep.servers.values(), key=lambda s: s.name):
            rows, why = pull_server_profile(srv, self.dep.profiling, url_check=self.url_check, timeout_s=self.timeout_s)
            if rows is None:
                if srv.name not in self.said:  # once per server, not every window
                    self.said.add(srv.name)
                    log.warning("profiling: NeMo Gym server %s: no profile (%s)", srv.name, why)
                continue
            before = self.prev.get(srv.name)
            self.prev[srv.name] = rows
            start = self.last_t.get(srv.name, now)
            self.last_t[srv.name] = now
            if before is None:  # the baseline: its profile is cumulative since ng_run started it
                continue
            if change := profile_change(before, rows):
                out.append(ProfileSnapshot(session=self.session, scope="verify", clock="cpu",
                                           worker=f"nemo-gym:{srv.name}", window_start=start, window_end=now,
                                           rows=change, source="nemo-gym"))
        return out

    def final(self) -> list[ProfileSnapshot]:
        """The last pull as the run ends (whatever the window)."""
        return self.poll(force=True)
