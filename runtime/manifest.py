"""The engine directory's manifest (`engines.json`): its names, the TensorRT library it was built
with, and the check of every recorded file's SHA-256 (engines.md §4); what a backend reads
before it loads anything, written by `build_engines.engines` and `build_engines.trt_build`.
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path
from types import ModuleType

import onnx

from runtime.export_format import sha256_file

# Modules tried in order: full TensorRT, then TensorRT-RTX. The cu13 bindings wheel installs
# RTX as `tensorrt_rtx_bindings`; the `tensorrt-rtx` meta package adds `tensorrt_rtx`.
LIBRARIES = ("tensorrt", "tensorrt_rtx", "tensorrt_rtx_bindings")
RTX = "tensorrt_rtx"
FULL = "tensorrt"
MANIFEST = "engines.json"
FORMAT = "omnijev-engines/1"
ONNX_ORT = "onnx_ort"  # the ONNX Runtime variant (fused Gated DeltaNet and vision attention)
ONNX_TRT = "onnx_trt"  # the variant the plans are built from (gdn="std")
PLANS_DIR = "plans"
TIMING_CACHE = "timing_cache.bin"
SHA_SUFFIX = ".sha256"
PLUGIN_ENV = "OMNIJEV_PLUGIN_LIBRARY"  # RuntimeConfig.plugin_library
PLUGIN_DEFAULT = Path(__file__).resolve().parents[1] / "plugins" / "build" / "libomnijev_plugins.so"
DIM = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]\w*)$")  # "T" or "4*merged", as the export names axes


def import_library(name: str | None = None) -> ModuleType | None:
    """The first importable TensorRT module (`name`: only `tensorrt` or only TensorRT-RTX)."""
    for module in LIBRARIES:
        if name is not None and library_name_of(module) != name:
            continue
        try:
            return importlib.import_module(module)
        except Exception:  # noqa: BLE001 - placeholder wheels fail in many ways; try the next
            continue
    return None


def library_name_of(module_name: str) -> str:
    return RTX if module_name.startswith(RTX) else FULL


def library_name(trt: ModuleType) -> str:
    return library_name_of(trt.__name__)


def is_rtx(trt: ModuleType) -> bool:
    return library_name(trt) == RTX


def plugin_library(configured: str | None = None) -> Path | None:
    """The readout plugin library (`RuntimeConfig.plugin_library`, else plugins/build/), where
    it was built."""
    path = Path(configured or PLUGIN_DEFAULT)
    return path if path.is_file() else None


def file_record(path: Path) -> dict:
    return {"sha256": sha256_file(path), "bytes": path.stat().st_size}


def onnx_files(onnx_path: Path) -> list[Path]:
    """The ONNX file and its external-data files, as the parser reads them."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    names = {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }
    return [onnx_path, *sorted(onnx_path.parent / name for name in names)]


def read_manifest(engine_dir: Path) -> dict | None:
    path = Path(engine_dir) / MANIFEST
    return json.loads(path.read_text("utf-8")) if path.is_file() else None


def compare_record(root: Path, relative: str, record: dict) -> str | None:
    path = root / relative
    if not path.is_file():
        return f"{relative}: missing"
    actual = sha256_file(path)
    if actual != record["sha256"]:
        return f"{relative}: sha256 {actual[:16]}…, recorded {record['sha256'][:16]}…"
    return None


def verify_plans(engine_dir: Path, plans_only: bool = False) -> list[str]:
    """What changed since the build: ONNX files, timing cache or plans whose SHA-256 no longer
    matches the manifest (an empty list when nothing did). `plans_only`: the plan files alone,
    what a runtime needs checked before loading them."""
    root = Path(engine_dir)
    manifest = read_manifest(root)
    if manifest is None:
        return [f"{MANIFEST}: missing"]
    problems = []
    if not plans_only:
        for variant in (manifest.get("onnx") or {}).values():
            for relative, record in variant["files"].items():
                problems.append(compare_record(root, relative, record))
    plans = manifest.get("plans")
    if not plans:
        return [p for p in problems if p] + ["plans: none built"]
    for entry in plans["graphs"].values():
        problems.append(compare_record(root, entry["plan"], entry))
    if plans_only:
        return sorted({p for p in problems if p})
    cache = plans["timing_cache"]
    problems.append(compare_record(root, cache["file"], cache))
    sha_file = root / (cache["file"] + SHA_SUFFIX)
    if sha_file.is_file() and sha_file.read_text("utf-8").split()[0] != cache["sha256"]:
        problems.append(f"{sha_file.name}: does not match the manifest")
    for entry in plans["graphs"].values():
        for relative, record in entry["onnx"].items():
            problems.append(compare_record(root, relative, record))
    return sorted({p for p in problems if p})
