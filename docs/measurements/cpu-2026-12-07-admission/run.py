"""Closed-loop clients posting one large body (a 1920x1080 noise JPEG, over 1 MiB) to a running
worker: served requests/s, latency with retries, and 503s, at the client counts given.

    python docs/measurements/cpu-2026-12-07-admission/run.py URL SECONDS CLIENTS...
"""

import base64
import http.client
import io
import json
import statistics
import sys
import threading
import time
from urllib.parse import urlsplit

import numpy as np
from PIL import Image


def large_body() -> bytes:
    noise = np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(noise).save(out, "JPEG", quality=90)
    url = "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode()
    questions = {
        f"q{i}": {"type": "noul", "instructions": f"Is there a cat number {i}?"} for i in range(3)
    }
    return json.dumps({"state": {"images": [url]}, "questions": questions}).encode()


def run(url: str, seconds: float, clients: int, body: bytes) -> dict:
    parts = urlsplit(url)
    stop = time.monotonic() + seconds
    latencies: list[float] = []
    busy = [0]
    lock = threading.Lock()

    def client() -> None:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
        while time.monotonic() < stop:
            started = time.perf_counter()
            while True:
                conn.request("POST", parts.path, body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                if response.status != 503:
                    break
                with lock:
                    busy[0] += 1
                if response.getheader("connection", "") == "close":
                    conn.close()
                    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
                time.sleep(float(response.getheader("retry-after", "1")))
            assert response.status == 200, response.status
            with lock:
                latencies.append(time.perf_counter() - started)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    took = time.perf_counter() - began
    latencies.sort()
    return {
        "clients": clients,
        "served": len(latencies),
        "seconds": round(took, 1),
        "requests_per_s": round(len(latencies) / took, 2),
        "p50_ms": round(1000 * statistics.median(latencies), 1),
        "p99_ms": round(1000 * latencies[int(0.99 * (len(latencies) - 1))], 1),
        "answered_503": busy[0],
    }


if __name__ == "__main__":
    target, seconds, counts = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
    payload = large_body()
    print(f"body {len(payload)} bytes", flush=True)
    for count in counts:
        print(json.dumps(run(target, seconds, int(count), payload)), flush=True)
