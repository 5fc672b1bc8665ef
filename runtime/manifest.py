"""The engine directory's manifest (`engines.json`): its names, the TensorRT library it was built
with, and the check of every recorded file's SHA-256 (docs/engines.md §4); what a backend reads
before it loads anything, written by `build_engines.engines` and `build_engines.trt_build`.
`verify_engine_dir` is the start-up check of a whole directory (issue 14), as
`runtime.export_format.load_export` is of a checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from collections.abc import Callable
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
# 2: the language-model graphs take `prefix_rows` and several image prefixes a pass
FORMAT = "omnijev-engines/2"
ONNX_ORT = "onnx_ort"  # the ONNX Runtime variant (fused Gated DeltaNet and vision attention)
ONNX_TRT = "onnx_trt"  # the variant the plans are built from (gdn="std")
PLANS_DIR = "plans"
TIMING_CACHE = "timing_cache.bin"
SHA_SUFFIX = ".sha256"
PLUGIN_ENV = "OMNIJEV_PLUGIN_LIBRARY"  # RuntimeConfig.plugin_library
PLUGIN_DEFAULT = Path(__file__).resolve().parents[1] / "plugins" / "build" / "libomnijev_plugins.so"
EXPORT_MANIFEST = "omnijev_export.json"  # the checkpoint's manifest, recorded by its SHA-256
DIM = re.compile(r"^(?:(\d+)\*)?([A-Za-z_]\w*)$")  # "T" or "4*merged", as the export names axes


def import_library(
    name: str | None = None,
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> ModuleType | None:
    """The first importable TensorRT module (`name`: only `tensorrt` or only TensorRT-RTX), each
    tried with `import_module`."""
    for module in LIBRARIES:
        if name is not None and library_name_of(module) != name:
            continue
        try:
            return import_module(module)
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


class EngineDirError(RuntimeError):
    """An engine directory that must not be loaded: unfinished, changed, or escaping itself."""


def verify_engine_dir(engines_dir: str | Path, checkpoint_dir: str | Path) -> None:
    """Refuse an engine directory unless `engines.json` records every ONNX file (with its
    external data), plan and plugin library it holds or names, each with its SHA-256, every path
    stays inside the directory, and it was built from this checkpoint. Raises EngineDirError
    naming the file."""
    root = Path(engines_dir)
    path = root / MANIFEST
    if not path.is_file():
        raise EngineDirError(f"{path}: missing; not a finished engine build")
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise EngineDirError(f"{path}: not JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise EngineDirError(
            f"{path}: format is {found!r}, not {FORMAT}; rebuild it with `omnijev engines`"
        )
    check_checkpoint(manifest.get("checkpoint"), Path(checkpoint_dir), path)
    recorded = onnx_records(manifest)
    plans = manifest.get("plans") or {}
    for entry in (plans.get("graphs") or {}).values():
        recorded[entry["plan"]] = entry
        recorded.update(entry.get("onnx") or {})
    for relative, record in recorded.items():
        check_recorded_file(root, relative, record)
    check_onnx_files(root, recorded)
    if plans.get("plugin"):
        check_plugin(plans["plugin"])
    if manifest.get("torch"):
        check_tree(root, manifest["torch"])


def onnx_records(manifest: dict) -> dict[str, dict]:
    records: dict[str, dict] = {}
    for variant in (manifest.get("onnx") or {}).values():
        records.update(variant.get("files") or {})
    return records


def check_checkpoint(record: object, checkpoint: Path, manifest_path: Path) -> None:
    """The checkpoint's manifest hashes to what the build recorded."""
    recorded = record.get("manifest_sha256") if isinstance(record, dict) else None
    export_manifest = checkpoint / EXPORT_MANIFEST
    if not export_manifest.is_file():
        raise EngineDirError(f"{export_manifest}: missing")
    actual = sha256_file(export_manifest)
    if recorded != actual:
        built_from = record.get("path") if isinstance(record, dict) else None
        raise EngineDirError(
            f"{manifest_path}: built from checkpoint {built_from} (manifest sha256 "
            f"{str(recorded)[:16]}…), not {checkpoint} ({actual[:16]}…)"
        )


def confined(root: Path, relative: object, named_in: str) -> Path:
    """`root / relative` for a relative path that stays inside `root`, symbolic links included."""
    if not isinstance(relative, str) or not relative or "\0" in relative:
        raise EngineDirError(f"{named_in}: path {relative!r} is not a file name")
    parts = Path(relative).parts
    if Path(relative).is_absolute() or ".." in parts or "\\" in relative:
        raise EngineDirError(f"{named_in}: path {relative} leaves the engine directory")
    path = root / relative
    if not path.resolve().is_relative_to(root.resolve()):
        raise EngineDirError(f"{named_in}: path {relative} resolves outside the engine directory")
    return path


def check_recorded_file(root: Path, relative: str, record: object) -> None:
    path = confined(root, relative, str(root / MANIFEST))
    if not isinstance(record, dict) or not isinstance(record.get("sha256"), str):
        raise EngineDirError(f"{path}: no sha256 recorded")
    if not path.is_file():
        raise EngineDirError(f"{path}: missing")
    actual = sha256_file(path)
    if actual != record["sha256"]:
        raise EngineDirError(f"{path}: sha256 {actual[:16]}…, recorded {record['sha256'][:16]}…")


def check_onnx_files(root: Path, recorded: dict[str, dict]) -> None:
    """Every ONNX file under the directory is recorded, and so is every external-data file it
    names, each inside the directory (the files are hashed already, so parsing them is safe)."""
    for onnx_path in sorted(root.rglob("*.onnx")):
        relative = onnx_path.relative_to(root).as_posix()
        if relative not in recorded:
            raise EngineDirError(f"{onnx_path}: not recorded in {MANIFEST}")
        model = onnx.load(str(onnx_path), load_external_data=False)
        for tensor in model.graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            for entry in tensor.external_data:
                if entry.key != "location":
                    continue
                data = confined(onnx_path.parent, entry.value, str(onnx_path))
                confined(root, data.relative_to(root).as_posix(), str(onnx_path))
                if data.relative_to(root).as_posix() not in recorded:
                    raise EngineDirError(f"{data}: external data not recorded in {MANIFEST}")


def check_plugin(record: object) -> None:
    """The plugin library the plans were built with, unchanged since (it lies outside the
    directory by design: plugins/build, or $OMNIJEV_PLUGIN_LIBRARY)."""
    library = record.get("library") if isinstance(record, dict) else None
    if not isinstance(library, str) or not Path(library).is_absolute():
        raise EngineDirError(f"plugin library {library!r}: not an absolute path")
    path = Path(library)
    if not path.is_file():
        raise EngineDirError(f"{path}: plugin library missing")
    actual = sha256_file(path)
    if actual != record.get("sha256"):
        raise EngineDirError(f"{path}: sha256 {actual[:16]}…, recorded {record.get('sha256')}")


def tree_digest(folder: Path) -> str:
    """sha256 over every file's relative path and contents, in path order (as
    `build_engines.engines.tree_digest` records the torch backend's compiler caches)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def check_tree(root: Path, record: object) -> None:
    """The torch backend's compiler caches (code it loads): inside the directory, unchanged."""
    named_in = str(root / MANIFEST)
    folder = confined(root, record.get("dir") if isinstance(record, dict) else None, named_in)
    if not folder.is_dir():
        raise EngineDirError(f"{folder}: missing")
    for path in folder.rglob("*"):
        confined(root, path.relative_to(root).as_posix(), named_in)
    actual = tree_digest(folder)
    if actual != record.get("sha256"):
        raise EngineDirError(f"{folder}: sha256 {actual[:16]}…, recorded {record.get('sha256')}")
