"""Shared test helpers: the tiny synthetic checkpoint, written once per session, and safe copies.

Test modules ask for the `export_dir` and `release_dir` fixtures of tests/conftest.py. The export
must not be modified; `copy_export` gives a private copy whose files may be rewritten.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from build_engines.checkpoints import make_checkpoint, release_path

_BUILT: dict[int, Path] = {}


def tiny_export(tmp_path_factory, seed: int = 0) -> Path:
    """The tiny preset's export directory (release beside it), built once per session and seed."""
    if seed not in _BUILT:
        root = tmp_path_factory.mktemp(f"tiny-seed{seed}", numbered=True)
        _BUILT[seed] = make_checkpoint("tiny", seed, root / "export")
    return _BUILT[seed]


def tiny_release(tmp_path_factory, seed: int = 0) -> Path:
    """The release (`base/`, `checkpoint/`) that `tiny_export` merged."""
    return release_path(tiny_export(tmp_path_factory, seed))


def copy_export(source: Path, dest: Path) -> Path:
    """A copy of a directory tree made of hard links: cheap, but rewrite files, never edit them."""
    shutil.copytree(source, dest, copy_function=os.link)
    return dest


def rewrite(path: Path, data: bytes | str) -> None:
    """Replaces a (possibly hard-linked) file without touching the other links."""
    path.unlink()
    if isinstance(data, str):
        path.write_text(data, "utf-8")
    else:
        path.write_bytes(data)
