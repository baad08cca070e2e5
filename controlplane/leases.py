"""One lease protocol for work that a worker takes from a database row: collection chunks (jobs.JobChunk),
verification runs (jobs.VerificationRun) and ops actions (endpoints.AdminAction).

A `Lease` names the row's model, its waiting and running states and, for work that runs long, the columns
of its holder (`lease_owner`), its heartbeat (`heartbeat_at`) and its attempt count (`attempts`):

* claim: one conditional UPDATE takes the row, waiting -> running. PostgreSQL re-checks the WHERE under the
  row lock, so exactly one taker wins. A row with a heartbeat may also be taken from a holder whose
  heartbeat is older than JOBS_LEASE_TIMEOUT_S (a dead worker). A row without one (an ops action) is
  claimed once: a redelivered message finds it running and does not run it again.
* held / beat: every write of the holder is guarded by its name (`held(pk, owner).update(...)`: zero rows
  means another worker took the row over); `beat` refreshes the heartbeat while the row is running.
* release: the holder gives the row back, running -> waiting, with whatever else the caller resets.
* expired / reclaim: the watchdog's side. `expired()` lists running rows whose heartbeat went stale;
  `reclaim` puts one back to waiting only if its holder and heartbeat are still those it read, so a holder
  that heartbeats meanwhile keeps its row. Sending the work again is the caller's (each kind has its task).

Core: no app imports; the apps build their Lease beside their models.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings
from django.db import connection
from django.db.models import F, Q
from django.utils import timezone

logger = logging.getLogger(__name__)


def stale_before(now=None):
    """Heartbeats older than this are a dead holder's (JOBS_LEASE_TIMEOUT_S)."""
    return (now or timezone.now()) - timedelta(seconds=settings.JOBS_LEASE_TIMEOUT_S)


@dataclass(frozen=True)
class Lease:
    model: type
    waiting: str
    running: str
    owner: str | None = "lease_owner"  # None (with heartbeat None): claimed once, no holder, no heartbeat
    heartbeat: str | None = "heartbeat_at"
    attempts: str | None = "attempts"

    @property
    def objects(self):
        return self.model._default_manager

    def claim(self, pk, owner: str = "", *, now=None, **values) -> bool:
        """Take the row: waiting, or running with a stale (or no) heartbeat. Sets the state, the holder, the
        heartbeat (now), one more attempt, and `values`. True when this caller won it."""
        now = now or timezone.now()
        taking = Q(state=self.waiting)
        if self.heartbeat is not None:
            taking |= (Q(state=self.running, **{f"{self.heartbeat}__lt": stale_before(now)})
                       | Q(state=self.running, **{f"{self.heartbeat}__isnull": True}))
        update = {"state": self.running}
        if self.owner is not None:
            update[self.owner] = owner
        if self.heartbeat is not None:
            update[self.heartbeat] = now
        if self.attempts is not None:
            update[self.attempts] = F(self.attempts) + 1
        return bool(self.objects.filter(pk=pk).filter(taking).update(**update, **values))

    def held(self, pk, owner: str):
        """The row as long as `owner` holds it: guard every write of the holder with it."""
        return self.objects.filter(pk=pk, **{self.owner: owner})

    def beat(self, pk, owner: str, now=None) -> bool:
        """Refresh the heartbeat. False: the lease is lost (another worker took the row, or it is no longer
        running)."""
        return bool(self.held(pk, owner).filter(state=self.running).update(**{self.heartbeat: now or timezone.now()}))

    def release(self, pk, owner: str, **values) -> bool:
        """Give the row back (running -> waiting) with `values` (e.g. the holder and heartbeat cleared)."""
        return bool(self.held(pk, owner).filter(state=self.running).update(state=self.waiting, **values))

    def expired(self, now=None):
        """Running rows whose holder stopped heartbeating (or never did)."""
        return self.objects.filter(state=self.running).filter(
            Q(**{f"{self.heartbeat}__lt": stale_before(now)}) | Q(**{f"{self.heartbeat}__isnull": True}))

    def reclaim(self, pk, owner: str, heartbeat_at, **values) -> bool:
        """Put an expired row back to waiting, only if its holder and heartbeat are still those read (a holder
        that heartbeat meanwhile keeps it)."""
        return bool(self.objects.filter(pk=pk, state=self.running, **{self.owner: owner, self.heartbeat: heartbeat_at})
                    .update(state=self.waiting, **values))


class HeartbeatThread(threading.Thread):
    """Keeps a lease fresh while its holder is busy in one long call (a batch can take longer than the lease
    timeout on a busy machine; without this the watchdog would hand a live row out again). Beats every
    quarter of the lease timeout (0.5 s to 5 s) until `stop` is set."""

    def __init__(self, lease: Lease, pk, owner: str, name: str):
        super().__init__(name=name, daemon=True)
        self.lease, self.pk, self.owner = lease, pk, owner
        self.stop = threading.Event()
        self.interval = max(0.5, min(5.0, settings.JOBS_LEASE_TIMEOUT_S / 4))

    def run(self):
        try:
            while not self.stop.wait(self.interval):
                try:
                    self.lease.beat(self.pk, self.owner)
                except Exception:  # noqa: BLE001  (a missed beat is retried; the lease timeout is the judge)
                    logger.exception("heartbeat of %s %s failed", self.lease.model.__name__, self.pk)
        finally:
            connection.close()
