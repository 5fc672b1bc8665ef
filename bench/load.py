"""`python -m bench.load`: closed-loop HTTP load on a running worker. N clients share M requests
of the traffic suite (or one bench workload); each posts one, reads the whole answer and posts
the next. Reports requests/s, latency quantiles, and the worker's own seconds per request read
from its `/metrics` before and after (execute: the GPU's share); every request's latency is kept.
With several client counts, each request's answers (latency fields left out) must be the same
bytes in every run: one client runs each request alone, more clients run them in batches.

Standard library only (one HTTP/1.1 connection a client), so it runs where the worker does.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import re
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from bench import traffic
from bench.parity import without_latency
from bench.workloads import bench_body, quantile

CLIENTS = 8
REQUESTS = 200
TIMEOUT_SECONDS = 120.0  # one request's socket timeout
QUANTILES = (0.5, 0.9, 0.99)
SERVER_STAGES = ("prepare", "queue_wait", "execute", "total")  # server.metrics.STAGES
STAGE_METRIC = "omnijev_stage_seconds"  # server.metrics: a histogram labelled by stage
BATCH_METRIC = "omnijev_batch_requests"  # server.metrics: requests per executed batch
MAX_CLIP_FRAMES = 16  # runtime.video.MAX_FRAMES: the contract's frames a clip
CLIP_DRAWS = 1 << 20  # the index of the draws that pick a mixed run's clips, apart from requests'


class Client(threading.Thread):
    """One closed-loop client: takes the next request, posts it, reads the answer, again."""

    def __init__(self, url: str, bodies: list[bytes], take, records: list[dict], retries: int = 0):
        super().__init__(daemon=True)
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path or "/"
        self.bodies, self.take, self.records = bodies, take, records
        self.retries = retries  # a 503's Retry-After honoured, as the SDKs do, this many times

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_SECONDS)

    def run(self) -> None:
        connection = self.connect()
        headers = {"Content-Type": "application/json"}
        while (index := self.take()) is not None:
            started = time.perf_counter()
            retried = 0
            while True:
                try:
                    connection.request("POST", self.path, self.bodies[index], headers)
                    response = connection.getresponse()
                    payload = response.read()
                    status: int | str = response.status
                    wait = response.getheader("Retry-After")
                except (OSError, http.client.HTTPException) as error:
                    status, payload, wait = type(error).__name__, b"", None
                    connection.close()
                    connection = self.connect()
                if status != 503 or wait is None or retried >= self.retries:
                    break
                retried += 1
                time.sleep(float(wait))
            seconds = time.perf_counter() - started
            record = {"index": index, "status": status, "latency_ms": 1e3 * seconds}
            record["retries"] = retried
            if status == 200:
                record["answers"] = answers_digest(payload)
            self.records.append(record)
        connection.close()


def answers_digest(payload: bytes) -> str | None:
    """SHA-256 of a native response's answers without their latency fields: what must be the
    same bytes whether the request ran alone or batched with others (None: not a native
    response)."""
    try:
        answers = without_latency(json.loads(payload))
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return hashlib.sha256(json.dumps(answers, sort_keys=True).encode()).hexdigest()


def differing_answers(reports: list[dict]) -> list[int]:
    """The requests whose answers differ between the runs (one client: each alone; more: in
    batches), where each of them was answered."""
    seen: dict[int, set] = {}
    for report in reports:
        for record in report["records"]:
            if record.get("answers") is not None:
                seen.setdefault(record["index"], set()).add(record["answers"])
    return sorted(index for index, digests in seen.items() if len(digests) > 1)


def counter(count: int):
    """A thread-safe source of the indices 0 … count − 1, then None."""
    lock, state = threading.Lock(), {"next": 0}

    def take() -> int | None:
        with lock:
            index = state["next"]
            if index >= count:
                return None
            state["next"] = index + 1
            return index

    return take


def stage_seconds(url: str) -> dict[str, tuple[float, float]] | None:
    """The worker's (sum, count) of seconds per stage from its /metrics; None without it."""
    parts = urlsplit(url)
    try:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
        connection.close()
    except (OSError, http.client.HTTPException):
        return None
    if response.status != 200:
        return None
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in (STAGE_METRIC, BATCH_METRIC):
            continue
        for sample in family.samples:
            kind = sample.name.removeprefix(family.name + "_")
            stage = BATCH_METRIC if family.name == BATCH_METRIC else sample.labels.get("stage", "")
            found.setdefault(stage, {})[kind] = sample.value
    return {stage: (v.get("sum", 0.0), v.get("count", 0.0)) for stage, v in found.items()}


def mean_between(before: dict, after: dict, name: str) -> float | None:
    """The mean of histogram `name` over what it observed between the two readings."""
    (s0, c0), (s1, c1) = before.get(name, (0.0, 0.0)), after.get(name, (0.0, 0.0))
    return (s1 - s0) / (c1 - c0) if c1 > c0 else None


def per_request_ms(before: dict | None, after: dict | None) -> dict[str, float] | None:
    """Each stage's mean milliseconds over the requests answered between the two readings."""
    if before is None or after is None:
        return None
    means = {stage: mean_between(before, after, stage) for stage in SERVER_STAGES}
    return {stage: 1e3 * mean for stage, mean in means.items() if mean is not None}


def requests_per_batch(before: dict | None, after: dict | None) -> float | None:
    """The mean requests of the batches the worker executed between the two readings."""
    if not before or not after:
        return None
    return mean_between(before, after, BATCH_METRIC)


def run_load(url: str, bodies: list[bytes], clients: int = CLIENTS, retries: int = 0) -> dict:
    """Every body once, by `clients` closed-loop clients (each 503 retried after its Retry-After
    up to `retries` times); the report without request details."""
    records: list[dict] = []
    take = counter(len(bodies))
    before = stage_seconds(url)
    started = time.perf_counter()
    workers = [Client(url, bodies, take, records, retries) for _ in range(clients)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - started
    after = stage_seconds(url)
    server = per_request_ms(before, after)
    records.sort(key=lambda r: r["index"])
    statuses = Counter(str(r["status"]) for r in records)
    latencies = [r["latency_ms"] for r in records]
    report = {
        "url": url,
        "clients": clients,
        "requests": len(bodies),
        "seconds": seconds,
        "ok": statuses.get("200", 0),
        "statuses": dict(sorted(statuses.items())),
        "requests_per_s": statuses.get("200", 0) / seconds,
        "retries": sum(r["retries"] for r in records),
        "latency_ms": {
            "mean": statistics.fmean(latencies),
            **{f"p{round(100 * f)}": quantile(latencies, f) for f in QUANTILES},
            "max": max(latencies),
        },
        "server_ms_per_request": server,
        "gpu_ms_per_request": (server or {}).get("execute"),
        "requests_per_batch": requests_per_batch(before, after),
        "records": records,
    }
    return report


def suite_bodies(args: argparse.Namespace, count: int, stream: str) -> tuple[list[bytes], list]:
    """The requests of the chosen suite, and what each is made of (traffic only)."""
    if args.suite == "bench":
        name = f"{args.questions or 12} question{'s' * ((args.questions or 12) > 1)}"
        return [bench_body(name)] * count, [{"workload": name}] * count
    size = tuple(int(x) for x in args.image_size.lower().split("x")) if args.image_size else None
    fmt = args.format.upper() if args.format else None
    made = [
        traffic.request(args.seed, i, stream, args.questions, size, fmt, args.images, clip)
        for i, clip in enumerate(clip_frames(args, count, stream))
    ]
    described = [
        {"size": list(r.size), "format": r.format, "questions": r.questions, "rows": r.options}
        for r in made
    ]
    return [r.body for r in made], described


def clip_frames(args: argparse.Namespace, count: int, stream: str) -> list[int | None]:
    """Each request's clip frames, None for a still: `--clip-share` of them, drawn by index."""
    if not args.clip_frames:
        return [None] * count
    draws = traffic.rng_for(args.seed, stream, CLIP_DRAWS).random(count)
    return [args.clip_frames if draw < args.clip_share else None for draw in draws]


def by_format(report: dict) -> dict[str, dict[str, float]]:
    """p50 and p99 of each kind of request in a run (stills by format, clips as MP4)."""
    kinds: dict[str, list[float]] = {}
    for record in report["records"]:
        kinds.setdefault(record.get("format", "-"), []).append(record["latency_ms"])
    return {k: {"p50": quantile(v, 0.5), "p99": quantile(v, 0.99)} for k, v in kinds.items()}


def table(reports: list[dict]) -> str:
    lines = [
        "| clients | requests | ok | requests/s | p50 ms | p90 ms | p99 ms | max ms | "
        "server prepare ms | queue ms | execute (GPU) ms | requests a batch |",
        "|" + " ---: |" * 12,
    ]
    for r in reports:
        server = r["server_ms_per_request"] or {}
        cells = [r["clients"], r["requests"], r["ok"], f"{r['requests_per_s']:.2f}"]
        cells += [f"{r['latency_ms'][k]:.1f}" for k in ("p50", "p90", "p99", "max")]
        cells += [f"{server[k]:.1f}" if k in server else "-" for k in SERVER_STAGES[:3]]
        batch = r.get("requests_per_batch")
        cells.append("-" if batch is None else f"{batch:.2f}")
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1/systemone")
    parser.add_argument(
        "--clients", default=str(CLIENTS), help="clients, or a list run in turn: 1,16"
    )
    parser.add_argument("--requests", type=int, default=REQUESTS, help="requests a run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", action="store_true", help="the seed's held-out stream")
    parser.add_argument("--suite", choices=("traffic", "bench"), default="traffic")
    parser.add_argument("--questions", type=int, default=None, help="questions a request")
    parser.add_argument("--image-size", default=None, metavar="WxH", help="traffic: one size")
    parser.add_argument("--format", choices=("png", "jpeg"), default=None, help="traffic")
    parser.add_argument(
        "--images",
        type=int,
        default=None,
        metavar="K",
        help="traffic: requests about K screenshots in turn (default: each its own)",
    )
    parser.add_argument(
        "--clip-frames", type=int, default=0, metavar="K", help="traffic: clips of K frames"
    )
    parser.add_argument(
        "--clip-share",
        type=float,
        default=1.0,
        help="traffic: the share of requests that are clips, the rest stills (default all)",
    )
    parser.add_argument(
        "--warm-up", type=int, default=0, help="requests of the warm-up stream first, not counted"
    )
    parser.add_argument(
        "--retries", type=int, default=0, help="a 503's Retry-After honoured up to N times"
    )
    parser.add_argument("--out", default=None, help="the reports and every request, as JSON")
    args = parser.parse_args(argv)
    if args.questions is not None and not 1 <= args.questions <= traffic.MAX_QUESTIONS:
        parser.error(f"--questions must be 1 to {traffic.MAX_QUESTIONS}, got {args.questions}")
    if args.suite == "bench" and args.questions not in (None, 1, 3, 6, 12):
        parser.error(f"the bench has 1, 3, 6 or 12 questions, got {args.questions}")
    if args.image_size and not re.fullmatch(r"\d+[xX]\d+", args.image_size):
        parser.error(f"--image-size wants WIDTHxHEIGHT, got {args.image_size!r}")
    if not 0 <= args.clip_frames <= MAX_CLIP_FRAMES:
        parser.error(f"--clip-frames must be 0 to {MAX_CLIP_FRAMES}, got {args.clip_frames}")
    if not 0.0 <= args.clip_share <= 1.0:
        parser.error(f"--clip-share must be 0 to 1, got {args.clip_share}")
    try:
        args.clients = [int(n) for n in args.clients.split(",")]
    except ValueError:
        parser.error(f"--clients wants numbers, got {args.clients!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stream = "held-out" if args.held_out else "suite"
    bodies, described = suite_bodies(args, args.requests, stream)
    if args.warm_up:
        run_load(args.url, suite_bodies(args, args.warm_up, "warm-up")[0], max(args.clients))
    reports = []
    for clients in args.clients:
        report = run_load(args.url, bodies, clients, args.retries)
        for record in report["records"]:
            record.update(described[record["index"]])
        reports.append(report)
    record = {"command": sys.argv, "suite": args.suite, "seed": args.seed, "runs": reports}
    record["held_out"] = args.held_out
    differing = differing_answers(reports)
    record["answers_differing"] = differing
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1))
    print(table(reports))
    if args.clip_frames and args.clip_share < 1.0:
        for report in reports:
            kinds = ", ".join(
                f"{kind} p50 {q['p50']:.1f} / p99 {q['p99']:.1f} ms"
                for kind, q in by_format(report).items()
            )
            print(f"{report['clients']} clients: {kinds}")
    if len(reports) > 1:
        verdict = f"no: {len(differing)} differ" if differing else "yes"
        print(f"every answer the same bytes in each run ({args.clients} clients): {verdict}")
    return 0 if all(r["ok"] == r["requests"] for r in reports) and not differing else 1


if __name__ == "__main__":
    sys.exit(main())
