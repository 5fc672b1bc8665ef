"""One tree's side of `bench/ab.sh`: load the torch engine, compile every bench workload, then
time a round of them each time its flag file appears, so that two code trees are timed in turns
on one GPU with neither compiling meanwhile. Standalone (run from the tree under test): it also
runs on trees older than this package.

    python3 bench/ab_driver.py NAME CHECKPOINT ENGINES FLAG_DIR [ROUNDS]
"""

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())
from runtime.config import RuntimeConfig  # noqa: E402
from runtime.executor import load_engine  # noqa: E402

try:
    from bench.workloads import bench_still, body, workloads
except ImportError:  # the tree before the bench package
    from tools.bench import BENCH_SIZE, body, encode, screen_image, workloads

    def bench_still() -> bytes:
        return encode(screen_image(*BENCH_SIZE, seed=1), "PNG")


from server.app import worker_process  # noqa: E402

name, checkpoint, engines, folder = sys.argv[1:5]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 2
runs = int(os.environ.get("AB_RUNS", "20"))
folder = Path(folder)
worker_process()
started = time.perf_counter()
ex = load_engine(checkpoint, engines, RuntimeConfig.from_env(backend="torch", prefix_cache=0))
ex.answer(json.dumps(ex.warm_up_request()).encode())
still = bench_still()
bodies = {n: body(still, "image/png", q) for n, q in workloads().items()}
answers = {}
for n, b in bodies.items():
    ex.answer(b)
    out = ex.answer(b)
    answers[n] = {
        q: {k: v for k, v in a.items() if not k.startswith("latency")}
        for q, a in out["answers"].items()
    }
ready_s = time.perf_counter() - started
(folder / f"{name}.answers.json").write_text(json.dumps(answers, sort_keys=True))
(folder / f"{name}.ready").touch()
record = {
    "name": name,
    "ready_s": ready_s,
    "backend": getattr(ex.backend, "name", "?"),
    "rounds": [],
}
for r in range(rounds):
    go = folder / f"{name}.go{r}"
    while not go.exists():
        time.sleep(0.05)
    rows = {}
    for n, b in bodies.items():
        times = []
        for _ in range(runs):
            t = time.perf_counter()
            ex.answer(b)
            times.append(1e3 * (time.perf_counter() - t))
        rows[n] = times
    record["rounds"].append(rows)
    (folder / f"{name}.json").write_text(json.dumps(record, indent=1))
    (folder / f"{name}.done{r}").touch()
