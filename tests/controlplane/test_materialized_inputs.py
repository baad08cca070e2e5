"""The drop-in's `<out>_materialized_inputs.jsonl` for a plain run is spliced from the stored row texts (no
decode and encode of every row before the first request): the same bodies as decoding every row, for rows with
escapes, raw non-ASCII, odd spacing and a CR, big and small numbers, an own index, a repeated line, their own
agent, and an index's name inside a string; on the suite's PostgreSQL (jsonb's rendering) and on the SQLite
default (the file's own text); with overrides (spliced into the row's parameters where that is exact) and with seeds (decoded)."""
from __future__ import annotations

import json

import pytest

from tests.sqlite_child import run_on_sqlite

CHILD = r"""
import io, json
import django
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0, interactive=False)
from tests.controlplane.test_materialized_inputs import both_ways
print("RESULT " + json.dumps(both_ways(TMP)))
"""


def _row(q, **extra):
    return {"responses_create_params": {"input": [{"role": "user", "content": q}]}, "expected_answer": "1", **extra}


LINES = [
    json.dumps(_row("plain")),
    json.dumps(_row("caf\u00e9 \U0001F600 escaped")),
    json.dumps(_row("caf\u00e9 \U0001F600 raw"), ensure_ascii=False),
    '{ "responses_create_params" : {"input": [{"role": "user", "content": "spaced"}]}, "expected_answer":"1" }\r',
    json.dumps(_row("numbers", big=123456789012345678901234567890, f=1e-7, g=2.5e300, nested={"a": [1, {"b": None}]})),
    json.dumps(_row("own index", _ng_task_index=7)),
    json.dumps(_row("plain")),  # a repeated line: the first one's task index, the next rollouts
    json.dumps(_row("its own agent", agent_ref={"type": "responses_api_agents", "name": "other_agent"})),
    json.dumps(_row('says "_ng_rollout_index" in a string')),
    # for the overrides: a row already holding one (deep-merged, the override wins), its parameters not first,
    # without spaces, or named again inside a string
    json.dumps({"responses_create_params": {"input": "holds one", "max_output_tokens": 5, "metadata": {"a": "1"}},
                "expected_answer": "1"}),
    json.dumps({"expected_answer": "1", "responses_create_params": {"input": "not first"}}),
    '{"responses_create_params":{"input":"tight"},"expected_answer":"1"}',
    json.dumps(_row('says "responses_create_params" in a string')),
]


def both_ways(tmp) -> dict:
    """{case: (lines from the stored texts, lines through the ORM)} for jobs of LINES with 2 repeats: plain and
    with an agent name (spliced), and with overrides and seeds (decoded from the texts)."""
    import io
    from pathlib import Path

    from controlplane.datasets.services import ingest_jsonl
    from controlplane.jobs.models import CollectionJob
    from controlplane.jobs.nemo_gym import write_materialized_inputs
    from controlplane.jobs.services import get_or_create_job
    from tests.factories import make_endpoint

    ds = ingest_jsonl(io.BytesIO(("\n".join(LINES) + "\n").encode()), name="mixed")
    endpoint = make_endpoint()
    out = {}
    for case, agent, overrides in (("plain", None, {}), ("agent", "math_agent", {}),
                                   ("overrides", None, {"max_output_tokens": 32, "temperature": 0.5}),
                                   ("overrides and seeds", "math_agent", {"max_output_tokens": 32, "temperature": 0.5})):
        job, _ = get_or_create_job(owner=None, dataset=ds, endpoint=endpoint, num_repeats=2, launch=False,
                                   operator=True, name=case, responses_create_params=overrides)
        if "seeds" in case:
            CollectionJob.objects.filter(pk=job.pk).update(collection_options={"add_seed": True})
            job.refresh_from_db()
        lines = {}
        for from_texts in (True, False):
            path = write_materialized_inputs(job, Path(tmp) / f"{case}-{from_texts}.jsonl", agent,
                                             from_texts=from_texts)
            lines[from_texts] = path.read_text(encoding="utf-8").splitlines()
        out[case] = [lines[True], lines[False]]
    return out


def check(result: dict) -> None:
    assert set(result) == {"plain", "agent", "overrides", "overrides and seeds"}
    for case, (from_texts, decoded) in result.items():
        assert len(from_texts) == len(decoded) == 2 * len(LINES)
        assert [json.loads(line) for line in from_texts] == [json.loads(line) for line in decoded], case
        bodies = [json.loads(line) for line in from_texts]
        assert [(b["_ng_task_index"], b["_ng_rollout_index"]) for b in bodies][:2] == [(0, 0), (0, 1)]
        assert (bodies[12]["_ng_task_index"], bodies[12]["_ng_rollout_index"]) == (0, 2)  # the repeated line
        assert bodies[10]["_ng_task_index"] == 7
        if case in ("plain", "overrides"):
            assert "agent_ref" not in bodies[0]
        else:
            assert bodies[0]["agent_ref"] == {"name": "math_agent"} and bodies[14]["agent_ref"]["name"] == "other_agent"
    overridden = [json.loads(line)["responses_create_params"] for line in result["overrides"][0]]
    assert all(rcp["max_output_tokens"] == 32 and rcp["temperature"] == 0.5 for rcp in overridden)
    assert overridden[18]["metadata"] == {"a": "1"} and overridden[20]["input"] == "not first"
    seeded = [json.loads(line) for line in result["overrides and seeds"][0]]
    rcp = seeded[3]["responses_create_params"]
    assert rcp["max_output_tokens"] == 32 and json.loads(rcp["metadata"]["extra_body"]) == {"seed": 1}


@pytest.mark.django_db
def test_spliced_materialized_inputs_are_the_decoded_ones_on_postgresql(tmp_path):
    check(both_ways(tmp_path))


@pytest.mark.slow
def test_spliced_materialized_inputs_keep_the_files_text_on_sqlite(tmp_path):
    result = run_on_sqlite(CHILD.replace("TMP", repr(str(tmp_path))), tmp_path)
    check(result)
    spliced = result["plain"][0]
    # the file's own text, its spacing kept: the rows were not decoded
    assert spliced[6].startswith('{ "responses_create_params" : {"input"') and "\r" not in spliced[6]
    # the overrides spliced into the row's own text, at the end of its parameters
    overridden = result["overrides"][0]
    assert overridden[6].startswith('{ "responses_create_params" : {"input": [{"role": "user", "content": "spaced"}], '
                                    '"max_output_tokens": 32, "temperature": 0.5}, "expected_answer":"1"'), overridden[6]
    assert overridden[22].startswith('{"responses_create_params":{"input":"tight", "max_output_tokens": 32, '
                                     '"temperature": 0.5},"expected_answer":"1", "_ng_task_index": '), overridden[22]


def test_overrides_go_into_an_empty_parameters_object():
    from controlplane.jobs.nemo_gym import _with_overrides

    added = ', "max_output_tokens": 32'
    assert _with_overrides('{"responses_create_params": { }, "x": 1}', added, {"max_output_tokens"}) == \
        '{"responses_create_params": {"max_output_tokens": 32}, "x": 1}'
    assert json.loads(_with_overrides('{"responses_create_params": {"a": {"b": "}"}}}', added, {"max_output_tokens"})) \
        == {"responses_create_params": {"a": {"b": "}"}, "max_output_tokens": 32}}
    assert _with_overrides('{"responses_create_params": {"max_output_tokens": 1}}', added, {"max_output_tokens"}) is None
