"""`omnijev demo`: builds the tiny synthetic checkpoint and its ONNX Runtime engines once, then
serves them on the CPU (the README's first command).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from build_engines import checkpoints, engines
from runtime.executor import load_engine
from server.app import create_app, serve

DEMO_DIR = Path("artifacts/demo")
DEMO_BACKEND = "auto"  # the demo has ONNX Runtime engines only, which `auto` picks without a GPU


def cli_demo(args: Any) -> int:
    """Build the tiny synthetic checkpoint and its ONNX Runtime engines once, then serve them."""
    checkpoint, engines_dir = DEMO_DIR / "checkpoint", DEMO_DIR / "engines"
    if not (checkpoint / "omnijev_export.json").exists():  # the manifest is written last
        shutil.rmtree(checkpoint, ignore_errors=True)  # a build that died half-way
        shutil.rmtree(checkpoints.release_path(checkpoint), ignore_errors=True)
        checkpoints.make_checkpoint("tiny", 0, checkpoint)
    if not engines_dir.exists():
        partial = DEMO_DIR / "engines.partial"  # renamed when complete, so a crash rebuilds
        shutil.rmtree(partial, ignore_errors=True)
        engines.build_engines(checkpoint, partial, plans=False)
        partial.rename(engines_dir)
    engine = load_engine(str(checkpoint), str(engines_dir), DEMO_BACKEND)
    serve(create_app(engine), args.host, args.port)
    return 0
