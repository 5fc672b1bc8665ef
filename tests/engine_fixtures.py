"""Shared test helpers: ONNX Runtime engines for the tiny checkpoint, exported once per session."""

from __future__ import annotations

from pathlib import Path

from tests.checkpoint_fixtures import tiny_export

_BUILT: dict[tuple[Path, str], Path] = {}


def tiny_variant(tmp_path_factory, gdn: str) -> Path:
    """The float32 ONNX Runtime files of the tiny export (`gdn` "ort" or "std") under an engine
    directory's `onnx_ort/`, exported once per session."""
    from build_engines.engines import (
        FORMAT,
        checkpoint_record,
        variant_files,
        write_manifest,
    )
    from build_engines.onnx_export import export_onnx

    export = tiny_export(tmp_path_factory)
    if (export, gdn) not in _BUILT:
        engines = tmp_path_factory.mktemp(f"tiny-{gdn}-engines")
        export_onnx(export, engines / "onnx_ort", dtype="float32", gdn=gdn, readout="std")
        # what `omnijev engines --skip-plans` records, so the directory passes verification
        manifest = {
            "format": FORMAT,
            "checkpoint": checkpoint_record(export),
            "onnx": {"onnx_ort": {"files": variant_files(engines, "onnx_ort")}},
            "plans": None,
        }
        write_manifest(engines, manifest)
        _BUILT[(export, gdn)] = engines
    return _BUILT[(export, gdn)]


def tiny_engines(tmp_path_factory) -> tuple[Path, Path]:
    """(export dir, engine dir) with the float32 ONNX Runtime variant under `onnx_ort/`."""
    return tiny_export(tmp_path_factory), tiny_variant(tmp_path_factory, "ort")


def tiny_std_engines(tmp_path_factory) -> Path:
    """The standard-op variant (what TensorRT builds): one 64-token chunk per pass."""
    return tiny_variant(tmp_path_factory, "std")
