"""The runtime's settings in one object, read once from the environment and the command line and
passed down to the executor, the pass planner and the backends (docs/design.md "Settings").

Only what a deployment chooses is a setting; what follows from the device and the engine (CUDA
graphs, packed passes, heads on the device...) is the backend's to declare
(`runtime.backends.Capabilities`). Every `OMNIJEV_*` variable is read here and nowhere else.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path

PREFIX = "OMNIJEV_"
PREFIX_CACHE = 8  # image prefixes kept: several questions about one screenshot are common
# rows of every question pass (runtime.passes: fixed row counts keep answers invariant); 16
# holds the 12 speed-bench questions in one pass
QUESTION_BATCH = 16
MAX_QUESTION_BATCH = 16  # rows of the largest question pass the engines are built for
# the worker's Host header allow-list and its documentation routes (server.app)
ALLOWED_HOSTS = PREFIX + "ALLOWED_HOSTS"  # "a,b" replaces the local names, "*" allows any
DOCS = PREFIX + "DOCS"  # "0" turns off /docs, /redoc and /openapi.json


@dataclass(frozen=True)
class RuntimeConfig:
    """Every setting a deployment chooses, with its default."""

    # which engine runs the passes: auto, onnxruntime (ort), tensorrt, torch; auto picks the
    # fastest that can run here
    backend: str = "auto"
    # cuda or cpu: a machine with a GPU may still serve from its CPU; None picks CUDA where the
    # backend can use it
    device: str | None = None
    # image prefixes kept across requests (~50 MiB each on the 4b): memory against reuse of
    # an image asked about again; 0 turns it off
    prefix_cache: int = PREFIX_CACHE
    # rows of a question pass where the engine keeps fixed row counts (ONNX Runtime, TensorRT):
    # a deployment whose requests ask few questions pads fewer rows (at most MAX_QUESTION_BATCH)
    question_batch: int = QUESTION_BATCH
    # ONNX Runtime intra-op threads: the cores a CPU deployment gives the engine; 0: its default
    ort_threads: int = 0
    # the TensorRT readout plugin, where the deployment installs it; None: plugins/build/
    plugin_library: str | None = None
    # waiting requests share passes where the backend keeps every byte (checked at load); off:
    # each request runs alone, its time independent of other clients' requests
    merge: bool = True

    def __post_init__(self) -> None:
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be at least 0, got {self.prefix_cache}")
        if not 1 <= self.question_batch <= MAX_QUESTION_BATCH:
            raise ValueError(
                f"question_batch must be 1..{MAX_QUESTION_BATCH}, got {self.question_batch}"
            )
        if self.ort_threads < 0:
            raise ValueError(f"ort_threads must be at least 0, got {self.ort_threads}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides) -> RuntimeConfig:
        """Defaults, then `OMNIJEV_<NAME>` variables, then `overrides` (None values ignored)."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in fields(cls):
            raw = environ.get(PREFIX + field.name.upper())
            if raw not in (None, ""):
                values[field.name] = parse(field.name, raw, field.type)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    @classmethod
    def from_args(cls, args: argparse.Namespace, environ: Mapping[str, str] | None = None):
        """The environment, then whatever of these settings the command line gave."""
        given = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        return cls.from_env(environ, **given)

    def with_(self, **changes) -> RuntimeConfig:
        return replace(self, **changes)


def cache_home() -> Path:
    """Where the runtime keeps what it builds for itself (tokenizer files, private copies of
    compiler caches): `$XDG_CACHE_HOME/omnijev`, else `~/.cache/omnijev`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omnijev"


def allowed_hosts(environ: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """OMNIJEV_ALLOWED_HOSTS as lowercase host names; None where it is not set."""
    value = (os.environ if environ is None else environ).get(ALLOWED_HOSTS)
    if value is None:
        return None
    return tuple(name.strip().lower() for name in value.split(",") if name.strip())


def docs_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the worker serves its documentation routes: OMNIJEV_DOCS other than "0"."""
    return (os.environ if environ is None else environ).get(DOCS, "1") != "0"


SWITCH = {"1": True, "on": True, "true": True, "0": False, "off": False, "false": False}


def parse(name: str, raw: str, kind: object) -> object:
    if "bool" in str(kind):
        try:
            return switch(raw)
        except argparse.ArgumentTypeError:
            raise ValueError(f"{PREFIX}{name.upper()} must be on or off, got {raw!r}") from None
    if "int" in str(kind):
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{PREFIX}{name.upper()} must be an integer, got {raw!r}") from None
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings as command-line options (each also `OMNIJEV_<NAME>`), listed in --help."""
    group = parser.add_argument_group("runtime settings (also OMNIJEV_<NAME> variables)")
    group.add_argument(
        "--backend", default=None, help="auto, onnxruntime, tensorrt or torch (default: auto)"
    )
    group.add_argument("--device", default=None, help="cuda or cpu (default: cuda if usable)")
    group.add_argument(
        "--prefix-cache",
        type=int,
        default=None,
        help=f"image prefixes kept, ~50 MiB each on the 4b; 0: none (default {PREFIX_CACHE})",
    )
    group.add_argument(
        "--question-batch",
        type=int,
        default=None,
        help=f"rows of a fixed-row question pass, 1..{MAX_QUESTION_BATCH}: fewer pad less where "
        f"requests ask few questions (default {QUESTION_BATCH})",
    )
    group.add_argument(
        "--ort-threads", type=int, default=None, help="ONNX Runtime threads (default: its own)"
    )
    group.add_argument(
        "--plugin-library",
        default=None,
        help="TensorRT readout plugin .so (default: plugins/build)",
    )
    group.add_argument(
        "--merge",
        type=switch,
        default=None,
        help="on or off: waiting requests share passes where the engine keeps every byte "
        "(default on)",
    )


def switch(raw: str) -> bool:
    """An on/off command-line value."""
    if raw.lower() not in SWITCH:
        raise argparse.ArgumentTypeError(f"must be on or off, got {raw!r}")
    return SWITCH[raw.lower()]
