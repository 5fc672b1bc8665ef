"""ONNX Runtime backend: one session per graph, torch tensors bound in place through IOBinding.

On CUDA, every tensor stays on the device between passes (states never travel to the host);
with CUDA graphs each distinct set of shapes gets its own `gpu_graph_id` and its own persistent
buffers, captured on first use and replayed afterwards (docs/engines.md §7.3). The weights are read
once and handed to every session (`add_initializer`), so sessions share one copy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from runtime.backends.base import Portable
from runtime.backends.graphs import GraphSlots, Slot, checked_feeds, like
from runtime.config import RuntimeConfig
from runtime.constants import GRAPHS
from runtime.manifest import ONNX_ORT

log = logging.getLogger("omnijev.ort")

ONNX_DIR = ONNX_ORT  # the ONNX Runtime variant inside an engine directory
MAX_CUDA_GRAPHS = 64  # shape signatures kept; each holds its own buffers
MAX_STATIC_SESSIONS = 12  # fixed-shape sessions kept; each holds its own activation arena
# the language-model passes are bucketed (runtime.passes), so their shapes repeat at once
STATIC_GRAPHS = ("lm_state", "lm_rows")
# the vision graph's size follows the image (a full-attention tower cannot be padded): a size
# gets its own session only once it has come back, so one-off sizes cost no session build
REPEATED_GRAPHS = ("vision",)
REPEATS_BEFORE_STATIC = 2
SEEN_SIZES = 1024  # image sizes remembered for that count; forgotten all at once beyond
# initializers at least this large are read once and shared by every session; small constants
# stay in the graphs, where ONNX Runtime folds them and places shape arithmetic
SHARED_BYTES = 1 << 20
# on CUDA the graphs' CPU nodes are shape arithmetic: one thread, not spinning, so that ORT's
# pools (one per session, a thread per core by default) leave the host's cores to preparation
# and the heads between passes
CUDA_HOST_THREADS = 1
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


ONNX_TO_TORCH = {
    onnx.TensorProto.FLOAT: torch.float32,
    onnx.TensorProto.BFLOAT16: torch.bfloat16,
    onnx.TensorProto.FLOAT16: torch.float16,
    onnx.TensorProto.INT64: torch.int64,
    onnx.TensorProto.INT32: torch.int32,
}


def element_type(dtype: torch.dtype) -> type | int:
    if dtype == torch.bfloat16:
        return onnx.TensorProto.BFLOAT16  # numpy has no bfloat16; IOBinding takes ONNX's number
    return TORCH_TO_NUMPY[dtype]


def session_options(threads: int | None, cuda: bool = False) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not cuda:
        # the CPU arena keeps the largest pass's memory for good (a 3,000-token prompt took the
        # worker from 0.99 to 9.8 GB); without it RSS stays at 0.85 GB and short requests are as
        # fast
        options.enable_cpu_mem_arena = False
    if cuda:
        threads = threads or CUDA_HOST_THREADS
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads:
        options.intra_op_num_threads = threads
    return options


def onnx_dir(engines_dir: Path) -> Path:
    path = Path(engines_dir) / ONNX_DIR
    return path if path.is_dir() else Path(engines_dir)


def max_pass_tokens(folder: Path) -> int | None:
    """The standard-op Gated DeltaNet variant takes one chunk per pass (onnx_export.json)."""
    description = folder / "onnx_export.json"
    if not description.exists():
        return None
    return json.loads(description.read_text()).get("max_tokens")


def bind(binding: ort.IOBinding, name: str, tensor: torch.Tensor, output: bool) -> None:
    device = "cuda" if tensor.is_cuda else "cpu"
    method = binding.bind_output if output else binding.bind_input
    method(
        name,
        device,
        tensor.device.index or 0,
        element_type(tensor.dtype),
        list(tensor.shape),
        tensor.data_ptr(),
    )


def io_binding(
    session: ort.InferenceSession, feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]
) -> ort.IOBinding:
    binding = session.io_binding()
    for name, tensor in feeds.items():
        bind(binding, name, tensor, output=False)
    for name, tensor in outputs.items():
        bind(binding, name, tensor, output=True)
    return binding


def external_fields(initializer: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in initializer.external_data}


def initializer_bytes(initializer: onnx.TensorProto, folder: Path) -> tuple[tuple, np.ndarray]:
    """(sharing key, raw bytes) of one initializer: external data is read from its file."""
    if initializer.data_location == onnx.TensorProto.EXTERNAL:
        fields = external_fields(initializer)
        path = folder / fields["location"]
        offset, length = int(fields.get("offset", 0)), int(fields["length"])
        raw = np.fromfile(path, dtype=np.uint8, count=length, offset=offset)
        return (str(path.resolve()), offset, length), raw
    raw = np.frombuffer(initializer.raw_data, dtype=np.uint8)
    # graphs derived from one another carry the same inline weights: share them by content
    return ("inline", hashlib.blake2b(raw.tobytes(), digest_size=16).hexdigest()), raw


def shareable(initializer: onnx.TensorProto) -> bool:
    if initializer.data_type not in ONNX_TO_TORCH:
        return False
    if initializer.data_location == onnx.TensorProto.EXTERNAL:
        return int(external_fields(initializer)["length"]) >= SHARED_BYTES
    return len(initializer.raw_data) >= SHARED_BYTES


class SharedWeights:
    """The graphs' large initializers, read once onto the backend's device and given to every
    session through `SessionOptions.add_initializer`, which uses a value in place when it already
    sits where the session plans it: one copy of the weights however many sessions exist."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tensors: dict[tuple, torch.Tensor] = {}  # owners of the memory the values point at
        self.values: dict[tuple, ort.OrtValue] = {}
        self.graphs: dict[str, list[tuple[str, tuple]]] = {}

    def load(self, path: str) -> list[tuple[str, tuple]]:
        """The (name, key) pairs of one graph's shared initializers, reading new ones."""
        if path in self.graphs:
            return self.graphs[path]
        folder = Path(path).parent
        model = onnx.load(path, load_external_data=False)
        named = []
        for initializer in model.graph.initializer:
            if not shareable(initializer):
                continue
            key, raw = initializer_bytes(initializer, folder)
            if key not in self.values:
                self.tensors[key], self.values[key] = self.value(initializer, raw)
            named.append((initializer.name, key))
        self.graphs[path] = named
        return named

    def value(self, initializer: onnx.TensorProto, raw: np.ndarray):
        """(owner of the memory, OrtValue) for one initializer on the backend's device."""
        host = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
        dtype = ONNX_TO_TORCH[initializer.data_type]
        # add_initializer takes only memory the caller owns: torch's, wrapped without a copy
        tensor = host.view(dtype).reshape(tuple(initializer.dims)).to(self.device)
        return tensor, ort.OrtValue.from_dlpack(tensor)

    def add_to(self, options: ort.SessionOptions, path: str) -> None:
        for name, key in self.load(path):
            options.add_initializer(name, self.values[key])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def signature(feeds: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> tuple:
    return tuple(
        (name, tuple(t.shape), t.dtype) for name, t in sorted({**feeds, **outputs}.items())
    )


@dataclass
class Bound:
    """What a slot runs: a session, the binding of the slot's buffers and its graph id."""

    session: ort.InferenceSession
    binding: ort.IOBinding
    options: ort.RunOptions
    graph_id: int


class OrtBackend(Portable):
    """Runs the ONNX Runtime variant of an engine directory."""

    def __init__(
        self,
        engines_dir: Path,
        config: RuntimeConfig | None = None,
        static_shapes: bool | None = None,
    ):
        """`static_shapes`: a session per shape signature; None: on CUDA, where it is what lets
        ONNX Runtime keep shape arithmetic off the host and capture CUDA graphs."""
        config = config or RuntimeConfig.from_env()
        available = ort.get_available_providers()
        cuda = "CUDAExecutionProvider" in available and torch.cuda.is_available()
        self.device = torch.device(config.device or ("cuda" if cuda else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        threads = config.ort_threads or None
        on_gpu = self.device.type == "cuda"
        self.capabilities = replace(Portable.capabilities, merges=not on_gpu)
        # CUDA graphs wherever the device has them: answers identical to the dynamic sessions',
        # byte for byte, and every workload faster
        cuda_graphs = on_gpu
        folder = onnx_dir(engines_dir)
        self.max_pass_tokens = max_pass_tokens(folder)
        # kernels follow the shape: passes keep fixed row counts (Portable's capabilities)
        # one session per shape signature with its dimensions fixed, so that ONNX Runtime folds
        # the shape arithmetic that otherwise keeps nodes on the CPU and CUDA graphs off
        self.static = on_gpu if static_shapes is None else static_shapes
        # those sessions are built in the background (1-1.5 s each on the 4b): a pass whose
        # session is not ready yet runs in the dynamic session meanwhile, never waits for it
        self._builder = ThreadPoolExecutor(1, "omnijev-static") if self.static else None
        self._builds: dict[tuple, tuple[Future, dict, dict]] = {}
        self._failed: set[tuple] = set()
        self._paths = {graph: str(folder / f"{graph}.onnx") for graph in GRAPHS}
        self._threads, self._cuda_graphs = threads, cuda_graphs
        self.weights = SharedWeights(self.device)
        self._seen: Counter = Counter()
        self.sessions: dict[str, ort.InferenceSession] = {}
        self.graphs_on: dict[str, bool] = {}
        self.static_graphs_on: dict[str, bool] = {}  # whether every fixed session took graphs
        for graph in GRAPHS:
            path = folder / f"{graph}.onnx"
            if graph == "lm_rows" and not path.exists():
                continue  # optional: the state variant also answers option passes
            self.sessions[graph], self.graphs_on[graph] = self._session(str(path), cuda_graphs)
        self._dtypes = {
            graph: {i.name: ORT_TO_TORCH[i.type] for i in s.get_inputs()}
            for graph, s in self.sessions.items()
        }
        if "prefix_rows" not in self._dtypes.get("lm_state", {"prefix_rows": None}):
            raise RuntimeError(
                f"{folder}: lm_state.onnx has no prefix_rows input (an export older than "
                "several image prefixes a pass); export it again with `omnijev export`"
            )
        # ONNX Runtime captures and replays by itself under each slot's graph id: no torch capture
        self.slots = GraphSlots(
            self.device,
            bind=self._dynamic_slot,
            launch=self._launch,
            size=MAX_STATIC_SESSIONS if self.static else MAX_CUDA_GRAPHS,
            capture=False,
        )
        self._graph_ids = 0
        self.fixed_runs = 0

    @property
    def name(self) -> str:
        graphs = any(self.graphs_on.values()) or any(self.static_graphs_on.values())
        return (
            f"onnxruntime-{self.device.type}"
            + ("+static" if self.static else "")
            + ("+graphs" if graphs else "")
        )

    def _providers(self, graphs: bool) -> list:
        if self.device.type != "cuda":
            return ["CPUExecutionProvider"]
        # TF32 would move float32 answers by ~1e-2: parity needs it off
        options = {"device_id": self.device.index or 0, "use_tf32": "0"}
        # exhaustive cuDNN search re-times the depthwise conv at every new shape: measured 1.5 s
        # of a 1.9 s profile; the heuristic choice brought a request from 977 ms to 250
        options["cudnn_conv_algo_search"] = "HEURISTIC"
        if graphs:
            options["enable_cuda_graph"] = "1"
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

    def _options(self, path: str, fixed: dict[str, int] | None = None) -> ort.SessionOptions:
        options = session_options(self._threads, self.device.type == "cuda")
        for dim, size in (fixed or {}).items():
            options.add_free_dimension_override_by_name(dim, int(size))
        self.weights.add_to(options, path)  # every session reads the one copy
        return options

    def _session(self, path: str, graphs: bool, fixed: dict | None = None):
        """A CUDA-graph session when the whole graph runs on the GPU, else a plain one."""
        if graphs and self.device.type == "cuda":
            try:
                options = self._options(path, fixed)
                return ort.InferenceSession(path, options, providers=self._providers(True)), True
            except Exception as error:  # ORT refuses graphs when a node falls back to the CPU
                log.warning("cuda graphs off for %s: %s", Path(path).name, error)
        options = self._options(path, fixed)
        return ort.InferenceSession(path, options, providers=self._providers(False)), False

    def has_graph(self, graph: str) -> bool:
        return graph in self.sessions

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        return self._dtypes[graph]

    def output_names(self, graph: str) -> list[str]:
        return [o.name for o in self.sessions[graph].get_outputs()]

    def _checked(self, graph: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return checked_feeds(graph, feeds, self._dtypes[graph], self.device)

    def _fixed(self, graph: str, shapes: tuple) -> bool:
        """Whether this pass (of this `signature`) runs in a session with its dimensions fixed."""
        if not self.static:
            return False
        if graph in STATIC_GRAPHS:
            return True
        if graph in REPEATED_GRAPHS:
            key = (graph, shapes)
            if key not in self._seen and len(self._seen) >= SEEN_SIZES:
                self._seen.clear()
            self._seen[key] += 1
            return self._seen[key] >= REPEATS_BEFORE_STATIC
        return False

    def run(
        self,
        graph: str,
        feeds: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
    ) -> None:
        feeds = self._checked(graph, feeds)
        shapes = signature(feeds, outputs)
        if self._fixed(graph, shapes) and self._fixed_slot(graph, shapes, feeds, outputs):
            self.slots.run((graph, shapes), feeds, outputs)
            return
        if self.graphs_on[graph]:
            # a graph-enabled session must never run without a graph id of its own: ORT would
            # replay whatever it captured under the default id, whatever the shapes now
            self.slots.run((graph, ("dynamic", shapes)), feeds, outputs)
            return
        binding = io_binding(self.sessions[graph], feeds, outputs)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.sessions[graph].run_with_iobinding(binding)

    def _fixed_slot(self, graph: str, shapes: tuple, feeds: dict, outputs: dict) -> Slot | None:
        """This signature's fixed-shape slot; None while its session is being built (the build
        starts on first sight) or when the build failed."""
        key = (graph, shapes)
        slot = self.slots.get(key)
        if slot is not None or key in self._failed:
            return slot
        if key not in self._builds:
            sizes = {name: tuple(t.shape) for name, t in feeds.items()}
            build = self._builder.submit(self._static_session, graph, sizes)
            self._builds[key] = (build, like(feeds), like(outputs))
            return None
        if not self._builds[key][0].done():
            return None
        return self._install(key)

    def _install(self, key: tuple) -> Slot | None:
        build, feeds, outputs = self._builds.pop(key)
        try:
            session, seconds = build.result()
        except Exception as error:  # the dynamic session keeps answering this signature
            log.warning("%s: no fixed-shape session: %s", key[0], error)
            self._failed.add(key)
            return None
        return self._new_slot(key, session, feeds, outputs, seconds)

    def settle(self) -> int:
        """Waits for the fixed-shape sessions being built and installs them; how many."""
        pending = list(self._builds)
        for key in pending:
            self._builds[key][0].exception()  # waits; errors are logged by _install
            self._install(key)
        return len(pending)

    def _static_session(
        self, graph: str, shapes: dict[str, tuple]
    ) -> tuple[ort.InferenceSession, float]:
        """A session whose named dimensions are fixed to these inputs' sizes, and the seconds
        its build took (builder thread: ONNX Runtime releases the GIL while it builds)."""
        started = time.perf_counter()
        fixed = {}
        for spec in self.sessions[graph].get_inputs():
            if spec.name not in shapes:
                continue
            for dim, size in zip(spec.shape, shapes[spec.name], strict=True):
                if isinstance(dim, str) and fixed.setdefault(dim, size) != size:
                    raise ValueError(f"{graph}: dimension {dim} is both {fixed[dim]} and {size}")
        session, graphs = self._session(self._paths[graph], self._cuda_graphs, fixed)
        log.info("%s: static session %s, cuda graphs %s", graph, fixed, graphs)
        self.static_graphs_on[graph] = self.static_graphs_on.get(graph, True) and graphs
        return session, time.perf_counter() - started

    def _dynamic_slot(self, key: tuple, feeds: dict, outputs: dict) -> Slot:
        """The dynamic session's CUDA-graph slot for a signature, apart from the fixed-shape
        slot the same signature may get."""
        return self._new_slot(key, self.sessions[key[0]], like(feeds), like(outputs))

    def _new_slot(
        self, key: tuple, session: ort.InferenceSession, feeds, outputs, seconds: float = 0.0
    ) -> Slot:
        """Persistent buffers bound to `session` under a graph id of their own (`seconds`: the
        session's build, where it was built for this signature)."""
        binding = io_binding(session, feeds, outputs)
        options = ort.RunOptions()
        self._graph_ids += 1  # 0 is ORT's default id; never reused after an eviction
        options.add_run_config_entry("gpu_graph_id", str(self._graph_ids))
        slot = Slot(feeds, outputs, state=Bound(session, binding, options, self._graph_ids))
        slot.meta["fixed"] = key[1][0] != "dynamic"
        return self.slots.install(key, slot, seconds)

    def _launch(self, slot: Slot) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        bound = slot.state
        bound.session.run_with_iobinding(bound.binding, bound.options)
        self.fixed_runs += slot.meta["fixed"]

    def prepare(self, signatures: list[tuple]) -> int:
        """Sessions are built on a signature's first sight; warm-up requests bring them."""
        return 0

    def stats(self) -> dict:
        """Slot counters, which graphs have fixed-shape and dynamic CUDA-graph slots, how many
        passes ran in fixed-shape sessions and how many builds are pending or failed."""
        keys = list(self.slots.slots)
        return {
            **self.slots.stats(),
            "fixed_graphs": sorted({g for g, shapes in keys if shapes[0] != "dynamic"}),
            "dynamic_graphs": sorted({g for g, shapes in keys if shapes[0] == "dynamic"}),
            "fixed_runs": self.fixed_runs,
            "pending_builds": len(self._builds),
            "failed_builds": len(self._failed),
        }
