"""Closed-loop HTTP load on a running worker: N clients each post one request file, wait for the
answer and post again, for a fixed time; prints requests/s and latency (issue 13's overlap check).

Quantiles as `tools.bench` takes them (validate.py's q); each client keeps one HTTP/1.1
connection. `--workload` builds `omnijev bench`'s request (the 1600×900 PNG still) in place of a
file; the rest is standard library.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

CLIENTS = 8  # the 8 closed-loop clients
SECONDS = 30.0  # measured time, after the warm-up
WARM_UP_SECONDS = 5.0  # first answers (sessions, graphs, caches) are not counted
TIMEOUT_SECONDS = 120.0  # one request's socket timeout
QUANTILES = (0.5, 0.9, 0.99)


def quantile(values: list[float], f: float) -> float:
    """validate.py's q(f) = sorted[min(n − 1, int(f·n))]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(f * len(ordered)))]


class Client(threading.Thread):
    """One closed-loop client: post, read the whole answer, post again until told to stop."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str], clock: dict[str, float]):
        super().__init__(daemon=True)
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path or "/"
        self.body, self.headers, self.clock = body, headers, clock
        self.latencies: list[float] = []  # seconds of answers finished inside the window
        self.statuses: Counter[int | str] = Counter()
        self.stop = threading.Event()

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_SECONDS)

    def run(self) -> None:
        connection = self.connect()
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("POST", self.path, self.body, self.headers)
                response = connection.getresponse()
                response.read()
                status: int | str = response.status
            except (OSError, http.client.HTTPException) as error:
                status = type(error).__name__
                connection.close()
                connection = self.connect()
            finished = time.perf_counter()
            if self.clock["start"] <= started and finished <= self.clock["end"]:
                self.latencies.append(finished - started)
                self.statuses[status] += 1
        connection.close()


def run_load(
    url: str,
    body: bytes,
    clients: int = CLIENTS,
    seconds: float = SECONDS,
    warm_up: float = WARM_UP_SECONDS,
    headers: dict[str, str] | None = None,
) -> dict:
    """Requests/s and latency of `clients` closed-loop clients over `seconds` after `warm_up`."""
    sent = {"Content-Type": "application/json", **(headers or {})}
    clock = {"start": float("inf"), "end": float("inf")}
    workers = [Client(url, body, sent, clock) for _ in range(clients)]
    for worker in workers:
        worker.start()
    time.sleep(warm_up)
    clock["start"] = time.perf_counter()
    clock["end"] = clock["start"] + seconds
    time.sleep(seconds)
    for worker in workers:
        worker.stop.set()
    for worker in workers:
        worker.join(TIMEOUT_SECONDS)
    latencies = [s for worker in workers for s in worker.latencies]
    statuses: Counter = sum((worker.statuses for worker in workers), Counter())
    ok = statuses.get(200, 0)
    report = {
        "url": url,
        "clients": clients,
        "seconds": seconds,
        "answers": len(latencies),
        "ok": ok,
        "statuses": {str(k): v for k, v in sorted(statuses.items(), key=str)},
        "requests_per_s": ok / seconds,
    }
    if latencies:
        report["latency_ms"] = {
            "mean": 1e3 * statistics.fmean(latencies),
            **{f"p{round(100 * f)}": 1e3 * quantile(latencies, f) for f in QUANTILES},
            "max": 1e3 * max(latencies),
        }
    return report


def summary(report: dict) -> str:
    latency = report.get("latency_ms", {})
    cells = ", ".join(f"{k} {v:.1f}" for k, v in latency.items())
    return (
        f"{report['clients']} clients, {report['seconds']:.0f} s: "
        f"{report['requests_per_s']:.2f} requests/s ({report['ok']} answered 200; statuses "
        f"{report['statuses']}); latency ms: {cells}"
    )


def bench_body(workload: str) -> bytes:
    """`omnijev bench`'s request for a workload: the screen still as PNG (contract.md §12.2)."""
    from tools.bench import BENCH_SIZE, body, encode, screen_image, workloads

    loads = workloads()
    if workload not in loads:
        raise SystemExit(f"unknown workload {workload!r}; one of {sorted(loads)}")
    return body(encode(screen_image(*BENCH_SIZE, seed=1), "PNG"), "image/png", loads[workload])


def parse_headers(values: list[str]) -> dict[str, str]:
    headers = {}
    for value in values:
        name, colon, text = value.partition(":")
        if not colon:
            raise SystemExit(f"--header wants NAME: VALUE, got {value!r}")
        headers[name.strip()] = text.strip()
    return headers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.loadtest", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1/systemone")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--request", help="request body file (JSON)")
    source.add_argument(
        "--workload",
        help="a bench workload on the 1600×900 PNG still instead, e.g. '12 questions'",
    )
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--seconds", type=float, default=SECONDS)
    parser.add_argument("--warm-up", type=float, default=WARM_UP_SECONDS)
    parser.add_argument("--single", action="store_true", help="also one client first, same time")
    parser.add_argument("--header", action="append", default=[], help="extra 'Name: value'")
    parser.add_argument("--out", default=None, help="write the report(s) as JSON")
    args = parser.parse_args(argv)
    body = Path(args.request).read_bytes() if args.request else bench_body(args.workload)
    headers = parse_headers(args.header)
    reports = []
    for clients in ([1] if args.single else []) + [args.clients]:
        report = run_load(args.url, body, clients, args.seconds, args.warm_up, headers)
        print(summary(report), flush=True)
        reports.append(report)
    if len(reports) == 2 and reports[0].get("latency_ms"):
        single_ms = reports[0]["latency_ms"]["p50"]
        print(
            f"throughput {reports[1]['requests_per_s']:.2f}/s against 1000/single p50 "
            f"{1e3 / single_ms:.2f}/s: {reports[1]['requests_per_s'] * single_ms / 1e3:.2f}×"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(reports, indent=1))
    return 0 if all(r["ok"] == r["answers"] for r in reports) else 1


if __name__ == "__main__":
    sys.exit(main())
