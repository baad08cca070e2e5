"""Servers are shared: bob cannot pause alice's server, nor set its weights, through his own endpoint record
of the same URL (spelt another way). An operation that changes a server needs the right to every record that
points at it, or staff; reading one (health) stays the record owner's business. Against a real simulator,
with the actions run as a worker would run them."""
from __future__ import annotations

import pytest
from django.test import Client
from rest_framework.test import APIClient

from controlplane.endpoints.models import AdminAction
from tests.factories import make_endpoint, make_user

pytestmark = pytest.mark.django_db(transaction=True)


def _api(user):
    c = APIClient()
    c.force_authenticate(user)
    return c


@pytest.fixture
def shared(simulator, eager_tasks):
    alice, bob = make_user("alice"), make_user("bob")
    ep_alice = make_endpoint(alice, simulator.url, model=simulator.model, name="alice-policy")
    # the same server, spelt another way: name instead of address, /v1 suffix, trailing slash
    ep_bob = make_endpoint(bob, f"http://localhost:{simulator.port}/v1/", model=simulator.model, name="bob-policy")
    return simulator, alice, bob, ep_alice, ep_bob


def test_bob_cannot_pause_or_reweight_alices_server_through_his_own_record(shared):
    sim, alice, bob, ep_alice, ep_bob = shared
    bob_api = _api(bob)
    r = bob_api.post(f"/api/endpoints/{ep_bob.pk}/ops/pause/", {"mode": "keep"}, format="json")
    assert r.status_code == 403, r.content
    assert "shared" in r.json()["detail"] and "other users" in r.json()["detail"]
    r = bob_api.post(f"/api/endpoints/{ep_bob.pk}/weights/", {"path": "/ckpt/evil", "version": 666}, format="json")
    assert r.status_code == 403, r.content
    for kind in ("resume", "sleep", "wake_up", "reset_prefix_cache"):
        assert bob_api.post(f"/api/endpoints/{ep_bob.pk}/ops/{kind}/", {}, format="json").status_code == 403, kind
    # the dashboard's buttons too: the endpoint page again, 403, with the reason
    web = Client()
    web.force_login(bob)
    r = web.post(f"/endpoints/{ep_bob.pk}/ops/pause/", {"mode": "keep"})
    assert r.status_code == 403 and "shared" in r.content.decode()
    # nothing was queued, and the server was never touched
    assert not AdminAction.objects.exists()
    assert sim.get_json("/is_paused")["is_paused"] is False
    assert str(sim.get_json("/weight_version").get("weight_version")) != "666"

    # reading stays per record: bob may check the health of his own record
    r = bob_api.post(f"/api/endpoints/{ep_bob.pk}/ops/health/", {}, format="json")
    assert r.status_code == 202, r.content
    # and alice, too, cannot change a server bob's record points at (she has no right to his record)
    assert _api(alice).post(f"/api/endpoints/{ep_alice.pk}/ops/pause/", {}, format="json").status_code == 403


def test_staff_and_sole_owners_may_change_the_server(shared):
    sim, alice, bob, ep_alice, ep_bob = shared
    staff = make_user("root", is_staff=True)
    r = _api(staff).post(f"/api/endpoints/{ep_bob.pk}/ops/pause/", {"mode": "keep"}, format="json")
    assert r.status_code == 202 and r.json()["state"] == "succeeded", r.content
    assert sim.get_json("/is_paused")["is_paused"] is True
    ep_bob.delete()  # alice is now the only one pointing at it
    r = _api(alice).post(f"/api/endpoints/{ep_alice.pk}/ops/resume/", {}, format="json")
    assert r.status_code == 202 and r.json()["state"] == "succeeded", r.content
    assert sim.get_json("/is_paused")["is_paused"] is False


def test_a_record_registered_after_the_action_was_queued_stops_it(shared):
    """The right is checked again when the worker runs the action."""
    from controlplane.endpoints import ops

    sim, alice, bob, ep_alice, ep_bob = shared
    ep_bob.delete()
    action = AdminAction.objects.create(endpoint=ep_alice, trace_id="t" * 32, kind="pause", params={"mode": "keep"},
                                        requested_by=alice)
    make_endpoint(bob, f"http://127.0.0.1:{sim.port}", model=sim.model, name="bob-again")
    assert ops.execute(action.pk) == AdminAction.State.FAILED
    action.refresh_from_db()
    assert "shared" in action.error
    assert sim.get_json("/is_paused")["is_paused"] is False
