"""The worker on Ray Serve: replicas of the same app (server.app) behind one HTTP endpoint, each
request about an image sent to the replica that keeps that image's prefix (server.ray_router).

Two deployments. `Ingress` takes every HTTP request from Ray's proxy, reads the body as the
worker does, computes the image's routing key and forwards the request through a deployment
handle (`session_id` = the key) to a `Worker` replica, which answers it with the worker's own app,
in process; the answer's status, headers and bytes come back unchanged. Ray's proxy streams a
body only after it has chosen the replica, so no router can see the image: the ingress is where
the key can be read (the pattern of Ray Serve LLM's ingress and its prefix-aware router).
`/health` answers for the deployment (ready once every replica has warmed up) and `/metrics`
concatenates every replica's metrics with a `replica` label. Started by `omnijev serve --replicas N`
on one host, or by `serve run server/ray_serve.yaml` on a cluster (docs/ray-serve.md).
"""

# no `from __future__ import annotations`: FastAPI reads the ingress routes' annotations as
# objects once Ray has rebound them to the class
import asyncio
import hashlib
import logging
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.config import BackpressureConfig, RequestRouterConfig
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from ray.serve.handle import DeploymentHandle
from starlette.types import ASGIApp, Message, Scope
from uvicorn.lifespan.on import LifespanOn

from runtime.config import RuntimeConfig
from server.admission import ADMITTED
from server.app import (
    BODY_READ_S,
    GRACEFUL_SHUTDOWN_S,
    RETRY_AFTER,
    Refusal,
    allowed_hosts_from_env,
    body_or_refusal,
    create_app,
    error,
    read_warm_up,
    worker_process,
)
from server.metrics import CONTENT_TYPE, DECISION_PATH
from server.ray_router import PIN, ImageRouter, replica_ids

APP_NAME = "omnijev"
WORKER = "Worker"  # the worker deployment's name (the router's registry is keyed by it)
IMAGE_MARK = b"data:image/"  # where a request's image starts in its body
# bytes of the image's data URL at each end hashed, with its length, into the routing key:
# constant work whatever the image's size; two images that agree on both ends and the length
# only share a replica (the prefix cache itself keys by the whole image)
KEY_SPAN = 64 * 1024
# a request whose replica died under it is sent once more, to another: answers do not depend on
# the replica, and a decision changes nothing, so sending it again is safe
RETRIES = 1
# requests waiting in the ingress's router for a replica slot; beyond them the answer is the
# worker's own 503 busy with Retry-After, as one worker answers past its ADMITTED
QUEUED = ADMITTED
INGRESS_ONGOING = 256  # requests the ingress forwards at once (it only reads and forwards)
SCRAPE_S = 10.0  # a replica's /metrics within this, else it is left out of the scrape
# how often Ray asks a replica whether it is healthy, and how long it waits for the answer
HEALTH_PERIOD_S = 5.0
HEALTH_TIMEOUT_S = 30.0
WARM_POLL_S = 0.05
METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
SERVING = ("HEALTHY", "UPSCALING", "DOWNSCALING")  # deployment states with every replica warm
# what the proxy adds itself (x-request-id, the same value) or the response object computes
DROPPED_HEADERS = (b"x-request-id",)
# the ASGI scope's parts that travel to the replica (the rest belongs to the ingress's app)
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path")
SCOPE_KEYS += ("query_string", "headers", "client", "server")

log = logging.getLogger("omnijev.ray")


class Answer(NamedTuple):
    """An HTTP answer as the worker's app sent it."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


def image_key(body: bytes) -> str:
    """The routing key of the image in a request body: a hash of its data URL's ends and
    length; "" when the body names no image (such requests go to the least loaded replica)."""
    start = body.find(IMAGE_MARK)
    if start < 0:
        return ""
    end = body.find(b'"', start)
    end = len(body) if end < 0 else end
    digest = hashlib.blake2b(digest_size=16)
    digest.update(body[start : min(end, start + KEY_SPAN)])
    digest.update(body[max(start, end - KEY_SPAN) : end])
    digest.update((end - start).to_bytes(8, "little"))
    return digest.hexdigest()


def request_scope(scope: Scope) -> dict[str, Any]:
    """The parts of a request's ASGI scope that a replica's app needs."""
    return {key: scope[key] for key in SCOPE_KEYS if key in scope}


async def call_app(app: ASGIApp, scope: dict, body: bytes, gone: asyncio.Event) -> Answer:
    """One request through an ASGI app in process: the whole body at once, a disconnect once
    `gone` is set; the answer it sent."""
    scope = {**scope, "root_path": ""}
    pending = [{"type": "http.request", "body": body, "more_body": False}]
    status, headers, chunks = 500, [], []

    async def receive() -> Message:
        if pending:
            return pending.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status, headers
        if message["type"] == "http.response.start":
            status, headers = message["status"], list(message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return Answer(status, headers, b"".join(chunks))


def response(answer: Answer) -> Response:
    """A replica's answer as the ingress's response, its headers as the replica sent them."""
    result = Response(answer.body, status_code=answer.status)
    result.raw_headers = [(k, v) for k, v in answer.headers if k.lower() not in DROPPED_HEADERS]
    return result


class Worker:
    """One replica: the worker's app over an engine loaded here, warmed up before Ray routes to
    it (the constructor returns once the warm-up requests have run)."""

    async def __init__(
        self,
        checkpoint: str,
        engines: str,
        config: RuntimeConfig,
        warm_ups: Sequence[dict] = (),
        allowed_hosts: Sequence[str] = (),
        docs: bool = True,
    ) -> None:
        from runtime.executor import load_engine

        worker_process()
        engine = await asyncio.to_thread(load_engine, checkpoint, engines, config)
        self.app = create_app(engine, warm_ups=warm_ups, allowed_hosts=allowed_hosts, docs=docs)
        self.lifespan = LifespanOn(uvicorn.Config(self.app, lifespan="on", log_config=None))
        await self.lifespan.startup()
        while self.state() == "warming up":
            await asyncio.sleep(WARM_POLL_S)
        if self.state() != "ready":
            raise RuntimeError(f"the replica did not warm up: {self.state()}")
        self.replica = serve.get_replica_context().replica_id.unique_id

    def state(self) -> str:
        return self.app.state.worker.state

    async def forward(self, scope: dict, body: bytes) -> Answer:
        """Answer one request with the app. If the caller is cancelled (its client went away),
        the app sees the disconnect: a request still waiting is dropped, as in one worker."""
        gone = asyncio.Event()
        answering = asyncio.ensure_future(call_app(self.app, scope, body, gone))
        try:
            return await asyncio.shield(answering)
        except asyncio.CancelledError:
            gone.set()
            raise

    async def replica_id(self) -> str:
        return self.replica

    async def check_health(self) -> None:
        """Ray's health check: a replica whose worker is not ready is replaced."""
        if self.state() != "ready":
            raise RuntimeError(f"worker state {self.state()!r}")

    async def __del__(self) -> None:
        await self.lifespan.shutdown()  # admitted work finishes first


def worker_status() -> str:
    """The worker deployment's status in this replica's application (Ray's controller)."""
    app = serve.get_replica_context().app_name
    deployments = serve.status().applications[app].deployments
    return str(deployments[WORKER].status.value)


class Replicated:
    """Prometheus metric families gathered from several replicas (a collector)."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return self.families


def labelled(texts: dict[str, bytes]) -> bytes:
    """Prometheus texts of several replicas as one, each sample labelled `replica`."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, "replica": replica}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Replicated(list(families.values())))
    return generate_latest(registry)


# serve.ingress freezes the app with a copy of what its routes use: defined above it
# the ingress's own routes: /health and /metrics for the deployment, every other request is
# forwarded; no documentation routes of its own (the replicas' are forwarded)
ingress_app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
ingress_app.router.redirect_slashes = False


@serve.ingress(ingress_app)
class Ingress:
    """Reads each request, keys it by its image and forwards it to a worker replica."""

    def __init__(self, worker: DeploymentHandle) -> None:
        self.worker = worker
        self.draining = asyncio.Event()  # never set: the replicas drain their own work

    @ingress_app.get("/health")
    async def health(self, request: Request) -> Response:
        """200 with a replica's health body once every replica has warmed up; 503 before."""
        status = await asyncio.to_thread(worker_status)
        if status not in SERVING:
            state = "warming up" if status == "UPDATING" else status.lower()
            return JSONResponse({"status": state}, status_code=503)
        return await self.forward(request)

    @ingress_app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        """Every replica's metrics, each sample labelled with its replica."""
        scope = request_scope(request.scope)
        if not replica_ids(WORKER):
            await self.worker.replica_id.remote()  # the first call starts the handle's router
        texts: dict[str, bytes] = {}
        for replica in replica_ids(WORKER):
            pinned = self.worker.options(session_id=PIN + replica)
            try:
                answer = await asyncio.wait_for(pinned.forward.remote(scope, b""), SCRAPE_S)
            except (TimeoutError, RayActorError, BackPressureError):
                continue  # gone or stuck: the next scrape sees the replica that replaces it
            if answer.status != 200:
                return response(answer)
            texts[replica] = answer.body
        return Response(labelled(texts), media_type=CONTENT_TYPE)

    @ingress_app.api_route("/{path:path}", methods=METHODS)
    async def forward(self, request: Request) -> Response:
        """The request to a replica: the one of its image's key, else the least loaded."""
        body = await body_or_refusal(request, BODY_READ_S, self.draining)
        if isinstance(body, Refusal):
            return body.response
        decision = request.method == "POST" and request.url.path == DECISION_PATH
        key = image_key(body) if decision else ""
        handle = self.worker.options(session_id=key) if key else self.worker
        scope = request_scope(request.scope)
        for attempt in range(RETRIES + 1):
            try:
                return response(await handle.forward.remote(scope, body))
            except BackPressureError:
                return error(503, "the worker is busy", RETRY_AFTER)
            except DeploymentUnavailableError:
                return error(503, "no replica is available", RETRY_AFTER)
            except RayActorError:
                log.warning("a replica died answering; attempt %d of %d", attempt + 1, RETRIES + 1)
        return error(503, "the replica answering failed", RETRY_AFTER)


@dataclass(frozen=True)
class Replicas:
    """How many worker replicas and what each holds: `count` fixed, or autoscaled from `count`
    to `most` on `target` ongoing requests a replica."""

    count: int = 1
    most: int | None = None
    target: float = ADMITTED / 2
    gpus: float = 0.0  # a fraction shares a GPU between replicas
    cpus: float = 1.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"replicas must be at least 1, got {self.count}")
        if self.most is not None and self.most < self.count:
            raise ValueError(f"max replicas must be at least {self.count}, got {self.most}")
        if not 0 < self.target <= ADMITTED:
            raise ValueError(
                f"target ongoing requests must be in (0, {ADMITTED}], got {self.target}"
            )

    def options(self) -> dict[str, Any]:
        """The worker deployment's options for Ray Serve."""
        scale: dict[str, Any] = {"num_replicas": self.count}
        if self.most is not None and self.most > self.count:
            scale = {
                "autoscaling_config": {
                    "min_replicas": self.count,
                    "max_replicas": self.most,
                    "target_ongoing_requests": self.target,
                }
            }
        return {
            "name": WORKER,
            **scale,
            "ray_actor_options": {"num_gpus": self.gpus, "num_cpus": self.cpus},
            # Ray sends a replica at most what one worker admits
            "max_ongoing_requests": ADMITTED,
            "max_queued_requests": QUEUED,
            "backpressure_config": BackpressureConfig(retry_after_s=1),
            "request_router_config": RequestRouterConfig(
                request_router_class=ImageRouter, request_router_kwargs={"num_fallback_replicas": 1}
            ),
            "health_check_period_s": HEALTH_PERIOD_S,
            "health_check_timeout_s": HEALTH_TIMEOUT_S,
            "graceful_shutdown_timeout_s": GRACEFUL_SHUTDOWN_S,
        }


def build_app(
    checkpoint: str,
    engines: str,
    config: RuntimeConfig,
    replicas: Replicas,
    *,
    warm_ups: Sequence[dict] = (),
    allowed_hosts: Sequence[str] | None = None,
    docs: bool = True,
) -> serve.Application:
    """The Ray Serve application: the ingress in front of the worker replicas."""
    worker = serve.deployment(Worker).options(**replicas.options())
    hosts = allowed_hosts_from_env() if allowed_hosts is None else tuple(allowed_hosts)
    bound = worker.bind(
        str(Path(checkpoint).resolve()),
        str(Path(engines).resolve()),
        config,
        list(warm_ups),
        list(hosts),
        docs,
    )
    ingress = serve.deployment(Ingress).options(
        name="Ingress",
        max_ongoing_requests=INGRESS_ONGOING,
        ray_actor_options={"num_cpus": 0},
        backpressure_config=BackpressureConfig(retry_after_s=1),
    )
    return ingress.bind(bound)


class ServeArgs(BaseModel):
    """The arguments of `serve run`'s config file (server/ray_serve.yaml): those of
    `omnijev serve --replicas`, runtime settings by their RuntimeConfig names."""

    model_config = ConfigDict(extra="forbid")

    checkpoint: str
    engines: str
    replicas: int = Field(1, ge=1)
    max_replicas: int | None = None
    target_ongoing: float = ADMITTED / 2
    replica_gpus: float = Field(0.0, ge=0)
    replica_cpus: float = Field(1.0, ge=0)
    warm_up: list[str] = []
    allowed_hosts: list[str] | None = None
    docs: bool = True
    settings: dict[str, Any] = {}


def build(args: ServeArgs) -> serve.Application:
    """`serve run`'s application builder (`import_path: server.ray_serve:build`)."""
    replicas = Replicas(
        args.replicas, args.max_replicas, args.target_ongoing, args.replica_gpus, args.replica_cpus
    )
    return build_app(
        args.checkpoint,
        args.engines,
        RuntimeConfig.from_env(**args.settings),
        replicas,
        warm_ups=[read_warm_up(path) for path in args.warm_up],
        allowed_hosts=args.allowed_hosts,
        docs=args.docs,
    )


def cli_serve(args: Any) -> int:
    """`omnijev serve --replicas N ...`: Ray on this host (or the cluster at --ray-address), Serve's
    proxy on --host:--port, the application deployed; until SIGTERM or SIGINT."""
    import ray

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        replicas = Replicas(
            args.replicas,
            args.max_replicas,
            args.target_ongoing,
            default_gpus(args) if args.replica_gpus is None else args.replica_gpus,
            args.replica_cpus,
        )
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    application = build_app(
        args.checkpoint,
        args.engines,
        RuntimeConfig.from_args(args),
        replicas,
        warm_ups=[read_warm_up(path) for path in args.warm_up or ()],
        allowed_hosts=args.allowed_host or None,
        docs=not args.no_docs,
    )
    # one host: no dashboard; Ray's own ports need the session's token (docs/ray-serve.md)
    local = {"include_dashboard": False}
    ray.init(address=args.ray_address, **({} if args.ray_address else local))
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application, name=APP_NAME, route_prefix="/")
        log.info(
            "OmniJev deployment listening on %s:%d, %s",
            args.host,
            args.port,
            f"{replicas.count} replicas" if replicas.most is None else "autoscaled",
        )
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def default_gpus(args: Any) -> float:
    """One GPU a replica where the runtime would use CUDA, else none."""
    import torch

    return 1.0 if args.device != "cpu" and torch.cuda.is_available() else 0.0
