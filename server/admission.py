"""Admission and scheduling of decision requests: 16 admitted, 2 preparing, 1 executing, and
the heads and finishing of executed requests on threads of their own.

Follows the later native worker's main.rs (docs/contract.md §1.6): the admission slot belongs to the
scheduled work, so a request whose client went away counts until its work ends, and a request
still waiting when its client goes away is dropped without running. Unlike it, the execution
permit covers the model's passes only: a request's heads, finishing and response JSON run after
it is handed on (`respond`), beside the next request's passes (issue 13).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

ADMITTED = 16  # docs/contract.md §1.6
PREPARING = 2  # docs/contract.md §1.6
# threads for heads, finishing and the response JSON of executed requests (issue 13): one runs
# beside each execution, a second covers a request answered while the previous one still is
RESPONDING = 2

T = TypeVar("T")


class Dropped(Exception):
    """The client went away while its request waited; the request was not run."""


@dataclass
class Ticket:
    """One admitted request: its disconnect flag, its stage timings and the task doing its work."""

    gone: asyncio.Event = field(default_factory=asyncio.Event)
    queue_wait_s: float | None = None  # stages that never started stay None
    prepare_s: float | None = None
    execute_s: float | None = None
    task: asyncio.Task[Any] = field(init=False)  # set by Scheduler.admit


class Scheduler:
    """Counts admitted requests, runs preparation two at a time and execution one at a time.

    Every method runs on the event loop; the work itself runs in the scheduler's own threads.
    """

    def __init__(
        self, admitted: int = ADMITTED, preparing: int = PREPARING, responding: int = RESPONDING
    ) -> None:
        self.limit = admitted
        self.admitted = 0
        self.preparing = 0
        self.waiting = 0  # prepared, waiting for the execution permit
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prepare_slots = asyncio.Semaphore(preparing)
        self._execute_permit = asyncio.Semaphore(1)  # FIFO: waiters are woken in arrival order
        self._prepare_pool = ThreadPoolExecutor(preparing, thread_name_prefix="omnijev-prepare")
        self._execute_pool = ThreadPoolExecutor(1, thread_name_prefix="omnijev-execute")
        self._respond_pool = ThreadPoolExecutor(responding, thread_name_prefix="omnijev-respond")

    def admit(self, work: Callable[[Ticket], Awaitable[T]]) -> Ticket | None:
        """Start `work` in its own task if fewer than `limit` requests are admitted, else None.

        The slot is released when that task ends, whether or not anyone still awaits it.
        """
        if self.admitted >= self.limit:
            return None
        self.admitted += 1
        ticket = Ticket()
        ticket.task = asyncio.ensure_future(work(ticket))
        self._tasks.add(ticket.task)
        ticket.task.add_done_callback(self._release)
        return ticket

    def _release(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        self.admitted -= 1

    async def prepare(self, ticket: Ticket, fn: Callable[[Any], T], arg: Any) -> T:
        """Run `fn(arg)` on a preparation thread once one of the slots is free."""
        await self._acquire(self._prepare_slots, ticket)
        self.preparing += 1
        start = time.perf_counter()
        try:
            return await self._run(self._prepare_pool, self._prepare_slots, fn, arg)
        finally:
            ticket.prepare_s = time.perf_counter() - start
            self.preparing -= 1

    async def execute(self, ticket: Ticket, fn: Callable[[Any], T], arg: Any) -> T:
        """Run `fn(arg)` on the execution thread when the request reaches the queue's head."""
        self.waiting += 1
        try:
            await self._acquire(self._execute_permit, ticket)
        finally:
            self.waiting -= 1
        start = time.perf_counter()
        try:
            return await self._run(self._execute_pool, self._execute_permit, fn, arg)
        finally:
            ticket.execute_s = time.perf_counter() - start

    async def respond(self, ticket: Ticket, fn: Callable[[Any], T], arg: Any) -> T:
        """Run `fn(arg)` on a responding thread, after `execute`, without the execution permit:
        the request's heads and finishing run while the next request executes. Its seconds count
        toward the ticket's `execute_s`."""
        start = time.perf_counter()
        future = asyncio.get_running_loop().run_in_executor(self._respond_pool, fn, arg)
        try:
            return await asyncio.shield(future)
        finally:
            del future  # see _run
            ticket.execute_s = (ticket.execute_s or 0.0) + time.perf_counter() - start

    async def _acquire(self, slot: asyncio.Semaphore, ticket: Ticket) -> None:
        """Wait for `slot`, or raise Dropped if the client goes away first."""
        start = time.perf_counter()
        acquiring = asyncio.ensure_future(slot.acquire())
        watching = asyncio.ensure_future(ticket.gone.wait())
        acquired = False
        try:
            await asyncio.wait((acquiring, watching), return_when=asyncio.FIRST_COMPLETED)
            acquired = acquiring.done()
        finally:
            watching.cancel()
            ticket.queue_wait_s = (ticket.queue_wait_s or 0.0) + time.perf_counter() - start
            if not acquiring.done():
                acquiring.cancel()  # the semaphore hands back a permit granted meanwhile
            elif not acquired:  # cancelled from outside just after the permit was granted
                slot.release()
        # nothing has run yet, so a request whose client left is dropped even if it got the slot
        if not acquired or ticket.gone.is_set():
            if acquired:
                slot.release()
            raise Dropped()

    async def _run(
        self, pool: ThreadPoolExecutor, slot: asyncio.Semaphore, fn: Callable[[Any], T], arg: Any
    ) -> T:
        """Run `fn(arg)` on `pool`, holding `slot` until the thread returns, even if cancelled."""
        future = asyncio.get_running_loop().run_in_executor(pool, fn, arg)
        try:
            return await asyncio.shield(future)
        finally:
            if future.done():
                slot.release()
            else:
                future.add_done_callback(lambda _: slot.release())
            # the future holds fn's exception, whose traceback holds this frame: without this the
            # cycle keeps the failed request (a refused 12 MiB body, twice) until the next gc
            del future

    async def close(self) -> None:
        """Let every admitted request finish, then stop the threads."""
        if self._tasks:
            await asyncio.wait(set(self._tasks))
        self._prepare_pool.shutdown(wait=True)
        self._execute_pool.shutdown(wait=True)
        self._respond_pool.shutdown(wait=True)
