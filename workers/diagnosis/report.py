"""What a diagnosis says (workers.diagnosis.classifier makes it): the verdict, every number consulted and whether
it held, the recommendations and the troubleshooting guide's conditions detected. Plain dataclasses, JSON-ready."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EvidenceItem:
    name: str
    value: Any
    threshold: Any
    meaning: str
    supports: str | None = None  # verdict it supports when it holds
    holds: bool = False
    weight: float = 0.0


@dataclass
class Recommendation:
    action: str
    why: str
    setting: str | None = None  # e.g. "num_samples_in_parallel", "gpu_memory_utilization"
    value: Any = None  # suggested value, when one can be computed


@dataclass
class Condition:
    """One of the troubleshooting guide's cases, detected."""

    name: str
    title: str
    evidence: str
    fixes: list[str] = field(default_factory=list)


@dataclass
class Diagnosis:
    verdict: str
    confidence: float
    summary: str
    evidence_items: list[EvidenceItem] = field(default_factory=list)
    recommendations: list[Recommendation] = field(default_factory=list)
    conditions: list[Condition] = field(default_factory=list)
    scores: dict[str, float] = field(default_factory=dict)
    label: str = ""
    subtype: str = ""  # e.g. "server_saturated" / "client_parallelism" for model-bound
    server_slots: int | None = None  # requests the model server runs at once, all replicas (None: unknown)
    server_slots_bound: str = ""  # where that figure comes from

    def to_dict(self) -> dict:
        d = asdict(self)
        d["evidence_items"] = [_jsonable(i) for i in d["evidence_items"]]
        return d

    def held(self) -> list[EvidenceItem]:
        return [i for i in self.evidence_items if i.holds]


def _jsonable(d: dict) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, float):
            v = None if (math.isnan(v) or math.isinf(v)) else round(v, 4)
        out[k] = v
    return out
