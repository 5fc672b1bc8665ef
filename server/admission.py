"""Admission and scheduling of decision requests: 48 admitted, 2 preparing, one batch executing,
and the heads and finishing of executed requests on threads of their own.

Follows the later native worker's main.rs (docs/contract.md §1.6): the admission slot belongs to the
scheduled work, so a request whose client went away counts until its work ends, and a request
still waiting when its client goes away is dropped without running. Unlike it, the execution
permit covers the model's passes only: a request's heads, finishing and response JSON run after
it is handed on (`respond`), beside the next request's passes (issue 13).

Prepared requests queue in arrival order; the execution thread takes the oldest together with
every waiting request of the same batch key (the engine's: requests whose passes it can run as
one), up to one largest request's worth, so that more clients fill the passes instead of
lengthening the queue (issue 37). A batch that fails is run again a request at a time, so that
a request that fails fails alone.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

# requests inside the worker (preparing, waiting or executing); the reference admits 16, run one
# at a time (docs/contract.md §1.6). Batched, the device runs about four a pass, and a refused
# client comes back after Retry-After's second: the admitted must hold more than a second of the
# device's work, or it idles between refusals (16 held half a second on an H100, and 64 clients
# were served 15 % less than 16). Their decoded images wait with them: 0.3 GB at 1920x1080, 2.4
# at the contract's largest
ADMITTED = 48
PREPARING = 2  # docs/contract.md §1.6
# threads that wait for an executed batch's readouts, then run heads, finishing and the response
# JSON (issue 13): a batch's requests each take one while the next batch's passes run
RESPONDING = 4
# a batch holds at most one largest request's worth (the sizes the engine gives sum to at most
# this): its passes and memory stay within what a single request may ask
BATCH_MOST = 1.0

T = TypeVar("T")
log = logging.getLogger("omnijev.admission")


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


@dataclass(eq=False)
class Waiting:
    """A prepared request in the execution queue."""

    ticket: Ticket
    run: Callable[[list[Any]], list[Any]]  # a batch's work: one result per argument, in order
    arg: Any
    key: Hashable | None  # requests of one key may run as one batch; None: always alone
    size: float  # its share of a batch (BATCH_MOST)
    future: asyncio.Future[Any]
    since: float = field(default_factory=time.perf_counter)


class Scheduler:
    """Counts admitted requests, runs preparation two at a time and execution a batch at a time.

    Every method runs on the event loop; the work itself runs in the scheduler's own threads.
    `batch_wait_s`: how long the oldest waiting request waits for others of its key when it
    reaches the execution thread with none (0: it runs at once, so one client is never slowed).
    `room`: run on the execution thread before each batch is formed, it returns once the device
    can take another batch (the engine's `room`): requests that arrive meanwhile join that batch.
    """

    def __init__(
        self,
        admitted: int = ADMITTED,
        preparing: int = PREPARING,
        responding: int = RESPONDING,
        batch_wait_s: float = 0.0,
        room: Callable[[], None] | None = None,
    ) -> None:
        self.limit = admitted
        self.admitted = 0
        self.preparing = 0
        self.batch_wait_s = batch_wait_s
        self.room = room
        self.batches: Counter[int] = Counter()  # executed batches by their number of requests
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prepare_slots = asyncio.Semaphore(preparing)
        self._queue: deque[Waiting] = deque()  # prepared, in arrival order
        self._executing: asyncio.Task[None] | None = None  # the task taking batches off the queue
        self._prepare_pool = ThreadPoolExecutor(preparing, thread_name_prefix="omnijev-prepare")
        self._execute_pool = ThreadPoolExecutor(1, thread_name_prefix="omnijev-execute")
        self._respond_pool = ThreadPoolExecutor(responding, thread_name_prefix="omnijev-respond")

    @property
    def full(self) -> bool:
        """Whether `admit` would refuse a request now."""
        return self.admitted >= self.limit

    def admit(self, work: Callable[[Ticket], Awaitable[T]]) -> Ticket | None:
        """Start `work` in its own task if fewer than `limit` requests are admitted, else None.

        The slot is released when that task ends, whether or not anyone still awaits it.
        """
        if self.full:
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

    @property
    def waiting(self) -> int:
        """Prepared requests waiting for the execution thread."""
        return len(self._queue)

    async def execute(self, ticket: Ticket, fn: Callable[[Any], T], arg: Any) -> T:
        """Run `fn(arg)` on the execution thread when the request reaches the queue's head."""
        return await self.execute_batched(ticket, Alone(fn), arg, None)

    async def execute_batched(
        self,
        ticket: Ticket,
        run: Callable[[list[Any]], list[T]],
        arg: Any,
        key: Hashable | None,
        size: float = BATCH_MOST,
    ) -> T:
        """`arg`'s result of `run([arg, ...])` on the execution thread, with the requests of the
        same `key` (and `run`) waiting when it reaches the queue's head, while their `size`s
        sum to at most BATCH_MOST; raises Dropped if the client goes away before it runs."""
        entry = Waiting(ticket, run, arg, key, size, asyncio.get_running_loop().create_future())
        self._queue.append(entry)
        if self._executing is None or self._executing.done():
            self._executing = asyncio.ensure_future(self._execute_queue())
        watching = asyncio.ensure_future(ticket.gone.wait())
        try:
            await asyncio.wait((entry.future, watching), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watching.cancel()
        if not entry.future.done() and entry in self._queue:
            self._queue.remove(entry)  # nothing has run yet
            waited(ticket, entry.since)
            raise Dropped()
        try:
            return await asyncio.shield(entry.future)
        finally:
            del entry  # its future holds a failed request's exception (see _run)

    async def _execute_queue(self) -> None:
        """Take batches off the queue and run them, one at a time, until it is empty."""
        loop = asyncio.get_running_loop()
        while self._queue:
            if self.room is not None:
                await loop.run_in_executor(self._execute_pool, self.room)
            batch = await self._next_batch()
            if batch:
                await self._run_batch(batch)

    async def _next_batch(self) -> list[Waiting]:
        """The oldest request and those that may join it (`execute_batched`); requests whose
        client went away are dropped here, before anything of theirs runs."""
        head = self._queue.popleft()
        if self.batch_wait_s and head.key is not None and not self._joining(head, head.size):
            await asyncio.sleep(self.batch_wait_s)
        batch, total = [head], head.size
        for entry in self._joining(head, total):
            if total + entry.size <= BATCH_MOST:
                self._queue.remove(entry)
                batch.append(entry)
                total += entry.size
        live = []
        for entry in batch:
            if entry.ticket.gone.is_set():
                waited(entry.ticket, entry.since)
                entry.future.set_exception(Dropped())
            else:
                live.append(entry)
        return live

    def _joining(self, head: Waiting, total: float) -> list[Waiting]:
        """Waiting requests that may run in `head`'s batch, oldest first."""
        if head.key is None:
            return []
        return [
            entry
            for entry in self._queue
            if entry.key == head.key and entry.run == head.run and total + entry.size <= BATCH_MOST
        ]

    async def _run_batch(self, batch: list[Waiting]) -> None:
        for entry in batch:
            waited(entry.ticket, entry.since)
        start = time.perf_counter()
        self.batches[len(batch)] += 1
        args = [entry.arg for entry in batch]
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._execute_pool, each_alone, batch[0].run, args)
        except Exception as exc:  # each_alone returns every failure; this is the pool's own
            results = [(False, exc)] * len(batch)
        for entry, (ok, value) in zip(batch, results, strict=True):
            entry.ticket.execute_s = time.perf_counter() - start
            if entry.future.done():
                continue
            if ok:
                entry.future.set_result(value)
            else:
                entry.future.set_exception(value)

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
        if self._executing is not None:
            await self._executing
        self._prepare_pool.shutdown(wait=True)
        self._execute_pool.shutdown(wait=True)
        self._respond_pool.shutdown(wait=True)


def waited(ticket: Ticket, since: float) -> None:
    """Add the seconds since `since` to the ticket's wait (preparation's wait is in it too)."""
    ticket.queue_wait_s = (ticket.queue_wait_s or 0.0) + time.perf_counter() - since


class Alone:
    """A request's work `fn(arg)` as a batch's (`Scheduler.execute_batched`), never batched."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, args: list[Any]) -> list[Any]:
        return [self.fn(arg) for arg in args]


def each_alone(run: Callable[[list[Any]], list[Any]], args: list[Any]) -> list[tuple[bool, Any]]:
    """(True, result) or (False, exception) per argument of `run(args)`; a batch of several
    that raises runs again an argument at a time, so that only the request that fails fails."""
    try:
        return [(True, result) for result in run(args)]
    except Exception as exc:
        if len(args) == 1:
            return [(False, exc)]
        log.exception("a batch of %d requests failed; each runs again alone", len(args))
    made: list[tuple[bool, Any]] = []
    for arg in args:
        try:
            made.append((True, run([arg])[0]))
        except Exception as exc:
            made.append((False, exc))
    return made
