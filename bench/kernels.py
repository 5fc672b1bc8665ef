"""Where a request's device time goes, kernel by kernel: requests run warm under torch's
profiler, each kernel's time summed by name and by family (products, attention, the recurrence,
norms and the rest), and the products' achieved TFLOP/s from the request's own count
(`bench.plans.products_tflop`). On the CPU the families are of operators' own time. With
`--tree`, another revision's files (the baseline's) run the same requests in a process of
their own, this file's profiler driving that tree's `load_engine` and `answer` alone.

    python -m bench.kernels --checkpoint C --engines E --out F [--tree DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

RUNS = 5  # profiled warm runs a request
TOP = 12  # kernels listed a request
# a kernel's family by the first of these its lowercased name holds (cuBLAS' own kernels are
# named for their tiles: nvjet, sm90_xmma, cutlass; the CPU's operators by aten's names)
FAMILIES = (
    ("products", ("gemm", "nvjet", "xmma", "cutlass", "aten::mm", "aten::addmm", "aten::linear")),
    ("attention", ("flash", "fmha", "attention", "attn", "softmax")),
    ("recurrence", ("chunk", "recurrent", "delta", "gdn", "conv")),
    ("norms", ("norm",)),
)


def family(name: str) -> str:
    lowered = name.lower()
    for label, marks in FAMILIES:
        if any(mark in lowered for mark in marks):
            return label
    return "other"


def requests(seed: int) -> dict[str, bytes]:
    """The issue's two single requests, 1 question on a 1920x1080 PNG and 12 on a 1920x1080
    JPEG, and the bench's Choice of 255 options (its workload furthest behind the baseline)."""
    from bench import traffic
    from bench.workloads import bench_body

    return {
        "q1-png": traffic.request(seed, 0, "suite", 1, (1920, 1080), "PNG").body,
        "q12-jpeg": traffic.request(seed, 0, "suite", 12, (1920, 1080), "JPEG").body,
        "o255": bench_body("255 options"),
    }


def kernel_times(answer, body: bytes, runs: int) -> dict[str, float]:
    """Milliseconds a run of each kernel (on the CPU: each operator's own time)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    answer(body)
    answer(body)
    with profile(activities=activities) as prof:
        for _ in range(runs):
            answer(body)
        if cuda:
            torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        if cuda:
            us = getattr(event, "self_device_time_total", None)
            if us is None:
                us = event.self_cuda_time_total
        else:
            us = event.self_cpu_time_total if event.key.startswith("aten::") else 0
        if us > 0:
            times[event.key] = times.get(event.key, 0.0) + us / 1e3 / runs
    return times


def summary(times: dict[str, float], tflop: float | None) -> dict:
    """A request's device milliseconds, by family and its TOP kernels, and its products' rate."""
    total = sum(times.values())
    families: dict[str, float] = {}
    for name, ms in times.items():
        families[family(name)] = families.get(family(name), 0.0) + ms
    top = sorted(times.items(), key=lambda item: -item[1])[:TOP]
    made = {
        "device_ms": round(total, 3),
        "families_ms": {k: round(v, 3) for k, v in sorted(families.items(), key=lambda i: -i[1])},
        "top": [
            {"kernel": name[:120], "ms": round(ms, 3), "family": family(name)} for name, ms in top
        ],
        # every kernel, for the comparisons a top list leaves out (which copies, which kernels)
        "kernels": {
            name[:120]: round(ms, 4) for name, ms in sorted(times.items(), key=lambda i: -i[1])
        },
    }
    products = families.get("products", 0.0)
    if tflop is not None and products > 0:
        made["products_tflop"] = tflop
        made["products_tflop_per_s"] = round(tflop / (products / 1e3), 1)
    return made


def packed_tflop(executor, body: bytes) -> float | None:
    """The products a request's packed passes run, in TFLOP (`bench.plans.products_tflop`)."""
    from bench.plans import products_tflop
    from runtime.packing import PackedPlan
    from runtime.strict_json import parse_body

    prepared = executor.prepare(parse_body(body))
    work = executor.work_of(prepared)
    return products_tflop(prepared, work)["tflop_slots"] if isinstance(work, PackedPlan) else None


def kernel_profile(
    executor,
    bodies: dict[str, bytes],
    runs: int = RUNS,
    count: Callable[[object, bytes], float | None] | None = packed_tflop,
) -> dict:
    """Each of `bodies` (`requests(seed)`) profiled warm: its summary, with its products'
    rate where `count` gives their TFLOP."""
    made = {}
    for name, body in bodies.items():
        tflop = count(executor, body) if count is not None else None
        made[name] = summary(kernel_times(executor.answer, body, runs), tflop)
    return made


def profile_tree(tree: Path, args: argparse.Namespace) -> dict:
    """`requests(args.seed)` profiled on `tree`'s runtime, in a process whose imports find that
    tree first (this file run as a script there, `--bodies`)."""
    with tempfile.TemporaryDirectory() as folder:
        for name, body in requests(args.seed).items():
            (Path(folder) / f"{name}.json").write_bytes(body)
        out = Path(folder) / "record.json"
        paths = [str(tree), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
        # -P: this file's folder stays off the path (its modules are named like other packages')
        command = [sys.executable, "-P", str(Path(__file__).resolve()), "--runs", str(args.runs)]
        for option in ("checkpoint", "engines"):  # the process runs in `tree`
            command += [f"--{option}", str(Path(getattr(args, option)).resolve())]
        command += ["--bodies", folder, "--out", str(out)]
        subprocess.run(command, cwd=tree, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def table(record: dict) -> str:
    lines = []
    for name, made in record.items():
        families = ", ".join(f"{k} {v:.2f}" for k, v in made["families_ms"].items())
        rate = made.get("products_tflop_per_s")
        rate_text = f"; products {rate} TFLOP/s (4b count)" if rate is not None else ""
        lines += [f"{name}: {made['device_ms']:.2f} ms ({families}){rate_text}"]
        lines += ["| kernel | ms | family |", "| --- | ---: | --- |"]
        lines += [f"| `{k['kernel'][:70]}` | {k['ms']:.3f} | {k['family']} |" for k in made["top"]]
    return "\n".join(lines)


def own_profile(args: argparse.Namespace) -> dict:
    """The requests profiled on the runtime this process imports: this tree's, shapes built
    first and products counted; or, with `--bodies` (`profile_tree`), another tree's, which
    builds its shapes in the warm runs and whose passes are not counted."""
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    # every request runs its image prefix, as over HTTP with the prefix cache off
    config = RuntimeConfig.from_env(backend="torch", prefix_cache=0)
    executor = load_engine(args.checkpoint, args.engines, config)
    if args.bodies is None:
        executor.build_shapes()
        return kernel_profile(executor, requests(args.seed), args.runs)
    bodies = {path.stem: path.read_bytes() for path in sorted(args.bodies.glob("*.json"))}
    return kernel_profile(executor, bodies, args.runs, count=None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engines", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tree", type=Path, default=None, help="another revision's files")
    parser.add_argument("--bodies", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tree is not None:
        record = profile_tree(args.tree.resolve(), args)
    else:
        record = own_profile(args)
    args.out.write_text(json.dumps(record, indent=1))
    print(table(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
