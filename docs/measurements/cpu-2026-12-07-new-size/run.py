"""The host's work for a new image size's vision tables with the 4b's vision shapes: the whole
tables on the host (`vision_inputs`, before 9788221) against the taps and rotary tables the
host still makes now that the position table is blended on the device; median of 20 each.

    python docs/measurements/cpu-2026-12-07-new-size/run.py
"""

import statistics
import time

import numpy as np

from bench.traffic import SIZES
from build_engines.presets import REAL_VISION, VISION_COMMON
from runtime.images import smart_resize
from runtime.model.vision import position_taps, rotary_tables, vision_inputs


def median_ms(fn, runs: int = 20) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


config = {**VISION_COMMON, **REAL_VISION}
PATCH = config["patch_size"]
side = int(config["num_position_embeddings"] ** 0.5)
table = np.random.default_rng(0).standard_normal((side * side, config["hidden_size"]))
table = table.astype(np.float32)
print("| image | grid | patches | host tables before ms | host now ms | table MB copied before |")
print("| --- | --- | ---: | ---: | ---: | ---: |")
for width, height in SIZES:
    h, w = smart_resize(height, width)
    grid = (1, h // PATCH, w // PATCH)
    before = median_ms(lambda g=grid: vision_inputs(g, table, config))
    now = median_ms(lambda g=grid: (position_taps(g, config), rotary_tables(g, config)))
    megabytes = grid[1] * grid[2] * config["hidden_size"] * 4 / 1e6
    print(
        f"| {width}×{height} | {grid[1]}×{grid[2]} | {grid[1] * grid[2]} | {before:.1f} | "
        f"{now:.2f} | {megabytes:.1f} |"
    )
