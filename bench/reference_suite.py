"""The reference's time on the traffic suite's 12-question requests, each answered `--runs` times
after one warm call, for the engine's speed-up on the same requests over HTTP (`bench.load
--questions 12` sends these bodies, index for index). JSON to --out, a table printed.

    python -m bench.reference_suite --checkpoint C --requests 5 --runs 10 --out F
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench import traffic
from bench.gpu import environment
from bench.latency import time_runs

QUESTIONS = 12  # the 12-question suite requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.reference_suite")
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    from reference.mso1 import Reference

    reference = Reference(args.checkpoint, dtype=args.dtype, device=args.device)
    rows = []
    for index in range(args.requests):
        made = traffic.request(args.seed, index, "suite", QUESTIONS)
        times = [1e3 * t for t in time_runs(reference.answer, made.body, args.runs)]
        rows.append(
            {
                "index": index,
                "size": list(made.size),
                "format": made.format,
                "ms": times,
                "median_ms": statistics.median(times),
            }  # fmt: skip
        )
        print(f"| {index} | {made.size[0]}x{made.size[1]} {made.format} | "
              f"{statistics.median(times):.1f} ms |", flush=True)  # fmt: skip
    record = {"environment": environment(), "dtype": args.dtype, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
