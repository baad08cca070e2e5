from django import template

from controlplane.disclosure import shown_for
from controlplane.jobs.replica_load import run_health as health

register = template.Library()


@register.filter
def duration(seconds):
    """1:02:03 / 02:03 like tqdm; '—' when unknown."""
    if seconds is None or seconds == "":
        return "—"
    try:
        s = int(round(float(seconds)))
    except (TypeError, ValueError):
        return "—"
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


@register.filter
def num(value, digits=2):
    if value is None or value == "":
        return "—"
    try:
        v = float(value)
    except (TypeError, ValueError):
        return value
    if v == int(v) and abs(v) < 1e15 and digits != 0 and isinstance(value, int):
        return f"{int(v):,}"
    return f"{v:,.{int(digits)}f}"


@register.filter
def percent(fraction):
    try:
        return f"{100.0 * float(fraction):.1f}"
    except (TypeError, ValueError):
        return "0.0"


@register.filter
def ms(seconds, digits=3):
    """Seconds as milliseconds ('—' when unknown): the unit profiles and latencies are read in."""
    try:
        return f"{1000.0 * float(seconds):,.{int(digits)}f}"
    except (TypeError, ValueError):
        return "—"


@register.filter
def shown_to(value, user):
    """An error text or report as `user` may read it (controlplane.disclosure): staff all of it, everyone
    else never what a server said."""
    return shown_for(user, value)


@register.simple_tag
def run_health(endpoint):
    """The endpoint as the latest job's run saw it (controlplane.jobs.replica_load.run_health), or None."""
    return health(endpoint)
