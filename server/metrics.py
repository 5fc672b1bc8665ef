"""Prometheus metrics and the one-line JSON log of each request to the worker.

The native worker's main.rs has neither; the metric names follow the precedents listed in
docs/anchors.md §8 (requests by status, stage latency, input tokens, queue depth).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from server import memory
from server.admission import Scheduler

DECISION_PATH = "/v1/systemone"  # docs/contract.md §1.3
# the decision routes counted in the metrics: the native one and the formats' (server.formats)
DECISION_PATHS = (DECISION_PATH, "/typesafe/v1/systemone", "/v1/decisions")
STAGES = ("prepare", "queue_wait", "execute", "total")
# seconds; one question takes ~0.16 s and a 16-deep queue of 255-option requests minutes
# (docs/anchors.md §2, docs/contract.md §1.6)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48)  # requests a batch: at most the 48 admitted
QUIET_PATHS = ("/health", "/metrics")  # probes: logged at debug level only

CONTENT_TYPE = CONTENT_TYPE_LATEST
log = logging.getLogger("omnijev.requests")


@dataclass
class RequestRecord:
    """What one request did; logged as one JSON line and counted in the metrics when it ends."""

    request_id: str
    method: str
    path: str
    status: int = 0
    # decision requests only: "admitted", "rejected" (busy), "rejected unread" (busy, a large body
    # not read), "uploads busy" (a large body found no upload slot)
    admission: str | None = None
    outcome: str | None = None  # e.g. "answered", "dropped", "client gone"
    input_tokens: int | None = None
    questions: int | None = None
    queue_wait_s: float | None = None
    prepare_s: float | None = None
    execute_s: float | None = None
    total_s: float | None = None

    def log_line(self) -> str:
        fields = {key: value for key, value in asdict(self).items() if value is not None}
        for key, value in fields.items():
            if key.endswith("_s"):
                fields[key] = round(value, 6)
        return json.dumps(fields, ensure_ascii=False)


class Metrics:
    """The worker's metrics in a registry of its own, so that several apps share a process."""

    def __init__(
        self,
        scheduler: Scheduler,
        engine: Any,
        warm_up_builds: Callable[[], tuple[int, float] | None] = lambda: None,
    ) -> None:
        """`warm_up_builds`: the engine's shape builds when the worker turned ready (None
        before: every build so far is the warm-up's)."""
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter(
            "omnijev_requests", "decision requests by status", ["status"], registry=registry
        )
        self.latency = Histogram(
            "omnijev_stage_seconds",
            "decision request latency by stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        # counted when admission decides, so that requests still running are included
        self.admissions = Counter("omnijev_admitted", "requests admitted", registry=registry)
        self.rejections = Counter(
            "omnijev_rejected", "requests refused because 16 were admitted", registry=registry
        )
        self.input_tokens = Counter(
            "omnijev_input_tokens", "input tokens of answered requests", registry=registry
        )
        self.questions = Counter(
            "omnijev_questions", "questions of answered requests", registry=registry
        )
        Gauge("omnijev_admitted_requests", "requests admitted now", registry=registry).set_function(
            lambda: scheduler.admitted
        )
        Gauge(
            "omnijev_queue_depth", "prepared requests waiting to execute", registry=registry
        ).set_function(lambda: scheduler.waiting)
        Gauge(
            "omnijev_preparing_requests", "requests in preparation now", registry=registry
        ).set_function(lambda: scheduler.preparing)
        # process_resident_memory_bytes, CPU seconds and open file descriptors (Linux /proc)
        ProcessCollector(registry=registry)
        Gauge(
            "omnijev_resident_memory_bytes", "resident set size of the worker", registry=registry
        ).set_function(memory.rss_bytes)
        Gauge(
            "omnijev_requests_merge",
            "1 where requests share passes here, 0 where each runs alone (--merge off, or a check "
            "before ready found a row's bytes moving with its pass)",
            registry=registry,
        ).set_function(lambda: float(getattr(engine, "merges", False)))
        registry.register(CudaMemory())
        registry.register(PrefixCache(engine))
        registry.register(Batches(scheduler))
        registry.register(Passes(engine))
        registry.register(ShapeBuilds(engine, warm_up_builds))

    def render(self) -> bytes:
        """The registry in Prometheus' text format."""
        return generate_latest(self.registry)

    def observe(self, record: RequestRecord) -> None:
        """Count a finished request and write its log line."""
        if record.path in QUIET_PATHS:
            log.debug(record.log_line())
            return
        log.info(record.log_line())
        if record.path not in DECISION_PATHS:
            return
        self.requests.labels(str(record.status)).inc()
        if record.status == 200:
            self.input_tokens.inc(record.input_tokens or 0)
            self.questions.inc(record.questions or 0)
        for stage in STAGES:
            seconds = getattr(record, f"{stage}_s")
            if seconds is not None:
                self.latency.labels(stage).observe(seconds)


class CudaMemory:
    """torch's CUDA memory by kind (allocated, reserved); nothing where CUDA is not in use."""

    def describe(self) -> list:
        return []  # collected on each scrape, so that a worker without CUDA shows nothing

    def collect(self) -> list[GaugeMetricFamily]:
        sizes = memory.cuda_bytes()
        if not sizes:
            return []
        family = GaugeMetricFamily(
            "omnijev_cuda_memory_bytes", "CUDA device memory held by torch", labels=["kind"]
        )
        for kind, size in sizes.items():
            family.add_metric([kind], size)
        return [family]


class PrefixCache:
    """The image-prefix cache's hits and misses (runtime.executor); nothing for an engine
    without one. Replicas that share an image's traffic show it here (server.ray_serve)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []

    def collect(self) -> list[CounterMetricFamily]:
        lookups = self.engine.prefix_lookups()
        if lookups is None:
            return []
        families = []
        for outcome, count in zip(("hits", "misses"), lookups, strict=True):
            family = CounterMetricFamily(
                f"omnijev_prefix_cache_{outcome}", f"image prefixes looked up: {outcome}"
            )
            family.add_metric([], count)
            families.append(family)
        return families


class Batches:
    """The executed batches by their number of requests (server.admission.Scheduler), as a
    histogram: how far more clients filled the passes."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def describe(self) -> list:
        return []

    def collect(self) -> list[HistogramMetricFamily]:
        sizes = dict(self.scheduler.batches)
        buckets = [(str(edge), sum(n for size, n in sizes.items() if size <= edge))
                   for edge in BATCH_BUCKETS]  # fmt: skip
        buckets.append(("+Inf", sum(sizes.values())))
        total = sum(size * n for size, n in sizes.items())
        family = HistogramMetricFamily(
            "omnijev_batch_requests", "requests in each executed batch of passes"
        )
        family.add_metric([], buckets, total)
        return [family]


# what the executed passes held (runtime.flight.PassCounts): name, help, its attribute
PASS_COUNTERS = (
    ("omnijev_pass_batches", "batches of requests executed as one", "batches"),
    ("omnijev_pass_requests", "requests in the executed batches", "requests"),
    ("omnijev_packed_passes", "packed passes run", "passes"),
    ("omnijev_packed_token_slots", "token slots of the packed passes run", "slots"),
    ("omnijev_packed_tokens", "token slots holding a token (the rest padding)", "tokens"),
    ("omnijev_packed_rows", "rows (question texts and options) of the packed passes", "rows"),
    ("omnijev_device_busy_seconds", "seconds the device held a batch's work", "device_seconds"),
)


class Passes:
    """What the engine's passes held, where it counts them: rows and requests a pass and the
    share of token slots filled are ratios of these counters; the device's busy share is the
    rate of `omnijev_device_busy_seconds`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def describe(self) -> list:
        return []

    def collect(self) -> list[CounterMetricFamily]:
        counts = getattr(self.engine, "passes", None)
        if counts is None:
            return []
        families = []
        for name, text, attribute in PASS_COUNTERS:
            family = CounterMetricFamily(name, text)
            family.add_metric([], getattr(counts, attribute))
            families.append(family)
        return families


class ShapeBuilds:
    """Pass shapes the engine built (compiled and captured, a session made) and the seconds they
    took, by phase: "warm-up" until the worker turned ready, "serving" after, where a request
    waited on each (issue 37's acceptance: none after ready)."""

    def __init__(self, engine: Any, warm_up: Callable[[], tuple[int, float] | None]) -> None:
        self.engine = engine
        self.warm_up = warm_up

    def describe(self) -> list:
        return []

    def collect(self) -> list[CounterMetricFamily]:
        count, seconds = self.engine.shape_builds()
        warm = self.warm_up() or (count, seconds)
        builds = CounterMetricFamily(
            "omnijev_shape_builds", "pass shapes built, by phase", labels=["phase"]
        )
        spent = CounterMetricFamily(
            "omnijev_shape_build_seconds", "seconds spent building pass shapes", labels=["phase"]
        )
        for family, total, warmed in ((builds, count, warm[0]), (spent, seconds, warm[1])):
            family.add_metric(["warm-up"], warmed)
            family.add_metric(["serving"], total - warmed)
        return [builds, spent]
