"""The q12-jpeg run's requests (12 questions on a 1920x1080 suite JPEG, seed 0, five of them):
`decode_rgb` with and without its fast paths, and the whole preparation as the GPU executor
runs it (`prepare(..., pack=False, resize=False)`, the image thread beside the tokenizer), in
the tree on PYTHONPATH; medians of 15 warm runs a request, in ms."""

import json
import statistics
import time
from functools import partial

from bench import traffic
from runtime import images, processing
from runtime.contract import compile_request
from runtime.tokenizer import build_tokenizer

RUNS = 15


def median_ms(work) -> float:
    work()
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        work()
        times.append((time.perf_counter() - started) * 1e3)
    return round(statistics.median(times), 2)


def prepare_once(obj: dict) -> None:
    processing.prepare(compile_request(obj), tokenizer, pack=False, resize=False)


tokenizer = build_tokenizer()
bodies = [traffic.request(0, i, questions=12, size=(1920, 1080), fmt="JPEG").body for i in range(5)]
rows = []
for body in bodies:
    obj = json.loads(body)
    data = compile_request(obj).image_bytes
    rows.append(
        {
            "decode fast": median_ms(partial(images.decode_rgb, data, "image/jpeg")),
            "decode pillow": median_ms(partial(images.decode_rgb, data, "image/jpeg", fast=False)),
            "prepare": median_ms(partial(prepare_once, obj)),
        }
    )
print(json.dumps(rows))
for key in rows[0]:
    print(f"{key}: {[row[key] for row in rows]}")
