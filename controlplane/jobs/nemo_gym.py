"""Jobs on NeMo Gym endpoints: the agents' own /aggregate_metrics (stored beside the product's aggregates)
and NeMo Gym's `_materialized_inputs.jsonl` (every /run body, in task order)."""
from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Iterator

from workers import outbound
from workers.disclosure import with_detail
from workers.nemo_gym.deployment import DeploymentError, resolve_sync
from workers.nemo_gym.rows import AGENT_REF, aggregate_entry, agent_of, run_body
from workers.engine.materialize import materialize_tasks, merge_overrides, row_repeats, with_seed
from workers.task_index import rollout_indices

from .models import Rollout

logger = logging.getLogger(__name__)
AGENT_METRICS_KEY = "nemo_gym_agents"  # in job.aggregate_metrics: NeMo Gym's list, one entry per agent
AGGREGATE_TIMEOUT_S = 120.0
AGGREGATE_MAX_BYTES = 16 * 1024 * 1024


def aggregation_disabled(job) -> bool:
    return bool((job.collection_options or {}).get("disable_aggregation"))


def agent_urls(endpoint) -> dict[str, str]:
    if endpoint.kind == endpoint.Kind.NEMO_GYM:
        return resolve_sync(endpoint.base_url, timeout_s=endpoint.connect_timeout_s).agents
    return {endpoint.model_name: endpoint.base_url.rstrip("/")}


def agent_aggregates(job) -> list[dict]:
    """POST {agent}/aggregate_metrics with the job's successful rows, grouped by agent, as ng_collect_rollouts
    does. One entry per agent: {agent_ref, agent_metrics, key_metrics, group_level_metrics}, or
    {agent_ref, error} where the agent does not answer (the job still completes)."""
    endpoint = job.endpoint
    by_agent: dict[str, list[dict]] = {}
    qs = (Rollout.objects.filter(job_id=job.pk, status=Rollout.Status.OK).order_by("task_index", "rollout_index")
          .values_list("data", flat=True))
    for data in qs.iterator(chunk_size=2000):
        name = agent_of(data, endpoint.model_name)
        if name:
            by_agent.setdefault(name, []).append(aggregate_entry(data))
    if not by_agent:
        return []
    try:
        urls = agent_urls(endpoint)
    except DeploymentError as exc:
        return [{AGENT_REF: {"name": n}, "error": str(exc)} for n in by_agent]
    out = []
    for name, entries in by_agent.items():
        url = urls.get(name) if endpoint.kind == endpoint.Kind.NEMO_GYM else next(iter(urls.values()))
        if not url:
            out.append({AGENT_REF: {"name": name}, "error": "the deployment no longer has this agent"})
            continue
        try:
            resp = outbound.fetch_sync("POST", f"{url}/aggregate_metrics", json={"verify_responses": entries},
                                       timeout_s=AGGREGATE_TIMEOUT_S, connect_timeout_s=endpoint.connect_timeout_s,
                                       max_bytes=AGGREGATE_MAX_BYTES)
            if resp.status != 200:
                raise outbound.OutboundError(f"HTTP {resp.status}", resp.body[:200].decode("utf-8", "replace"))
            body = resp.json()
            out.append({AGENT_REF: {"name": name}, "agent_metrics": body.get("agent_metrics", {}),
                        "key_metrics": body.get("key_metrics", {}),
                        "group_level_metrics": body.get("group_level_metrics", [])})
        except outbound.OutboundError as exc:
            logger.warning("job %s: /aggregate_metrics of agent %s failed: %s", job.pk, name, exc)
            out.append({AGENT_REF: {"name": name}, "error": with_detail(f"{url}/aggregate_metrics: {exc.reason}",
                                                                        exc.detail)[:500]})
        except (ValueError, AttributeError) as exc:
            out.append({AGENT_REF: {"name": name},
                        "error": f"{url}/aggregate_metrics: bad answer ({type(exc).__name__})"})
    return out


def with_agent_aggregates(job, aggregate_metrics: dict) -> dict:
    """The product's aggregates plus, for a NeMo Gym job, the agents' own under `nemo_gym_agents`. A job run with
    NeMo Gym's `+disable_aggregation=true` (collection_options["disable_aggregation"]) never calls the agents'
    /aggregate_metrics: as in ng_collect_rollouts, the shards are aggregated afterwards (`gym eval aggregate`)."""
    if not getattr(job.endpoint, "is_nemo_gym", False) or aggregation_disabled(job):
        return aggregate_metrics
    return {**aggregate_metrics, AGENT_METRICS_KEY: agent_aggregates(job)}


def materialized_path(output_path: str | os.PathLike) -> Path:
    p = Path(output_path)
    return p.with_name(p.stem + "_materialized_inputs.jsonl")


# a row whose first key is its responses_create_params (NeMo Gym's files and ours): where that object ends is found
# by decoding it alone
_PARAMS_FIRST = re.compile(r'\{\s*"responses_create_params"\s*:\s*')
_scan_value = json.JSONDecoder().scan_once


def _with_overrides(text: str, added: str, keys) -> str | None:
    """The row's text with the job's overrides (`added`: ', "key": value' each) spliced into the end of its
    responses_create_params, or None where that is not exact (the object elsewhere or named twice, or already
    holding an override's key: deep-merged then, by decoding)."""
    m = _PARAMS_FIRST.match(text)
    if m is None or text.count('"responses_create_params"') != 1:
        return None
    try:
        params, end = _scan_value(text, m.end())
    except (StopIteration, ValueError):
        return None
    if not isinstance(params, dict) or not keys.isdisjoint(params):
        return None
    inner = text[:end - 1].rstrip()
    return f"{inner}{added[2:] if inner.endswith('{') else added}{text[end - 1:]}"


def _lines_from_texts(rows, repeats: int, agent_name: str | None, overrides: dict, add_seed: bool) -> Iterator[str]:
    """The materialized lines of a model endpoint's job from the rows' stored JSON texts. Where the bodies are the
    rows themselves plus the indices (and the agent a row names none of), those are spliced in before the
    closing brace, and the job's overrides at the end of the row's responses_create_params: decoding and encoding
    every row through the ORM cost ~0.5 s of a 30,000-row file's start, before its first request. Otherwise
    (seeds, an override's key already in the row, a row whose text names an index or an agent) the text is
    decoded and the body dumped."""
    agent = f', "{AGENT_REF}": {json.dumps({"name": agent_name}, ensure_ascii=False)}' if agent_name else ""
    added = "".join(f", {json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                    for k, v in overrides.items())
    keys = overrides.keys()
    for task_index, occurrence, text in rows:
        text = text.strip()
        spliced = None if add_seed else (_with_overrides(text, added, keys) if overrides else text)
        plain = (spliced is not None and spliced[:1] == "{" and spliced[-1:] == "}"
                 and not spliced[:-1].rstrip().endswith("{")
                 and '"_ng_task_index"' not in text and '"_ng_rollout_index"' not in text
                 and not (agent and f'"{AGENT_REF}"' in text))
        head = spliced[:-1].rstrip() if plain else ""
        row = None
        for rollout_index in rollout_indices(occurrence, repeats):
            if plain:
                yield f'{head}, "_ng_task_index": {task_index}, "_ng_rollout_index": {rollout_index}{agent}}}\n'
                continue
            if row is None:
                row = json.loads(text)
            body = merge_overrides(row, overrides)
            if add_seed:
                body = with_seed(body, rollout_index)
            body = {**body, "_ng_task_index": task_index, "_ng_rollout_index": rollout_index}
            if agent_name:
                body.setdefault(AGENT_REF, {"name": agent_name})
            yield json.dumps(body, ensure_ascii=False) + "\n"


def write_materialized_inputs(job, output_path, agent_name: str | None, from_texts: bool = True) -> Path:
    """`<out>_materialized_inputs.jsonl`: the body sent for each (task, repeat), in NeMo Gym's order. A model
    endpoint's job (R repeats a row) is written from the stored texts (`from_texts=False`: every row read
    through the ORM, as for NeMo Gym agents and repeats per agent)."""
    from controlplane.datasets.services import iter_task_row_texts, iter_task_rows

    path = materialized_path(output_path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    overrides = dict(job.responses_create_params or {})
    end = min(job.limit, job.dataset.row_count) if job.limit else None
    options = job.collection_options or {}
    repeats = row_repeats(job.num_repeats, options)
    if from_texts and not job.endpoint.is_nemo_gym and isinstance(repeats, int):
        with open(tmp, "w", encoding="utf-8", buffering=1 << 20) as f:
            f.writelines(_lines_from_texts(iter_task_row_texts(job.dataset, 0, end), repeats, agent_name, overrides,
                                           bool(options.get("add_seed"))))
        os.replace(tmp, path)
        return path
    with open(tmp, "w", encoding="utf-8", buffering=1 << 20) as f:
        for item in materialize_tasks(iter_task_rows(job.dataset, 0, end), repeats):
            if job.endpoint.is_nemo_gym:
                body = run_body(item.row, agent_name, overrides, item.task_index, item.rollout_index,
                                add_seed=bool(options.get("add_seed")))
            else:
                body = merge_overrides(item.row, overrides)
                if options.get("add_seed"):
                    body = with_seed(body, item.rollout_index)
                body = {**body, "_ng_task_index": item.task_index, "_ng_rollout_index": item.rollout_index}
                if agent_name:
                    body.setdefault(AGENT_REF, {"name": agent_name})
            f.write(json.dumps(body, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path
