"""The feeder: tasks read lazily from the run's (async) iterable into its queue, never more of them resident
than the limit.

A task is resident from the moment it is read until its result is emitted or it is dropped (queued + in
flight + being emitted); `Residency` counts them: only the feeder acquires, the run's workers release, and
the run raises the limit when its parallelism grows. In-memory sequences are read in the event loop; any
other synchronous iterator is advanced in one dedicated thread, in batches of ITER_BATCH, so that an
iterator doing blocking I/O (a database cursor) never blocks the loop and always runs in the same thread.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

ITER_BATCH = 64
END = object()  # put on the queue after the last task: every worker that takes it puts it back and ends


class Residency:
    """Counts tasks resident in the engine (read from the iterator, not yet emitted or dropped).

    Only the feeder acquires; workers release. The limit can be raised at runtime."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.event = asyncio.Event()

    async def acquire_up_to(self, k: int) -> int:
        while self.used >= self.limit:
            self.event.clear()
            await self.event.wait()
        got = min(k, self.limit - self.used)
        self.used += got
        return got

    def release(self, k: int = 1) -> None:
        self.used -= k
        if self.used < self.limit:
            self.event.set()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        if self.used < limit:
            self.event.set()


class RequestSlots:
    """At most `limit` requests in flight (the run's parallelism) among more workers: a worker verifying a
    rollout holds no slot, so the model server is sent the next request meanwhile. The limit can change at
    runtime (a lower one takes effect as slots are released). Waiters are served in order."""

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._waiters: deque[asyncio.Future] = deque()

    async def acquire(self) -> None:
        if self.used < self.limit and not self._waiters:
            self.used += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # granted: `used` was counted for this waiter by _wake
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled before it ran: give it back
                self.release()
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def release(self) -> None:
        self.used -= 1
        self._wake()

    def set_limit(self, limit: int) -> None:
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.used < self.limit:
            fut = self._waiters.popleft()
            if not fut.done():
                self.used += 1
                fut.set_result(None)


async def feed(tasks, put: Callable, resident: Residency, loop: asyncio.AbstractEventLoop,
               new_thread: Callable[[], ThreadPoolExecutor]) -> None:
    """Read every task of `tasks` into `put((item, time it became resident))`, each after a place in
    `resident`. `new_thread()` gives the thread a synchronous iterator is advanced in (asked only for one).
    Returns when the tasks are exhausted; an exception of the iterator propagates."""
    monotonic = time.monotonic
    if hasattr(tasks, "__aiter__"):
        it = aiter(tasks)
        while True:
            await resident.acquire_up_to(1)
            try:
                item = await anext(it)
            except StopAsyncIteration:
                resident.release()
                break
            put((item, monotonic()))
    elif isinstance(tasks, (list, tuple, range)):
        for item in tasks:
            await resident.acquire_up_to(1)
            put((item, monotonic()))
    else:
        it = iter(tasks)
        executor = new_thread()

        def take(n):
            batch = []
            for item in it:
                batch.append(item)
                if len(batch) >= n:
                    break
            return batch

        while True:
            n = await resident.acquire_up_to(ITER_BATCH)
            batch = await loop.run_in_executor(executor, take, n)
            now = monotonic()
            for item in batch:
                put((item, now))
            if len(batch) < n:
                resident.release(n - len(batch))
                break
