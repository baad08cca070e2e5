"""What a collection run carries besides its sink and control: telemetry in every progress tick and, when
asked, the adaptive concurrency controller. Django-free: the control plane passes its settings in."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from workers.adaptive import AdaptiveConcurrency
from workers.engine.types import CollectionSpec, Control, Sink
from workers.telemetry import Telemetry, TelemetrySink

log = logging.getLogger(__name__)


@dataclass
class Instrumentation:
    telemetry: bool = True  # host / loop / timing telemetry in every progress tick
    scrape_vllm: bool = True  # also scrape the endpoint's /metrics (vLLM servers)
    scrape_interval_s: float = 5.0
    adaptive: bool = False  # let the adaptive controller choose parallelism
    adaptive_max: int = 1024


def instrument_run(spec: CollectionSpec, sink: Sink, control: Control | None,
                   how: Instrumentation) -> tuple[Sink, Control | None]:
    """(sink, control) to hand to run_collection. Never raises: a problem here leaves the run as it was."""
    try:
        telemetry = None
        if how.telemetry:
            telemetry = Telemetry(metrics_urls=list(spec.endpoint.base_urls) if how.scrape_vllm else None,
                                  scrape_interval_s=float(how.scrape_interval_s))
        if how.adaptive:
            ctl = AdaptiveConcurrency(initial=spec.parallelism, max_parallelism=int(how.adaptive_max),
                                      telemetry=telemetry)
            sink = ctl.wrap(sink)
            control = ctl.control(control)
        if telemetry is not None:
            sink = TelemetrySink(sink, telemetry, history=0)
    except Exception:
        log.exception("could not attach telemetry / adaptive concurrency; running without")
    return sink, control
