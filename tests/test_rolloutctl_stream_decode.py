"""rolloutctl.stream's decoding of a batch leaves the collector's young generations free of the batch: the first
collections after it do not walk thousands of rows that are no garbage; a cycle among them is still collected."""
import gc
import json

from rolloutctl.stream import decode_batch, decode_lines


def _rows(n):
    return [{"id": i, "data": {"input": [{"role": "user", "content": "q"}], "output": [{"content": [{"t": "a"}]}]}}
            for i in range(n)]


def test_a_decoded_batch_is_not_left_to_the_young_generations():
    rows = _rows(3000)
    lines = b"".join(json.dumps(r).encode() + b"\n" for r in rows) + b'{"batch": {"count": 3000}}\n'
    as_lines = decode_lines([lines[k:k + 65536] for k in range(0, len(lines), 65536)])
    as_doc = decode_batch(json.dumps({"count": 3000, "rollouts": rows}).encode())
    for body in (as_lines, as_doc):
        assert body["rollouts"] == rows and gc.isenabled()
        young = {id(o) for g in (0, 1) for o in gc.get_objects(generation=g)}
        assert not any(id(r) in young or id(r["data"]["input"]) in young for r in body["rollouts"])
    assert gc.get_count()[0] < 500  # not the ~36,000 containers decoded since the last collection

    cycle = as_lines["rollouts"][0]["data"]["input"]
    cycle.append(cycle)  # a cycle among decoded objects: a full collection still finds it
    del as_lines, as_doc, cycle
    assert gc.collect() >= 1


def test_a_collector_the_caller_paused_stays_paused():
    gc.disable()
    try:
        decode_lines([b'{"id": 1}\n{"batch": {"count": 1}}\n'])
        assert not gc.isenabled()
    finally:
        gc.enable()
