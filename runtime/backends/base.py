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

    # `lm_packed` runs token-packed passes (runtime.packing): rows of any length end to end in
    # a few fixed token counts, a row's bytes whatever else the pass holds
    packed: bool = False
    # `run` given no readout outputs (`hidden`, `logprobs`) runs no readout
    optional_readouts: bool = False
    # the log-probability lists padded to a power of two (False: the backend reads them in
    # fixed pieces outside its graphs)
    padded_targets: bool = True
    # every pass after the image prefix reads the longest prefix's keys, a shorter prefix's
    # padded with masked zero keys (`runtime.run_passes.padded_prefix`): a backend that captures
    # a graph per shape then has one for each pass shape, not one for each image size besides;
    # its packed passes take a stack of fewer image prefixes than `prefixes` in the first rows
    # of the graph that reads `prefixes` of them
    fixed_prefix_keys: bool = False
    # the device runs enqueued work while the host goes on (CUDA): the heads' large products
    # there, behind the passes
    asynchronous: bool = False
    # image prefixes a language-model pass may read, each row its own (`prefix_rows`; 1: one
    # prefix shared by every row). Declared, not probed: every backend's attention keeps a
    # row's bytes whatever the other prefixes of its pass (docs/design.md "A pass's inputs"),
    # and the TensorRT plans' profiles take up to MAX_PREFIXES, which the portable engines
    # therefore declare
    prefixes: int = MAX_PREFIXES
    # requests of several clients may share passes (runtime.batch): shown to keep every answer's
    # bytes on this backend and device. The torch backend's packed passes do, on the CPU and
    # the GPU (a row's arithmetic never follows its pass); the portable engines' rectangles on a
    # GPU were never measured, so requests run alone there
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
    ) -> None:
        """Run `graph`, writing into the preallocated `outputs` tensors."""
        ...

    def prepare(self, signatures: list[tuple]) -> int:
        """Build ahead of time what these pass signatures need (sessions, compiled code, CUDA
        graphs; `runtime.backends.graphs.signature`); how many were new."""
        ...

    def settle(self) -> int:
        """Wait for work building in the background; how many builds there were."""
        ...

    def stats(self) -> dict:
        """Counters for metrics and benchmarks (slots, captures, replays...), among them
        `builds`, the pass shapes built so far, and `build_seconds`, the seconds their builds
        took (`runtime.backends.graphs.builds_of`)."""
        ...


class Portable:
    """The capabilities of a backend whose kernels follow a pass's shape (ONNX Runtime,
    TensorRT): rectangle passes of fixed row counts."""

    capabilities = Capabilities()
