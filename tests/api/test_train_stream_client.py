"""rolloutctl.stream against a live server: a trainer killed inside its loop body gets the batch again after
its restart; rollouts that land while it long-polls reach it; every ok rollout exactly once."""
from __future__ import annotations

import threading
import time

import pytest

from controlplane.jobs.models import Rollout, StreamConsumer
from rolloutctl.stream import RolloutStream
from tests.factories import add_rollouts, make_dataset, make_endpoint, make_job, make_user


class Killed(Exception):
    pass


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_trainer_restarted_mid_batch_continues_exactly_once(live_server):
    user = make_user("trainer-owner", token=True)
    job = make_job(user, make_dataset(user, n=5), make_endpoint(user), n_rollouts=30, repeats=3, state="running",
                   rewards=lambda t, r: float(r == 0))
    open_stream = lambda: RolloutStream(live_server.url, user.api_token, job.pk, "ppo", max=6, wait=1.0,  # noqa: E731
                                        groups=True)
    seen, killed_batch = [], None
    with pytest.raises(Killed):
        for batch in open_stream().batches(idle_timeout_s=3):
            if len(seen) >= 12:  # the trainer dies mid-batch, after two acknowledged batches
                killed_batch = [r["id"] for r in batch.rollouts]
                raise Killed
            seen += [r["id"] for r in batch.rollouts]

    def land_more():  # new rollouts land while the restarted trainer waits
        time.sleep(0.5)
        add_rollouts(job, 3, start_task=500)  # repeat 0 only: with 3 repeats these groups are not complete
        for t in range(500, 503):
            for r in (1, 2):
                Rollout.objects.create(job=job, task_index=t, rollout_index=r, status="ok", reward=float(r), data={})

    writer = threading.Thread(target=land_more)
    writer.start()
    restarted = open_stream()
    first = True
    for batch in restarted.batches(until_finished=False, idle_timeout_s=3):
        if first:
            assert batch.redelivered and [r["id"] for r in batch.rollouts] == killed_batch
            first = False
        for group in batch.groups():
            assert len(group) == 3 and len({r["task_index"] for r in group}) == 1
            assert [r["rollout_index"] for r in group] == [0, 1, 2]
        seen += [r["id"] for r in batch.rollouts]
    writer.join()
    ok_ids = sorted(Rollout.objects.filter(job=job, status="ok").values_list("id", flat=True))
    assert len(ok_ids) == 39 and sorted(seen) == ok_ids and len(seen) == len(set(seen))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_lean_trainer_gets_only_its_fields_exactly_once_across_a_restart(live_server):
    from rolloutctl.stream import TRAIN_FIELDS

    user = make_user("lean-owner", token=True)
    job = make_job(user, make_dataset(user, n=5), make_endpoint(user), n_rollouts=20, state="completed")
    ok = list(Rollout.objects.filter(job=job, status="ok").order_by("id").values_list("id", flat=True))
    open_stream = lambda: RolloutStream(live_server.url, user.api_token, job.pk, "lean", max=6, wait=0.5,  # noqa: E731
                                        fields=TRAIN_FIELDS)
    seen = []
    with pytest.raises(Killed):
        for batch in open_stream().batches():
            assert all(set(r) == set(TRAIN_FIELDS) for r in batch.rollouts)
            if len(seen) >= 6:
                raise Killed  # mid-batch: this one comes again
            seen += [r["id"] for r in batch.rollouts]
    for batch in open_stream().batches():
        assert all(set(r) == set(TRAIN_FIELDS) for r in batch.rollouts)
        seen += [r["id"] for r in batch.rollouts]
    assert seen == ok


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_trainer_gone_mid_body_leaves_nothing_handed_out_or_acknowledged(live_server):
    """A take as JSON lines whose reader hangs up in the middle of the body: the take's transaction is rolled back
    with the ack it carried; the next take (which waits for that rollback on the consumer's lock) hands out the
    batch before again, and every row comes exactly once."""
    import requests

    user = make_user("gone-owner", token=True)
    job = make_job(user, make_dataset(user, n=5), make_endpoint(user), n_rollouts=0, state="running")
    add_rollouts(job, 9000)
    ok = list(Rollout.objects.filter(job=job).order_by("id").values_list("id", flat=True))
    stream = RolloutStream(live_server.url, user.api_token, job.pk, "gone", max=1000, wait=0)
    first = stream.take()
    assert [r["id"] for r in first.rollouts] == ok[:1000]
    url = f"{live_server.url}/api/jobs/{job.pk}/stream/"
    params = {"consumer": "gone", "max": 8000, "ack": first.token}  # ~15 MB of lines: more than sockets hold
    with requests.get(url, params=params, stream=True, timeout=30,
                      headers={"Authorization": f"Token {user.api_token}", "Accept": "application/x-ndjson"}) as r:
        assert r.status_code == 200
        assert r.raw.read(100_000).startswith(b'{"id": %d' % ok[1000])  # rows of the next batch came ...
    # ... and the reader is gone before the last line
    again = stream.take()
    assert again.redelivered and again.token == first.token and [r["id"] for r in again.rollouts] == ok[:1000]
    c = StreamConsumer.objects.get(job=job, name="gone")
    assert c.cursor == 0 and c.delivered == 0  # the ack the cut take carried did not count
    seen = [r["id"] for r in again.rollouts]
    stream.ack(again)
    for batch in stream.batches(until_finished=False, idle_timeout_s=0.5):
        seen += [r["id"] for r in batch.rollouts]
    assert seen == ok
