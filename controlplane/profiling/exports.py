"""A job's merged profile rows written out for other tools: a marshalled pstats dict (pstats, snakeviz), the
callgrind format (KCachegrind / QCachegrind) and the nested tree the flame graph draws."""
from __future__ import annotations

import io
import marshal

from .services import short_module


def to_pstats(rows) -> bytes:
    """The profile as a marshalled pstats dict (pstats.Stats(path) loads it; snakeviz opens it)."""
    stats = {}
    by_key = {r.key: r for r in rows}
    callers: dict = {r.key: {} for r in rows}
    for r in rows:
        for c in r.children:
            ck = (c[0], int(c[1]), c[2])
            child = by_key.get(ck)
            n = int(round(c[3]))
            tt = child.tsub * (c[4] / child.ttot) if child and child.ttot else 0.0
            callers.setdefault(ck, {})[r.key] = (n, n, tt, float(c[4]))
    for r in rows:
        n = int(round(r.ncall))
        stats[(r.module, int(r.line), r.name)] = (n, n, float(r.tsub), float(r.ttot), callers.get(r.key, {}))
    return marshal.dumps(stats)


def to_callgrind(rows, *, title="rollout control plane profile") -> str:
    """The profile in callgrind format for KCachegrind / QCachegrind (costs in microseconds)."""
    out = io.StringIO()
    w = out.write
    total = sum(max(0.0, r.tsub) for r in rows)
    w("# callgrind format\nversion: 1\ncreator: rollout-control-plane\n")
    w(f"cmd: {title}\npositions: line\nevents: Microseconds\nsummary: {int(total * 1e6)}\n\n")
    by_key = {r.key: r for r in rows}
    for r in rows:
        w(f"fl={r.module}\nfn={r.name}\n{int(r.line)} {int(max(0.0, r.tsub) * 1e6)}\n")
        for c in r.children:
            child = by_key.get((c[0], int(c[1]), c[2]))
            w(f"cfl={c[0]}\ncfn={c[2]}\ncalls={max(1, int(round(c[3])))} {int(c[1])}\n")
            w(f"{int(r.line)} {int(max(0.0, c[4]) * 1e6)}\n")
            _ = child
        w("\n")
    return out.getvalue()


def call_tree(rows, max_depth=12, min_share=0.005) -> dict:
    """A nested {name, value, children} tree (value = inclusive µs) from the roots (functions nobody calls)."""
    by_key = {r.key: r for r in rows}
    called = {tuple(c[:3]) for r in rows for c in r.children}
    total = sum(max(0.0, r.tsub) for r in rows) or 1.0
    roots = [r for r in rows if r.key not in called] or sorted(rows, key=lambda r: -r.ttot)[:1]

    def node(r, t, depth, path):
        kids = []
        if depth < max_depth:
            for c in sorted(r.children, key=lambda c: -c[4]):
                ck = tuple(c[:3])
                if ck in path or ck not in by_key or c[4] / total < min_share:
                    continue
                kids.append(node(by_key[ck], c[4], depth + 1, path | {ck}))
        return {"name": f"{r.name} ({short_module(r.module)}:{r.line})", "value": int(t * 1e6), "children": kids}

    return {"name": "all", "value": int(total * 1e6),
            "children": [node(r, r.ttot, 1, {r.key}) for r in sorted(roots, key=lambda r: -r.ttot)
                         if r.ttot / total >= min_share]}
