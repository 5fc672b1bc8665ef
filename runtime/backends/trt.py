"""TensorRT backend: runs an engine directory's plans with `tensorrt` or `tensorrt_rtx` on torch
CUDA tensors, following the TensorRT runtime API and its CUDA-graph rules (docs/engines.md §2,
§7.1).

Each graph's plan is deserialized once (the plugin library loaded first). Each distinct set of
input shapes gets its own execution context, persistent I/O buffers and, after a warm-up enqueue,
a CUDA graph captured around `execute_async_v3`; where capture fails it runs by plain enqueue.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from runtime import manifest as manifests
from runtime.backends.base import Portable
from runtime.backends.graphs import GraphSlots, Slot, builds_of
from runtime.config import RuntimeConfig
from runtime.constants import DTYPES

MAX_BOUND = 128  # shape sets kept bound (context, buffers, graph); the least recent go first
# The TensorRT-RTX runtime's own list when it refused an H200 (docs/engines.md §0.3): "Supported
# compute capabilities: 8.0 8.6 8.9 12.0 12.1 >12.0".
RTX_RUNTIME_CAPABILITIES = ((8, 0), (8, 6), (8, 9))
RTX_RUNTIME_FROM = (12, 0)  # this and every newer compute capability


# -- pure helpers (no GPU needed) ---------------------------------------------------------------


def io_dtypes(io: list[dict], mode: str = "input") -> dict[str, torch.dtype]:
    return {item["name"]: DTYPES[item["dtype"]] for item in io if item["mode"] == mode}


def axis_values(inputs: list[dict], shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    """Axis sizes of a pass from its input shapes (axis names as in the manifest's I/O list)."""
    values: dict[str, int] = {}
    for item in inputs:
        shape, name = tuple(shapes[item["name"]]), item["name"]
        if len(shape) != len(item["shape"]):
            raise ValueError(f"input {name}: rank {len(shape)}, expected {len(item['shape'])}")
        for dim, size in zip(item["shape"], shape, strict=True):
            if isinstance(dim, int):
                if dim >= 0 and dim != size:
                    raise ValueError(f"input {item['name']}: size {size}, expected {dim}")
                continue
            match = manifests.DIM.match(dim)
            if match is None:
                continue
            scale, axis = int(match.group(1) or 1), match.group(2)
            if size % scale:
                raise ValueError(f"input {item['name']}: axis {dim} = {size} is not a multiple")
            value = size // scale
            if values.setdefault(axis, value) != value:
                raise ValueError(f"axis {axis}: {value} in {item['name']}, {values[axis]} before")
    return values


def select_profile(profiles: list[dict], values: dict[str, int]) -> int:
    """The first optimization profile whose ranges cover every axis value."""
    for index, profile in enumerate(profiles):
        if all(lo <= values[a] <= hi for a, (lo, _, hi) in profile["axes"].items() if a in values):
            return index
    worst = []
    for profile in profiles:
        for axis, (lo, _, hi) in profile["axes"].items():
            if axis in values and not lo <= values[axis] <= hi:
                worst.append(f"{axis}={values[axis]} outside {lo}..{hi}")
    raise ValueError(f"no optimization profile covers the pass: {'; '.join(worst)}")


def rtx_refuses(capability: tuple[int, int]) -> bool:
    return capability not in RTX_RUNTIME_CAPABILITIES and tuple(capability) < RTX_RUNTIME_FROM


def plan_validity(trt, path: Path) -> str | None:
    """The library's own verdict on a plan header where it offers one (RTX does)."""
    runtime = trt.Runtime(trt.Logger(trt.Logger.ERROR))
    check = getattr(runtime, "get_engine_validity", None)
    if check is None:
        return None
    with open(path, "rb") as handle:
        header = handle.read(int(runtime.engine_header_size))
    validity, diagnostics = check(header)
    if validity.name == "INVALID":
        return f"{manifests.library_name(trt)} finds {path.name} invalid here ({diagnostics:#x})"
    return None


def unavailable_reason(
    engines_dir: Path,
    import_library: Callable[[str], ModuleType | None] = manifests.import_library,
    validity: Callable[[ModuleType, Path], str | None] = plan_validity,
) -> str | None:
    """Why the plans of `engines_dir` cannot run here, or None when they can. `import_library`
    finds the manifest's library; `validity` is that library's verdict on a plan."""
    engines_dir = Path(engines_dir)
    manifest = manifests.read_manifest(engines_dir)
    if manifest is None:
        return f"no {manifests.MANIFEST} in {engines_dir}"
    plans = manifest.get("plans")
    if not plans:
        return f"no plans in {engines_dir} (built with --skip-plans)"
    for graph, entry in plans["graphs"].items():
        if not (engines_dir / entry["plan"]).is_file():
            return f"plan for {graph} missing: {entry['plan']}"
    library = plans["library"]
    trt = import_library(library)
    if trt is None:
        return f"plans need {library}, which is not importable"
    if trt.__version__ != plans["version"]:
        return f"plans were built with {library} {plans['version']}; {trt.__version__} is installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    capability = torch.cuda.get_device_capability()
    label = f"{capability[0]}.{capability[1]}"
    if library == manifests.RTX:
        if rtx_refuses(capability):
            return f"tensorrt_rtx refuses compute capability {label} (docs/engines.md §0.3)"
    elif plans["device"]["compute_capability"] != label:
        built = plans["device"]
        return f"plans were built on {built['name']} ({built['compute_capability']}), not {label}"
    if plans["readout"] == "plugin":
        plugin = Path(plans["plugin"]["library"])
        if not plugin.is_file():
            return f"plugin library missing: {plugin}"
    first = next(iter(plans["graphs"].values()))
    return validity(trt, engines_dir / first["plan"])


# -- the backend ------------------------------------------------------------------------------


@dataclass
class Plan:
    engine: object
    io: list[dict]
    profiles: list[dict]
    scratch: torch.Tensor | None = None
    slots: GraphSlots | None = None

    @property
    def inputs(self) -> list[dict]:
        return [item for item in self.io if item["mode"] == "input"]

    @property
    def output_names(self) -> list[str]:
        return [item["name"] for item in self.io if item["mode"] == "output"]


class TensorRTBackend(Portable):
    """Runs the plans of an engine directory (interface of OrtBackend)."""

    def __init__(
        self,
        engines_dir: Path,
        config: RuntimeConfig | None = None,
        verify: bool = True,
    ):
        config = config or RuntimeConfig.from_env()
        engines_dir = Path(engines_dir)
        reason = unavailable_reason(engines_dir)
        if reason is not None:
            raise RuntimeError(f"tensorrt backend unavailable: {reason}")
        if verify:
            changed = manifests.verify_plans(engines_dir, plans_only=True)
            if changed:
                raise RuntimeError(
                    f"engine directory changed since its build: {'; '.join(changed)}"
                )
        manifest = manifests.read_manifest(engines_dir)
        plans = manifest["plans"]
        self.trt = manifests.import_library(plans["library"])
        self.name = plans["library"]
        self.device = torch.device(config.device or "cuda")
        self.max_pass_tokens = plans["max_pass_tokens"]  # the executor splits longer passes
        # kernels follow the shape: passes keep fixed row counts (Portable's capabilities)
        self._lock = threading.Lock()  # one enqueue at a time: contexts share scratch memory
        with torch.cuda.device(self.device):
            self.stream = torch.cuda.Stream(self.device)  # never the default stream (§7.1)
        self.logger = self.trt.Logger(self.trt.Logger.WARNING)
        if plans["readout"] == "plugin":
            # creators must be registered before deserialization (docs/engines.md §12.3)
            self.trt.get_plugin_registry().load_library(plans["plugin"]["library"])
        self.runtime = self.trt.Runtime(self.logger)
        self.plans = {
            graph: self._load(engines_dir / entry["plan"], entry)
            for graph, entry in plans["graphs"].items()
        }

    def _load(self, path: Path, entry: dict) -> Plan:
        with torch.cuda.device(self.device):
            engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
        if engine is None:
            raise RuntimeError(f"{path.name}: deserialization failed")
        return self._with_slots(Plan(engine=engine, io=entry["io"], profiles=entry["profiles"]))

    def _with_slots(self, plan: Plan) -> Plan:
        """A context, buffers and CUDA graph per shape set, bound on first use (the profile is
        the key's second field)."""
        plan.slots = GraphSlots(
            self.device,
            bind=lambda key, feeds, outputs: self._bind(plan, key[1], feeds),
            launch=self._enqueue,
            size=MAX_BOUND,
            capture=True,
            stream=self.stream,
        )
        return plan

    # -- interface ----------------------------------------------------------------------------

    def has_graph(self, graph: str) -> bool:
        return graph in self.plans

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        return io_dtypes(self.plans[graph].io, "input")

    def output_names(self, graph: str) -> list[str]:
        return self.plans[graph].output_names

    def run(
        self,
        graph: str,
        feeds: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
    ) -> None:
        plan = self.plans[graph]
        tensors = self._inputs(graph, plan, feeds)
        values = axis_values(plan.inputs, {name: t.shape for name, t in tensors.items()})
        profile = select_profile(plan.profiles, values)
        key = (graph, profile, *(tuple(t.shape) for t in tensors.values()))
        current = torch.cuda.current_stream(self.device)
        with self._lock:
            self.stream.wait_stream(current)  # the feeds were written on the caller's stream
            with torch.cuda.stream(self.stream):
                plan.slots.run(key, tensors, outputs)
                for tensor in (*tensors.values(), *outputs.values()):
                    tensor.record_stream(self.stream)
            current.wait_stream(self.stream)

    def prepare(self, signatures: list) -> int:
        """Nothing to build ahead: a shape set is bound and captured on its first two runs."""
        return 0

    def settle(self) -> int:
        return 0

    def stats(self) -> dict:
        graphs = {graph: plan.slots.stats() for graph, plan in self.plans.items()}
        return {**graphs, **builds_of(plan.slots for plan in self.plans.values())}

    # -- internals -------------------------------------------------------------------------------

    def _inputs(self, graph: str, plan: Plan, feeds: dict) -> dict[str, torch.Tensor]:
        tensors = {}
        for item in plan.inputs:
            name = item["name"]
            if name not in feeds:
                raise ValueError(f"{graph} input {name} missing")
            tensor = feeds[name]
            if tensor.dtype != DTYPES[item["dtype"]] or tensor.device != self.device:
                raise ValueError(f"{graph} input {name}: {tensor.dtype} on {tensor.device}")
            tensors[name] = tensor
        return tensors

    def _scratch(self, plan: Plan) -> torch.Tensor:
        """Activation memory shared by a graph's contexts: they run one at a time."""
        if plan.scratch is None:
            engine = plan.engine
            size = getattr(engine, "device_memory_size_v2", None) or engine.device_memory_size
            size = max(int(size), 1)
            plan.scratch = torch.empty(size, dtype=torch.uint8, device=self.device)
        return plan.scratch

    def _context(self, plan: Plan):
        strategy = self.trt.ExecutionContextAllocationStrategy.USER_MANAGED
        context = plan.engine.create_execution_context(strategy)
        scratch = self._scratch(plan)
        if hasattr(context, "set_device_memory"):
            context.set_device_memory(scratch.data_ptr(), scratch.numel())
        else:  # tensorrt 10.0
            context.device_memory = scratch.data_ptr()
        return context

    def _bind(self, plan: Plan, profile: int, tensors: dict[str, torch.Tensor]) -> Slot:
        """A context for one shape set; shapes and addresses are set once, before any capture."""
        context = self._context(plan)
        context.set_optimization_profile_async(profile, self.stream.cuda_stream)
        inputs = {}
        for name, tensor in tensors.items():
            context.set_input_shape(name, tuple(tensor.shape))
            inputs[name] = torch.empty_like(tensor, memory_format=torch.contiguous_format)
            context.set_tensor_address(name, inputs[name].data_ptr())
        outputs = {}
        for item in plan.io:
            if item["mode"] != "output":
                continue
            shape = tuple(context.get_tensor_shape(item["name"]))
            outputs[item["name"]] = torch.empty(
                shape, dtype=DTYPES[item["dtype"]], device=self.device
            )
            context.set_tensor_address(item["name"], outputs[item["name"]].data_ptr())
        capturable = getattr(context, "is_stream_capturable", None)
        slot = Slot(inputs=inputs, outputs=outputs, state=context)
        slot.capturable = capturable is None or bool(capturable(self.stream.cuda_stream))
        return slot

    def _enqueue(self, slot: Slot) -> bool:
        return bool(slot.state.execute_async_v3(self.stream.cuda_stream))
