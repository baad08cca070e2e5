"""The panel registry (core: imports no app). The job page is a list of panels, rendered in order (the compare page has sections added the same way,
`register_compare_section`). A panel is a template (it receives the page's context: `job`, `snapshot`, ...
and `panel_ctx`, what its own context function returns). Later work (diagnosis, profiling) adds a panel
with `register_panel` from its app's `ready()`:

    from controlplane.panels import register_panel
    register_panel("diagnostics/panels/diagnosis.html", context=lambda request, job: {...}, after="charts")
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass
class Panel:
    name: str
    template: str
    context: Callable | None = None  # (request, job) -> dict, available to the template as `panel_ctx`
    live: bool = False  # updated in place by the page's JS; other panels are re-fetched from the server
                        # every PANEL_REFRESH_S while the job runs and when its state changes


JOB_PANELS: list[Panel] = [
    Panel("progress", "dashboard/panels/progress.html", live=True),
    Panel("actions", "dashboard/panels/actions.html", live=True),
    Panel("charts", "dashboard/panels/charts.html", live=True),
    Panel("metrics", "dashboard/panels/metrics.html"),
    Panel("verification", "dashboard/panels/verification.html"),  # contexts: the dashboard's ready()
    Panel("workers", "dashboard/panels/workers.html"),
    Panel("timing", "dashboard/panels/timing.html"),
    Panel("errors", "dashboard/panels/errors.html"),
    Panel("parameters", "dashboard/panels/parameters.html"),
]


def register_panel(template: str, *, name: str | None = None, context: Callable | None = None,
                   after: str | None = None, live: bool = False) -> Panel:
    """Add a panel after another (or last); a panel of an existing name and no `after` takes its place."""
    panel = Panel(name or template, template, context, live)
    for i, p in enumerate(JOB_PANELS):
        if p.name == panel.name and after is None:
            JOB_PANELS[i] = panel
            return panel
    JOB_PANELS[:] = [p for p in JOB_PANELS if p.name != panel.name]
    if after is not None:
        for i, p in enumerate(JOB_PANELS):
            if p.name == after:
                JOB_PANELS.insert(i + 1, panel)
                return panel
    JOB_PANELS.append(panel)
    return panel


# Sections of the compare page that other apps add (profiling: per function), after the built-in ones.
# context(request, jobs) returns the section's `section_ctx`, or None to leave the section out.
COMPARE_SECTIONS: list[Panel] = []


def register_compare_section(template: str, *, name: str, context: Callable) -> Panel:
    section = Panel(name, template, context)
    COMPARE_SECTIONS[:] = [s for s in COMPARE_SECTIONS if s.name != name] + [section]
    return section


def render_compare_sections(request, jobs) -> list[dict]:
    out = []
    for s in COMPARE_SECTIONS:
        ctx = s.context(request, jobs)
        if ctx is not None:
            out.append({"name": s.name, "template": s.template, "context": ctx})
    return out


def render_list(request, job) -> list[dict]:
    """[{name, template, context}] for the page to {% include %} in order."""
    out = []
    for p in JOB_PANELS:
        extra = p.context(request, job) if p.context else {}
        out.append({"name": p.name, "template": p.template, "context": extra or {}, "live": p.live})
    return out
