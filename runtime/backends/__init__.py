"""Engine backends behind one interface: run a named graph on a dict of torch tensors.

`onnxruntime` runs the ONNX files (CPU; CUDA with IOBinding and CUDA graphs); `tensorrt` runs
plans with `tensorrt` or `tensorrt_rtx`. The executor never sees which one it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch


class Backend(Protocol):
    name: str
    device: torch.device

    def has_graph(self, graph: str) -> bool: ...

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]: ...

    def run(
        self, graph: str, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
    ) -> None:
        """Run `graph`, writing into the preallocated `outputs` tensors."""
        ...


def choose_backend(engines_dir: Path, backend: str = "auto", device: str | None = None) -> Backend:
    """`auto`: TensorRT when a plan for this library exists and can run, else ONNX Runtime."""
    if backend in ("auto", "tensorrt"):
        try:
            from runtime.backends import trt
        except ImportError as error:
            reason = f"backend module missing: {error}"
        else:
            reason = trt.unavailable_reason(engines_dir)
            if reason is None:
                return trt.TensorRTBackend(engines_dir)
        if backend == "tensorrt":
            raise RuntimeError(f"tensorrt backend unavailable: {reason}")
    if backend in ("auto", "onnxruntime", "ort"):
        from runtime.backends.ort import OrtBackend

        return OrtBackend(engines_dir, device=device)
    raise ValueError(f"unknown backend {backend!r}; expected auto, onnxruntime or tensorrt")
