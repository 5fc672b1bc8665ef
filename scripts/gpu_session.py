"""One whole GPU measurement per call (issue: runtime on the H200): build, check, time, report.

    python scripts/gpu_session.py tiny       # tiny checkpoint: CUDA parity, invariance, timing
    python scripts/gpu_session.py build4b    # 4b checkpoint and its ONNX files under $WORK
    python scripts/gpu_session.py latency4b  # 4b latency (bf16 engines) with the reference beside
    python scripts/gpu_session.py parity4b   # 4b parity (float32 engines) against the reference

Results go to $OUT (JSON and a Markdown table); large artifacts to $WORK (default /tmp/omnijev),
which survives between calls only while the machine stays warm.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORK = Path(os.environ.get("WORK", "/tmp/omnijev"))
OUT = Path(os.environ.get("OUT", "/tmp/omnijev-out"))
DEVICE = os.environ.get("DEVICE", "cuda")  # cpu only to try the script without a GPU


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save(name: str, value) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / name).write_text(value if isinstance(value, str) else json.dumps(value, indent=1))


def environment() -> dict:
    import onnxruntime
    import torch
    import transformers

    query = ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
    smi = "none"
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(query, capture_output=True, text=True).stdout.strip()
    return {
        "gpu": smi,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "onnxruntime": onnxruntime.__version__,
        "providers": onnxruntime.get_available_providers(),
    }


class PeakMemory:
    """Device memory in use (all processes' allocations on the GPU), sampled every millisecond."""

    def __init__(self):
        import torch

        self.torch = torch
        self.peak = 0
        self.running = False

    def __enter__(self):
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()
        return self

    def _poll(self):
        while self.running:
            free, total = self.torch.cuda.mem_get_info()
            self.peak = max(self.peak, total - free)
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def build(preset: str, dtypes: tuple[str, ...], graphs_for: dict[str, tuple[str, ...]]) -> dict:
    from build_engines.checkpoints import make_checkpoint, release_path
    from build_engines.onnx_export import export_onnx

    times = {}
    export = WORK / f"{preset}-export"
    if not export.exists():
        start = time.perf_counter()
        make_checkpoint(preset, 0, export)
        times["checkpoint_s"] = time.perf_counter() - start
        shutil.rmtree(release_path(export), ignore_errors=True)  # disk: the export is enough
        log(f"{preset} checkpoint in {times['checkpoint_s']:.1f} s")
    for dtype in dtypes:
        onnx = WORK / f"{preset}-{dtype}" / "onnx_ort"
        if not onnx.exists():
            start = time.perf_counter()
            export_onnx(
                export,
                onnx,
                dtype=dtype,
                gdn="ort",
                readout="std",
                graphs=graphs_for.get(dtype, ("vision", "lm_state", "lm_rows")),
            )
            times[f"onnx_{dtype}_s"] = time.perf_counter() - start
            log(f"{preset} {dtype} onnx in {times[f'onnx_{dtype}_s']:.1f} s")
    return times


def tiny() -> None:
    from reference.mso1 import Reference
    from runtime import bench
    from runtime.executor import load_engine

    report = {"environment": environment(), "build": build("tiny", ("float32",), {})}
    export, engines = WORK / "tiny-export", WORK / "tiny-float32"
    executor = load_engine(str(export), str(engines), "onnxruntime")
    report["backend"] = executor.backend.name
    reference = Reference(export, dtype="float32", device=DEVICE)
    parity = bench.parity(executor, reference, bench.question_sets())
    report["parity"] = parity["summary"]
    report["flips"] = parity["flips"]
    log(bench.parity_table(parity))
    report["invariance"] = invariance(executor)
    report["latency"] = bench.latency(executor, None, runs=10)
    log(bench.latency_table(report["latency"]))
    save("tiny.json", report)


def invariance(executor) -> dict:
    """Each question alone, all together and reversed: identical answers, byte for byte."""
    from reference.questions import gate_questions, request_body, speed_bench_questions
    from runtime import bench

    image = bench.encode(bench.screen_image(1600, 900, 1), "PNG")
    questions = {**speed_bench_questions(12), **gate_questions()}

    def answers(qs):
        response = executor.answer(request_body(image, qs, "image/png"))
        return {
            q: {k: v for k, v in a.items() if not k.startswith("latency")}
            for q, a in response["answers"].items()
        }

    together = answers(questions)
    backwards = answers(dict(reversed(list(questions.items()))))
    differ = [
        q for q in questions if json.dumps(answers({q: questions[q]})[q]) != json.dumps(together[q])
    ]
    differ_reversed = [q for q in questions if json.dumps(backwards[q]) != json.dumps(together[q])]
    repeat = json.dumps(answers(questions)) == json.dumps(together)
    result = {"alone_differs": differ, "reversed_differs": differ_reversed, "repeatable": repeat}
    log(f"invariance: {result}")
    return result


def build4b() -> None:
    times = build("4b", ("bfloat16",), {})
    sizes = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e9
        for p in WORK.iterdir()
        if p.name.startswith("4b")
    }
    save("build4b.json", {"environment": environment(), "times": times, "sizes_gb": sizes})
    log(json.dumps(sizes))


def latency4b() -> None:
    import torch

    from reference.mso1 import Reference
    from runtime import bench
    from runtime.executor import load_engine

    export, engines = WORK / "4b-export", WORK / "4b-bfloat16"
    start = time.perf_counter()
    executor = load_engine(str(export), str(engines), "onnxruntime")
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    cold = time.perf_counter() - start
    log(f"cold start {cold:.1f} s, backend {executor.backend.name}")
    runs = int(os.environ.get("RUNS", "20"))
    rows = bench.latency(executor, None, runs=runs)
    with PeakMemory() as peak:
        executor.answer(
            bench.body(
                bench.encode(bench.screen_image(1600, 900, 1), "PNG"),
                "image/png",
                bench.choice_with(255),
            )
        )
    report = {
        "environment": environment(),
        "backend": executor.backend.name,
        "cold_start_s": cold,
        "peak_device_bytes_255": peak.peak,
    }
    del executor
    torch.cuda.empty_cache()
    reference = Reference(export, dtype="bfloat16", device=DEVICE)
    image = bench.encode(bench.screen_image(1600, 900, 1), "PNG")
    for row, (_, questions) in zip(rows, bench.workloads().items(), strict=True):
        theirs = bench.time_runs(reference.answer, bench.body(image, "image/png", questions), 5)
        row["reference_median_ms"] = 1e3 * sorted(theirs)[len(theirs) // 2]
        row["speedup"] = row["reference_median_ms"] / row["median_ms"]
    report["rows"] = rows
    table = bench.latency_table(rows)
    save("latency4b.json", report)
    save("latency4b.md", table)
    log(f"peak device memory, 255 options: {peak.peak / 2**30:.1f} GiB")
    log(table)


def parity4b() -> None:
    from reference.mso1 import Reference
    from runtime import bench
    from runtime.executor import load_engine

    times = build("4b", ("float32",), {})
    export, engines = WORK / "4b-export", WORK / "4b-float32"
    executor = load_engine(str(export), str(engines), "onnxruntime")
    reference = Reference(export, dtype="float32", device=DEVICE)
    report = bench.parity(executor, reference, bench.question_sets())
    report["build"] = times
    report["backend"] = executor.backend.name
    save("parity4b.json", report)
    save("parity4b.md", bench.parity_table(report))
    log(bench.parity_table(report))


if __name__ == "__main__":
    {"tiny": tiny, "build4b": build4b, "latency4b": latency4b, "parity4b": parity4b}[sys.argv[1]]()
