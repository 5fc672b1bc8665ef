"""`omnijev engines`: export → ONNX Runtime check → plan build into one engine directory that the
runtime loads (docs/design.md; docs/engines.md §2-§4, §8, §11).

Layout: `onnx_ort/` (fused GDN, standard-op readout: what ONNX Runtime runs), `onnx_trt/`
(standard-op GDN; the plugin readout where the library can load it), `plans/`, `timing_cache.bin`
with its `.sha256`, `torch/` (the torch backend's Inductor and Triton caches, when prepared on a
GPU) and the manifest `engines.json`.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np

from build_engines import trt_build
from runtime import manifest as manifests
from runtime.constants import GRAPHS

FORMAT = manifests.FORMAT
MANIFEST = manifests.MANIFEST
ONNX_ORT = manifests.ONNX_ORT
ONNX_TRT = manifests.ONNX_TRT
DESCRIPTION = "onnx_export.json"  # each variant's export description (onnx_export.MANIFEST)
GDN = {ONNX_ORT: "ort", ONNX_TRT: "std"}  # the Gated DeltaNet form of each variant directory
EXPORT_MANIFEST = manifests.EXPORT_MANIFEST
# Small, distinct pass sizes for the check (distinct so a swapped axis shows); T ≤ 64 fits the
# standard-op GDN graph too.
CHECK_SIZES = {"B": 2, "T": 5, "N": 3, "P": 4, "Q": 3, "S": 2, "R": 3, "M": 4, "I": 2}
CHECK_SEED = 0
# Largest |ONNX Runtime − export module| / max(1, |module|) accepted; float32 differs only by
# operation order, bfloat16 by rounding of intermediates.
CHECK_TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def variant_files(engine_dir: Path, variant: str) -> dict:
    folder = engine_dir / variant
    files = {}
    described = [folder / DESCRIPTION] if (folder / DESCRIPTION).is_file() else []
    for onnx_path in sorted(folder.glob("*.onnx")):
        for path in manifests.onnx_files(onnx_path):
            files[path.relative_to(engine_dir).as_posix()] = manifests.file_record(path)
    for path in described:  # the backend reads it (the variant's pass limit): hashed too
        files[path.relative_to(engine_dir).as_posix()] = manifests.file_record(path)
    return files


def export_variant(
    checkpoint: Path, engine_dir: Path, variant: str, dtype: str, readout: str
) -> dict:
    from build_engines.onnx_export import export_onnx

    gdn = GDN[variant]
    started = time.perf_counter()
    export_onnx(checkpoint, engine_dir / variant, dtype=dtype, gdn=gdn, readout=readout)
    return {
        "gdn": gdn,
        "readout": readout,
        "dtype": dtype,
        "export_seconds": round(time.perf_counter() - started, 2),
        "files": variant_files(engine_dir, variant),
    }


# -- ONNX Runtime check ------------------------------------------------------------------------


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    actual, expected = actual.astype(np.float64), expected.astype(np.float64)
    if actual.shape != expected.shape:
        raise ValueError(f"shape {actual.shape}, expected {expected.shape}")
    if actual.size == 0:
        return 0.0
    scale = max(1.0, float(np.abs(expected).max()))
    return float(np.abs(actual - expected).max()) / scale


class CheckModules:
    """The export modules the check compares against, each loaded once for every variant and
    graph (the language pass serves both language graphs: only `return_state` differs)."""

    def __init__(self, checkpoint: Path, dtype: str):
        self.checkpoint, self.dtype = checkpoint, dtype
        self._tower = self._language = None

    def tower(self):
        from runtime.constants import DTYPES
        from runtime.model.weights import load_vision_tower

        if self._tower is None:
            self._tower, _ = load_vision_tower(self.checkpoint, DTYPES[self.dtype])
        return self._tower

    def language(self, return_state: bool):
        from runtime.constants import DTYPES
        from runtime.model.weights import load_language_pass

        if self._language is None:
            self._language = load_language_pass(self.checkpoint, DTYPES[self.dtype])
        self._language.return_state = return_state
        return self._language


def check_inputs(modules: CheckModules, graph: str) -> tuple:
    """(module, positional args, ONNX feeds by name, output names) for one small pass."""
    import torch

    from build_engines.onnx_export import (
        example_lm_feeds,
        lm_args,
        lm_output_names,
        vision_example,
    )
    from runtime.constants import DTYPES
    from runtime.model.weights import read_config

    torch.manual_seed(CHECK_SEED)  # example_lm_feeds draws token ids from the global generator
    config = read_config(modules.checkpoint)
    torch_dtype = DTYPES[modules.dtype]
    if graph == "vision":
        args = vision_example(config, torch_dtype)
        names = ["pixel_values", "pos_embeds", "cos", "sin"]
        return modules.tower(), args, dict(zip(names, args, strict=True)), ["image_features"]
    state = graph == "lm_state"
    feeds = example_lm_feeds(config, torch_dtype, CHECK_SIZES)
    return modules.language(state), lm_args(feeds, config), feeds, lm_output_names(config, state)


def numpy_of(tensor) -> np.ndarray:
    import torch

    if tensor.dtype == torch.bfloat16:
        import ml_dtypes  # onnx's dependency; numpy has no bfloat16 of its own

        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def check_graph(modules: CheckModules, onnx_path: Path, graph: str) -> dict:
    """One small pass in an ONNX Runtime CPU session against the export module."""
    import onnxruntime as ort
    import torch

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    module, args, feeds, names = check_inputs(modules, graph)
    dtype = modules.dtype
    wanted = {i.name for i in session.get_inputs()}
    ort_feeds = {name: numpy_of(value) for name, value in feeds.items() if name in wanted}
    got = dict(zip(names, session.run(names, ort_feeds), strict=True))
    with torch.no_grad():
        result = module(*args)
    results = (result,) if isinstance(result, torch.Tensor) else result
    expected = dict(zip(names, results, strict=True))
    errors = {}
    for name in names:
        actual = np.asarray(got[name]).astype(np.float32)
        if not np.isfinite(actual).all():
            raise RuntimeError(f"{onnx_path.name}: output {name} is not finite")
        errors[name] = relative_error(actual, expected[name].float().numpy())
    worst = max(errors, key=errors.get)
    if errors[worst] > CHECK_TOLERANCE[dtype]:
        raise RuntimeError(
            f"{onnx_path.name}: output {worst} differs from the export module by "
            f"{errors[worst]:.2e} (relative), above {CHECK_TOLERANCE[dtype]:.0e}"
        )
    return {"max_relative_error": errors[worst], "worst_output": worst, "outputs": len(names)}


def custom_domains(onnx_path: Path) -> list[str]:
    import onnx

    graph = onnx.load(str(onnx_path), load_external_data=False).graph
    return sorted({node.domain for node in graph.node if node.domain not in ("", "ai.onnx")})


def check_variant(modules: CheckModules, engine_dir: Path, variant: str) -> dict:
    """Every graph of a variant that ONNX Runtime can run; custom-node graphs are noted."""
    results = {}
    for graph in GRAPHS:
        onnx_path = engine_dir / variant / f"{graph}.onnx"
        domains = [d for d in custom_domains(onnx_path) if d != "com.microsoft"]
        if domains:
            results[graph] = {"skipped": f"custom domain {', '.join(domains)}: no ORT kernel"}
            continue
        results[graph] = check_graph(modules, onnx_path, graph)
    return results


# -- the engine directory -------------------------------------------------------------------


def checkpoint_record(checkpoint: Path) -> dict:
    manifest = checkpoint / EXPORT_MANIFEST
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest() if manifest.is_file() else None
    return {"path": str(checkpoint.resolve()), "manifest_sha256": digest}


def write_manifest(engine_dir: Path, manifest: dict) -> Path:
    path = engine_dir / MANIFEST
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n", "utf-8")
    temporary.replace(path)  # a reader never sees half a manifest
    return path


def build_engines(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    plans: bool = True,
    timing_cache: str | Path | None = None,
) -> Path:
    """Exports the ONNX variants, checks them in ONNX Runtime, builds the plans (unless `plans`
    is false: then only the ONNX Runtime variant) and writes `engines.json`."""
    started = time.perf_counter()
    checkpoint, engine_dir = Path(checkpoint_dir), Path(out_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    (engine_dir / MANIFEST).unlink(missing_ok=True)  # no stale manifest over new files
    trt = manifests.import_library()
    if plans and trt is None:
        raise RuntimeError("no tensorrt or tensorrt_rtx importable; use --skip-plans")
    readout, reason = trt_build.trt_readout(trt)
    onnx = {ONNX_ORT: export_variant(checkpoint, engine_dir, ONNX_ORT, dtype, "std")}
    if plans:  # the standard-op variant only feeds the plans
        onnx[ONNX_TRT] = export_variant(checkpoint, engine_dir, ONNX_TRT, dtype, readout)
    modules = CheckModules(checkpoint, dtype)
    checks = {variant: check_variant(modules, engine_dir, variant) for variant in onnx}
    del modules  # the weights are not needed for the plans
    manifest = {
        "format": FORMAT,
        "dtype": dtype,
        "checkpoint": checkpoint_record(checkpoint),
        "onnx": onnx,
        "ort_check": checks,
        "plans": None,
    }
    if plans:
        manifest["plans"] = trt_build.build_plans(engine_dir, trt, readout, reason, timing_cache)
    manifest["seconds"] = round(time.perf_counter() - started, 2)
    write_manifest(engine_dir, manifest)
    return engine_dir


def summary(manifest: dict) -> list[str]:
    lines = []
    for variant, info in manifest["onnx"].items():
        lines.append(
            f"{variant}: gdn={info['gdn']} readout={info['readout']} "
            f"({info['export_seconds']} s, {len(info['files'])} files)"
        )
    for variant, graphs in manifest["ort_check"].items():
        for graph, result in graphs.items():
            error = result.get("max_relative_error")
            detail = result.get("skipped") or f"max relative error {error:.1e}"
            lines.append(f"ort check {variant}/{graph}: {detail}")
    plans = manifest["plans"]
    if plans:
        lines.append(
            f"plans: {plans['library']} {plans['version']} on {plans['device']}, "
            f"readout={plans['readout']}, timing cache {plans['timing_cache']['mode']}"
        )
        for entry in plans["graphs"].values():
            lines.append(f"  {entry['plan']}: {entry['bytes']} bytes ({entry['build_seconds']} s)")
    lines.append(f"total {manifest['seconds']} s")
    return lines


def torch_engine_dir(checkpoint_dir: str | Path, out_dir: str | Path, dtype: str) -> Path:
    """The torch backend's engine directory without an ONNX export: the manifest naming the
    checkpoint and dtype (the backend compiles from the checkpoint's weights)."""
    engine_dir = Path(out_dir)
    engine_dir.mkdir(parents=True, exist_ok=True)
    record = {
        "format": FORMAT,
        "dtype": dtype,
        "checkpoint": checkpoint_record(Path(checkpoint_dir)),
    }
    write_manifest(engine_dir, record)
    return engine_dir


def cli_engines(args) -> int:
    """`omnijev engines --checkpoint DIR --out DIR [--dtype] [--skip-plans]`, or with
    `--backend torch` the torch engine alone: no ONNX export, its compiler caches filled."""
    if getattr(args, "backend", "all") == "torch":
        torch_engine_dir(args.checkpoint, args.out, args.dtype)
        record = build_torch_artifacts(args.checkpoint, args.out, args.dtype)
        print(f"torch caches: {record['files']} files, {record['seconds']} s, {record['versions']}")
        return 0
    engine_dir = build_engines(
        args.checkpoint,
        args.out,
        args.dtype,
        plans=not getattr(args, "skip_plans", False),
        timing_cache=getattr(args, "timing_cache", None),
    )
    for line in summary(manifests.read_manifest(engine_dir)):
        print(line)
    if args.torch_artifacts:  # on the GPU the caches are for
        record = build_torch_artifacts(args.checkpoint, args.out, args.dtype)
        print(f"torch caches: {record['files']} files, {record['seconds']} s, {record['versions']}")
    return 0


# -- the torch backend's compiler caches -------------------------------------------------------


def tree_digest(folder: Path) -> tuple[str, int]:
    """sha256 over every file's relative path and contents, in path order; the file count."""
    digest, count = hashlib.sha256(), 0
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
        count += 1
    return digest.hexdigest(), count


def build_torch_artifacts(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "bfloat16",
    warm_up: list[bytes] | None = None,
    question_rows: int | None = None,
) -> dict:
    """Fills `torch/` with the compiler caches of the torch backend's passes (the worker's
    warm-up request and `warm_up` request bodies: their shapes are compiled and captured) and
    records them in `engines.json` with the versions of torch, Triton and fla-core they were
    made with; the backend refuses them under other versions. Needs the GPU they are for."""
    import json as json_module

    from runtime.backends import compiled
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine
    from runtime.passes import QUESTION_ROWS

    started = time.perf_counter()
    engine_dir = Path(out_dir)
    folder = engine_dir / compiled.TORCH_DIR
    folder.mkdir(parents=True, exist_ok=True)
    compiled.use_caches(folder)
    path = engine_dir / MANIFEST
    manifest = json.loads(path.read_text("utf-8")) if path.is_file() else {}
    manifest.pop("torch", None)  # no stale record while the caches are rewritten
    manifest.setdefault("format", FORMAT)
    manifest.setdefault("dtype", dtype)
    manifest.setdefault("checkpoint", checkpoint_record(Path(checkpoint_dir)))
    write_manifest(engine_dir, manifest)
    config = RuntimeConfig.from_env(backend="torch", question_batch=question_rows or QUESTION_ROWS)
    executor = load_engine(str(checkpoint_dir), str(engine_dir), config)
    torch_backend = executor.backend
    if not isinstance(torch_backend, compiled.TorchBackend):
        raise RuntimeError(f"the torch caches need the torch backend, got {torch_backend.name}")
    loaded = time.perf_counter()
    warm_seconds = []  # per warm-up request: what a cold start spends where
    for body in [json_module.dumps(executor.warm_up_request()).encode(), *(warm_up or [])]:
        at = time.perf_counter()
        executor.answer(body)
        warm_seconds.append(round(time.perf_counter() - at, 2))
    at = time.perf_counter()
    executor.build_shapes()  # every patch bucket, prefix length and packed size: all compiled
    shapes_seconds = round(time.perf_counter() - at, 2)
    hashed = time.perf_counter()
    digest, count = tree_digest(folder)
    manifest["torch"] = {
        "dir": compiled.TORCH_DIR,
        "versions": compiled.versions(),
        "device": torch_device_name(),
        "sha256": digest,
        "files": count,
        "seconds": round(time.perf_counter() - started, 2),
        "load_seconds": round(loaded - started, 2),
        "load_parts": executor.load_seconds,
        "weights_seconds": round(torch_backend.weights_seconds, 2),
        "warm_up_seconds": warm_seconds,
        "shapes_seconds": shapes_seconds,
        "hash_seconds": round(time.perf_counter() - hashed, 2),
    }
    write_manifest(engine_dir, manifest)
    return manifest["torch"]


def torch_device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
