"""A batch's passes in flight on the device: enqueued by the execution thread, which goes straight
on to the next batch, and landed once, on whichever request's thread asks first, each request
then taking its own questions' readouts; and the counts of what the passes held.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from runtime.batch import split
from runtime.packing import PackedPlan
from runtime.passes import Plan
from runtime.readouts import HostReadouts, Landing, MlpsBehind
from runtime.run_passes import Stopwatch
from runtime.types import Prepared, QuestionReadout


class Flight:
    """The passes of one batch (`Executor.enqueue`): `request` its requests merged into one (or
    the one request), `batch` the requests as the scheduler gave them."""

    def __init__(
        self,
        request: Prepared,
        batch: list[Prepared],
        landing: Landing,
        behind: MlpsBehind | None,
        clock: Stopwatch,
        counts: PassCounts,
        started: torch.cuda.Event | None = None,
    ) -> None:
        self.request, self.batch = request, batch
        self.landing, self.behind, self.clock, self.counts = landing, behind, clock, counts
        self.started = started  # recorded before the batch's first work (device busy time)
        self._lock = threading.Lock()
        self._made: list[list[QuestionReadout]] | None = None

    def readouts(self, index: int) -> list[QuestionReadout]:
        """The readouts of `batch[index]`, waiting for the device the first time."""
        with self._lock:
            if self._made is None:
                self._made = self._land()
            return self._made[index]

    def _land(self) -> list[list[QuestionReadout]]:
        self.landing.wait()
        if self.started is not None and self.landing.event is not None:
            # flights run in stream order, so their spans never overlap: their sum is the time
            # the device had a batch's work
            self.counts.landed(self.started.elapsed_time(self.landing.event) / 1e3)
        every = list(range(len(self.request.layouts)))
        with torch.inference_mode():
            taken = HostReadouts()
            self.landing.into(taken)
            self.clock.lap("readouts")
        collected = taken.collect(self.request, every)
        if self.behind is not None:
            self.behind.hand_out(every, collected, self.landing.mlps)
        self.landing = None  # type: ignore[assignment]  # the device tensors go with it
        if len(self.batch) == 1:
            return [collected]
        return split(collected, self.batch)


@dataclass
class PassCounts:
    """What the executed passes held, for /metrics: batches and their requests, packed passes
    and their token slots, the slots holding tokens, and their rows."""

    batches: int = 0
    requests: int = 0
    passes: int = 0
    slots: int = 0
    tokens: int = 0
    rows: int = 0
    device_seconds: float = 0.0  # batches' spans on the device, start to readouts landed
    since: float = field(default_factory=time.perf_counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, work: Plan | PackedPlan, requests: int) -> None:
        with self._lock:
            self.batches += 1
            self.requests += requests
            if isinstance(work, PackedPlan):
                self.passes += len(work.passes)
                self.slots += work.slots
                self.tokens += work.tokens
                self.rows += sum(len(p.read_rows) for p in work.passes)

    def landed(self, seconds: float) -> None:
        with self._lock:
            self.device_seconds += seconds
