"""TensorRT plans from an engine directory's ONNX files, and the plan manifest that checks them.

Follows the TensorRT Python API (docs/engines.md §2-§4) and its TensorRT-RTX variant (§11): library
selection (`tensorrt`, else TensorRT-RTX), strongly typed networks parsed with external data,
optimization profiles over the contract's limits, a timing cache pinned by its SHA-256.

Rebuilds are not always byte-identical (TensorRT-RTX numbers shape symbols and Myelin tensors in
an order that follows heap addresses and thread timing: docs/measurements/rtx-rebuilds.md), so
checks use the manifest's hashes of each input and plan.
"""

from __future__ import annotations

import hashlib
import time
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import onnx

from runtime.config import RuntimeConfig
from runtime.constants import GRAPHS, MAX_PREFIXES
from runtime.manifest import (
    DIM,
    ONNX_TRT,
    PLANS_DIR,
    PLUGIN_DEFAULT,
    PLUGIN_ENV,
    SHA_SUFFIX,
    TIMING_CACHE,
    file_record,
    is_rtx,
    library_name,
    onnx_files,
    plugin_library,
)

# Modules tried in order: full TensorRT, then TensorRT-RTX. The cu13 bindings wheel installs
# RTX as `tensorrt_rtx_bindings`; the `tensorrt-rtx` meta package adds `tensorrt_rtx`.
CPU_AOT = "cpu-aot"  # RTX builds ahead of time on the CPU; kernels are compiled at load (§11)
OPTIMIZATION_LEVEL = 3  # the builder's default, pinned: the level decides which tactics are tried
# RTX's default build targets (docs/engines.md §11), set explicitly so the manifest states them; the
# runtime refuses any other compute capability, 9.0 (H100/H200) included (§0.3).
RTX_TARGETS = ("SM80", "SM86", "SM89", "SM120")

# Limits the profiles cover (docs/design.md passes; docs/contract.md §2.7, §4.8).
MAX_ROWS = 64  # rows per pass: runtime.passes.OPTION_BATCH
MAX_PASS_TOKENS = 64  # tokens per pass of the standard-op GDN graph: modules.STD_MAX_TOKENS
MAX_SEQUENCE = 8192  # tokens of one question's sequence (MAX_SEQUENCE): bounds any past
MAX_PATCHES = 2352  # max_patches = 602,112 pixels / 16² (docs/contract.md §4.8)
MAX_IMAGE_TOKENS = MAX_PATCHES // 4  # merged vision rows after the 2×2 spatial merge
MAX_READS = MAX_ROWS * MAX_PASS_TOKENS  # read_rows and targets are flat indices into B·T
# image prefixes a pass reads (`prefix_rows`): up to MAX_PREFIXES, what a pass's rows can come
# from (one question pass's, one request each); tuned for one, a request's passes alone
PREFIXES = (1, 1, MAX_PREFIXES)

# name -> axis -> (min, opt, max); the first profile that covers a pass's shapes runs it. One
# profile per graph: DISTRIBUTIVE_INDEPENDENCE (row results independent of the other rows, §3)
# is refused with several profiles (tensorrt_rtx 1.7.1: "not supported when multiple
# optimization profiles are used").
# Vision rows are patches, a multiple of 4 (the export names the axis "patches", or "4*merged").
VISION_PROFILES = (
    ("image", {"patches": (4, 1024, MAX_PATCHES), "merged": (1, 256, MAX_IMAGE_TOKENS)}),
)
LM_PROFILES = (
    (
        "rows",
        {
            "B": (1, 16, MAX_ROWS), "T": (1, 16, MAX_PASS_TOKENS), "N": (1, 1, MAX_IMAGE_TOKENS),
            "P": (1, 640, MAX_SEQUENCE), "S": (1, 16, MAX_ROWS), "Q": (1, 64, MAX_SEQUENCE),
            "R": (1, 16, MAX_READS), "M": (1, 256, MAX_READS), "I": PREFIXES,
        },
    ),
)  # fmt: skip
PROFILES = {"vision": VISION_PROFILES, "lm_state": LM_PROFILES, "lm_rows": LM_PROFILES}

DTYPE_NAMES = {  # TensorRT DataType member -> the dtype name the manifest and backends use
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT32": "int32",
    "INT64": "int64",
    "INT8": "int8",
    "UINT8": "uint8",
    "BOOL": "bool",
    "FP8": "float8_e4m3fn",
}


# -- library ---------------------------------------------------------------------------------


def dtype_name(trt_dtype) -> str:
    name = getattr(trt_dtype, "name", str(trt_dtype).rsplit(".", 1)[-1])
    if name not in DTYPE_NAMES:
        raise ValueError(f"tensorrt dtype {name} has no torch counterpart")
    return DTYPE_NAMES[name]


def trt_readout(trt: ModuleType | None) -> tuple[str, str]:
    """Readout variant of the TensorRT ONNX files and why: the plugin only where it can load."""
    if trt is None:
        return "std", "no tensorrt library importable"
    if is_rtx(trt):
        return "std", (
            "tensorrt_rtx has no add_plugin_v3 and aborts on Python plugins "
            "(docs/engines.md §0.4); the plugin library needs full TensorRT headers"
        )
    if plugin_library(RuntimeConfig.from_env().plugin_library) is None:
        return "std", f"plugin library not built ({PLUGIN_DEFAULT} or ${PLUGIN_ENV})"
    return "plugin", "tensorrt with the plugin library"


# -- profiles and I/O ------------------------------------------------------------------------


def dim_value(dim, axes: dict[str, int], where: str) -> int:
    """A dimension's size for given axis sizes: an int, an axis name, or `k*axis`."""
    if isinstance(dim, int) and dim >= 0:
        return dim
    match = DIM.match(str(dim))
    if match is None or match.group(2) not in axes:
        raise ValueError(f"no range for axis {dim!r} of {where}")
    return int(match.group(1) or 1) * axes[match.group(2)]


def profile_shapes(inputs: list[dict], axes: dict[str, tuple[int, int, int]]) -> dict:
    """Input name -> {min, opt, max} shapes from axis ranges."""
    shapes = {}
    for item in inputs:
        triple = {}
        for index, kind in enumerate(("min", "opt", "max")):
            sizes = {axis: bounds[index] for axis, bounds in axes.items()}
            triple[kind] = [dim_value(d, sizes, f"input {item['name']}") for d in item["shape"]]
        shapes[item["name"]] = triple
    return shapes


def used_axes(inputs: list[dict]) -> set[str]:
    return {
        DIM.match(str(d)).group(2)
        for item in inputs
        for d in item["shape"]
        if not isinstance(d, int) and DIM.match(str(d))
    }


def graph_profiles(graph: str, inputs: list[dict]) -> list[dict]:
    """The graph's profiles: axis ranges limited to the axes its inputs use, and their shapes."""
    axes_used = used_axes(inputs)
    profiles = []
    for name, axes in PROFILES[graph]:
        kept = {axis: list(bounds) for axis, bounds in axes.items() if axis in axes_used}
        profiles.append({"name": name, "axes": kept, "shapes": profile_shapes(inputs, kept)})
    return profiles


def onnx_io(onnx_path: Path) -> tuple[list[dict], list[dict]]:
    """Inputs and outputs of an ONNX file: name, dtype, shape (ints and axis names)."""
    graph = onnx.load(str(onnx_path), load_external_data=False).graph

    def describe(values) -> list[dict]:
        described = []
        for value in values:
            tensor = value.type.tensor_type
            dims = [
                d.dim_param if d.HasField("dim_param") else d.dim_value for d in tensor.shape.dim
            ]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
            described.append({"name": value.name, "dtype": str(dtype), "shape": dims})
        return described

    return describe(graph.input), describe(graph.output)


def network_io(network, onnx_inputs: list[dict], onnx_outputs: list[dict]) -> list[dict]:
    """Every I/O tensor of the network: name, mode, the dtype TensorRT binds, the ONNX shape."""
    shapes = {item["name"]: item["shape"] for item in onnx_inputs + onnx_outputs}
    io = []
    for mode, count, get in (
        ("input", network.num_inputs, network.get_input),
        ("output", network.num_outputs, network.get_output),
    ):
        for index in range(count):
            tensor = get(index)
            shape = shapes.get(tensor.name) or [d if d >= 0 else -1 for d in tensor.shape]
            dtype = dtype_name(tensor.dtype)
            io.append({"name": tensor.name, "mode": mode, "dtype": dtype, "shape": shape})
    return io


# -- building ---------------------------------------------------------------------------------


def network_flags(trt: ModuleType) -> int:
    creation = trt.NetworkDefinitionCreationFlag
    # TensorRT 11 is always strongly typed and ignores the flag; RTX and 10.x need it.
    return 1 << int(creation.STRONGLY_TYPED) if hasattr(creation, "STRONGLY_TYPED") else 0


def parse_network(trt: ModuleType, builder, logger, onnx_path: Path, graph: str):
    network = builder.create_network(network_flags(trt))
    # Without a name the builder writes "Unnamed Network <n>" with a per-process counter into
    # the plan, and two builds of one file differ (observed with tensorrt_rtx 1.7.1).
    network.name = graph
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # external data is read beside the file
        errors = "; ".join(str(parser.get_error(i).desc()) for i in range(parser.num_errors))
        raise RuntimeError(f"{onnx_path.name}: onnx parser failed: {errors}")
    return network, parser


def builder_flags(trt: ModuleType, replay: bool) -> list[str]:
    """Flags set on every build. Timing-cache flags only where the library times tactics."""
    flags = ["DISTRIBUTIVE_INDEPENDENCE"]  # the closest thing to batch invariance (§3)
    if not is_rtx(trt):
        # keep JIT results out of the recorded cache so the cache holds tactic choices only
        flags += ["DISABLE_COMPILATION_CACHE", "EDITABLE_TIMING_CACHE"]
        if replay:
            flags.append("ERROR_ON_TIMING_CACHE_MISS")
    return [f for f in flags if hasattr(trt.BuilderFlag, f)]


def configure(trt: ModuleType, builder, network, profiles: list[dict], flags: list[str]):
    config = builder.create_builder_config()
    config.builder_optimization_level = OPTIMIZATION_LEVEL
    config.clear_flag(trt.BuilderFlag.TF32)  # float32 islands stay float32 (parity, §2.1)
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if is_rtx(trt):
        config.num_compute_capabilities = len(RTX_TARGETS)
        for index, target in enumerate(RTX_TARGETS):
            config.set_compute_capability(getattr(trt.ComputeCapability, target), index)
    names = {network.get_input(i).name for i in range(network.num_inputs)}
    for spec in profiles:
        profile = builder.create_optimization_profile()
        for name, shape in spec["shapes"].items():
            if name in names:
                profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
        config.add_optimization_profile(profile)
    return config


def new_timing_cache(trt: ModuleType) -> bytes:
    """An empty timing cache, serialized (RTX writes a valid but inert one)."""
    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # RTX: "operations are no-ops"
        return bytes(builder.create_builder_config().create_timing_cache(b"").serialize())


def attach_cache(trt: ModuleType, config, data: bytes):
    """Loads a timing cache into the config; None under RTX, whose cache operations are no-ops."""
    if is_rtx(trt):
        return None
    cache = config.create_timing_cache(data)
    config.set_timing_cache(cache, False)  # never ignore a cache made on another device
    return cache


def build_plan(
    trt: ModuleType, onnx_path: Path, plan_path: Path, graph: str, cache_data: bytes, replay: bool
) -> tuple[dict, bytes]:
    """One plan; returns its manifest entry and the timing cache after the build."""
    started = time.perf_counter()
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network, _parser = parse_network(trt, builder, logger, onnx_path, graph)
    inputs, outputs = onnx_io(onnx_path)
    io = network_io(network, inputs, outputs)
    profiles = graph_profiles(graph, [item for item in io if item["mode"] == "input"])
    flags = builder_flags(trt, replay)
    config = configure(trt, builder, network, profiles, flags)
    cache = attach_cache(trt, config, cache_data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError(f"{graph}: tensorrt build failed")
    cache_after = bytes(cache.serialize()) if cache is not None else cache_data
    if replay and cache_after != cache_data:
        # TensorRT 11.0 let some misses through ERROR_ON_TIMING_CACHE_MISS (docs/engines.md §3)
        raise RuntimeError(f"{graph}: timing cache missed (the build changed the pinned cache)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    root = plan_path.parent.parent
    entry = {
        "plan": plan_path.relative_to(root).as_posix(),
        **file_record(plan_path),
        "onnx": {p.relative_to(root).as_posix(): file_record(p) for p in onnx_files(onnx_path)},
        "flags": flags,
        "profiles": profiles,
        "io": io,
        "build_seconds": round(time.perf_counter() - started, 2),
    }
    return entry, cache_after


def target_capability(target: str) -> str:
    """ "SM89" -> "8.9", "SM120" -> "12.0"."""
    digits = target.removeprefix("SM")
    return f"{digits[:-1]}.{digits[-1]}"


def device_record(trt: ModuleType) -> dict | str:
    if is_rtx(trt):
        return CPU_AOT
    import torch

    index = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(index)
    return {"name": torch.cuda.get_device_name(index), "compute_capability": f"{major}.{minor}"}


def load_cache(engine_dir: Path, source: Path | None) -> tuple[bytes | None, Path]:
    """The pinned timing cache (`source`, else the directory's own), checked against its SHA-256
    file; None when there is none yet."""
    path = Path(source) if source else Path(engine_dir) / TIMING_CACHE
    if not path.is_file():
        return None, path
    data = path.read_bytes()
    sha_path = path.with_name(path.name + SHA_SUFFIX)
    if sha_path.is_file():
        recorded = sha_path.read_text("utf-8").split()[0]
        actual = hashlib.sha256(data).hexdigest()
        if recorded != actual:
            raise RuntimeError(f"timing cache {path} changed: sha256 {actual}, recorded {recorded}")
    return data, path


def save_cache(engine_dir: Path, data: bytes) -> Path:
    path = Path(engine_dir) / TIMING_CACHE
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    path.with_name(path.name + SHA_SUFFIX).write_text(f"{digest}  {path.name}\n", "utf-8")
    return path


def build_plans(
    engine_dir: Path,
    trt: ModuleType,
    readout: str,
    readout_reason: str,
    timing_cache: Path | None = None,
    graphs: tuple[str, ...] = GRAPHS,
) -> dict:
    """Plans for every graph of `onnx_trt/`; returns the manifest's `plans` section."""
    engine_dir = Path(engine_dir)
    plugin = None
    if readout == "plugin":
        plugin = plugin_library(RuntimeConfig.from_env().plugin_library)
        if plugin is None or not trt.get_plugin_registry().load_library(str(plugin)):
            raise RuntimeError(f"plugin library {plugin} could not be loaded")
    cache_data, cache_source = load_cache(engine_dir, timing_cache)
    replay = cache_data is not None
    data = cache_data if replay else new_timing_cache(trt)
    entries = {}
    for graph in graphs:
        onnx_path = engine_dir / ONNX_TRT / f"{graph}.onnx"
        plan_path = engine_dir / PLANS_DIR / f"{graph}.plan"
        entries[graph], data = build_plan(trt, onnx_path, plan_path, graph, data, replay)
    cache_path = engine_dir / TIMING_CACHE
    if not replay or cache_source.resolve() != cache_path.resolve():
        save_cache(engine_dir, data)
    return {
        "library": library_name(trt),
        "module": trt.__name__,
        "version": trt.__version__,
        "device": device_record(trt),
        "compute_capabilities": [target_capability(t) for t in RTX_TARGETS]
        if is_rtx(trt)
        else None,
        "strongly_typed": True,
        "optimization_level": OPTIMIZATION_LEVEL,
        "tf32": False,
        "readout": readout,
        "readout_reason": readout_reason,
        "plugin": {"library": str(plugin), **file_record(plugin)} if plugin else None,
        "max_pass_tokens": MAX_PASS_TOKENS,
        "timing_cache": {
            "file": TIMING_CACHE,
            "sha256": hashlib.sha256(data).hexdigest(),
            "mode": "replay" if replay else "record",
            "applies": not is_rtx(trt),
            "note": "tensorrt_rtx ignores timing caches: no tactic timing at its ahead-of-time "
            "build; kernels are chosen when the plan is loaded (docs/engines.md §3, §11)"
            if is_rtx(trt)
            else "later builds load it with ERROR_ON_TIMING_CACHE_MISS",
        },
        "graphs": entries,
    }


def plan_difference(a: bytes, b: bytes) -> dict:
    """How two plans differ: sizes, the count of differing bytes and where they lie."""
    common = min(len(a), len(b))
    left = np.frombuffer(a, np.uint8, common)
    right = np.frombuffer(b, np.uint8, common)
    differing = np.flatnonzero(left != right)
    return {
        "identical": a == b,
        "sizes": (len(a), len(b)),
        "differing_bytes": len(differing) + abs(len(a) - len(b)),
        "first": int(differing[0]) if differing.size else None,
        "last": int(differing[-1]) if differing.size else None,
    }
