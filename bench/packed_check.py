"""The packed passes in process on the machine at hand (prefix cache off): how long building every
shape takes, each stage's device time for the issue's two single requests and their kernels
(`bench.kernels`), the passes and token slots of suite requests, their warm times, and whether
each question's answer is the same bytes alone, with its request and batched with another
request (JSON to --out).

    python -m bench.packed_check --checkpoint C --engines E --requests 24 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from bench import traffic
from bench.kernels import kernel_profile
from bench.kernels import requests as single_requests
from bench.kernels import table as kernel_table
from bench.latency import time_runs
from bench.parity import without_latency

RUNS = 5  # warm runs a request


def timed(executor, prepared) -> tuple[dict, float]:
    started = time.perf_counter()
    answer = executor.execute(prepared)
    return answer, (time.perf_counter() - started) * 1e3


def check(executor, requests: int, seed: int) -> dict:
    """Warm times and byte checks of `requests` suite requests (12 questions for every third)."""
    from runtime.strict_json import parse_body

    record: dict = {"requests": [], "differ": []}
    previous = None
    for index in range(requests):
        made = traffic.request(seed, index, questions=12 if index % 3 == 0 else None)
        obj = parse_body(made.body)
        prepared = executor.prepare(obj)
        work = executor.work_of(prepared)
        first, first_ms = timed(executor, prepared)
        times = [timed(executor, executor.prepare(obj))[1] for _ in range(RUNS)]
        whole = without_latency(first)
        differ = []
        for qid, question in list(obj["questions"].items())[:4]:
            alone = dict(obj, questions={qid: question})
            if without_latency(executor.execute(executor.prepare(alone)))[qid] != whole[qid]:
                differ.append(qid)
        same_key = previous is not None and (
            executor.batch_key(previous)[0] == executor.batch_key(prepared)[0] is not None
        )
        if same_key:
            together = executor.readouts_batch([previous, prepared])
            if without_latency(executor.respond(prepared, together[1], 0.0)) != whole:
                differ.append("batched")
        previous = prepared
        row = {
            "size": list(made.size),
            "format": made.format,
            "questions": made.questions,
            "passes": [p.size for p in work.passes] if hasattr(work, "passes") else None,
            "tokens": getattr(work, "tokens", None),
            "first_ms": round(first_ms, 2),
            "warm_ms": round(statistics.median(times), 2),
            "differ": differ,
        }
        record["requests"].append(row)
        print(json.dumps(row), flush=True)
    warm = [r["warm_ms"] for r in record["requests"]]
    record["warm_p50_ms"] = statistics.median(warm)
    record["questions_differing"] = sum(len(r["differ"]) for r in record["requests"])
    return record


def stage_profile(executor, seed: int) -> dict:
    """Each stage's device time (a lap waits for the device) and the whole request's, medians of
    RUNS warm runs (`bench.latency.time_runs`), of the issue's two single requests: 1 question
    on a 1920x1080 PNG, 12 on a 1920x1080 JPEG."""
    import torch

    made = {}
    for name, body in single_requests(seed).items():
        executor.stage_sync = torch.cuda.synchronize if torch.cuda.is_available() else None
        stages: dict = executor.stages
        times = time_runs(executor.answer, body, RUNS, stages)
        executor.stage_sync = None
        made[name] = {"whole": round(1e3 * statistics.median(times), 2)}
        made[name].update({k: round(1e3 * v, 2) for k, v in stages.items()})
        print(name, json.dumps(made[name]), flush=True)
    return made


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.packed_check")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engines", required=True)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    started = time.perf_counter()
    # every request runs its image prefix, as the worker measured over HTTP does
    config = RuntimeConfig.from_env(backend="torch", prefix_cache=0)
    executor = load_engine(args.checkpoint, args.engines, config)
    loaded = time.perf_counter()
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    warmed = time.perf_counter()
    built = executor.build_shapes()
    done = time.perf_counter()
    record = {
        "backend": executor.backend.name,
        "load_s": round(loaded - started, 1),
        "warm_up_s": round(warmed - loaded, 1),
        "build_shapes": built,
        "build_shapes_s": round(done - warmed, 1),
    }
    print(json.dumps(record), flush=True)
    builds = executor.shape_builds()[0]
    record["stages_ms"] = stage_profile(executor, args.seed)
    record["kernels"] = kernel_profile(executor, single_requests(args.seed))
    print(kernel_table(record["kernels"]), flush=True)
    record.update(check(executor, args.requests, args.seed))
    record["builds_while_checking"] = executor.shape_builds()[0] - builds
    args.out.write_text(json.dumps(record, indent=1))
    print(
        f"warm p50 {record['warm_p50_ms']} ms, differing {record['questions_differing']}, "
        f"builds while checking {record['builds_while_checking']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
