"""Shared test helpers: ONNX Runtime engines for the tiny checkpoint, exported once per run.

Every ONNX variant of an export is written once per test run, whichever pytest-xdist worker asks
first (`exported`): the engine fixtures read it, and `build_engines` in tests/test_engines.py
copies it (`reuse_exports`) where it asks for the same export with the same arguments, since a
variant of the tiny checkpoint takes 30-40 s to export on the 2-core CI machine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from tests.checkpoint_fixtures import once, tiny_export


def exported(
    tmp_path_factory, export: Path, dtype: str, gdn: str, readout: str, export_onnx=None
) -> Path:
    """The folder of one ONNX variant of `export` (every graph), exported once per run (by
    `export_onnx`, the exporter's own where not given)."""
    from build_engines import onnx_export

    export_onnx = export_onnx or onnx_export.export_onnx
    source = hashlib.sha256(str(Path(export).resolve()).encode()).hexdigest()[:12]
    name = f"onnx-{source}-{dtype}-{gdn}-{readout}"

    def export_variant(folder: Path) -> None:
        export_onnx(export, folder / "variant", dtype=dtype, gdn=gdn, readout=readout)

    return once(tmp_path_factory, name, export_variant) / "variant"


def reuse_exports(tmp_path_factory, monkeypatch) -> None:
    """Makes `build_engines.onnx_export.export_onnx` copy a run's variant (`exported`) into
    the folder it is asked to write, where the arguments are the same, instead of exporting
    again; the copy is the same files, so manifests, checks and plans see what an export
    writes."""
    from build_engines import onnx_export

    real = onnx_export.export_onnx

    def export_onnx(export_dir, out_dir, dtype="float32", gdn="ort", readout="std", **options):
        if options.get("graphs", onnx_export.GRAPHS) != onnx_export.GRAPHS or options.get(
            "attention"
        ):
            return real(export_dir, out_dir, dtype=dtype, gdn=gdn, readout=readout, **options)
        folder = exported(tmp_path_factory, Path(export_dir), dtype, gdn, readout, real)
        shutil.copytree(folder, out_dir, dirs_exist_ok=True)
        return json.loads((Path(out_dir) / onnx_export.MANIFEST).read_text("utf-8"))

    monkeypatch.setattr(onnx_export, "export_onnx", export_onnx)


def tiny_variant(tmp_path_factory, gdn: str) -> Path:
    """The float32 ONNX Runtime files of the tiny export (`gdn` "ort" or "std") under an engine
    directory's `onnx_ort/`, exported once per run."""
    from build_engines.engines import (
        FORMAT,
        checkpoint_record,
        variant_files,
        write_manifest,
    )

    export = tiny_export(tmp_path_factory)

    def build(folder: Path) -> None:
        engines = folder / "engines"
        variant = exported(tmp_path_factory, export, "float32", gdn, "std")
        shutil.copytree(variant, engines / "onnx_ort")
        # what `omnijev engines --skip-plans` records, so the directory passes verification
        manifest = {
            "format": FORMAT,
            "checkpoint": checkpoint_record(export),
            "onnx": {"onnx_ort": {"files": variant_files(engines, "onnx_ort")}},
            "plans": None,
        }
        write_manifest(engines, manifest)

    return once(tmp_path_factory, f"tiny-{gdn}-engines", build) / "engines"


def tiny_engines(tmp_path_factory) -> tuple[Path, Path]:
    """(export dir, engine dir) with the float32 ONNX Runtime variant under `onnx_ort/`."""
    return tiny_export(tmp_path_factory), tiny_variant(tmp_path_factory, "ort")


def tiny_std_engines(tmp_path_factory) -> Path:
    """The standard-op variant (what TensorRT builds): one 64-token chunk per pass."""
    return tiny_variant(tmp_path_factory, "std")
