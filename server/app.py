"""The HTTP worker: `POST /v1/systemone`, `GET /health` and `GET /metrics` on FastAPI, and the
ecosystem's formats beside them (`POST /typesafe/v1/systemone`, `POST /v1/decisions`,
`GET /v1/models`; server.formats), each through the native route's checks and admission.

Follows the native worker's main.rs (docs/contract.md §1): the same routes, order of checks,
statuses, bodies and admission; unlike it, the server binds before loading and warms up in the
background, and it guards the body read (upload slots, deadlines), the Host and the Content-Type
(issue 14).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import uvicorn
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from runtime import config as settings
from runtime.errors import BodyError, ContractError
from runtime.strict_json import parse_body
from runtime.types import Prepared
from runtime.video import DECODERS
from server import memory
from server.admission import ADMITTED, PREPARING, Dropped, Scheduler, Ticket
from server.formats import (
    NATIVE,
    NATIVE_PATH,
    FormatError,
    Translation,
    Wire,
    decisions,
    typesafe,
    unchanged,
)
from server.metrics import CONTENT_TYPE, Metrics, RequestRecord
from server.protocol import MAX_HEADER_BYTES, GuardedH11Protocol
from server.schemas import (
    ROUTE_DOCS,
    ROUTE_SUMMARIES,
    HealthBody,
    ModelList,
    request_body,
    request_schemas,
    route_responses,
)

MAX_BODY = 12 * 1024 * 1024  # docs/contract.md §1.4: 12,582,912 bytes
# a refused body up to this size is read and dropped so that its client reads the 413 instead
# of a connection reset; a larger one is cut off
DRAIN_LIMIT = 64 * 1024 * 1024
REQUEST_ID_MAX = 128  # longer client ids are replaced (docs/anchors.md §8: request ids)
RETRY_AFTER = {"Retry-After": "1"}  # docs/contract.md §1.5
# admitted work finishes before a SIGTERM'd worker exits; the reference's 16 requests of 255
# options took minutes (docs/contract.md §1.6: 40.6 s median with 8 clients)
GRACEFUL_SHUTDOWN_S = 300
# warm-up rounds once the fixed-shape sessions built during the first have settled: ONNX
# Runtime runs a pass before it captures its CUDA graph, and replays from the next
SETTLED_ROUNDS = 2
# a body must arrive within this: 12 MiB at 4 Mbit/s takes 25 s; a stalled client gets 408
BODY_READ_S = 30.0
# bodies declared larger than this, or sent without a length, are read and parsed in one of
# UPLOADS slots: a 12 MiB body of small values holds the GIL for ~0.25 s in json.loads and takes
# up to 300 MiB while parsed, so one at a time bounds both, while a typical request (an image
# of a few hundred KiB) never waits
LARGE_BODY = 1024 * 1024
UPLOADS = 1
UPLOAD_WAIT_S = 5.0  # a large body waits this long for its slot, unread, then gets 503 busy
SMALL_PARSERS = 2  # threads parsing the small bodies, apart from the large ones
# How long a thread running Python holds the GIL before one that waits gets it (CPython's
# default is 5 ms): the execution thread launches the GPU's work in short bursts between the
# preparing and responding threads' Python (tokens, layout, heads), and each wake-up after a
# replay or a wait can queue this long for the GIL. An execution-like thread beside three threads
# of Python bursts ran 9× slower at 5 ms than at 0.1 ms, and CPU-bound threads' work took as long
# at 0.1 ms as at 5 (docs/performance.md).
GIL_SWITCH_S = 0.0001
# PyTorch's CPU threads in the worker, at most (the heads' products; their bytes do not depend on
# it, see runtime/__init__.py): on a 16-core host the heads of 12 questions were three times
# slower on 16 threads than on 8, and slower on 4 (docs/performance.md)
TORCH_THREADS = 8
# the Host header must name one of these (a browser page elsewhere cannot reach the worker);
# OMNIJEV_ALLOWED_HOSTS="a,b" replaces them, "*" allows any (runtime.config.allowed_hosts)
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
JSON_TYPE = "application/json"
WIRES = (NATIVE, typesafe.WIRE, decisions.WIRE)  # the decision routes, one a format
CREATED = 0  # `GET /v1/models`' creation time: the served model carries none

log = logging.getLogger("omnijev.server")


class Engine(Protocol):
    """The model side: the contract and preparation, then execution (runtime.executor)."""

    model_id: str
    # whether `execute` is split in two (runtime.executor.Executor's is):
    # `enqueue(batch)`, the model's passes of several prepared requests at once, enqueued on
    # the execution thread, which goes on to the next batch; the flight it gives waits for
    # them on a responding thread (`Flight.readouts(index)`, each request's); `batch_key(prepared)`,
    # the key of the requests it may run as one batch (None: alone) and the request's share of
    # a batch (runtime.executor.Executor.batch_key); and `respond(prepared, readouts, seconds)`,
    # heads and finishing (`seconds`: the passes' time), which the worker runs beside the next
    # batch's passes (`Worker.execute`); `check_batches()`, run before ready, whether batches
    # keep the readout bytes here (False: `batch_key` gives None from then on);
    # `build_shapes()`, every shape a request can need, built before ready
    splits: bool

    def prepare(self, obj: dict) -> Prepared:
        """Contract and preparation; raises runtime.errors.ContractError (422)."""
        ...

    def execute(self, prepared: Prepared) -> dict:
        """The response object; any exception is a failed execution (500)."""
        ...

    def warm_up_request(self) -> dict:
        """The warm-up request body of docs/contract.md §1.2."""
        ...

    def settle(self) -> int:
        """Waits for work the engine builds in the background; how many builds there were."""
        ...

    def prefix_lookups(self) -> tuple[int, int] | None:
        """The image-prefix cache's (hits, misses) so far; None for an engine without one."""
        ...

    def shape_builds(self) -> tuple[int, float]:
        """The pass shapes built so far (compiled, captured, a session made) and their seconds."""
        ...


def error(status: int, detail: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"detail": detail}, status_code=status, headers=headers)


def wire_error(
    wire: Wire, status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error answer in the route's format (the native `{"detail": ...}` on the native one)."""
    return JSONResponse(wire.error_body(status, message, None), status_code=status, headers=headers)


def encode(response: dict) -> bytes:
    """Compact JSON in the engine's field order; NaN or infinity is an execution failure."""
    text = json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode()


def request_id(scope: Scope) -> str:
    """The client's x-request-id if it is 1-128 printable ASCII characters, else a new one."""
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            if 0 < len(value) <= REQUEST_ID_MAX and all(0x20 <= b < 0x7F for b in value):
                return value.decode("ascii")
            break
    return uuid.uuid4().hex


class BodyTimeout(Exception):
    """The body did not arrive within BODY_READ_S."""


class Draining(Exception):
    """The worker began shutting down while the body was still arriving."""


async def read_body(request: Request, deadline_s: float, draining: asyncio.Event) -> bytes | None:
    """The body, or None when it exceeds 12 MiB: Content-Length first, then counted as it comes.

    Raises BodyTimeout after `deadline_s`, Draining once `draining` is set.
    """
    reading = asyncio.ensure_future(collect_body(request))
    stopping = asyncio.ensure_future(draining.wait())
    try:
        done, _ = await asyncio.wait(
            (reading, stopping), timeout=deadline_s, return_when="FIRST_COMPLETED"
        )
    finally:
        stopping.cancel()
        if not reading.done():
            reading.cancel()
    try:
        if reading in done:
            return reading.result()
    finally:
        # a disconnect raised by result() holds this frame, and the frame the task that holds it:
        # the cycle would keep the bytes read so far until the next garbage collection
        del reading, done
    raise Draining() if draining.is_set() else BodyTimeout()


async def collect_body(request: Request) -> bytes | None:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        # without a 100 Continue the client sends nothing more; a huge body is not worth reading
        if request.headers.get("expect", "").lower() == "100-continue":
            return None
        if int(declared) > DRAIN_LIMIT:
            return None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= MAX_BODY:
            chunks.append(chunk)
        elif size > DRAIN_LIMIT:
            break
        else:
            chunks.clear()
    return b"".join(chunks) if size <= MAX_BODY else None


class Refusal(NamedTuple):
    """A body not read: the answer to give, and the outcome to log."""

    response: Response
    outcome: str | None


async def body_or_refusal(
    request: Request,
    deadline_s: float,
    draining: asyncio.Event,
    refuse: Callable[..., Response] = error,
) -> bytes | Refusal:
    """The body, or why it was not read: 499 (client gone), 408 (deadline), 503 (draining) or
    413 (over 12 MiB), each refusal made by `refuse` (the route's error shape)."""
    close = {"Connection": "close"}
    try:
        body = await read_body(request, deadline_s, draining)
    except ClientDisconnect:
        return Refusal(Response(status_code=499), "client gone")
    except BodyTimeout:
        detail = f"request body not complete within {deadline_s:g} s"
        return Refusal(refuse(408, detail, close), "body read deadline")
    except Draining:
        return Refusal(refuse(503, "the worker is shutting down", close), "shutting down")
    if body is None:  # the rest of the body may still be on its way, so close after
        return Refusal(refuse(413, "request body exceeds 12 MiB", close), None)
    return body


def is_large(request: Request) -> bool:
    """A body declared over LARGE_BODY, or sent without a length (chunked)."""
    declared = request.headers.get("content-length", "")
    return not declared.isdigit() or int(declared) > LARGE_BODY


class Uploads:
    """The upload slots: large bodies are read and parsed `slots` at a time, each in a thread;
    the others wait unread (TCP holds their bytes), up to UPLOAD_WAIT_S."""

    def __init__(self, slots: int = UPLOADS) -> None:
        self.slots = asyncio.Semaphore(slots)
        self.large_pool = ThreadPoolExecutor(slots, thread_name_prefix="omnijev-parse-large")
        self.small_pool = ThreadPoolExecutor(SMALL_PARSERS, thread_name_prefix="omnijev-parse")

    async def take(self, wait_s: float) -> bool:
        """A slot within `wait_s` seconds, else False."""
        try:
            await asyncio.wait_for(self.slots.acquire(), wait_s)
        except TimeoutError:
            return False
        return True

    def give_back(self) -> None:
        self.slots.release()

    async def parse(self, body: bytes, large: bool) -> dict:
        """Parse in a thread; a large body lets the other threads in while it is parsed."""
        pool = self.large_pool if large else self.small_pool
        parse = functools.partial(parse_body, body, interleave=large)
        return await asyncio.get_running_loop().run_in_executor(pool, parse)

    def close(self) -> None:
        self.large_pool.shutdown(wait=True)
        self.small_pool.shutdown(wait=True)


async def watch_disconnect(receive: Receive, gone: asyncio.Event) -> None:
    """Set `gone` when the client closes the connection (call after the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


class RequestLog:
    """ASGI middleware: an x-request-id on every response, one log line and metrics per request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        record = RequestRecord(request_id(scope), scope["method"], scope["path"])
        scope.setdefault("state", {})["record"] = record
        header = (b"x-request-id", record.request_id.encode("ascii"))
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                record.status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            log.exception("request %s: unhandled error", record.request_id)
            if started:
                raise
            await error(500, "internal error")(scope, receive, send_with_id)
        finally:
            record.total_s = time.perf_counter() - start
            self.metrics.observe(record)


def allowed_hosts_from_env() -> tuple[str, ...]:
    """OMNIJEV_ALLOWED_HOSTS as a tuple of host names, else the local names."""
    return settings.allowed_hosts() or LOCAL_HOSTS


def host_name(value: str) -> str:
    """The host of a Host header, without its port: `[::1]:8000` -> `::1`."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return ""


class Guard:
    """ASGI middleware: the Host must be allowed (400), a decision must be JSON (415); each
    decision route's refusals in its format's error body."""

    def __init__(self, app: ASGIApp, allowed_hosts: Sequence[str], wires: Sequence[Wire]) -> None:
        self.app = app
        self.any_host = "*" in allowed_hosts
        self.allowed = {name.lower() for name in allowed_hosts}
        self.wires = {wire.path: wire for wire in wires}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> JSONResponse | None:
        wire = self.wires.get(scope["path"], NATIVE)
        host = host_name(header(scope, b"host"))
        if not self.any_host and host not in self.allowed:
            return wire_error(wire, 400, f"host {host!r} is not allowed")
        if scope["method"] == "POST" and scope["path"] in self.wires:
            media = header(scope, b"content-type").split(";")[0].strip().lower()
            if media != JSON_TYPE:
                return wire_error(wire, 415, f"content type must be {JSON_TYPE}, not {media!r}")
        return None


class Worker:
    """The engine behind the scheduler: warm-up state and the work of one admitted request."""

    def __init__(self, engine: Engine, scheduler: Scheduler, warm_ups: Sequence[dict] = ()) -> None:
        self.engine = engine
        self.scheduler = scheduler
        self.warm_ups = list(warm_ups)  # the operator's own requests, after the built-in one
        self.state = "warming up"  # then "ready" or "warm-up failed"
        # the engine's shape builds when it turned ready: the warm-up's; later ones are serving's
        self.warm_up_builds: tuple[int, float] | None = None

    async def warm_up(self) -> None:
        """Run the warm-up request, then the operator's, through prepare and execute; only then
        is the worker ready (their shapes' sessions and graphs are built by then)."""
        start = time.perf_counter()
        try:
            await self._warm_up_round()
            if await asyncio.to_thread(self.engine.settle):
                for _ in range(SETTLED_ROUNDS):
                    await self._warm_up_round()
        except Exception:
            log.exception("warm-up failed; the worker will not answer")
            self.state = "warm-up failed"
            return
        self.warm_up_builds = self.engine.shape_builds()
        DECODERS.ready()  # the first clip's decoder, started: it does not wait for Python and PyAV
        self.state = "ready"
        log.info("warm-up done in %.3f s", time.perf_counter() - start)

    async def _warm_up_round(self) -> None:
        for index, body in enumerate([None, *self.warm_ups]):
            start = time.perf_counter()
            ticket = Ticket()
            prepared = await self.scheduler.prepare(ticket, self._prepare_warm_up, body)
            await self.execute(ticket, prepared)
            # what a cold start spends where: the new shapes' compilations and captures
            log.info("warm-up request %d in %.3f s", index, time.perf_counter() - start)
        if self.engine.splits:
            await self._warm_up_batch()
            await self._warm_up_shapes()

    async def _warm_up_batch(self) -> None:
        """The engine's batch check (`Executor.check_batches`) on the execution thread: the
        warm-up request with its companion as one batch, whose shapes are then built before
        ready, and against each alone; requests run alone where the bytes differ."""
        start = time.perf_counter()
        engine: Any = self.engine
        merges = await self.scheduler.execute(Ticket(), lambda _: engine.check_batches(), None)
        log.info("warm-up batch in %.3f s, merges %s", time.perf_counter() - start, merges)

    async def _warm_up_shapes(self) -> None:
        """Every shape the engine can need (`Executor.build_shapes`), built on the execution
        thread before ready: no request waits for a build."""
        start = time.perf_counter()
        engine: Any = self.engine
        built = await self.scheduler.execute(Ticket(), lambda _: engine.build_shapes(), None)
        log.info("warm-up shapes: %d in %.3f s", built, time.perf_counter() - start)

    def _prepare_warm_up(self, body: dict | None) -> Prepared:
        return self.engine.prepare(self.engine.warm_up_request() if body is None else body)

    async def answer(
        self, ticket: Ticket, obj: dict, record: RequestRecord, wire: Wire = NATIVE
    ) -> tuple[int, bytes]:
        """Prepare and execute one admitted request: (status, body); never raises. The body is
        translated into the native request and the answers back by `wire` (server.formats)."""
        try:
            prepared, translation = await self.scheduler.prepare(
                ticket, self._prepare_translated, (obj, wire)
            )
            record.input_tokens = prepared.input_tokens
            record.questions = len(prepared.questions)
            body, status = await self.execute(ticket, prepared, translation.answer), 200
        except Dropped:
            record.outcome = "dropped"
            return 499, b""  # nginx's "client closed request"; nobody reads it
        except FormatError as exc:
            body, status = encode(wire.error_body(exc.status, str(exc), exc.param)), exc.status
        except ContractError as exc:
            message, param = wire.native_param(str(exc))
            status = wire.refusal_status
            body = encode(wire.error_body(status, message, param))
        except Exception:
            log.exception("request %s: inference failed", record.request_id)
            body, status = encode(wire.error_body(500, "inference failed", None)), 500
        if ticket.gone.is_set():
            record.outcome = "client gone"
        return status, body

    def _prepare_translated(self, work: tuple[dict, Wire]) -> tuple[Prepared, Translation]:
        obj, wire = work
        translation = wire.translate(obj)
        return self.engine.prepare(translation.native), translation

    async def execute(
        self, ticket: Ticket, prepared: Prepared, answer: Callable[[dict], dict] = unchanged
    ) -> bytes:
        """The response JSON of a prepared request, through `answer` (a format's translation).
        With a split engine the execution thread runs only the passes; heads, finishing and the
        JSON run on a responding thread while the next request's passes run (issue 13), with the
        same answer bytes as `execute`."""
        if not self.engine.splits:
            response = await self.scheduler.execute(ticket, self.engine.execute, prepared)
            return encode(answer(response))
        key, size = self.engine.batch_key(prepared)  # type: ignore[attr-defined]
        flight = await self.scheduler.execute_batched(ticket, self._enqueue, prepared, key, size)
        return await self.scheduler.respond(ticket, self._respond, (prepared, *flight, answer))

    def _enqueue(self, batch: list[Prepared]) -> list[tuple[Any, int, float]]:
        """Each request's (flight, place in it, when its batch started): the batch's passes
        enqueued, not waited for."""
        started = time.perf_counter()
        flight = self.engine.enqueue(batch)  # type: ignore[attr-defined]
        return [(flight, index, started) for index in range(len(batch))]

    def _respond(self, work: tuple[Prepared, Any, int, float, Callable[[dict], dict]]) -> bytes:
        """A request's readouts once its batch has landed, then its heads and finishing."""
        prepared, flight, index, started, answer = work
        readouts = flight.readouts(index)
        seconds = time.perf_counter() - started
        return encode(answer(self.engine.respond(prepared, readouts, seconds)))  # type: ignore[attr-defined]


def documented_openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The app's OpenAPI document with each decision route's request model as its body."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schemas = document.setdefault("components", {}).setdefault("schemas", {})
            schemas.update(request_schemas())
            app.openapi_schema = document
        return app.openapi_schema

    return openapi


def create_app(
    engine: Engine,
    *,
    admitted: int = ADMITTED,
    preparing: int = PREPARING,
    warm_ups: Sequence[dict] = (),
    uploads: int = UPLOADS,
    upload_wait_s: float = UPLOAD_WAIT_S,
    body_read_s: float = BODY_READ_S,
    allowed_hosts: Sequence[str] | None = None,
    docs: bool | None = None,
    batch_wait_s: float = 0.0,
) -> FastAPI:
    """The worker's app. It listens at once and warms up in a background thread at startup;
    `warm_ups` are parsed request bodies run after the built-in warm-up request.

    Large bodies are read and parsed `uploads` at a time (503 busy after `upload_wait_s` in
    line), every body within `body_read_s` (408 after). `allowed_hosts` (default:
    OMNIJEV_ALLOWED_HOSTS, else the local names) bounds the Host header; `docs` false
    (default: OMNIJEV_DOCS != "0") removes /docs, /redoc and /openapi.json. `batch_wait_s`:
    how long a request that reaches the execution thread alone waits for others to batch with
    (server.admission.Scheduler).

    Until the warm-up request has run through engine.prepare and engine.execute, `GET /health`
    answers 503 `{"status": "warming up"}` and `POST /v1/systemone` answers 503
    `{"detail": "the worker is warming up"}` with `Retry-After: 1`; then `/health` answers 200
    `{"status": "ready", "model": engine.model_id}`. Shutdown lets admitted work finish.
    """
    room = getattr(engine, "room", None)  # the executor's: the device can take another batch
    scheduler = Scheduler(admitted, preparing, batch_wait_s=batch_wait_s, room=room)
    worker = Worker(engine, scheduler, warm_ups)
    metrics = Metrics(scheduler, engine, lambda: worker.warm_up_builds)
    slots = Uploads(uploads)
    draining = asyncio.Event()  # set by ListeningServer when shutdown begins
    if docs is None:
        docs = settings.docs_enabled()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warming = asyncio.ensure_future(worker.warm_up())
        yield
        await warming
        await scheduler.close()
        slots.close()

    app = FastAPI(
        title="OmniJev worker",
        version="1.1",
        description="OmniJev-4B decisions over one image: noul, choice and score questions.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.router.redirect_slashes = False  # `/v1/systemone/` is 404, never a redirect
    app.state.draining = draining
    app.state.worker = worker  # its warm-up state, for server.ray_serve's health check
    hosts = allowed_hosts_from_env() if allowed_hosts is None else tuple(allowed_hosts)
    app.add_middleware(Guard, allowed_hosts=hosts, wires=WIRES)
    app.add_middleware(RequestLog, metrics=metrics)  # outermost: every answer gets its id
    app.openapi = documented_openapi(app)  # type: ignore[method-assign]

    def decision_route(wire: Wire) -> Callable[[Request], Awaitable[Response]]:
        """The endpoint of one decision route: every route has the same body limit, upload
        slots, deadlines, strict JSON and admission; `wire` translates its format."""

        async def decide(request: Request) -> Response:
            record: RequestRecord = request.state.record
            large = is_large(request)
            # a large body that could not be admitted once parsed is refused unread: parsed, it
            # would hold the upload slot that admitted clients' next bodies wait for
            if large and scheduler.full:
                return busy_unread(request, record, wire, "rejected unread")
            if large and not await slots.take(upload_wait_s):
                return busy_unread(request, record, wire, "uploads busy")
            if large and scheduler.full:  # filled while it waited for the slot
                slots.give_back()
                return busy_unread(request, record, wire, "rejected unread")
            try:
                obj = await read_and_parse(request, record, large, wire)
            finally:
                if large:
                    slots.give_back()
                    with contextlib.suppress(RuntimeError):  # the pool is shut down at exit
                        asyncio.get_running_loop().run_in_executor(slots.large_pool, memory.trim)
            if isinstance(obj, Response):
                return obj
            if worker.state == "warm-up failed":
                return wire_error(wire, 503, "the worker failed to warm up")
            if worker.state != "ready":
                return wire_error(wire, 503, "the worker is warming up", RETRY_AFTER)
            ticket = scheduler.admit(lambda ticket: worker.answer(ticket, obj, record, wire))
            if ticket is None:
                metrics.rejections.inc()
                record.admission = "rejected"
                return wire_error(wire, 503, "the worker is busy", RETRY_AFTER)
            metrics.admissions.inc()
            record.admission = "admitted"
            return await finish(request, ticket, record)

        return decide

    for wire in WIRES:
        app.add_api_route(
            wire.path,
            decision_route(wire),
            methods=["POST"],
            summary=ROUTE_SUMMARIES[wire.path],
            description=ROUTE_DOCS[wire.path],
            responses=route_responses(wire.path),
            openapi_extra={"requestBody": request_body(wire.path)},
        )

    def busy_unread(request: Request, record: RequestRecord, wire: Wire, why: str) -> Response:
        """503 busy to a large body before it is read."""
        record.admission = why
        metrics.rejections.inc()
        # uvicorn reads and drops a body of known length after the answer, so that the client
        # reads the 503; one without a length may never end, so its connection closes
        chunked = not request.headers.get("content-length", "").isdigit()
        close = {"Connection": "close"} if chunked else {}
        return wire_error(wire, 503, "the worker is busy", {**RETRY_AFTER, **close})

    async def read_and_parse(
        request: Request, record: RequestRecord, large: bool, wire: Wire
    ) -> Any:
        """The parsed body, or the error response: 499, 408, 503 (draining), 413 or 400."""
        body = await body_or_refusal(
            request, body_read_s, draining, functools.partial(wire_error, wire)
        )
        if isinstance(body, Refusal):
            record.outcome = body.outcome
            return body.response
        try:
            return await slots.parse(body, large)
        except BodyError as exc:
            return wire_error(wire, 400, str(exc))

    async def finish(request: Request, ticket: Ticket, record: RequestRecord) -> Response:
        """Await the admitted work; if the client goes away, the work goes on or is dropped."""
        watcher = asyncio.ensure_future(watch_disconnect(request.receive, ticket.gone))
        try:
            status, body = await asyncio.shield(ticket.task)
        finally:
            watcher.cancel()
            record.queue_wait_s = ticket.queue_wait_s
            record.prepare_s = ticket.prepare_s
            record.execute_s = ticket.execute_s
        return Response(body, status_code=status, media_type="application/json")

    @app.get("/health", response_model=HealthBody, responses={503: {"model": HealthBody}})
    async def health() -> JSONResponse:
        """200 once the warm-up request has run; 503 before."""
        if worker.state == "ready":
            return JSONResponse({"status": "ready", "model": engine.model_id})
        return JSONResponse({"status": worker.state}, status_code=503)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> JSONResponse:
        """The served model, as OpenAI-style servers list theirs."""
        card = {"id": engine.model_id, "object": "model", "created": CREATED, "owned_by": "omnijev"}
        return JSONResponse({"object": "list", "data": [{**card, "inputs": model_inputs()}]})

    @app.get("/metrics", response_class=Response)
    async def prometheus() -> Response:
        """Prometheus text: requests by status, stage latency, admission, queue depth, tokens."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    return app


def model_inputs() -> dict:
    """What the decision routes take: images on each, a video on the two whose formats carry
    one (the Decisions API has no video input)."""
    from runtime.images import PILLOW_FORMATS
    from runtime.video import accepted

    routes = [NATIVE_PATH, typesafe.PATH]
    return {"image": list(PILLOW_FORMATS), "video": {**accepted(), "routes": routes}}


class ListeningServer(uvicorn.Server):
    """uvicorn's server, logging the native worker's startup line once it listens (§1.1),
    cutting unfinished body reads when shutdown begins, and exiting 0 after a clean shutdown."""

    def __init__(self, config: uvicorn.Config, draining: asyncio.Event | None = None) -> None:
        super().__init__(config)
        self.draining = draining

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            log.info("OmniJev worker listening on %s:%d", self.config.host, self.config.port)

    async def shutdown(self, sockets: list | None = None) -> None:
        if self.draining is not None:
            self.draining.set()  # stalled uploads end now; admitted work still finishes
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            try:
                yield
            finally:
                # uvicorn re-raises the SIGTERM it handled, so the process exits 143; the
                # shutdown was clean by now, so it exits 0
                self._captured_signals.clear()


def worker_config(app: ASGIApp, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> Any:
    """uvicorn's settings for the worker: the guarded protocol, its header limit, the graceful
    shutdown and no access log (RequestLog writes one JSON line per request instead)."""
    settings = {
        "http": GuardedH11Protocol,
        "h11_max_incomplete_event_size": MAX_HEADER_BYTES,
        "access_log": False,
        "timeout_graceful_shutdown": GRACEFUL_SHUTDOWN_S,
        **options,
    }
    return uvicorn.Config(app, host=host, port=port, **settings)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a busy port fails at once."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family, backlog=2048)
    except OSError as exc:
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def limit_torch_threads(most: int = TORCH_THREADS) -> int:
    """PyTorch's intra-op threads capped at `most`; the count now."""
    import torch

    torch.set_num_threads(max(1, min(torch.get_num_threads(), most)))
    return torch.get_num_threads()


def worker_process() -> None:
    """The worker process's settings: malloc arenas capped, the GIL's switch interval, PyTorch's
    threads capped; the benchmarks that time a request in process apply them too."""
    memory.limit_arenas()
    sys.setswitchinterval(GIL_SWITCH_S)
    limit_torch_threads()


def serve(app: FastAPI, host: str, port: int, sock: socket.socket | None = None) -> None:
    """Serve until SIGTERM or SIGINT on `sock` (else bind host:port); admitted work finishes
    first, and a clean shutdown exits 0."""
    worker_process()
    sock = sock or bind(host, port)
    server = ListeningServer(worker_config(app, host, port), app.state.draining)
    server.run(sockets=[sock])


def cli_serve(args: Any, load: Callable[..., Engine] | None = None) -> int:
    """`omnijev serve --checkpoint DIR --engines DIR [--backend auto] [--host H --port P]`.

    The port is bound before the model loads (by `load`: runtime.executor.load_engine where
    None). Host allow-list: `--allowed-host` (repeatable), else OMNIJEV_ALLOWED_HOSTS;
    `--no-docs` (or OMNIJEV_DOCS=0) turns the documentation routes off.
    """
    from runtime.config import RuntimeConfig

    if load is None:
        from runtime.executor import load_engine as load

    # the load's own lines (where a start spends its time) come before serving's
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warm_ups = [read_warm_up(path) for path in args.warm_up or ()]
    sock = bind(args.host, args.port)
    engine = load(args.checkpoint, args.engines, RuntimeConfig.from_args(args))
    app = create_app(
        engine,
        warm_ups=warm_ups,
        allowed_hosts=args.allowed_host or None,
        docs=False if args.no_docs else None,
        batch_wait_s=args.batch_wait_ms / 1000,
    )
    serve(app, args.host, args.port, sock)
    return 0


def read_warm_up(path: str) -> dict:
    """A warm-up request file, checked as the worker checks a body before serving starts."""
    from runtime.contract import compile_request

    try:
        obj = parse_body(Path(path).read_bytes())
        compile_request(obj)
    except (OSError, BodyError, ContractError) as error:
        raise SystemExit(f"warm-up request {path}: {error}") from None
    return obj
