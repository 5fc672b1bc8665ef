"""`python -m bench.admission`: served requests/s at several closed-loop client counts (each
503 retried after its Retry-After, as the SDKs do) with the worker admitting each of several
limits, the engine served on a loopback port as `omnijev bench` serves it; the device's busy
share from the worker's `/metrics` where it has a device. JSON to --out, a table printed.

    python -m bench.admission --checkpoint C --engines E --admitted 16,48 --clients 16,64
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from bench import traffic
from bench.clients import served
from bench.load import run_load

RETRIES = 30  # a request refused this many times in a row counts as refused
BUSY = "omnijev_device_busy_seconds"  # a counter: its sample is BUSY + "_total"


def busy_seconds(url: str) -> float:
    """The worker's seconds of device work so far (0 where it has no device)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == BUSY:
            return sum(s.value for s in family.samples if s.name == BUSY + "_total")
    return 0.0


def measure(engine, admitted: int, clients: list[int], bodies: list[bytes]) -> list[dict]:
    """The worker admitting `admitted`, under each client count in turn."""
    rows = []
    with served(engine, admitted) as url:
        run_load(url + "/v1/systemone", bodies[: max(clients)], max(clients), RETRIES)  # warm
        for count in clients:
            busy, started = busy_seconds(url), time.perf_counter()
            report = run_load(url + "/v1/systemone", bodies, count, RETRIES)
            busy = busy_seconds(url) - busy
            share = busy / (time.perf_counter() - started) if busy > 0 else None
            rows.append(row(admitted, count, report, share))
            print(table_line(rows[-1]), flush=True)
    return rows


def row(admitted: int, clients: int, report: dict, busy_share: float | None) -> dict:
    latency = report["latency_ms"]
    return {
        "admitted": admitted,
        "clients": clients,
        "requests": report["requests"],
        "ok": report["ok"],
        "requests_per_s": report["requests_per_s"],
        "retries": report["retries"],
        "p50_ms": latency["p50"],
        "p99_ms": latency["p99"],
        "busy_share": busy_share,
    }


def table_line(r: dict) -> str:
    busy = "–" if r["busy_share"] is None else f"{100 * r['busy_share']:.0f} %"
    return (
        f"| {r['admitted']} | {r['clients']} | {r['ok']}/{r['requests']} | "
        f"{r['requests_per_s']:.2f} | {r['retries']} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | "
        f"{busy} |"
    )


def main(argv: list[str] | None = None) -> int:
    from runtime.cli import client_counts
    from runtime.executor import load_engine

    parser = argparse.ArgumentParser(prog="python -m bench.admission", description=__doc__)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--engines", required=True)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--admitted", default="16,48", help="limits, in turn")
    parser.add_argument("--clients", default="16,64", help="client counts, in turn")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--questions", type=int, default=1)
    parser.add_argument("--image-size", default="640x480")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    try:
        limits, clients = client_counts(args.admitted), client_counts(args.clients)
        width, height = (int(side) for side in args.image_size.split("x"))
    except (ValueError, argparse.ArgumentTypeError):
        limits, clients, width, height = (), (), 0, 0
    if not limits or not clients or width < 1 or height < 1:
        parser.error("--admitted and --clients want positive numbers (16,48), --image-size WxH")
    bodies = [
        traffic.request(
            args.seed, i, questions=args.questions, size=(width, height), fmt="PNG"
        ).body
        for i in range(args.requests)
    ]
    engine = load_engine(args.checkpoint, args.engines, args.backend)
    print("| admitted | clients | served | requests/s | retries | p50 ms | p99 ms | device busy |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rows = [r for limit in limits for r in measure(engine, limit, clients, bodies)]
    if args.out:
        Path(args.out).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
