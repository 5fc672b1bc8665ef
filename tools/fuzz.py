"""`make fuzz`: a seeded abuse run against a real worker on 127.0.0.1 (issue 14's acceptance).

Starts `omnijev serve` on the demo's tiny model (or uses a running worker), then: HTTP-level
abuse, malformed bodies with good requests among them, hostile images and videos (issue 48), a
flood of 12 MiB bodies under a good request's latency, 1,000 valid requests up to the longest
prompts the contract allows, stalled clients, schemathesis' every check on every route of the
OpenAPI document, and SIGTERM with stalled clients and work in flight. The malformed bodies go to
the three decision routes in turn. Prints one JSON report; exits 1 if an acceptance bound of
issue 14 or 48 failed.
"""

from __future__ import annotations

import argparse
import base64
import copy
import io
import json
import os
import random
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from PIL import Image

DECIDE = "/v1/systemone"
# every decision route: the malformed bodies go to each in turn (server.formats)
ROUTES = (DECIDE, "/typesafe/v1/systemone", "/v1/decisions")
JSON_HEADERS = {"Content-Type": "application/json"}
MODEL_ID = "tinnel123/OmniJev"
MiB = 1024 * 1024
MAX_BODY = 12 * MiB  # docs/contract.md §1.4
# never 500, never a reset; 404 is /v1/decisions' unknown model
OK_STATUSES = {200, 400, 404, 408, 413, 415, 422, 431, 503}
CLIENTS = 8  # concurrent senders of malformed bodies
GOOD_EVERY = 50  # one good request among this many malformed ones
PROGRESS_EVERY = 1000  # a progress line every this many malformed bodies
FLOOD_CLIENTS = 16  # issue 14: 16 clients keep sending 12 MiB bodies
STALLED = 50  # issue 14: 50 stalled clients
HEADER_DEADLINE_S = 10.0  # server.protocol.HEADER_READ_S
BODY_DEADLINE_S = 30.0  # server.app.BODY_READ_S
START_S = 120.0  # the worker must answer /health within this
RSS_RATIO = 1.3  # issue 14: RSS after the valid requests within 1.3x its warm-up level
ICCP_CHUNKS = 2000  # the bomb's ancillary chunks, each inflating to 1 MiB (8,000 in issue 14)
VIDEO_REFUSED_S = 1.0  # issue 48: a hostile video is refused within a second
VIDEO_MEDIA_EVERY = 5  # every fifth hostile video goes to the TypeSafe route as well (0.2 s each)
WORDS = [
    "model", "state", "images", "questions", "type", "instructions", "options", "criteria",
    "levels", "region", "box", "key", "text", "abstain", "noul", "choice", "score", "omnijev",
    "tinnel123/OmniJev", "<|opt|>", "<|vision_end|>", "<|im_end|>", "", "é", "😀", "\u0000",
    "data:image/png;base64,", "x" * 300,
]  # fmt: skip


# -- requests ----------------------------------------------------------------------------------


def png_bytes(width: int, height: int, color: tuple = (30, 60, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 10)).save(buffer, format="JPEG")
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def decision(
    questions: dict | None = None, image: str | None = None, size: tuple[int, int] = (64, 48)
) -> dict:
    """A valid request with one question of each type, in an order that is not sorted; without
    `image`, a plain PNG of `size`."""
    if questions is None:
        questions = {
            "zeta": {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": "B"}},
            "alpha": {"type": "score", "instructions": "How much?", "levels": ["low", "high"]},
            "mid": {"type": "noul", "instructions": "Is it there?"},
        }
    image = data_url(png_bytes(*size)) if image is None else image
    return {"model": MODEL_ID, "state": {"images": [image]}, "questions": questions}


def longest_prompt(rng: random.Random) -> dict:
    """A valid request near the contract's text limits: 8,192-character instructions."""
    words = " ".join(rng.choice(["red", "green", "blue", "bright", "dark"]) for _ in range(1600))
    instructions = words[:8192]
    questions = {
        "long": {"type": "noul", "instructions": instructions},
        "many": {
            "type": "choice",
            "instructions": instructions[:2000],
            "criteria": {f"option {i}": "x" * 150 for i in range(40)},
        },
    }
    return decision(questions, data_url(png_bytes(128, 96, (rng.randrange(256), 80, 160))))


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming(width: int, height: int, pixels: bytes = b"\0" * 64, extra: bytes = b"") -> bytes:
    """A PNG whose header claims width × height, with the given pixel data and extra chunks."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunks = png_chunk(b"IHDR", header) + extra + png_chunk(b"IDAT", zlib.compress(pixels))
    return b"\x89PNG\r\n\x1a\n" + chunks + png_chunk(b"IEND", b"")


def ancillary_bomb(kind: bytes, count: int) -> bytes:
    """A small PNG carrying `count` compressed ancillary chunks that inflate to 1 MiB each."""
    inflated = zlib.compress(b"\0" * MiB, 9)
    payloads = {
        b"iCCP": b"profile\0\0" + inflated,
        b"zTXt": b"Comment\0\0" + inflated,
        b"iTXt": b"Comment\0\1\0\0\0" + inflated,
        b"tEXt": b"Comment\0" + b"x" * 1024,
        b"sPLT": b"palette\0\x08" + b"\0" * 600,
    }
    extra = png_chunk(kind, payloads[kind]) * count
    return png_claiming(16, 16, b"\0" * (1 + 3 * 16) * 16, extra)


def hostile_images() -> dict[str, str]:
    """Image strings that must be refused (422), or answered, without harm to the worker."""
    png = png_bytes(64, 48)
    encoded = data_url(png).split(",", 1)[1]
    frames = [Image.new("RGB", (16, 16), c) for c in ((0, 0, 0), (255, 255, 255))]
    animated = io.BytesIO()
    frames[0].save(animated, format="PNG", save_all=True, append_images=frames[1:])
    images = {
        "truncated": data_url(png[:40]),
        "bomb header": data_url(png_claiming(100_000, 100_000)),
        "4096 without pixels": data_url(png_claiming(4096, 4096)),
        "4097 wide": data_url(png_claiming(4097, 64)),
        "aspect 401:2": data_url(png_claiming(401, 2)),
        "png as jpeg": data_url(png, "image/jpeg"),
        "jpeg as png": data_url(jpeg_bytes(32, 32), "image/png"),
        "truncated jpeg": data_url(jpeg_bytes(32, 32)[:200], "image/jpeg"),
        "gif": data_url(png, "image/gif"),
        "animated": data_url(animated.getvalue()),
        "garbage png": data_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
        "no padding": "data:image/png;base64," + encoded[:-2],
        "newline": "data:image/png;base64," + encoded[:40] + "\n" + encoded[40:],
        "bad alphabet": "data:image/png;base64,!!!!",
        "empty": "data:image/png;base64,",
        "no comma": "data:image/png",
        "remote": "http://127.0.0.1/image.png",
        "over 8 MiB": data_url(b"\x89PNG\r\n\x1a\n" + b"\0" * (8 * MiB + 100)),
        "4096 squared from 50 kB": data_url(png_claiming(4096, 4096, b"\0" * 12289 * 4096)),
    }
    for kind in (b"iCCP", b"zTXt", b"iTXt", b"tEXt", b"sPLT"):
        images[f"{kind.decode()} x{ICCP_CHUNKS}"] = data_url(ancillary_bomb(kind, ICCP_CHUNKS))
    return images


def random_json(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth >= 4 or roll < 0.45:
        return rng.choice(
            [None, True, False, 0, -1, 2**70, 1e308, -0.0, 0.5, rng.choice(WORDS), [0, 0, 1, 1]]
        )
    if roll < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {rng.choice(WORDS): random_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def paths(value: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path into a nested request, the root included."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def mutated(rng: random.Random, request: dict) -> object:
    """The request with one node replaced by a random value, deleted, or given a stray key."""
    body = copy.deepcopy(request)
    path = rng.choice(list(paths(body))[1:])
    parent = body
    for step in path[:-1]:
        parent = parent[step]
    action = rng.choice(("replace", "replace", "delete", "add"))
    if action == "replace":
        parent[path[-1]] = random_json(rng)
    elif action == "delete":
        del parent[path[-1]]
    elif isinstance(parent, dict):
        parent[rng.choice(WORDS)] = random_json(rng)
    else:
        parent.append(random_json(rng))
    return body


def nested(depth: int) -> bytes:
    return b'{"questions": ' + b'{"q": ' * depth + b"1" + b"}" * depth + b"}"


def large_and_deep() -> list[bytes]:
    """Huge strings, too many things, deep nesting: each must be refused."""
    noul = {"type": "noul", "instructions": "x"}
    questions = [
        {"q": {**noul, "instructions": "x" * 8193}},
        {"q": {**noul, "instructions": "é" * 500_000}},
        {"i" * 257: noul},
        {f"q{i}": noul for i in range(65)},
        {
            f"q{i}": {"type": "score", "instructions": "x", "levels": [str(j) for j in range(205)]}
            for i in range(5)
        },
    ]
    bodies = [json.dumps(decision(q)).encode() for q in questions]
    bodies.append(json.dumps({**decision(), "model": "m" * 2_000_000}).encode())
    bodies.append(b"[" * 10_000 + b"]" * 10_000)
    bodies.append(nested(10_000))
    bodies.append(b'{"a": "' + b"\\ud800" * 10_000 + b'"}')
    return bodies


def bad_bodies(rng: random.Random, count: int) -> Iterator[bytes]:
    """A seeded stream of bad bodies: random shapes, mutations, hostile images, broken bytes."""
    valid = decision()
    images = [image for name, image in hostile_images().items() if "x2000" not in name]
    for _ in range(count):
        kind = rng.randrange(5)
        if kind == 0:
            body = json.dumps(random_json(rng), ensure_ascii=rng.random() < 0.5).encode()
        elif kind == 1:
            body = json.dumps(mutated(rng, valid)).encode()
        elif kind == 2:
            body = json.dumps(decision(image=rng.choice(images))).encode()
        elif kind == 3:
            raw = bytearray(json.dumps(valid).encode())
            for _ in range(rng.randrange(1, 4)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            body = bytes(raw[: rng.randrange(1, len(raw) + 1)])
        else:
            body = json.dumps({rng.choice(WORDS): random_json(rng)}).encode()
        yield body


def raw_requests(host: str) -> dict[str, tuple[bytes, int]]:
    """HTTP-level abuse on raw sockets: (bytes sent, status expected)."""
    head = f"POST {DECIDE} HTTP/1.1\r\nHost: {host}\r\n".encode()
    body = json.dumps(decision()).encode()
    length = b"Content-Length: %d\r\n" % len(body)
    return {
        "garbage": (b"\x16\x03\x01\x02\x00garbage\r\n\r\n", 400),
        "bad content-length": (head + b"Content-Length: abc\r\n\r\n", 400),
        "two content-lengths": (head + b"Content-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
        "200 KB header": (head + b"x-big: " + b"a" * 200_000 + b"\r\n\r\n", 431),
        "no content-type": (head + length + b"\r\n" + body, 415),
        "form content-type": (
            head + b"Content-Type: application/x-www-form-urlencoded\r\n" + length + b"\r\n" + body,
            415,
        ),
        "foreign host": (
            f"POST {DECIDE} HTTP/1.1\r\nHost: evil.example\r\n".encode()
            + b"Content-Type: application/json\r\n"
            + length
            + b"\r\n"
            + body,
            400,
        ),
    }


# -- the worker ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_worker(checkpoint: str, engines: str, port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "runtime.cli", "serve", "--checkpoint", checkpoint]
    command += ["--engines", engines, "--port", str(port)]
    return subprocess.Popen(command, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_ready(url: str, process: subprocess.Popen | None) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise SystemExit(f"fuzz: the worker exited with status {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("fuzz: the worker did not become ready")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def stable(content: bytes) -> str:
    """A response body without its latency fields: what must repeat byte for byte."""
    response = json.loads(content)
    for answer in response.get("answers", {}).values():
        answer.pop("latency_s", None)
        answer.pop("latency_total_s", None)
    return json.dumps(response, separators=(",", ":"))


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


class Run:
    """One abuse run against the worker at `url` (process `pid`, for its RSS)."""

    def __init__(self, url: str, pid: int, seed: int) -> None:
        self.url = url
        self.pid = pid
        self.rng = random.Random(seed)
        self.good_body = json.dumps(decision()).encode()
        self.failures: list[str] = []
        self.report: dict = {"seed": seed}

    def post(self, client: httpx.Client, body: bytes, path: str = DECIDE) -> httpx.Response:
        return client.post(path, content=body, headers=JSON_HEADERS)

    def check(self, status: int, what: str) -> None:
        if status not in OK_STATUSES:
            self.failures.append(f"{what}: status {status}")

    def good(self, client: httpx.Client) -> tuple[float, str]:
        started = time.perf_counter()
        response = self.post(client, self.good_body)
        took = time.perf_counter() - started
        if response.status_code != 200:
            self.failures.append(f"good request: status {response.status_code}")
            return took, ""
        return took, stable(response.content)

    def baseline(self, solo_requests: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            self.good(client)
            times, answers = zip(*(self.good(client) for _ in range(solo_requests)), strict=True)
        self.expected = answers[0]
        self.report["solo_latency_s"] = {
            "median": round(statistics.median(times), 4),
            "p90": round(percentile(list(times), 0.9), 4),
        }
        self.report["rss_after_warm_up_mib"] = round(rss_mib(self.pid), 1)

    def malformed(self, count: int) -> None:
        """`count` bad bodies from CLIENTS threads, with a good request every GOOD_EVERY."""
        bodies = list(bad_bodies(self.rng, count)) + large_and_deep()
        statuses: Counter[int] = Counter()
        mismatched = 0
        lock = threading.Lock()

        def send(batch: list[bytes]) -> None:
            nonlocal mismatched
            with httpx.Client(base_url=self.url, timeout=120) as client:
                for index, body in enumerate(batch):
                    try:
                        route = ROUTES[index % len(ROUTES)]
                        status = self.post(client, body, route).status_code
                    except httpx.TransportError as error:
                        status = -1
                        self.failures.append(f"malformed body: {type(error).__name__}")
                    self.check(status, "malformed body")
                    if index % GOOD_EVERY == 0:
                        _, answer = self.good(client)
                        with lock:
                            mismatched += answer != self.expected
                    with lock:
                        statuses[status] += 1
                        done = sum(statuses.values())
                    if done % PROGRESS_EVERY == 0:
                        seconds = time.perf_counter() - started
                        print(f"fuzz: {done} of {len(bodies)} bodies, {seconds:.0f} s", flush=True)

        started = time.perf_counter()
        with ThreadPoolExecutor(CLIENTS) as pool:
            list(pool.map(send, [bodies[i::CLIENTS] for i in range(CLIENTS)]))
        self.report["malformed"] = {
            "requests": len(bodies),
            "seconds": round(time.perf_counter() - started, 1),
            "statuses": dict(sorted(statuses.items())),
            "good_requests_differing": mismatched,
        }

    def schemathesis(self, seed: int) -> None:
        """schemathesis' every check against the worker's OpenAPI document (schemathesis.toml)."""
        command = [str(Path(sys.executable).with_name("st")), "run", "--checks", "all"]
        command += ["--seed", str(seed), "--no-color", f"{self.url}/openapi.json"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        summary = [line for line in done.stdout.splitlines() if "generated" in line]
        self.report["schemathesis"] = {"exit_status": done.returncode, "summary": summary}
        if done.returncode != 0:
            print(done.stdout[-4000:], flush=True)
            self.failures.append("schemathesis found failures")

    def raw(self) -> None:
        host = self.url.removeprefix("http://")
        results = {}
        for name, (data, expected) in raw_requests(host).items():
            status = raw_status(self.url, data)
            results[name] = status
            if status != expected:
                self.failures.append(f"raw {name}: status {status}, expected {expected}")
        self.report["http_level"] = results

    def images(self) -> None:
        results = {}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            for name, image in hostile_images().items():
                body = json.dumps(decision(image=image)).encode()
                started = time.perf_counter()
                status = self.post(client, body).status_code
                results[name] = [status, round(time.perf_counter() - started, 3)]
                self.check(status, f"image {name}")
        self.report["hostile_images"] = results

    def videos(self) -> None:
        """The hostile video states (tools/hostile_videos.py) to the native route, each
        answered or refused within VIDEO_REFUSED_S, and some files as OneJev's media to the
        TypeSafe route."""
        from tools.hostile_videos import hostile_videos

        results = {}
        with httpx.Client(base_url=self.url, timeout=120) as client:
            states = hostile_videos(data_url(png_bytes(64, 48)))
            for index, (name, state) in enumerate(states.items()):
                body = {**decision(), "state": state}
                started = time.perf_counter()
                status = self.post(client, json.dumps(body).encode()).status_code
                took = time.perf_counter() - started
                results[name] = [status, round(took, 3)]
                self.check(status, f"video {name}")
                if took > VIDEO_REFUSED_S:
                    self.failures.append(f"video {name}: {took:.2f} s, over {VIDEO_REFUSED_S} s")
                file = isinstance(state.get("video"), str) and "images" not in state
                if file and index % VIDEO_MEDIA_EVERY == 0:
                    media = {
                        "state": "<video:1>",
                        "media": [{"type": "video", "data": state["video"]}],
                        "questions": {"n": {"type": "noul", "instructions": "Is it there?"}},
                    }
                    status = self.post(client, json.dumps(media).encode(), ROUTES[1]).status_code
                    self.check(status, f"video {name} as media")
        self.report["hostile_videos"] = results

    def valid(self, count: int) -> None:
        """`count` valid requests, one in ten near the longest prompt the contract allows."""
        long_bodies = [json.dumps(longest_prompt(self.rng)).encode() for _ in range(4)]
        statuses: Counter[int] = Counter()
        started = time.perf_counter()
        with httpx.Client(base_url=self.url, timeout=300) as client:
            for index in range(count):
                body = long_bodies[index % 4] if index % 10 == 0 else self.good_body
                status = self.post(client, body).status_code
                statuses[status] += 1
                if status != 200:
                    self.failures.append(f"valid request {index}: status {status}")
        after = rss_mib(self.pid)
        ratio = after / self.report["rss_after_warm_up_mib"]
        if ratio > RSS_RATIO:
            self.failures.append(f"valid: RSS {after:.0f} MiB, {ratio:.2f}x its warm-up level")
        self.report["valid"] = {
            "requests": count,
            "seconds": round(time.perf_counter() - started, 1),
            "statuses": dict(statuses),
            "rss_after_mib": round(after, 1),
            "rss_ratio_to_warm_up": round(ratio, 3),
        }

    def flood(self, seconds: float) -> None:
        """FLOOD_CLIENTS keep sending 12 MiB bodies while one client times good requests."""
        floods = [
            b'{"x":[' + b"1," * (MAX_BODY // 2 - 8) + b"1]}",
            b'{"x":[' + b'"",' * (MAX_BODY // 3 - 8) + b'""]}',
            b'{"x":"' + b"a" * (MAX_BODY - 16) + b'"}',
        ]
        stop = threading.Event()
        statuses: Counter[int] = Counter()
        peak = [rss_mib(self.pid)]

        def flooder(index: int) -> None:
            with httpx.Client(base_url=self.url, timeout=120) as client:
                while not stop.is_set():
                    try:
                        status = self.post(client, floods[index % len(floods)]).status_code
                    except httpx.TransportError:
                        status = -1
                    statuses[status] += 1
                    if status == 503:
                        time.sleep(0.05)

        threads = [threading.Thread(target=flooder, args=(i,)) for i in range(FLOOD_CLIENTS)]
        for thread in threads:
            thread.start()
        times = []
        ends = time.monotonic() + seconds
        with httpx.Client(base_url=self.url, timeout=120) as client:
            while time.monotonic() < ends:
                took, answer = self.good(client)
                times.append(took)
                if answer != self.expected:
                    self.failures.append("good request under flood: different answer")
                peak.append(rss_mib(self.pid))
                time.sleep(0.1)
        stop.set()
        for thread in threads:
            thread.join()
        solo = self.report["solo_latency_s"]["p90"]
        p90 = percentile(times, 0.9)
        rise = max(peak) - peak[0]  # over the RSS at the flood's start
        self.report["flood"] = {
            "clients": FLOOD_CLIENTS,
            "seconds": seconds,
            "flood_statuses": dict(statuses),
            "good_requests": len(times),
            "good_p90_s": round(p90, 4),
            "good_p90_over_solo_p90": round(p90 / solo, 2),
            "rss_peak_over_start_mib": round(rise, 1),
            "rss_peak_over_warm_up_mib": round(max(peak) - self.report["rss_after_warm_up_mib"], 1),
        }
        if statuses.get(-1):
            self.failures.append(f"flood: {statuses[-1]} transport errors")
        if p90 > 3 * solo:
            self.failures.append(f"flood: good p90 {p90:.3f} s over 3x solo {solo:.3f} s")
        if rise > 1536:
            self.failures.append(f"flood: RSS rose {rise:.0f} MiB")

    def stalled(self, count: int) -> None:
        """`count` clients stall in their headers or body; each must be dropped in time."""
        socks = open_stalled(self.url, count)
        started = time.monotonic()
        closed = [None] * count

        def watch(index: int) -> None:
            sock = socks[index]
            sock.settimeout(BODY_DEADLINE_S + 10)
            try:
                while sock.recv(65536):
                    pass
            except OSError:
                pass
            closed[index] = time.monotonic() - started

        with ThreadPoolExecutor(count) as pool:
            list(pool.map(watch, range(count)))
        for sock in socks:
            sock.close()
        headers = [t for i, t in enumerate(closed) if i % 2 == 0]
        bodies = [t for i, t in enumerate(closed) if i % 2 == 1]
        self.report["stalled"] = {
            "clients": count,
            "header_stalls_dropped_after_s": [round(min(headers), 1), round(max(headers), 1)],
            "body_stalls_dropped_after_s": [round(min(bodies), 1), round(max(bodies), 1)],
        }
        if max(headers) > HEADER_DEADLINE_S + 2 or max(bodies) > BODY_DEADLINE_S + 2:
            self.failures.append("stalled clients outlived their deadline")

    def after(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            _, answer = self.good(client)
        self.report["same_bytes_after"] = answer == self.expected
        self.report["rss_end_mib"] = round(rss_mib(self.pid), 1)
        if answer != self.expected:
            self.failures.append("the good request's answer changed")


def open_stalled(url: str, count: int) -> list[socket.socket]:
    """Even indices stall in their headers, odd ones half-way through a body."""
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for index in range(count):
        sock = socket.create_connection((host, int(port)))
        if index % 2 == 0:
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n".encode())
        else:
            sock.sendall(
                f"POST {DECIDE} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                "Content-Length: 1000\r\n\r\n{".encode()
            )
        socks.append(sock)
    return socks


def raw_status(url: str, data: bytes) -> int:
    """The status of the answer to raw bytes; -1 for a reset or no answer."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        try:
            sock.sendall(data)
            answer = b""
            while b"\r\n" not in answer and (chunk := sock.recv(65536)):
                answer += chunk
        except OSError:
            return -1
    try:
        return int(answer.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return -1


def sigterm_with_stalls(url: str, process: subprocess.Popen, report: dict) -> list[str]:
    """SIGTERM while 10 clients stall and a long request runs: exit 0 within its time + 5 s."""
    body = json.dumps(longest_prompt(random.Random(0))).encode()
    started = time.perf_counter()
    httpx.post(url + DECIDE, content=body, headers=JSON_HEADERS, timeout=300)
    work_s = time.perf_counter() - started
    socks = open_stalled(url, 10)
    results: list[int] = []
    sender = threading.Thread(
        target=lambda: results.append(
            httpx.post(url + DECIDE, content=body, headers=JSON_HEADERS, timeout=300).status_code
        )
    )
    sender.start()
    time.sleep(min(0.2, work_s / 4))
    started = time.perf_counter()
    process.send_signal(signal.SIGTERM)
    status = process.wait(120)
    took = time.perf_counter() - started
    sender.join(60)
    for sock in socks:
        sock.close()
    report["sigterm"] = {
        "exit_status": status,
        "seconds": round(took, 2),
        "in_flight_work_s": round(work_s, 2),
        "in_flight_status": results,
    }
    failures = []
    if status != 0 or took > work_s + 5 or results != [200]:
        failures.append(f"sigterm: {report['sigterm']}")
    return failures


def run(
    url: str,
    pid: int,
    process: subprocess.Popen | None,
    seed: int,
    requests: int,
    valid: int,
    flood_s: float,
    stalled: int,
    phases: Callable[[str], bool] = lambda _: True,
) -> tuple[dict, list[str]]:
    """Every phase in order; returns (report, failures)."""
    abuse = Run(url, pid, seed)
    abuse.baseline(20)
    steps = [
        ("raw", abuse.raw),
        ("malformed", lambda: abuse.malformed(requests)),
        ("images", abuse.images),
        ("videos", abuse.videos),
        ("flood", lambda: abuse.flood(flood_s)),
        ("valid", lambda: abuse.valid(valid)),
        ("stalled", lambda: abuse.stalled(stalled)),
        ("schemathesis", lambda: abuse.schemathesis(seed)),
    ]
    for name, step in steps:
        if phases(name):
            started = time.perf_counter()
            step()
            print(f"fuzz: {name} done in {time.perf_counter() - started:.1f} s", flush=True)
    abuse.after()
    if process is not None and process.poll() is not None:
        abuse.failures.append(f"the worker exited with status {process.returncode}")
    if process is not None and phases("sigterm"):
        abuse.failures += sigterm_with_stalls(url, process, abuse.report)
    return abuse.report, abuse.failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=10_000, help="malformed bodies")
    parser.add_argument("--valid", type=int, default=1000, help="valid requests (memory)")
    parser.add_argument("--flood-seconds", type=float, default=30.0)
    parser.add_argument("--stalled", type=int, default=STALLED)
    parser.add_argument("--checkpoint", default="artifacts/demo/checkpoint")
    parser.add_argument("--engines", default="artifacts/demo/engines")
    parser.add_argument("--url", default=None, help="a running worker (then --pid for its RSS)")
    parser.add_argument("--pid", type=int, default=None)
    parser.add_argument("--out", default=None, help="also write the report here")
    parser.add_argument(
        "--phases",
        default="raw,malformed,images,videos,valid,flood,stalled,schemathesis,sigterm",
        help="which phases to run, comma-separated",
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the worker is stopped too
    process = None
    if args.url is None:
        if not Path(args.engines).is_dir():
            raise SystemExit(f"fuzz: no engines at {args.engines}; run `make demo` once first")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"omnijev-fuzz-{port}.log"
        process = start_worker(args.checkpoint, args.engines, port, log)
        print(f"fuzz: worker on {url}, log {log}", flush=True)
        wait_ready(url, process)
        pid = process.pid
    else:
        url, pid = args.url.rstrip("/"), args.pid or 0
    try:
        report, failures = run(
            url,
            pid,
            process,
            args.seed,
            args.requests,
            args.valid,
            args.flood_seconds,
            args.stalled,
            set(args.phases.split(",")).__contains__,
        )
    finally:
        if process is not None and process.poll() is None:
            process.kill()
    report["failures"] = failures
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
