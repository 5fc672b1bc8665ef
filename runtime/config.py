"""The runtime's settings in one object, read once from the environment and the command line and
passed down to the executor, the pass planner and the backends (docs/design.md "Settings").
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


@dataclass(frozen=True)
class RuntimeConfig:
    """Every setting with its default; None means "decided by the device" (on CUDA: on)."""

    backend: str = "auto"  # auto, onnxruntime (ort), tensorrt, torch
    device: str | None = None  # cuda, cpu; None picks CUDA when the backend can use it
    prefix_cache: int = PREFIX_CACHE  # image prefixes kept across requests; 0 turns it off
    question_batch: int = QUESTION_BATCH  # rows of a question pass (at most MAX_QUESTION_BATCH)
    static_shapes: bool | None = None  # ONNX Runtime: a session per shape signature
    cuda_graphs: bool | None = None  # replay passes as CUDA graphs
    fit_rows: bool | None = None  # passes sized to the request; None: where the engine's
    # arithmetic keeps a row's bytes whatever the row count (the torch backend checks at load)
    device_heads: bool | None = None  # the heads' D-wide MLPs on the engine's device; None:
    # on CUDA, where they keep a row's bytes and agree with the host (Heads.use_device)
    joint_passes: bool | None = None  # each option pass and its questions' rows as one pass;
    # None: where the engine has joint passes and keeps a row's bytes in them (the torch backend)
    early_heads: bool | None = None  # the heads of questions whose joint passes are done run
    # while the later passes execute; None: on CUDA
    joint_lanes: bool | None = None  # joint passes of different option lengths run at once on
    # two CUDA streams (TorchBackend.lane_stream); None: on CUDA with graphs
    mlps_behind: bool | None = None  # the heads' MLPs enqueued on the device right behind a
    # request's passes, their outputs back with the readouts; None: wherever the heads' MLPs
    # run on the engine's device (device_heads)
    early_prefix: bool = False  # the vision tower and image prefix enqueued as soon as the
    # image is decoded, while the text is prepared (Executor.start_prefix); off by default: on
    # the H200 it gave the same whole-request times as after the text (h200-2026-12-04d)
    share_weights: bool = True  # ONNX Runtime sessions share one copy of the weights
    ort_threads: int = 0  # ONNX Runtime intra-op threads; 0: its default (one on CUDA)
    plugin_library: str | None = None  # the TensorRT readout plugin; None: plugins/build/

    def __post_init__(self) -> None:
        if self.prefix_cache < 0:
            raise ValueError(f"prefix_cache must be at least 0, got {self.prefix_cache}")
        if not 1 <= self.question_batch <= MAX_QUESTION_BATCH:
            raise ValueError(
                f"question_batch must be 1..{MAX_QUESTION_BATCH}, got {self.question_batch}"
            )

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

    def on(self, setting: bool | None, cuda: bool) -> bool:
        """A device-decided setting: as given, else on exactly on CUDA."""
        return cuda if setting is None else setting


def cache_home() -> Path:
    """Where the runtime keeps what it builds for itself (tokenizer files, private copies of
    compiler caches): `$XDG_CACHE_HOME/omnijev`, else `~/.cache/omnijev`."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omnijev"


def parse(name: str, raw: str, kind: object) -> object:
    text = str(kind)
    if "bool" in text:
        if raw.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"{PREFIX}{name.upper()} must be 0 or 1, got {raw!r}")
        return raw.lower() in ("1", "true", "yes")
    if "int" in text:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{PREFIX}{name.upper()} must be an integer, got {raw!r}") from None
    return raw


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings as command-line options (each also `OMNIJEV_<NAME>`), listed in --help."""
    group = parser.add_argument_group("runtime settings (also OMNIJEV_<NAME> variables)")
    group.add_argument("--backend", default=None, help="auto, onnxruntime, tensorrt or torch")
    group.add_argument("--device", default=None, help="cuda or cpu (default: cuda if usable)")
    group.add_argument(
        "--prefix-cache",
        type=int,
        default=None,
        help=f"image prefixes kept (default {PREFIX_CACHE})",
    )
    group.add_argument(
        "--question-batch",
        type=int,
        default=None,
        help=f"rows of a question pass, 1..{MAX_QUESTION_BATCH} (default {QUESTION_BATCH})",
    )
    for name, text in (
        ("static-shapes", "ONNX Runtime session per shape (default: on CUDA)"),
        ("cuda-graphs", "replay passes as CUDA graphs (default: on CUDA)"),
        ("fit-rows", "passes sized to the request (default: where the engine keeps bytes)"),
        ("device-heads", "the heads' large products on the GPU (default: on CUDA)"),
        ("joint-passes", "option rows in one pass with their questions (default: where kept)"),
        ("early-heads", "heads of finished questions beside later passes (default: on CUDA)"),
        ("joint-lanes", "joint passes at once on two CUDA streams (default: on CUDA)"),
        ("mlps-behind", "heads' MLPs right behind the passes (default: with device heads)"),
        ("early-prefix", "image prefix enqueued while the text is prepared (default: off)"),
        ("share-weights", "ONNX Runtime sessions share the weights (default: on)"),
    ):
        group.add_argument(
            f"--{name}", action=argparse.BooleanOptionalAction, default=None, help=text
        )
    group.add_argument("--ort-threads", type=int, default=None, help="ONNX Runtime threads")
    group.add_argument("--plugin-library", default=None, help="TensorRT readout plugin (.so)")
