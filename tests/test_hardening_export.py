"""Checkpoint paths stay inside the export directory (issue 14): a listed output that is a
symbolic link out of it, and an index naming a shard by a path, are refused before any read
(runtime.export_format.check_outputs, check_shards)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runtime.export_format import INDEX, MANIFEST, ExportError, load_export, sha256_file
from tests.checkpoint_fixtures import copy_export, rewrite


@pytest.fixture
def copy(export_dir: Path, tmp_path: Path) -> Path:
    return copy_export(export_dir, tmp_path / "export")


def test_a_listed_output_linking_outside_is_refused(copy: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside.json"
    outside.write_bytes((copy / "config.json").read_bytes())  # same bytes: the hash matches
    (copy / "config.json").unlink()
    (copy / "config.json").symlink_to(outside)
    with pytest.raises(ExportError, match="config.json resolves outside the export directory"):
        load_export(copy, verify=False)


@pytest.mark.parametrize("shard", ["../model-00001-of-00002.safetensors", "/etc/passwd"])
def test_an_index_naming_a_shard_by_a_path_is_refused(copy: Path, shard: str) -> None:
    index = json.loads((copy / INDEX).read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    rewrite(copy / INDEX, json.dumps(index))
    manifest = json.loads((copy / MANIFEST).read_text())

    manifest["outputs"][INDEX] = sha256_file(copy / INDEX)
    rewrite(copy / MANIFEST, json.dumps(manifest))
    with pytest.raises(ExportError, match="is not listed in the manifest"):
        load_export(copy)
