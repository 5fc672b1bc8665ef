"""Static buffers and CUDA graphs per shape signature, shared by every backend that captures:
bind once, run eagerly once (lazy initialisation stays out of the graph), capture, then replay.

Follows PyTorch's `torch.cuda.graph` rules (static addresses, a side stream, warm-up before
capture) and docs/engines.md §7: a graph replays only with the very buffers it was captured on, so
feeds are copied in and outputs copied out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from runtime.lru import LRU

log = logging.getLogger("omnijev.graphs")

Signature = tuple  # hashable: (graph, *(name, shape, dtype) ...) or whatever a backend keys by


@dataclass
class Slot:
    """One shape signature: its persistent input and output buffers, the backend's own state for
    it (a TensorRT context, a compiled callable) and its CUDA graph once captured."""

    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]
    state: Any = None
    graph: torch.cuda.CUDAGraph | None = None
    launches: int = 0
    capturable: bool = True
    built: bool = False  # bound, run and (where it captures) captured: it only replays now
    meta: dict = field(default_factory=dict)


def checked_feeds(
    graph: str,
    feeds: dict[str, torch.Tensor],
    expected: dict[str, torch.dtype],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The feeds the graph takes (others dropped), contiguous, each of the graph's dtype on the
    backend's device; anything else is refused with the input's name."""
    used = {}
    for name, tensor in feeds.items():
        if name not in expected:
            continue
        if tensor.dtype != expected[name] or tensor.device != device:
            raise ValueError(f"{graph} input {name}: {tensor.dtype} on {tensor.device}")
        used[name] = tensor.contiguous()
    return used


def signature(graph: str, feeds: dict[str, torch.Tensor]) -> Signature:
    """The key a pass's buffers and graph are kept under: every feed's name, shape and dtype."""
    return (graph, *((name, tuple(t.shape), t.dtype) for name, t in feeds.items()))


def like(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Persistent buffers shaped as these tensors (a slot's inputs or outputs)."""
    return {
        name: torch.empty_like(t, memory_format=torch.contiguous_format)
        for name, t in tensors.items()
    }


Bind = Callable[[Signature, dict[str, torch.Tensor], dict[str, torch.Tensor]], Slot]


class GraphSlots:
    """An LRU of slots. `bind(key, feeds, outputs)` makes a slot (buffers shaped like the feeds
    and outputs); `launch(slot)` runs the work on the current stream reading `slot.inputs`,
    writing `slot.outputs` (returning False when it could not be enqueued). With `capture`, the
    launch after `warm_launches` eager ones is captured and every later run replays it; a launch
    that cannot be captured keeps running eagerly.

    A slot's build is its binding and every run until it is built (its capture, or its first
    launch where it does not capture): `builds` counts the slots built, `build_seconds` the
    host's seconds spent building (compilation, capture, a session's first run).

    With `pool` (`torch.cuda.graph_pool_handle()`), every capture allocates from that one pool,
    shared with the other GraphSlots given it: a graph's temporaries are dead once its replay
    ends, so the graphs of a backend need room for the largest, not for all of them. Its price:
    a slot's outputs may lie where a later capture keeps its temporaries, so they hold only until
    the next replay of any graph of the pool (a caller reads them, in stream order, before it
    runs another), and every graph of the pool replays on one stream, one at a time."""

    def __init__(
        self,
        device: torch.device,
        bind: Bind,
        launch: Callable[[Slot], bool | None],
        size: int,
        capture: bool,
        warm_launches: int = 1,
        stream: torch.cuda.Stream | None = None,
        pool: tuple | None = None,
    ):
        self.device = device
        self.pool = pool
        self.bind, self.launch = bind, launch
        self.capture = capture and device.type == "cuda"
        self.warm_launches = warm_launches
        self.stream = stream
        self.slots: LRU[Signature, Slot] = LRU(size)
        self.captured = self.replays = self.eager = self.builds = 0
        self.build_seconds = 0.0

    def run(
        self, key: Signature, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
    ) -> Slot:
        """Runs one pass: feeds copied into the slot, replay or launch, outputs copied out."""
        started = time.perf_counter()
        slot = self.slots.get(key)
        if slot is None:
            slot = self.install(key, self.bind(key, feeds, outputs))
        for name, tensor in feeds.items():
            static = slot.inputs[name]
            if static.data_ptr() != tensor.data_ptr():  # a feed already in place is not copied
                static.copy_(tensor, non_blocking=True)
        if slot.graph is not None:
            slot.graph.replay()
            self.replays += 1
        elif self.capture and slot.capturable and slot.launches >= self.warm_launches:
            self._capture(slot)
        else:
            if self.launch(slot) is False:
                raise RuntimeError(f"{key[0]}: enqueue failed")
            slot.launches += 1
            self.eager += 1
        for name, out in outputs.items():
            out.copy_(slot.outputs[name], non_blocking=True)
        if not slot.built:
            self._building(slot, time.perf_counter() - started)
        return slot

    def _building(self, slot: Slot, seconds: float) -> None:
        """Counts a run of a slot not yet built, and the slot once this run built it."""
        self.build_seconds += seconds
        if slot.graph is not None or not (self.capture and slot.capturable):
            slot.built = True
            self.builds += 1

    def install(self, key: Signature, slot: Slot, seconds: float = 0.0) -> Slot:
        """Keeps a slot a backend made itself (a session built in the background, say);
        `seconds`: what making it took, counted in `build_seconds`."""
        self.build_seconds += seconds
        return self.slots.put(key, slot)

    def get(self, key: Signature) -> Slot | None:
        return self.slots.entries.get(key)

    def _capture(self, slot: Slot) -> None:
        """Captures one launch and replays it (a capture records, it does not run)."""
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread-local: the server's other threads may touch CUDA meanwhile
            with torch.cuda.graph(
                graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"
            ):
                if self.launch(slot) is False:
                    raise RuntimeError("enqueue refused under capture")
        except RuntimeError as error:
            log.warning("capture failed, running eagerly: %s", error)
            torch.cuda.synchronize(self.device)
            slot.capturable = False
            self.launch(slot)
            return
        slot.graph = graph
        self.captured += 1
        graph.replay()
        self.replays += 1

    def drop_graphs(self) -> None:
        """Forgets every captured graph (their buffers stay): each slot runs eagerly again,
        then is captured anew, with whatever its launch does by then."""
        for slot in self.slots.values():
            slot.graph, slot.launches, slot.built = None, 0, False

    def stats(self) -> dict[str, int | float]:
        return {
            "slots": len(self.slots),
            "captured": self.captured,
            "replays": self.replays,
            "eager": self.eager,
            **builds_of([self]),
        }


def builds_of(slots: Iterable[GraphSlots]) -> dict[str, int | float]:
    """The `builds` and `build_seconds` of these slots together (a backend's `stats`)."""
    slots = list(slots)
    return {
        "builds": sum(s.builds for s in slots),
        "build_seconds": sum(s.build_seconds for s in slots),
    }
