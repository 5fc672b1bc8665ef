"""One tree in process (run from its folder): the tiny checkpoint on the torch backend's CPU path,
the bench's 1- and 12-question workloads, 5 warm runs each, the median and the last run's stages.
    python inproc.py CHECKPOINT ENGINES"""

import os
import sys
import time

sys.path.insert(0, os.getcwd())
from bench.workloads import bench_still, body, workloads  # noqa: E402
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.executor import load_engine  # noqa: E402
from server.app import worker_process  # noqa: E402

worker_process()
ex = load_engine(sys.argv[1], sys.argv[2], RuntimeConfig.from_env(backend="torch", prefix_cache=0))
still = bench_still()
for name in ("1 question", "12 questions"):
    request = body(still, "image/png", workloads()[name])
    ex.answer(request)
    ex.answer(request)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        ex.answer(request)
        runs.append(time.perf_counter() - started)
    stages = {k: round(v * 1e3, 1) for k, v in ex.stages.items()}
    print(os.getcwd(), name, round(sorted(runs)[2] * 1e3, 1), "ms", stages)
