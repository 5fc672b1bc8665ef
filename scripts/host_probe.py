"""`python scripts/host_probe.py`: two probes of a GPU machine's host, for issue 13, without the
model: the PNG decode of the bench still by pieces on 1-16 threads (`runtime.images.fast_png`),
and how long an execution-like thread (CUDA graph replays, each waited for) takes while other
threads run Python, for several GIL switch intervals (`server.app.GIL_SWITCH_S`).

Prints a table and writes JSON to $OUT/host-probe.json.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DECODE_THREADS = (1, 2, 4, 8, 16)
DECODE_RUNS = 30
SWITCH_INTERVALS_MS = (5.0, 1.0, 0.5, 0.2, 0.1)
LAUNCHES = 24  # graph replays a 12-question request's execution waits on, about
GPU_US = 1500  # each replay's GPU time: ~36 ms in all, near the request's GPU stages
BUSY_THREADS = 3  # preparing (2) and responding (1) threads, as server/admission.py has
BUSY_MS, IDLE_MS = 3.0, 3.0  # each busy thread's Python burst and pause
REQUESTS = 40


def decode_probe() -> dict:
    """decode_rgb of the bench still, median ms, by the number of decode threads; and its
    inflate and the unfiltering alone."""
    from PIL import Image

    from runtime import images, pools
    from tools import bench

    still = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    opened = Image.open(io.BytesIO(still))
    _, _, offset, _ = tuple(opened.tile[0])
    stream = images.idat_stream(still, offset - images.CHUNK_HEAD.size)
    width, height = opened.size
    stride = 1 + 3 * width
    inflate, libspng = images.fast_png_codecs()
    raw = inflate(stream, height * stride)
    filters = np.frombuffer(raw, np.uint8)[::stride]
    out = np.empty((height, width, 3), np.uint8)
    reference = images.decode_rgb(still, "image/png").tobytes()

    median_ms = partial(bench.median_ms, runs=DECODE_RUNS)
    result = {"inflate": median_ms(lambda: inflate(stream, height * stride))}
    for threads in DECODE_THREADS:
        images.DECODE_THREADS = threads
        pools.forget("png")  # the next decode makes a pool of this many threads
        pieces = images.png_pieces(filters, stride, threads)
        same = images.decode_rgb(still, "image/png").tobytes() == reference
        result[f"threads {threads}"] = {
            "pieces": len(pieces),
            "unfilter": median_ms(
                lambda p=pieces: images.unfilter_pieces(libspng, raw, p, out, stride, 2, "RGB8")
            ),
            "decode_rgb": median_ms(lambda: images.decode_rgb(still, "image/png")),
            "same_bytes": same,
        }
    return result


def busy(stop: threading.Event) -> None:
    """Python in bursts of BUSY_MS, pauses of IDLE_MS (the GIL held, then released)."""
    while not stop.is_set():
        until = time.perf_counter() + BUSY_MS / 1e3
        total = 0
        while time.perf_counter() < until:
            total += sum(range(200))
        time.sleep(IDLE_MS / 1e3)


def gil_probe() -> dict:
    """An execution-like request (LAUNCHES replays of a graph that sleeps GPU_US on the GPU,
    each waited for; without CUDA, sleeps of GPU_US) alone and beside BUSY_THREADS Python
    threads, median ms, per switch interval."""
    wait = gpu_wait() if cuda_here() else (lambda: time.sleep(GPU_US / 1e6))

    def request() -> float:
        started = time.perf_counter()
        for _ in range(LAUNCHES):
            wait()
        return time.perf_counter() - started

    def median_ms(loaded: bool) -> float:
        stop = threading.Event()
        threads = [threading.Thread(target=busy, args=(stop,)) for _ in range(BUSY_THREADS)]
        if loaded:
            for thread in threads:
                thread.start()
        try:
            request()
            times = [request() for _ in range(REQUESTS)]
        finally:
            stop.set()
            for thread in threads if loaded else ():
                thread.join()
        return round(1e3 * statistics.median(times), 2)

    kept = sys.getswitchinterval()
    result = {"alone": median_ms(False)}
    try:
        for interval in SWITCH_INTERVALS_MS:
            sys.setswitchinterval(interval / 1e3)
            result[f"switch {interval} ms"] = median_ms(True)
    finally:
        sys.setswitchinterval(kept)
    return result


def cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def gpu_wait():
    """One replay of a graph that sleeps GPU_US on the GPU, waited for (the GIL released)."""
    import torch

    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    cycles = int(GPU_US * 1e-6 * torch.cuda.get_device_properties(device).clock_rate * 1e3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)  # warm
        stream.synchronize()
    with torch.cuda.graph(graph, stream=stream):
        torch.cuda._sleep(cycles)

    def wait() -> None:
        with torch.cuda.stream(stream):
            graph.replay()
        stream.synchronize()

    return wait


def main() -> int:
    report = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    report["decode"] = decode_probe()
    print("decode (median ms):", json.dumps(report["decode"], indent=1))
    report["gil"] = gil_probe()
    report["gil"]["on"] = "cuda graphs" if cuda_here() else "sleeps"
    print("execution-like request (median ms):", json.dumps(report["gil"], indent=1))
    out = Path(os.environ.get("OUT", "/tmp")) / "host-probe.json"
    out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
