"""Engine backends behind one contract: run a named graph on named device tensors.

`onnxruntime` runs the ONNX files (CPU; CUDA with IOBinding and CUDA graphs), `tensorrt` runs plans
with `tensorrt` or `tensorrt_rtx`, `torch` runs the model's own modules (compiled, with CUDA graphs
on the GPU). The executor sees only `Backend` and its `Capabilities` (runtime.backends.base);
static buffers and graph capture are `runtime.backends.graphs`.
"""

from __future__ import annotations

from pathlib import Path

from runtime.backends.base import Backend, Capabilities
from runtime.config import RuntimeConfig

__all__ = ["BACKENDS", "Backend", "Capabilities", "choose_backend"]
BACKENDS = ("auto", "onnxruntime", "ort", "tensorrt", "torch")


def choose_backend(
    engines_dir: Path, config: RuntimeConfig | None = None, checkpoint: Path | None = None
) -> Backend:
    """`auto`: TensorRT when a plan for this library exists and can run; else the torch engine
    on CUDA when fla-core and Triton import; else ONNX Runtime."""
    config = config or RuntimeConfig.from_env()
    backend = config.backend
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend in ("auto", "tensorrt"):
        try:
            from runtime.backends import trt
        except ImportError as error:
            reason = f"backend module missing: {error}"
        else:
            reason = trt.unavailable_reason(engines_dir)
            if reason is None:
                return trt.TensorRTBackend(engines_dir, config=config)
        if backend == "tensorrt":
            raise RuntimeError(f"tensorrt backend unavailable: {reason}")
    if backend in ("auto", "torch"):
        torch_backend = torch_engine(engines_dir, config, checkpoint, required=backend == "torch")
        if torch_backend is not None:
            return torch_backend
    from runtime.backends.ort import OrtBackend

    return OrtBackend(engines_dir, config=config)


def torch_engine(
    engines_dir: Path, config: RuntimeConfig, checkpoint: Path | None, required: bool
) -> Backend | None:
    """The compiled PyTorch engine where it is asked for or, for `auto`, where it is the fast
    choice (CUDA with fla-core and Triton); None when `auto` should go on to ONNX Runtime."""
    try:
        from runtime.backends import compiled
    except ImportError as error:
        if required:
            raise RuntimeError(f"torch backend unavailable: {error}") from None
        return None
    if not required and compiled.unavailable_reason(config) is not None:
        return None
    if checkpoint is None:
        raise RuntimeError("torch backend needs the checkpoint directory")
    return compiled.TorchBackend(Path(checkpoint), Path(engines_dir), config)
