"""The stream's rows as the database writes them, and its pending batch kept as runs of ids: a streamed rollout
is the stored one field for field (odd strings, nulls, floats), a batch with holes in its ids (failed rows,
another job's rows) comes again exactly, and a batch cut by its byte bound skips nothing."""

from __future__ import annotations

from datetime import datetime

from controlplane.api.stream import ROW_FIELDS
from controlplane.disclosure import shown_for
from controlplane.jobs import stream
from controlplane.jobs.models import Rollout, StreamConsumer
from tests.factories import add_rollouts, make_job


def _take(api, job, consumer="trainer", **params):
    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": consumer, **params})
    assert r.status_code == 200, r.content
    return r.json()


def _ids(batch):
    return [r["id"] for r in batch["rollouts"]]


def test_a_streamed_rollout_is_the_stored_one(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=6, state="running")
    rows = list(Rollout.objects.filter(job=job).order_by("id"))
    odd = 'quote " backslash \\ newline \n tab \t unicode é 漢 \u2028 end'
    Rollout.objects.filter(pk=rows[0].pk).update(
        weight_version='7"', completed_version=odd, worker=odd, error="kept: " + odd, failure_class="x\\y"
    )
    Rollout.objects.filter(pk=rows[1].pk).update(
        reward=0.1, queue_ms=None, ttft_ms=1e-300, wall_ms=1.5e300, input_tokens=None, output_tokens=0
    )
    Rollout.objects.filter(pk=rows[2].pk).update(data={"text": odd, "n": [1, 2.5, None, True], "nested": {"a": {}}})
    first = _take(api, job, max=10)
    again = _take(api, job, max=10)  # not acknowledged: the same rows again, read by id
    assert again["redelivered"] and again["rollouts"] == first["rollouts"]
    assert [r["id"] for r in first["rollouts"]] == [r.pk for r in rows]
    for got, row in zip(first["rollouts"], Rollout.objects.filter(job=job).order_by("id")):
        assert set(got) == {*ROW_FIELDS, "data", "lag"}
        for f in ROW_FIELDS:
            want = getattr(row, f)
            if f == "error":
                assert got[f] == shown_for(alice, want)
            elif f == "created_at":
                assert datetime.fromisoformat(got[f].replace("Z", "+00:00")) == want
            else:
                assert got[f] == want, (f, got[f], want)
        assert got["data"] == row.data


def test_a_batch_with_holes_in_its_ids_comes_again_exactly(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=0, state="running")
    other = make_job(alice, dataset, endpoint, n_rollouts=0, state="running")
    for k in range(4):  # ids interleaved with another job's, and failed rows among the job's own
        add_rollouts(job, 5, failed_every=3, start_task=10 * k)
        add_rollouts(other, 2, start_task=10 * k)
    ok = list(Rollout.objects.filter(job=job, status="ok").order_by("id").values_list("id", flat=True))
    first = _take(api, job, max=9)
    assert _ids(first) == ok[:9]
    packed = StreamConsumer.objects.get(job=job, name="trainer").pending_ids
    assert stream.unpack_ids(packed) == ok[:9] and len(packed) < 9  # runs, not each id
    assert api.get(f"/api/jobs/{job.pk}/stream/consumers/").json()["consumers"][0]["pending"] == 9
    again = _take(api, job, max=9)
    assert again["redelivered"] and _ids(again) == ok[:9]
    rest = _take(api, job, max=100, ack=first["token"])
    assert _ids(rest) == ok[9:]
    done = api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": "trainer", "token": rest["token"]}, format="json")
    assert done.json()["delivered"] == len(ok)


def test_a_pending_batch_stored_as_plain_ids_is_still_handed_out_and_acknowledged(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=6, state="running")
    ids = list(Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True))
    StreamConsumer.objects.create(
        job=job, name="trainer", pending_token="ab12", pending_ids=ids[:3], pending_cursor=ids[2]
    )
    b = _take(api, job, max=10)
    assert b["redelivered"] and _ids(b) == ids[:3]
    assert _ids(_take(api, job, max=10, ack="ab12")) == ids[3:]
    assert StreamConsumer.objects.get(job=job, name="trainer").delivered == 3


def test_a_batch_cut_at_its_byte_bound_skips_nothing(api, alice, dataset, endpoint, monkeypatch):
    job = make_job(alice, dataset, endpoint, n_rollouts=30, state="running")
    ids = list(Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True))
    monkeypatch.setattr(stream, "MAX_BATCH_BYTES", 3000)  # a few rows' JSON
    seen, token, sizes = [], None, []
    while (b := _take(api, job, max=1000, **({"ack": token} if token else {})))["count"]:
        seen += _ids(b)
        sizes.append(b["count"])
        token = b["token"]
    assert seen == ids and max(sizes) < 30 and len(sizes) > 2
    monkeypatch.setattr(stream, "MAX_BATCH_BYTES", 1)  # never less than one row
    job2 = make_job(alice, dataset, endpoint, n_rollouts=2, state="running")
    assert _take(api, job2, max=10)["count"] == 1


def test_pack_ids_round_trip():
    for ids in ([], [5], [1, 2, 3], [1, 3, 4, 5, 9, 10, 2], [7, 6, 5]):
        assert stream.unpack_ids(stream.pack_ids(ids)) == ids
        assert stream.packed_len(stream.pack_ids(ids)) == len(ids)
    assert stream.pack_ids([1, 2, 3, 7, 9, 10]) == [[1, 3], 7, [9, 10]]


LEAN = ["id", "task_index", "rollout_index", "reward", "weight_version", "data"]


def test_lean_rows_are_the_stored_values_field_for_field(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=8, state="running")
    rows = list(Rollout.objects.filter(job=job).order_by("id"))
    odd = 'quote " backslash \\ newline \n tab \t unicode é 漢 \u2028 end'
    Rollout.objects.filter(pk=rows[0].pk).update(weight_version='7"' + odd, error="kept: " + odd)
    Rollout.objects.filter(pk=rows[1].pk).update(reward=1e-300, data={"text": odd, "n": [1, 2.5, None, True]})
    Rollout.objects.filter(pk=rows[2].pk).update(reward=None)  # inline verification: a row without a reward
    stored = list(Rollout.objects.filter(job=job).order_by("id"))
    for consumer, fields, want_keys in (
        ("lean", ",".join(LEAN), set(LEAN)),
        ("reward-only", "reward, data", {"id", "reward", "data"}),  # id always comes
        ("no-data", "weight_version,lag,error", {"id", "weight_version", "lag", "error"}),
    ):
        first = _take(api, job, consumer, max=5, fields=fields)
        again = _take(api, job, consumer, max=5, fields=fields)  # redelivered: read again by id, same rows
        assert again["redelivered"] and again["rollouts"] == first["rollouts"]
        rest = _take(api, job, consumer, max=5, fields=fields, ack=first["token"])
        got_rows = first["rollouts"] + rest["rollouts"]
        assert [r["id"] for r in got_rows] == [r.pk for r in stored]  # every row once, in order
        for got, row in zip(got_rows, stored):
            assert set(got) == want_keys, (consumer, set(got))
            for f in want_keys - {"lag", "error"}:
                assert got[f] == getattr(row, f), (consumer, f, got[f], getattr(row, f))
            if "error" in want_keys:
                assert got["error"] == shown_for(alice, row.error)
            if "lag" in want_keys:
                assert got["lag"] == stream.lag_of(row.weight_version, first["current_version"])
    full = _take(api, job, "full", max=8)["rollouts"]  # the default: every field, as before
    assert set(full[0]) == {*ROW_FIELDS, "data", "lag"}


def test_unknown_or_blank_fields_are_refused(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=3, state="running")
    for bad in ("id,reward,secret_column", "data,pk", "id;reward", "trajectory", " , "):
        r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "t", "fields": bad})
        assert r.status_code == 400, (bad, r.content)
        assert "fields" in r.json(), r.json()
    assert api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "t", "fields": ""}).status_code == 400
    assert not StreamConsumer.objects.filter(job=job).exists()  # refused before anything was handed out
    schema = api.get("/api/schema/", {"format": "json"})
    assert schema.status_code == 200
    params = schema.json()["paths"]["/api/jobs/{job_id}/stream/"]["get"]["parameters"]
    assert "fields" in {p["name"] for p in params}


def _take_lines(api, job, consumer="trainer", **params):
    """A take as JSON lines (Accept: application/x-ndjson): (rollouts, the last line's batch)."""
    import json

    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": consumer, **params}, HTTP_ACCEPT="application/x-ndjson")
    assert r.status_code == 200 and r.streaming and r["Content-Type"].startswith("application/x-ndjson")
    body = b"".join(r.streaming_content)
    lines = [json.loads(line) for line in body.splitlines()]
    batch = lines.pop()["batch"] if lines and "batch" in lines[-1] else None
    return lines, batch


def test_lines_carry_what_the_json_body_carries(api, alice, dataset, endpoint):
    job = make_job(alice, dataset, endpoint, n_rollouts=0, state="running")
    add_rollouts(job, 2500, failed_every=7)  # pages of STREAM_PAGE rows, failed rows among them
    Rollout.objects.filter(job=job, task_index=3).update(error="kept: x \n y", weight_version="2")
    for params in ({}, {"fields": "id,reward,weight_version,lag,error,data"}, {"fields": "id,data"}):
        lines, head = _take_lines(api, job, "lines", max=2000, **params)
        body = _take(api, job, "json", max=2000, **params)
        assert len(lines) == head["count"] == body["count"] > 1700, (len(lines), head["count"], body["count"])
        assert lines == body["rollouts"]
        assert {k: v for k, v in head.items() if k != "token"} == \
            {k: v for k, v in body.items() if k not in ("token", "rollouts")} | {"consumer": "lines"}
        again, head2 = _take_lines(api, job, "lines", max=2000, **params)  # not acknowledged: the same again
        assert again == lines and head2["redelivered"] and head2["token"] == head["token"]
        for consumer, token in (("lines", head["token"]), ("json", body["token"])):
            assert api.post(f"/api/jobs/{job.pk}/stream/ack/", {"consumer": consumer, "token": token},
                            format="json").status_code == 200
        StreamConsumer.objects.filter(job=job).delete()
    # groups mode answers its JSON body whatever is asked for
    r = api.get(f"/api/jobs/{job.pk}/stream/", {"consumer": "g", "groups": "true"}, HTTP_ACCEPT="application/x-ndjson")
    assert r.status_code == 200 and not r.streaming and r.json()["groups"] is not None


def test_lines_stop_at_a_bound_mid_read_and_the_next_take_goes_on(api, alice, dataset, endpoint, monkeypatch):
    """A batch sent as it is read (one query, its rows received page by page) can end before the rows the query
    asked for: at the byte bound, or (deferred verification) at the first row without a reward. The take still
    reads the query to its end (leaving it early would cancel the query and abort the take's transaction), hands
    out exactly the rows before the stop, and the next take starts there."""
    job = make_job(alice, dataset, endpoint, n_rollouts=0, state="running")
    add_rollouts(job, 1800, failed_every=11)
    ok = list(Rollout.objects.filter(job=job, status="ok").order_by("id").values_list("id", flat=True))
    monkeypatch.setattr(stream, "MAX_BATCH_BYTES", 400_000)  # a few hundred rows of ~1 KB: ends mid-page
    seen, token, sizes = [], None, []
    while True:
        lines, head = _take_lines(api, job, "bytes", max=1500, **({"ack": token} if token else {}))
        if not head["count"]:
            break
        assert [r["id"] for r in lines] == ok[len(seen):len(seen) + head["count"]]
        seen += [r["id"] for r in lines]
        sizes.append(head["count"])
        token = head["token"]
    assert seen == ok and len(sizes) > 2 and max(sizes) < 1500, sizes
    monkeypatch.undo()
    job.verify_mode = "deferred"
    job.save(update_fields=["verify_mode"])
    unverified = ok[700]  # mid-page: the rows after it come once it has its reward
    Rollout.objects.filter(pk=unverified).update(reward=None)
    lines, head = _take_lines(api, job, "deferred", max=1500)
    assert [r["id"] for r in lines] == ok[:700] and head["count"] == 700
    Rollout.objects.filter(pk=unverified).update(reward=1.0)
    lines, head = _take_lines(api, job, "deferred", max=1500, ack=head["token"])
    assert [r["id"] for r in lines] == ok[700:700 + 1500]
