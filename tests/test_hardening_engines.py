"""Engine directories are verified before use (issue 14): a missing manifest, a changed ONNX
file, external-data file, plan or plugin, a `../` path and another checkpoint are each refused
with a message naming the file (runtime.manifest.verify_engine_dir)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from build_engines.engines import (
    FORMAT,
    checkpoint_record,
    tree_digest,
    variant_files,
    write_manifest,
)
from runtime import manifest as manifests
from runtime.manifest import MANIFEST, EngineDirError, file_record, verify_engine_dir
from tests.engine_fixtures import tiny_engines

VARIANT = "onnx_ort"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(checkpoint, engine dir) with a manifest as the build writes it: the vision graph's
    weights moved to external data (as the 4B export keeps them), a stand-in plan, plugin
    library and torch compiler cache (hashing does not care what the bytes are)."""
    export, onnx_dir = tiny_engines(tmp_path_factory)
    engines = tmp_path_factory.mktemp("verified") / "engines"
    shutil.copytree(onnx_dir, engines)
    vision = engines / VARIANT / "vision.onnx"
    model = onnx.load(str(vision))
    onnx.save_model(model, str(vision), save_as_external_data=True, location="vision.data")
    plan = engines / "plans" / "vision.plan"
    plan.parent.mkdir()
    plan.write_bytes(b"serialized plan")
    plugin = engines.parent / "libomnijev_plugins.so"
    plugin.write_bytes(b"\x7fELF plugin")
    cache = engines / "torch" / "inductor"
    cache.mkdir(parents=True)
    (cache / "kernel.py").write_text("compiled = True\n")
    manifest = {
        "torch": {"dir": "torch", "sha256": tree_digest(engines / "torch")[0]},
        "format": FORMAT,
        "checkpoint": checkpoint_record(export),
        "onnx": {VARIANT: {"files": variant_files(engines, VARIANT)}},
        "plans": {
            "graphs": {"vision": {"plan": "plans/vision.plan", **file_record(plan), "onnx": {}}},
            "plugin": {"library": str(plugin), **file_record(plugin)},
        },
    }
    write_manifest(engines, manifest)
    return export, engines


@pytest.fixture
def copy(built: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the verified directory for one test to tamper with."""
    export, engines = built
    target = tmp_path / "engines"
    shutil.copytree(engines, target)
    manifest = json.loads((target / MANIFEST).read_text())
    plugin = tmp_path / "libomnijev_plugins.so"
    shutil.copy(manifest["plans"]["plugin"]["library"], plugin)
    manifest["plans"]["plugin"]["library"] = str(plugin)
    write_manifest(target, manifest)
    return export, target


def edit_manifest(engines: Path, change) -> None:
    manifest = json.loads((engines / MANIFEST).read_text())
    change(manifest)
    write_manifest(engines, manifest)


def refused(engines: Path, export: Path) -> str:
    with pytest.raises(EngineDirError) as caught:
        verify_engine_dir(engines, export)
    return str(caught.value)


def some_onnx(engines: Path) -> Path:
    return sorted((engines / VARIANT).glob("*.onnx"))[0]


def test_an_intact_directory_is_accepted(built: tuple[Path, Path]) -> None:
    export, engines = built
    verify_engine_dir(engines, export)
    verify_engine_dir(str(engines), str(export))


def test_a_missing_manifest_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    (engines / MANIFEST).unlink()
    assert f"{engines / MANIFEST}: missing" in refused(engines, export)


def test_a_changed_onnx_file_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    target = some_onnx(engines)
    with target.open("ab") as handle:
        handle.write(b"\0")
    assert str(target) in refused(engines, export)


def test_a_changed_external_data_file_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    target = engines / VARIANT / "vision.data"
    raw = bytearray(target.read_bytes())
    raw[0] ^= 1
    target.write_bytes(bytes(raw))
    assert str(target) in refused(engines, export)


def test_an_unrecorded_onnx_file_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    stray = engines / VARIANT / "stray.onnx"
    shutil.copy(some_onnx(engines), stray)
    assert f"{stray}: not recorded" in refused(engines, export)


def test_a_changed_plan_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    plan = engines / "plans" / "vision.plan"
    plan.write_bytes(b"another plan")
    assert str(plan) in refused(engines, export)


def test_a_changed_plugin_library_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    plugin = Path(json.loads((engines / MANIFEST).read_text())["plans"]["plugin"]["library"])
    plugin.write_bytes(b"\x7fELF something else")
    assert f"{plugin}: sha256" in refused(engines, export)


@pytest.mark.parametrize("escape", ["../outside.plan", "/etc/hostname", "plans/../../x.plan"])
def test_a_plan_path_leaving_the_directory_is_refused(copy: tuple[Path, Path], escape) -> None:
    export, engines = copy

    def point_outside(manifest: dict) -> None:
        manifest["plans"]["graphs"]["vision"]["plan"] = escape

    edit_manifest(engines, point_outside)
    assert f"path {escape} leaves the engine directory" in refused(engines, export)


def test_a_symlink_out_of_the_directory_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    plan = engines / "plans" / "vision.plan"
    outside = engines.parent / "outside.plan"
    outside.write_bytes(plan.read_bytes())
    plan.unlink()
    plan.symlink_to(outside)
    assert "plans/vision.plan resolves outside" in refused(engines, export)


def test_an_external_data_location_leaving_the_directory_is_refused(
    copy: tuple[Path, Path],
) -> None:
    export, engines = copy
    target = engines / VARIANT / "vision.onnx"
    model = onnx.load(str(target), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external, "the fixture keeps the vision weights as external data"
    for entry in external[0].external_data:
        if entry.key == "location":
            entry.value = "../../outside.bin"
    onnx.save(model, str(target))
    relative = target.relative_to(engines).as_posix()

    def record_the_new_hash(manifest: dict) -> None:
        manifest["onnx"][VARIANT]["files"][relative] = file_record(target)

    edit_manifest(engines, record_the_new_hash)  # the hash matches: the location must not
    message = refused(engines, export)
    assert str(target) in message and "../../outside.bin leaves the engine directory" in message


def test_engines_built_from_another_checkpoint_are_refused(
    copy: tuple[Path, Path], tmp_path: Path
) -> None:
    export, engines = copy
    other = tmp_path / "other-checkpoint"
    shutil.copytree(export, other)
    manifest = other / "omnijev_export.json"
    manifest.write_text(manifest.read_text() + " ")
    message = refused(engines, other)
    assert str(engines / MANIFEST) in message and "built from checkpoint" in message


def test_the_runtime_digest_of_a_tree_is_the_build_s(built: tuple[Path, Path]) -> None:
    _, engines = built
    assert manifests.tree_digest(engines / "torch") == tree_digest(engines / "torch")[0]


def test_a_changed_torch_compiler_cache_is_refused(copy: tuple[Path, Path]) -> None:
    export, engines = copy
    (engines / "torch" / "inductor" / "kernel.py").write_text("import os\n")
    assert f"{engines / 'torch'}: sha256" in refused(engines, export)


def test_the_executor_refuses_a_tampered_directory_before_loading_it(copy):
    """The check runs at start-up, before any session reads a file: a changed ONNX file and a
    missing manifest stop `load_engine` with a message naming the file."""
    from runtime.executor import load_engine

    export, engines = copy
    path = some_onnx(engines)
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(EngineDirError, match=path.name):
        load_engine(str(export), str(engines), "onnxruntime")
    (engines / MANIFEST).unlink()
    with pytest.raises(EngineDirError, match="engines.json: missing"):
        load_engine(str(export), str(engines), "onnxruntime")
