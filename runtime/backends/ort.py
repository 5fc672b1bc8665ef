"""ONNX Runtime backend: one session per graph, torch tensors bound in place through IOBinding.

On CUDA, every tensor stays on the device between passes (states never travel to the host);
with `cuda_graphs` each distinct set of shapes gets its own `gpu_graph_id` (engines.md §7.3).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

ONNX_DIR = "onnx_ort"  # the ONNX Runtime variant inside an engine directory
ORT_TO_TORCH = {
    "tensor(float)": torch.float32,
    "tensor(bfloat16)": torch.bfloat16,
    "tensor(float16)": torch.float16,
    "tensor(int64)": torch.int64,
    "tensor(int32)": torch.int32,
    "tensor(bool)": torch.bool,
}
TORCH_TO_NUMPY = {
    torch.float32: np.float32,
    torch.float16: np.float16,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def element_type(dtype: torch.dtype) -> type:
    if dtype == torch.bfloat16:
        import ml_dtypes  # onnx's dependency; numpy has no bfloat16 of its own

        return ml_dtypes.bfloat16
    return TORCH_TO_NUMPY[dtype]


def session_options(threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return options


def onnx_dir(engines_dir: Path) -> Path:
    path = Path(engines_dir) / ONNX_DIR
    return path if path.is_dir() else Path(engines_dir)


class OrtBackend:
    """Runs the ONNX Runtime variant of an engine directory."""

    def __init__(self, engines_dir: Path, device: str | None = None, threads: int | None = None):
        providers = ort.get_available_providers()
        cuda = "CUDAExecutionProvider" in providers and torch.cuda.is_available()
        wanted = device or ("cuda" if cuda else "cpu")
        self.device = torch.device(wanted)
        self.name = f"onnxruntime-{self.device.type}"
        threads = threads or int(os.environ.get("OMNIJEV_ORT_THREADS", "0")) or None
        if self.device.type == "cuda":
            index = self.device.index or 0
            providers = [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        else:
            providers = ["CPUExecutionProvider"]
        folder = onnx_dir(engines_dir)
        self.sessions = {
            graph: ort.InferenceSession(
                str(folder / f"{graph}.onnx"), session_options(threads), providers=providers
            )
            for graph in ("vision", "lm_state", "lm_rows")
        }
        self._dtypes = {
            graph: {i.name: ORT_TO_TORCH[i.type] for i in s.get_inputs()}
            for graph, s in self.sessions.items()
        }

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        return self._dtypes[graph]

    def output_names(self, graph: str) -> list[str]:
        return [o.name for o in self.sessions[graph].get_outputs()]

    def _bind(self, binding: ort.IOBinding, name: str, tensor: torch.Tensor, output: bool) -> None:
        device = "cuda" if tensor.is_cuda else "cpu"
        index = tensor.device.index or 0
        tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
        bind = binding.bind_output if output else binding.bind_input
        bind(name, device, index, element_type(tensor.dtype), list(tensor.shape), tensor.data_ptr())

    def run(
        self, graph: str, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
    ) -> None:
        session = self.sessions[graph]
        binding = session.io_binding()
        expected = self._dtypes[graph]
        for name, tensor in feeds.items():
            if name not in expected:
                continue
            if tensor.dtype != expected[name] or tensor.device != self.device:
                raise ValueError(f"{graph} input {name}: {tensor.dtype} on {tensor.device}")
            if not tensor.is_contiguous():
                raise ValueError(f"{graph} input {name} is not contiguous")
            self._bind(binding, name, tensor, output=False)
        for name, tensor in outputs.items():
            self._bind(binding, name, tensor, output=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        session.run_with_iobinding(binding)
