"""Compiled blocks saved ahead of time: Dynamo's `aot_compile` of a block (one saved function
per graph it needs, chosen by their guards), loaded by a later process without tracing.

On the H200 a start with every compiled graph in the compiler caches still spent 38 of its
89.6 s tracing the blocks (docs/measurements/h200-2026-12-02d), and on the CPU each traced op
cost milliseconds of symbolic arithmetic (docs/measurements/dynamo-tracing-2026-12-02.md): a
saved function skips the tracing. Off by default (`AOT_ENV`) until it is measured on the H200.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

# a saved graph calls the model's custom ops by name, and nothing registers them when no block
# is traced: the fla core's op was missing on the H200 (docs/measurements/h200-2026-12-02e)
from runtime.model import attention_kernels, gdn_kernels, layers  # noqa: F401

log = logging.getLogger("omnijev.aot")

AOT_ENV = "OMNIJEV_AOT_BLOCKS"  # "1": the torch backend's blocks compiled and saved ahead of time
AOT_DIR_ENV = "OMNIJEV_AOT_DIR"  # where they are saved (compiled.use_caches sets it)
SUFFIX = ".aot"


def enabled() -> bool:
    """Whether the torch backend compiles its blocks ahead of time (`AOT_ENV`)."""
    return os.environ.get(AOT_ENV, "0").lower() in ("1", "true", "yes")


def supported() -> bool:
    """Whether this torch has Dynamo's ahead-of-time compile (experimental in torch 2.11 and
    2.13) and its switch (`enable_aot_compile`, which the block turns on)."""
    return hasattr(torch.compiler, "load_compiled_function") and hasattr(
        torch._dynamo.config, "enable_aot_compile"
    )


class AheadOfTimeBlock:
    """A block function compiled as Dynamo's saved functions in `folder` (`{name}.*.aot`): a
    call runs the first whose guards take its arguments; a call none takes compiles one more,
    saves it and runs it. Where the compile fails, the block falls back to `torch.compile`."""

    def __init__(self, name: str, function: Callable, folder: Path):
        self.name, self.function, self.folder = name, function, Path(folder)
        # floats as constants: Dynamo's float tensorification restarts its analysis, which an
        # ahead-of-time compile does not take (TensorifyScalarRestartAnalysis)
        torch._dynamo.config.specialize_float = True
        # torch 2.11 has the API but hands a compiled function its `aot_compile` only with this
        # on (torch 2.13 has it on by default)
        torch._dynamo.config.enable_aot_compile = True
        self.compiler = torch.compile(function, fullgraph=True, dynamic=True)
        self.fallback: Callable | None = None
        self.entries = self.load()
        self.compiled = 0  # entries this process compiled

    def load(self) -> list:
        """The saved functions of this block, oldest first; one that does not load is skipped."""
        entries = []
        paths = sorted(self.folder.glob(f"{self.name}.*{SUFFIX}"), key=lambda p: p.stat().st_mtime)
        for path in paths:
            try:
                # under inference mode, as the executor calls the blocks: a loaded guard takes
                # the dispatch keys a tensor has under the mode it is built in
                with open(path, "rb") as file, torch.inference_mode():
                    entries.append(torch.compiler.load_compiled_function(file))
            except Exception as error:  # another torch's, or a partial file
                log.warning("aot: %s does not load (%s), skipped", path.name, error)
        return entries

    def __call__(self, *args):
        if self.fallback is not None:
            return self.fallback(*args)
        for entry in self.entries:
            if entry.guard_check(*args):
                return entry(*args)
        try:
            entry = self.compiler.aot_compile((args, {}))
        except Exception as error:  # a graph break, an input it cannot save
            log.warning("aot: %s does not compile ahead of time (%s)", self.name, error)
            self.fallback = torch.compile(self.function, dynamic=True)
            return self.fallback(*args)
        self.entries.append(entry)
        self.compiled += 1
        self.save(entry)
        return entry(*args)

    def save(self, entry) -> None:
        """Written whole, then renamed: a concurrent start reads complete files only."""
        self.folder.mkdir(parents=True, exist_ok=True)
        target = self.folder / f"{self.name}.{uuid.uuid4().hex}{SUFFIX}"
        partial = target.with_suffix(".partial")
        try:
            entry.save_compiled_function(str(partial))
            partial.rename(target)
        except Exception as error:  # the entry still runs in this process
            log.warning("aot: %s not saved (%s)", self.name, error)
            partial.unlink(missing_ok=True)


def aot_folder() -> Path:
    """Where the saved functions go: `AOT_DIR_ENV`, else beside the compiler caches."""
    named = os.environ.get(AOT_DIR_ENV)
    if named:
        return Path(named)
    from runtime.config import cache_home

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return cache_home() / "aot" / f"{torch.__version__}-{device}".replace(" ", "_")
