"""`omnijev demo`: builds the tiny synthetic checkpoint and its ONNX Runtime engines once, then
serves them on the CPU (the README's first command).

The port is bound first, so that a busy port fails at once; the build runs in a child process,
so that the serving process never holds the build's memory (issue 14), and prints a progress
line every few seconds.
"""

from __future__ import annotations

import multiprocessing
import shutil
import time
from pathlib import Path
from typing import Any

DEMO_DIR = Path("artifacts/demo")  # the Makefile's CHECKPOINT and ENGINES point here too
CHECKPOINT = DEMO_DIR / "checkpoint"
ENGINES = DEMO_DIR / "engines"
DEMO_BACKEND = "auto"  # the demo has ONNX Runtime engines only, which `auto` picks without a GPU
PROGRESS_S = 10.0  # a line at least this often while the build runs


def say(message: str) -> None:
    print(f"demo: {message}", flush=True)


def build(checkpoint: Path, engines_dir: Path) -> None:
    """The tiny checkpoint and its ONNX Runtime engines, where they are not complete yet."""
    from build_engines import checkpoints, engines

    if not (checkpoint / "omnijev_export.json").exists():  # the manifest is written last
        started = time.perf_counter()
        shutil.rmtree(checkpoint, ignore_errors=True)  # a build that died half-way
        shutil.rmtree(checkpoints.release_path(checkpoint), ignore_errors=True)
        checkpoints.make_checkpoint("tiny", 0, checkpoint)
        say(f"checkpoint written to {checkpoint} in {time.perf_counter() - started:.1f} s")
    if not engines_dir.exists():
        started = time.perf_counter()
        say("exporting the ONNX graphs (3) and checking them in ONNX Runtime")
        partial = engines_dir.with_name(engines_dir.name + ".partial")  # renamed when complete
        shutil.rmtree(partial, ignore_errors=True)
        engines.build_engines(checkpoint, partial, plans=False)
        partial.rename(engines_dir)
        say(f"engines written to {engines_dir} in {time.perf_counter() - started:.1f} s")


def build_in_child(checkpoint: Path, engines_dir: Path) -> None:
    """`build` in a spawned process, with a progress line every PROGRESS_S seconds."""
    if (checkpoint / "omnijev_export.json").exists() and engines_dir.exists():
        return
    say("building the tiny model once (about a minute on 2 cores)")
    child = multiprocessing.get_context("spawn").Process(
        target=build, args=(checkpoint, engines_dir), name="omnijev-demo-build"
    )
    started = time.monotonic()
    child.start()
    while True:
        child.join(PROGRESS_S)
        if child.exitcode is not None:
            break
        say(f"still building: {time.monotonic() - started:.0f} s")
    if child.exitcode != 0:
        raise SystemExit(f"demo: the build failed (exit status {child.exitcode})")


def cli_demo(args: Any) -> int:
    """Bind the port, build the tiny model once in a child process, then serve it."""
    from runtime.executor import load_engine
    from server.app import bind, create_app, serve

    sock = bind(args.host, args.port)
    build_in_child(CHECKPOINT, ENGINES)
    engine = load_engine(str(CHECKPOINT), str(ENGINES), DEMO_BACKEND)
    serve(create_app(engine), args.host, args.port, sock)
    return 0
