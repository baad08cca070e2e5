"""Bottleneck diagnosis (no Django): evidence in, verdict + evidence items + recommendations + conditions out.

    from workers.diagnosis import build_evidence, diagnose
    d = diagnose(build_evidence(ticks, config={"parallelism": 64, "rpm_limit": 600}))
    d.verdict, d.confidence, d.recommendations
"""
from .classifier import (  # noqa: F401
    AGENT, CONTROL_PLANE, INSUFFICIENT, MODEL, NETWORK, VERDICTS, VERIFICATION, diagnose, rate_limit_parallelism,
)
from .evidence import Evidence, build_evidence  # noqa: F401
from .report import Condition, Diagnosis, EvidenceItem, Recommendation  # noqa: F401


def diagnose_ticks(ticks, config=None, rollout_stats=None, sweep=None) -> Diagnosis:
    """build_evidence + diagnose in one call."""
    return diagnose(build_evidence(ticks, config=config, rollout_stats=rollout_stats, sweep=sweep))
