"""The contract every engine backend keeps: what the executor may use of it, and the record of
what it offers beyond running its graphs (`Capabilities`), from which the executor's choices
follow: no caller probes a backend for an attribute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from runtime.constants import MAX_PREFIXES


@dataclass(frozen=True)
class Capabilities:
    """What a backend offers; the portable engines (ONNX Runtime, TensorRT) offer the defaults."""

    # a row's outputs are the same bytes whatever the pass's row count: passes are sized to the
    # request (runtime.passes.fitted_rows)
    rows_fit: bool = False
    # `lm_joint` runs an option pass with its questions' rows as one pass, a row's bytes kept
    # (runtime.passes.plan(joint=True)); only with `rows_fit`
    joint: bool = False
    # `lm_packed` runs token-packed passes (runtime.packing): rows of any length end to end in
    # a few fixed token counts, a row's bytes whatever else the pass holds
    packed: bool = False
    # `image` runs the vision tower from the decoded uint8 image (resize and patches inside)
    image_graph: bool = False
    # `run` given no readout outputs (`hidden`, `logprobs`) runs no readout
    optional_readouts: bool = False
    # the log-probability lists padded to a power of two (False: the backend reads them in
    # fixed pieces outside its graphs)
    padded_targets: bool = True
    # joint passes may run at once in this many lanes (`lane_stream`, `run(..., lane=)`)
    lanes: int = 1
    # every pass after the image prefix reads the longest prefix's keys, a shorter prefix's
    # padded with masked zero keys (`runtime.run_passes.padded_prefix`): a backend that captures
    # a graph per shape then has one for each pass shape, not one for each image size besides
    fixed_prefix_keys: bool = False
    # the device runs enqueued work while the host goes on (CUDA): the heads' large products
    # there, behind the passes, and the heads of finished questions beside later passes
    asynchronous: bool = False
    # image prefixes a language-model pass may read, each row its own (`prefix_rows`; 1: one
    # prefix shared by every row). Declared, not probed: every backend's attention keeps a
    # row's bytes whatever the other prefixes of its pass (docs/design.md "A pass's inputs"),
    # and the TensorRT plans' profiles take up to MAX_PREFIXES, which the portable engines
    # therefore declare
    prefixes: int = MAX_PREFIXES
    # requests of several clients may share passes (runtime.batch): shown to keep every answer's
    # bytes on this backend and device. On the CPU they are (tests/test_batching.py); the torch
    # backend's batches on a GPU changed answers (docs/performance.md), and the portable engines'
    # on a GPU were never measured, so requests run alone there
    merges: bool = False


@runtime_checkable
class Backend(Protocol):
    """What the executor may use of an engine, and nothing else."""

    name: str  # shown in logs, metrics and benchmark tables
    device: torch.device  # where feeds and outputs live
    max_pass_tokens: int | None  # the longest pass it takes in one run (None: any); longer
    # passes are split by the executor
    capabilities: Capabilities

    def has_graph(self, graph: str) -> bool:
        """Whether this graph exists (`lm_rows` is optional: `lm_state` answers option passes)."""
        ...

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        """The graph's inputs by name with their dtypes."""
        ...

    def output_names(self, graph: str) -> list[str]:
        """The graph's outputs in order."""
        ...

    def run(
        self,
        graph: str,
        feeds: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        lane: int = 0,
    ) -> None:
        """Run `graph`, writing into the preallocated `outputs` tensors; a joint pass in
        `lane` < `capabilities.lanes` on that lane's graphs (the caller has made
        `lane_stream(lane)` current)."""
        ...

    def lane_stream(self, lane: int) -> torch.cuda.Stream | None:
        """The stream a lane's passes run on; None for lane 0 (the caller's) or without lanes."""
        ...

    def state_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        """The static buffer the next passes read input `name` of this shape from, for a pass
        to write its states straight into; None where the backend lends none."""
        ...

    def prepare(self, signatures: list[tuple]) -> int:
        """Build ahead of time what these pass signatures need (sessions, compiled code, CUDA
        graphs; `runtime.backends.graphs.signature`); how many were new."""
        ...

    def settle(self) -> int:
        """Wait for work building in the background; how many builds there were."""
        ...

    def built(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> bool:
        """Whether a pass of these feeds' shapes runs on something already built (its CUDA
        graph captured); True where nothing is built per shape."""
        ...

    def build_later(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> None:
        """Note a pass shape to build when the worker is idle (`build_pending`)."""
        ...

    def build_pending(self) -> bool:
        """Build one noted pass shape; whether any is left."""
        ...

    def stats(self) -> dict:
        """Counters for metrics and benchmarks (slots, captures, replays...), among them
        `builds`, the pass shapes built so far, and `build_seconds`, the seconds their builds
        took (`runtime.backends.graphs.builds_of`)."""
        ...


class Portable:
    """The answers of a backend with one lane and no lent buffers (ONNX Runtime, TensorRT)."""

    capabilities = Capabilities()

    def lane_stream(self, lane: int) -> torch.cuda.Stream | None:
        return None

    def state_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype
    ) -> torch.Tensor | None:
        return None

    def built(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> bool:
        return True  # fixed-shape sessions are built in the background (`settle`)

    def build_later(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> None:
        return None

    def build_pending(self) -> bool:
        return False

    def check_lane(self, graph: str, lane: int) -> None:
        """Refuses a lane this backend does not have."""
        if lane:
            raise ValueError(f"{graph} has no lane {lane} (lanes: 1)")
