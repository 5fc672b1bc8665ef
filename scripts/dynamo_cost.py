"""What tracing the torch backend's compiled blocks costs, on any machine: Dynamo alone (its
`eager` backend, no Inductor), the demo's tiny export, a 1-question request, then more.

    python scripts/dynamo_cost.py [--checkpoint DIR] [--engines DIR] [VARIANT ...]

Variants: `dynamic` (the backend's own `dynamic=True`), `static` (`dynamic=False`), `auto`
(Dynamo's automatic dynamic: static first, symbolic where a size changed), `duck` (duck sizing
on), `nofix` (the folded attention without its fixed-row pads). Each runs in a process of its
own, answers the 1, 3 and 12 speed-bench questions, the gate questions and 6 questions, and
prints one row: each request's seconds, Dynamo's compile time, the part of it spent running ops
on fake tensors, and the graphs' node counts. It measures tracing only, not the graphs' speed:
cold starts on the H200 spent most of their compile time there (docs/measurements).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

DEMO = Path("artifacts/demo")  # `make demo`'s checkpoint and engines
VARIANTS = ("dynamic", "static", "auto", "duck", "nofix")


def run_variant(variant: str, checkpoint: Path, engines: Path) -> dict:
    """One variant in this process: the backend compiled with Dynamo's eager backend."""
    import torch
    import torch._dynamo.utils as dynamo_utils

    import runtime.backends.compiled as compiled
    from reference.questions import gate_questions, speed_bench_questions
    from runtime.config import RuntimeConfig
    from runtime.executor import Executor
    from tools import bench

    plain_compile, nodes = torch.compile, []

    def backend(gm, example_inputs):
        nodes.append(len(gm.graph.nodes))
        return gm.forward

    dynamic = {"static": False, "auto": None}.get(variant, True)
    compiled.torch.compile = lambda f, **kw: plain_compile(
        f, **{**kw, "backend": backend, "dynamic": dynamic}
    )
    if variant == "nofix":
        compiled.FIT_TOKENS = 0  # folded_attention's min_tokens: no fixed-row pads
    if variant == "duck":
        invariant = compiled.invariant_compilation

        def with_duck_shapes() -> list[str]:
            import torch.fx.experimental._config as shapes

            modes = invariant()
            shapes.use_duck_shape = True
            return modes

        compiled.invariant_compilation = with_duck_shapes
    plain_init = compiled.TorchBackend.__init__

    def compiling_init(self, *args, **kwargs):
        plain_init(self, *args, **{**kwargs, "compile": True})

    compiled.TorchBackend.__init__ = compiling_init
    executor = Executor(checkpoint, engines, RuntimeConfig.from_env(backend="torch"))
    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    asked = [speed_bench_questions(n) for n in (1, 3, 12)]
    asked += [gate_questions(), speed_bench_questions(6)]
    seconds = []
    for questions in asked:
        started = time.perf_counter()
        executor.answer(bench.body(image, "image/png", questions))
        seconds.append(round(time.perf_counter() - started, 2))
    head, rows = dynamo_utils.compile_times(repr="csv")
    phases = dict(zip(head, rows, strict=True))

    def total(phase: str) -> float:
        return round(sum(float(x) for x in phases.get(phase, "0").split(",")), 2)

    return {
        "variant": variant,
        "requests_s": seconds,
        "compile_s": total("_compile.compile_inner"),
        "fake_tensors_s": total("get_fake_value"),
        "graphs": len(nodes),
        "nodes": nodes,
    }


def main(argv: list[str]) -> int:
    args = list(argv)
    checkpoint, engines = DEMO / "checkpoint", DEMO / "engines"
    if "--checkpoint" in args:
        checkpoint = Path(args.pop(args.index("--checkpoint") + 1))
        args.remove("--checkpoint")
    if "--engines" in args:
        engines = Path(args.pop(args.index("--engines") + 1))
        args.remove("--engines")
    if args[:1] == ["--one"]:
        print(json.dumps(run_variant(args[1], checkpoint, engines)))
        return 0
    variants = args or list(VARIANTS)
    print("| variant | requests, s | Dynamo compile, s | on fake tensors, s | graphs | nodes |")
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for variant in variants:
        done = subprocess.run(
            [sys.executable, __file__, "--checkpoint", str(checkpoint), "--engines",
             str(engines), "--one", variant],
            capture_output=True, text=True,
        )  # fmt: skip
        if done.returncode:
            print(f"| {variant} | failed: {done.stderr.strip().splitlines()[-1:]} | | | | |")
            continue
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(
            f"| {variant} | {row['requests_s']} | {row['compile_s']} | {row['fake_tensors_s']} "
            f"| {row['graphs']} | {row['nodes']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
