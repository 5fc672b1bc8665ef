"""`omnijev bench`: each workload's whole-request latency, the reference beside, then the host
stages; the reference's `speed_bench.py` workloads (docs/contract.md §10.1, §12.2); then the
traffic suite over HTTP at 1, 4 and 16 clients (`bench.clients`). The tables are printed last."""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from bench.clients import CLIENTS, client_runs
from bench.load import table as load_table
from bench.parity import progress
from bench.workloads import bench_bodies, host_requests, quantile
from runtime.config import RuntimeConfig

WARM_RUNS = 20  # at least 20 warm runs a workload
STAGES = ("prepare", "vision", "prefix", "questions", "options", "heads")


def median_ms(call, runs: int, warm: int = 1) -> float:
    """Median wall milliseconds of `runs` calls of `call()` after `warm` untimed ones."""
    for _ in range(warm):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def time_runs(
    answer, request: bytes, runs: int, stages: dict | None = None, settle=None
) -> list[float]:
    """Wall seconds of `runs` warm calls; with `stages`, collects the executor's per-stage times.
    `settle` waits for sessions built in the background after the first call."""
    answer(request)  # warm-up: sessions built, graphs captured, caches filled
    if settle is not None:
        settle()
    answer(request)
    answer(request)
    times, per_stage = [], {}
    for _ in range(runs):
        start = time.perf_counter()
        answer(request)
        times.append(time.perf_counter() - start)
        for stage, seconds in (stages or {}).items():
            per_stage.setdefault(stage, []).append(seconds)
    if stages is not None:
        stages.clear()
        stages.update({k: statistics.median(v) for k, v in per_stage.items()})
    return times


def latency(
    executor, reference=None, runs: int = WARM_RUNS, only: list[str] | None = None
) -> list[dict]:
    """Each workload (or those named in `only`) from request JSON to response, every run kept.
    The image is the same in every run, so the executor is made with the prefix cache off
    (`bench_config`): the numbers are the full path's."""
    rows, chosen, started = [], bench_bodies(only), time.perf_counter()
    for name, request in chosen.items():
        progress(len(rows), len(chosen), f"latency {name}, {runs} runs", started)
        ours = time_runs(executor.answer, request, runs, executor.stages, executor.settle)
        row = {
            "workload": name,
            "median_ms": 1e3 * statistics.median(ours),
            "p90_ms": 1e3 * quantile(ours, 0.9),
            "stages_ms": {k: round(1e3 * v, 2) for k, v in executor.stages.items()},
            "runs_ms": [round(1e3 * t, 3) for t in ours],
        }
        if reference is not None:
            theirs = time_runs(reference.answer, request, max(5, runs // 4))
            row["reference_median_ms"] = 1e3 * statistics.median(theirs)
            row["reference_runs_ms"] = [round(1e3 * t, 3) for t in theirs]
            row["speedup"] = row["reference_median_ms"] / row["median_ms"]
        rows.append(row)
    return rows


def latency_table(rows: list[dict]) -> str:
    """Median and p90 per workload, the reference beside, and the median of each stage."""
    lines = [
        "| workload | median ms | p90 ms | reference median ms | speed-up | "
        + " | ".join(STAGES)
        + " |",
        "| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(STAGES),
    ]
    for r in rows:
        ref = f"{r['reference_median_ms']:.1f}" if "reference_median_ms" in r else "-"
        speed = f"{r['speedup']:.1f}×" if "speedup" in r else "-"
        stages = " | ".join(f"{r.get('stages_ms', {}).get(s, 0.0):.1f}" for s in STAGES)
        lines.append(
            f"| {r['workload']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {ref} | {speed} | "
            f"{stages} |"
        )
    return "\n".join(lines)


def bench_config(config: RuntimeConfig) -> RuntimeConfig:
    """`config` with the prefix cache off: every bench request sends the same still."""
    return replace(config, prefix_cache=0)


def cli_bench(args) -> int:
    from runtime.executor import load_engine

    if args.host_only:  # no engines: the host stages alone
        return print_host_profile(args.runs, None, args.out)
    started = time.perf_counter()
    config = bench_config(RuntimeConfig.from_args(args))
    executor = load_engine(args.checkpoint, args.engines, config)
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    cold = time.perf_counter() - started
    reference = None
    if args.reference_dtype:
        from reference.mso1 import Reference

        reference = Reference(args.checkpoint, dtype=args.reference_dtype, device=args.device)
    rows = latency(executor, reference, args.runs)
    made = {"cold_start_s": cold, "rows": rows}
    counts = args.clients
    if counts is None:
        counts = CLIENTS if executor.device.type == "cuda" else ()
    if counts:
        made["clients"] = client_runs(executor, counts, args.client_requests)
    if args.out:
        Path(args.out).write_text(json.dumps(made, indent=1))
    print(f"cold start (load + warm-up): {cold:.2f} s")
    print(latency_table(rows))
    print_host_profile(args.runs, executor)
    if counts:
        runs = made["clients"]["runs"]
        print(f"the traffic suite over HTTP ({args.client_requests} requests a client count):")
        print(load_table(runs))
        differing = made["clients"]["answers_differing"]
        print(f"every answer the same bytes at each client count: {'no' if differing else 'yes'}")
    return 0


def print_host_profile(runs: int, executor=None, out: str | None = None) -> int:
    """The per-stage host profile (bench.hoststages) with the executor's own preparation, or
    the built-in tokenizer and 4b-sized synthetic heads."""
    from bench import hoststages

    results = hoststages.profile(host_requests(), runs=runs, executor=executor)
    if out:
        Path(out).write_text(json.dumps({"host_stages_ms": results}, indent=1))
    where = str(executor.device) if executor is not None else "no engine"
    print(f"host stages ({hoststages.machine()}, {where})", file=sys.stdout)
    print(hoststages.table(results))
    return 0
