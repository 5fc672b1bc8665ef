"""Shared test helpers: ONNX Runtime engines for the tiny checkpoint, exported once per session."""

from __future__ import annotations

from pathlib import Path

from tests.checkpoint_fixtures import tiny_export

_BUILT: dict[Path, Path] = {}


def tiny_engines(tmp_path_factory) -> tuple[Path, Path]:
    """(export dir, engine dir) with the float32 ONNX Runtime variant under `onnx_ort/`."""
    from build_engines.onnx_export import export_onnx

    export = tiny_export(tmp_path_factory)
    if export not in _BUILT:
        engines = tmp_path_factory.mktemp("tiny-engines")
        export_onnx(export, engines / "onnx_ort", dtype="float32", gdn="ort", readout="std")
        _BUILT[export] = engines
    return export, _BUILT[export]


def tiny_std_engines(tmp_path_factory) -> Path:
    """The standard-op variant (what TensorRT builds): one 64-token chunk per pass."""
    from build_engines.onnx_export import export_onnx

    export = tiny_export(tmp_path_factory)
    key = export / "std"
    if key not in _BUILT:
        engines = tmp_path_factory.mktemp("tiny-std")
        export_onnx(export, engines / "onnx_ort", dtype="float32", gdn="std", readout="std")
        _BUILT[key] = engines
    return _BUILT[key]
