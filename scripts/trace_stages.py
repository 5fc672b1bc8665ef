"""Per-stage kernel table of a Chrome trace that `scripts/gpu_torch.py` wrote (`traces`): the
kernels between two device synchronisations belong to the stage whose lap ended there.

    python scripts/trace_stages.py TRACE.json.gz REPORT.json "1 question"

Prints, per stage: the span on the device, the sum of kernel times, the kernel count, the idle
time between kernels with the median gap and the longest gaps, and its largest kernels by
name.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections import defaultdict

TOP = int(os.environ.get("TOP", 8))  # kernels listed per stage
SYNC = ("cudaDeviceSynchronize",)  # what the stage clock's sync shows in the trace
LONG_GAPS = 3  # gaps between kernels listed per stage, the longest first, when at least
LONG_GAP_US = 100.0  # a graph's kernels ran 0.4 µs apart (median) on the H200


def load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def stage_kernels(events: list[dict], laps: list[str]) -> list[tuple[str, list[dict]]]:
    """(stage, kernels) in lap order: kernels that start before the end of each sync."""
    syncs = sorted(
        e["ts"] + e.get("dur", 0) for e in events if e.get("name") in SYNC and e.get("ph") == "X"
    )
    kernels = sorted(
        (e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"),
        key=lambda e: e["ts"],
    )
    stages, at = [], 0
    for stage, end in zip(laps, syncs, strict=False):
        mine = []
        while at < len(kernels) and kernels[at]["ts"] < end:
            mine.append(kernels[at])
            at += 1
        stages.append((stage, mine))
    if at < len(kernels):
        stages.append(("(after the last lap)", kernels[at:]))
    return stages


def describe(stage: str, kernels: list[dict]) -> list[str]:
    if not kernels:
        return [f"## {stage}: no kernels"]
    busy = sum(k["dur"] for k in kernels)
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - kernels[0]["ts"]
    by_name: dict[str, list[float]] = defaultdict(list)
    for k in kernels:
        by_name[k["name"][:90]].append(k["dur"])
    pairs = zip(kernels, kernels[1:], strict=False)
    gaps = sorted(((b["ts"] - a["ts"] - a["dur"], b["name"][:60]) for a, b in pairs), reverse=True)
    median_gap = gaps[len(gaps) // 2][0] if gaps else 0.0
    lines = [
        f"## {stage}: span {span / 1e3:.2f} ms, kernels {busy / 1e3:.2f} ms, "
        f"{len(kernels)} kernels, idle {(span - busy) / 1e3:.2f} ms "
        f"(median gap {median_gap:.1f} µs)"
    ]
    # the host's waits show as a few long gaps (a graph launched late), launch latency as many
    # short ones
    for gap, name in gaps[:LONG_GAPS]:
        if gap >= LONG_GAP_US:
            lines.append(f"  gap {gap / 1e3:7.3f} ms before {name}")
    top = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:TOP]
    for name, times in top:
        lines.append(f"  {sum(times) / 1e3:7.3f} ms  {len(times):5d} × {name}")
    return lines


def main(argv: list[str]) -> int:
    trace, report, workload = argv
    laps = json.loads(open(report).read())["traces"][workload]
    for stage, kernels in stage_kernels(load(trace), laps):
        print("\n".join(describe(stage, kernels)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
