"""The TensorRT backend without TensorRT execution: why plans cannot run here, dtype maps, axis
sizes and profile choice; on a GPU, the bind / capture / replay / fallback path with a stand-in
execution context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from build_engines import trt_build
from runtime import manifest as manifests
from runtime.backends import trt as backend
from runtime.backends.graphs import Slot
from runtime.constants import DTYPES, GRAPHS
from runtime.model.gdn import STD_MAX_TOKENS

LM_INPUTS = [
    {"name": "input_ids", "mode": "input", "dtype": "int64", "shape": ["B", "T"]},
    {"name": "positions", "mode": "input", "dtype": "int64", "shape": [3, "B", "T"]},
    {"name": "prefix_k.0", "mode": "input", "dtype": "bfloat16", "shape": [1, 2, "P", 32]},
    {"name": "prefix_mask", "mode": "input", "dtype": "bool", "shape": [1, "P"]},
    {"name": "read_rows", "mode": "input", "dtype": "int64", "shape": ["R"]},
]
LM_IO = LM_INPUTS + [
    {"name": "hidden", "mode": "output", "dtype": "float32", "shape": ["R", 64]},
    {"name": "logprobs", "mode": "output", "dtype": "float32", "shape": ["M"]},
]
PROFILES = [
    {"name": "prefix",
     "axes": {"B": [1, 1, 1], "T": [1, 64, 64], "P": [1, 1, 8192], "R": [1, 1, 64]}},
    {"name": "rows",
     "axes": {"B": [1, 16, 64], "T": [1, 16, 64], "P": [1, 640, 8192], "R": [1, 16, 4096]}},
]  # fmt: skip


def lm_shapes(b: int, t: int, p: int, r: int) -> dict[str, tuple[int, ...]]:
    return {
        "input_ids": (b, t), "positions": (3, b, t), "prefix_k.0": (1, 2, p, 32),
        "prefix_mask": (1, p), "read_rows": (r,),
    }  # fmt: skip


def write_engines(
    root: Path,
    library: str = manifests.RTX,
    version: str = "1.7.1.116",
    readout: str = "std",
    device="cpu-aot",
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "plans").mkdir(exist_ok=True)
    graphs = {}
    for graph in GRAPHS:
        (root / "plans" / f"{graph}.plan").write_bytes(b"plan")
        graphs[graph] = {"plan": f"plans/{graph}.plan", "io": LM_IO, "profiles": PROFILES}
    plans = {
        "library": library, "version": version, "device": device, "readout": readout,
        "plugin": {"library": str(root / "libomnijev_plugins.so")} if readout == "plugin" else None,
        "max_pass_tokens": trt_build.MAX_PASS_TOKENS, "graphs": graphs,
    }  # fmt: skip
    (root / "engines.json").write_text(json.dumps({"onnx": {}, "plans": plans}))
    return root


class FakeLibrary:
    def __init__(self, name: str, version: str = "1.7.1.116"):
        self.__name__, self.__version__ = name, version


class GpuLike:
    """A library of the plans' version that finds every plan valid, and a CUDA device of a
    chosen compute capability."""

    def __init__(self):
        self.capability = (8, 9)

    def reason(self, root: Path) -> str | None:
        return backend.unavailable_reason(
            root, import_library=FakeLibrary, validity=lambda trt, path: None
        )


@pytest.fixture
def gpu_like(monkeypatch):
    gpu = GpuLike()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: gpu.capability)
    return gpu


# -- unavailable_reason --------------------------------------------------------------------------


def test_reason_without_manifest_or_plans(tmp_path):
    assert backend.unavailable_reason(tmp_path) == f"no engines.json in {tmp_path}"
    (tmp_path / "engines.json").write_text(json.dumps({"onnx": {}, "plans": None}))
    assert "built with --skip-plans" in backend.unavailable_reason(tmp_path)


def test_reason_for_a_missing_plan_file(tmp_path):
    root = write_engines(tmp_path / "e")
    (root / "plans" / "lm_rows.plan").unlink()
    assert backend.unavailable_reason(root) == "plan for lm_rows missing: plans/lm_rows.plan"


def test_reason_when_the_library_is_missing_or_another_version(tmp_path):
    root = write_engines(tmp_path / "e", library=manifests.FULL, version="10.13.2.6",
                         device={"name": "NVIDIA H200", "compute_capability": "9.0"})  # fmt: skip
    missing = backend.unavailable_reason(root, import_library=lambda name: None)
    assert missing == "plans need tensorrt, which is not importable"
    newer = backend.unavailable_reason(
        root, import_library=lambda name: FakeLibrary(name, "10.16.0.1")
    )
    assert newer == ("plans were built with tensorrt 10.13.2.6; 10.16.0.1 is installed")


def test_reason_without_cuda(tmp_path, gpu_like, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_like.reason(write_engines(tmp_path / "e")) == "no CUDA device"


def test_rtx_refuses_hopper(tmp_path, gpu_like):
    root = write_engines(tmp_path / "e")
    gpu_like.capability = (9, 0)
    assert gpu_like.reason(root) == (
        "tensorrt_rtx refuses compute capability 9.0 (docs/engines.md §0.3)"
    )
    gpu_like.capability = (8, 9)
    assert gpu_like.reason(root) is None


def test_rtx_capability_table():
    for capability, refused in [((9, 0), True), ((7, 5), True), ((8, 7), True), ((8, 0), False),
                                ((8, 6), False), ((8, 9), False), ((12, 0), False),
                                ((12, 1), False), ((13, 0), False)]:  # fmt: skip
        assert backend.rtx_refuses(capability) is refused, capability


def test_full_tensorrt_plans_need_their_own_device(tmp_path, gpu_like):
    device = {"name": "NVIDIA H200", "compute_capability": "9.0"}
    root = write_engines(tmp_path / "e", library=manifests.FULL, device=device)
    gpu_like.capability = (9, 0)
    assert gpu_like.reason(root) is None
    gpu_like.capability = (8, 9)
    assert gpu_like.reason(root) == "plans were built on NVIDIA H200 (9.0), not 8.9"


def test_plugin_plans_need_the_plugin_library(tmp_path, gpu_like):
    device = {"name": "NVIDIA H200", "compute_capability": "9.0"}
    root = write_engines(tmp_path / "e", library=manifests.FULL, readout="plugin", device=device)
    gpu_like.capability = (9, 0)
    assert gpu_like.reason(root).startswith("plugin library missing: ")
    (root / "libomnijev_plugins.so").write_bytes(b"\x7fELF")
    assert gpu_like.reason(root) is None


def test_backend_refuses_to_start_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match="tensorrt backend unavailable: no engines.json"):
        backend.TensorRTBackend(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="answers differ with a GPU")
def test_real_rtx_plans_here_lack_only_a_gpu(tmp_path):
    trt = manifests.import_library()
    if trt is None:
        pytest.skip("no tensorrt library")
    root = write_engines(
        tmp_path / "e", library=manifests.library_name(trt), version=trt.__version__
    )
    assert backend.unavailable_reason(root) == "no CUDA device"


# -- dtypes, axes, profiles ---------------------------------------------------------------------


def test_dtype_maps():
    assert backend.io_dtypes(LM_IO) == {
        "input_ids": torch.int64, "positions": torch.int64, "prefix_k.0": torch.bfloat16,
        "prefix_mask": torch.bool, "read_rows": torch.int64,
    }  # fmt: skip
    assert backend.io_dtypes(LM_IO, "output") == {
        "hidden": torch.float32,
        "logprobs": torch.float32,
    }
    for name in trt_build.DTYPE_NAMES.values():
        assert name in DTYPES, name


def test_axis_values_from_input_shapes():
    assert backend.axis_values(LM_INPUTS, lm_shapes(4, 16, 100, 4)) == {
        "B": 4, "T": 16, "P": 100, "R": 4
    }  # fmt: skip
    shapes = lm_shapes(4, 16, 100, 4) | {"positions": (3, 5, 16)}
    with pytest.raises(ValueError, match="axis B: 5 in positions, 4 before"):
        backend.axis_values(LM_INPUTS, shapes)
    shapes = lm_shapes(4, 16, 100, 4) | {"prefix_k.0": (1, 3, 100, 32)}
    with pytest.raises(ValueError, match="input prefix_k.0: size 3, expected 2"):
        backend.axis_values(LM_INPUTS, shapes)
    patches = [{"name": "pixel_values", "shape": ["4*merged", 1536]}]
    assert backend.axis_values(patches, {"pixel_values": (24, 1536)}) == {"merged": 6}
    with pytest.raises(ValueError, match="not a multiple"):
        backend.axis_values(patches, {"pixel_values": (26, 1536)})


def test_profile_selection():
    assert backend.select_profile(PROFILES, {"B": 1, "T": 64, "P": 1, "R": 1}) == 0
    assert backend.select_profile(PROFILES, {"B": 1, "T": 64, "P": 1, "R": 65}) == 1
    assert backend.select_profile(PROFILES, {"B": 64, "T": 16, "P": 8192, "R": 64}) == 1
    with pytest.raises(ValueError, match="T=65 outside 1..64"):
        backend.select_profile(PROFILES, {"B": 2, "T": 65, "P": 1, "R": 1})


def test_the_executor_is_told_the_pass_limit():
    assert trt_build.MAX_PASS_TOKENS == STD_MAX_TOKENS == 64
    for axes in (profile[1] for profile in trt_build.LM_PROFILES):
        assert axes["T"][2] == STD_MAX_TOKENS


# -- run(): bind, warm up, capture, replay (GPU; TensorRT replaced by a stand-in) ------------------


class StandInContext:
    """Does what an execution context of `hidden = 2 * x + 1` would, on the stream it is given."""

    def __init__(self, capturable: bool = True):
        self.calls, self.capturable = 0, capturable

    def is_stream_capturable(self, stream: int) -> bool:
        return self.capturable

    def execute_async_v3(self, stream: int) -> bool:
        self.calls += 1
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            torch.mul(self.inputs["x"], 2, out=self.outputs["y"]).add_(1)
        return True


class StandInBackend(backend.TensorRTBackend):
    def __init__(self, capturable: bool = True):  # no plans: only the run() machinery
        self.device = torch.device("cuda")
        self.capture, self.capturable = True, capturable
        self.stream = torch.cuda.Stream()
        self._lock = __import__("threading").Lock()
        io = [{"name": "x", "mode": "input", "dtype": "float32", "shape": ["B", 8]},
              {"name": "y", "mode": "output", "dtype": "float32", "shape": ["B", 8]}]  # fmt: skip
        profiles = [{"name": "rows", "axes": {"B": [1, 4, 64]}}]
        self.plans = {"g": self._with_slots(backend.Plan(engine=None, io=io, profiles=profiles))}
        self.contexts = []

    def _bind(self, plan, profile, tensors):
        context = StandInContext(self.capturable)
        context.inputs = {n: torch.empty_like(t) for n, t in tensors.items()}
        context.outputs = {"y": torch.empty_like(tensors["x"])}
        self.contexts.append(context)
        slot = Slot(inputs=context.inputs, outputs=context.outputs, state=context)
        slot.capturable = self.capturable
        return slot


@pytest.mark.gpu
@pytest.mark.parametrize("capturable", [True, False])
def test_run_captures_once_per_shape_then_replays(capturable):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    runner = StandInBackend(capturable)
    for step in range(3):
        for rows in (2, 5):
            x = torch.randn(rows, 8, device="cuda") + step
            y = torch.empty_like(x)
            runner.run("g", {"x": x, "unused": x}, {"y": y})
            torch.testing.assert_close(y, 2 * x + 1)
    assert len(runner.contexts) == 2  # one per shape set
    assert runner.has_graph("g") and not runner.has_graph("lm_rows")
    graphs = [slot.graph for slot in runner.plans["g"].slots.slots.values()]
    if capturable:
        assert all(g is not None for g in graphs)
        # warm-up enqueue and the captured one; replays do not call the context again
        assert [c.calls for c in runner.contexts] == [2, 2]
    else:
        assert graphs == [None, None]
        assert [c.calls for c in runner.contexts] == [3, 3]
    with pytest.raises(ValueError, match="B=65 outside 1..64"):
        runner.run("g", {"x": torch.zeros(65, 8, device="cuda")}, {})
    with pytest.raises(ValueError, match="input x: torch.float64"):
        runner.run("g", {"x": torch.zeros(2, 8, device="cuda", dtype=torch.float64)}, {})
