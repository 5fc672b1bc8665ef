"""Shared test helpers: the tiny synthetic checkpoint, written once per test run, and safe copies.

Test modules ask for the `export_dir` and `release_dir` fixtures of tests/conftest.py. The export
must not be modified; `copy_export` gives a private copy whose files may be rewritten. `once`
builds a folder once per run, however many pytest-xdist workers ask for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

from build_engines.checkpoints import make_checkpoint, release_path

DONE = ".built"  # written last into a folder `once` built, so a half-built one is never used


def run_root(tmp_path_factory) -> Path:
    """The folder every worker of this test run sees: the base temp of the run, which is the
    parent of a worker's own under pytest-xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The folder `name` of this run, `build(folder)` having filled it once: the first worker to
    ask builds it while the others wait on its lock."""
    folder = run_root(tmp_path_factory) / name
    with FileLock(f"{folder}.lock"):
        if not (folder / DONE).exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed part way
            folder.mkdir(parents=True)
            build(folder)
            (folder / DONE).touch()
    return folder


def tiny_export(tmp_path_factory, seed: int = 0) -> Path:
    """The tiny preset's export directory (release beside it), built once per run and seed."""
    root = once(
        tmp_path_factory, f"tiny-seed{seed}", lambda f: make_checkpoint("tiny", seed, f / "export")
    )
    return root / "export"


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
