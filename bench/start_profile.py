"""Where a start spends its time: the engine's load and its warm-up request under cProfile, each
function's own time summed by the library it lies in, and the longest calls by cumulative time,
printed as tables (issue 46's start on the engine directory's caches)."""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

# a function's file → the part of the stack it belongs to (the first match wins)
PARTS = (
    ("torch/_dynamo", "dynamo (tracing)"),
    ("torch/_functorch", "aot autograd"),
    ("torch/_inductor", "inductor (cache loads, codegen)"),
    ("torch/fx", "fx"),
    ("torch/_subclasses", "fake tensors"),
    ("torch/utils/_sympy", "sympy (dynamic shapes)"),
    ("sympy/", "sympy (dynamic shapes)"),
    ("torch/cuda", "torch.cuda (graphs, sync)"),
    ("triton/", "triton (kernel loads)"),
    ("safetensors", "safetensors"),
    ("hashlib", "hashing"),
    ("runtime/", "this runtime"),
    ("torch/", "torch (other)"),
)
TOP = 30  # calls listed by cumulative time


def part_of(filename: str) -> str:
    for marker, name in PARTS:
        if marker in filename:
            return name
    return "built-ins and other" if filename.startswith("~") or "<" in filename else "other"


def summary(profile: cProfile.Profile, seconds: float) -> dict:
    """Own time by part, and the TOP calls by cumulative time."""
    stats = pstats.Stats(profile)
    parts: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_, calls, own, cumulative, _) in stats.stats.items():
        part = part_of(filename)
        parts[part] = parts.get(part, 0.0) + own
        rows.append((cumulative, calls, f"{Path(filename).name}:{line}({name})"))
    rows.sort(reverse=True)
    return {
        "seconds": round(seconds, 2),
        "own_s_by_part": {k: round(v, 2) for k, v in sorted(parts.items(), key=lambda x: -x[1])},
        "top_cumulative": [{"s": round(c, 2), "calls": n, "function": f} for c, n, f in rows[:TOP]],
    }


def table(name: str, made: dict) -> str:
    lines = [f"{name}: {made['seconds']} s", "| part | own s |", "| --- | ---: |"]
    lines += [f"| {part} | {s} |" for part, s in made["own_s_by_part"].items()]
    lines += ["", "| cumulative s | calls | function |", "| ---: | ---: | --- |"]
    lines += [f"| {r['s']} | {r['calls']} | `{r['function']}` |" for r in made["top_cumulative"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.start_profile")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engines", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    config = RuntimeConfig.from_env(backend="torch", prefix_cache=0)
    record = {}
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    executor = load_engine(args.checkpoint, args.engines, config)
    profile.disable()
    record["load"] = summary(profile, time.perf_counter() - started)
    record["load"]["steps_s"] = executor.load_seconds
    print(table("load", record["load"]), flush=True)
    body = json.dumps(executor.warm_up_request()).encode()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.enable()
    executor.answer(body)
    profile.disable()
    record["warm_up_request"] = summary(profile, time.perf_counter() - started)
    print(table("warm-up request", record["warm_up_request"]), flush=True)
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
