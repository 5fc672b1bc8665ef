"""`python scripts/heads_probe.py [OLD_HEADS_PY] [--executor]`: where a request's heads spend
their time on this machine: `questions_mu` (MLPs on the GPU, as the worker runs them) of the
bench's 1, 12 and 255-option requests at 1, 8 and 16 PyTorch threads, split into the device MLPs
and the rest; with a path to an older `runtime/heads.py`, that one beside. `--executor` also
answers the requests through an Executor on the 4b synthetic export (scripts/gpu_torch.py's,
torch backend uncompiled, CUDA graphs; `--compiled`: compiled, as the worker runs) and times its
heads stage with each code at 16, 8 and 1 threads. `--no-direct` skips the direct timings.
JSON to $OUT.
"""

from __future__ import annotations

import cProfile
import importlib.util
import io
import json
import os
import pstats
import sys
from functools import partial
from itertools import product
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from runtime.contract import compile_request  # noqa: E402
from runtime.strict_json import parse_body  # noqa: E402
from runtime.types import QuestionReadout  # noqa: E402
from tools import bench, hoststages  # noqa: E402

RUNS, WARM = 30, 3  # timed calls per setting (median), after untimed ones
EXECUTOR_RUNS = 10  # requests timed through the executor (after tools.bench.time_runs' warm-up)
# PyTorch threads tried: one, the worker's cap (server.app.TORCH_THREADS), the H200 host's cores
THREADS = (1, 8, 16)
REQUESTS = ("1 question", "12 questions", "255 options")  # of tools.bench.workloads
OUT = Path(os.environ.get("OUT", "/tmp/heads-probe"))


def items_of(body: bytes, seed: int = 0) -> list[tuple[str, QuestionReadout]]:
    """(type, readout) of a bench request's questions, readouts as the engines shape them."""
    rng = np.random.default_rng(seed)
    items = []
    for q in compile_request(parse_body(body)).questions:
        k = max(len(q.keys), 1)
        items.append(
            (
                q.type,
                QuestionReadout(
                    zq=rng.standard_normal(hoststages.HIDDEN).astype(np.float32),
                    u=rng.standard_normal((k, hoststages.HIDDEN)).astype(np.float32),
                    picked=[-rng.random(3).astype(np.float32) for _ in range(k)],
                    first=[-0.5] * k,
                ),
            )
        )
    return items


def device_mlps(heads, items: list) -> None:
    """The device MLPs of `questions_mu` alone."""
    wanted = [heads.first_inputs(kind, readout, True) for kind, readout in items]
    with torch.inference_mode():
        heads.device_mlps.run(wanted, [{} for _ in items])


def module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    from runtime import heads as new

    versions = {"new": new}
    paths = [arg for arg in sys.argv[1:] if not arg.startswith("--")]
    if paths:
        versions["old"] = module(paths[0], "heads_old")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    loads = bench.workloads()
    requests = {name: items_of(bench.body(image, "image/png", loads[name])) for name in REQUESTS}
    tensors = {n: t.numpy() for n, t in hoststages.synthetic_heads().t.items()}
    rows, profiles = [], {}
    for label, heads_module in versions.items() if "--no-direct" not in sys.argv else ():
        heads = heads_module.Heads(tensors)
        on_device = heads.use_device(device)
        for threads in THREADS:
            torch.set_num_threads(threads)
            for name, items in requests.items():
                row = {"code": label, "threads": threads, "request": name, "device": on_device}
                row["heads_ms"] = bench.median_ms(
                    partial(heads_module.questions_mu, heads, items), RUNS, WARM
                )
                if heads.device_mlps is not None:
                    row["device_mlps_ms"] = bench.median_ms(
                        partial(device_mlps, heads, items), RUNS, WARM
                    )
                rows.append(row)
                print(row, flush=True)
                if threads == THREADS[-1] and name == REQUESTS[-1]:
                    profile = cProfile.Profile()
                    profile.enable()
                    for _ in range(10):
                        heads_module.questions_mu(heads, items)
                    profile.disable()
                    text = io.StringIO()
                    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(20)
                    profiles[label] = text.getvalue()
                    print(profiles[label], flush=True)
    report = {"rows": rows, "profiles": profiles}
    if "--executor" in sys.argv:
        report["executor"] = executor_rows(versions, image, loads)
    (OUT / "heads-probe.json").write_text(json.dumps(report))


def executor_rows(versions: dict, image: bytes, loads: dict) -> list[dict]:
    """The heads stage of Executor.answer (real readouts, the executor's process) per code."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_torch

    from runtime import finish

    gpu_torch.build()
    compiled = "--compiled" in sys.argv
    executor = gpu_torch.executor_for(gpu_torch.Run("probe", compile=compiled))
    tensors = {n: t.numpy() for n, t in executor.heads.t.items()}
    rows = []
    for label, heads_module in versions.items():
        executor.heads = heads_module.Heads(tensors)
        executor.heads.use_device(executor.device)
        finish.questions_mu = heads_module.questions_mu
        for threads, name in product(THREADS[::-1], REQUESTS):
            torch.set_num_threads(threads)
            body = bench.body(image, "image/png", loads[name])
            stages = executor.stages  # time_runs leaves each stage's median there
            bench.time_runs(executor.answer, body, EXECUTOR_RUNS, stages)
            row = {"code": label, "request": name, "threads": threads, "compiled": compiled}
            row["heads_ms"] = round(1e3 * stages["heads"], 3)
            row["load_average"] = os.getloadavg()[0]
            rows.append(row)
            print("executor", row, flush=True)
    return rows


if __name__ == "__main__":
    main()
