"""One whole GPU measurement per call (issue: runtime on the H200): build, check, time, report.

    python scripts/gpu_session.py tiny       # tiny checkpoint: CUDA parity, invariance, timing
    python scripts/gpu_session.py build4b    # 4b checkpoint, its ONNX files, and the tiny run
    python scripts/gpu_session.py latency4b  # 4b latency (bf16 engines) with the reference beside
    python scripts/gpu_session.py reference4b plain|fla  # (run by latency4b) the reference alone
    python scripts/gpu_session.py references # both references, then the table (after REFERENCE=0)
    python scripts/gpu_session.py parity4b   # 4b parity (float32 engines) against the reference
    python scripts/gpu_session.py profile4b  # 4b kernels per stage (CUPTI), 1 question and 255

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
BIG = os.environ.get("PRESET", "4b")  # tiny only to try the script without a GPU
TIMED = os.environ.get("DTYPE", "bfloat16")  # float32 only to try it on the CPU (no BF16 kernels)


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
            self.peak = max(self.peak, device_used())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


# export variants by name suffix: (gdn, vision attention, graphs written). "std": the chunked
# standard-op Gated DeltaNet (64 tokens a pass); "stdvision": the vision tower's attention in
# standard ops, its language model linked from the default export (see linked_engines)
EXPORTS = {
    "": ("ort", "ort", ("vision", "lm_state", "lm_rows")),
    "std": ("std", "std", ("vision", "lm_state", "lm_rows")),
    "stdvision": ("ort", "std", ("vision",)),
}


def linked_engines(engines: Path, base: Path) -> None:
    """Completes a vision-only export with the language-model files of `base` (links)."""
    own, theirs = engines / "onnx_ort", base / "onnx_ort"
    if (own / "lm_state.onnx").exists():
        return
    for path in theirs.iterdir():
        if path.name.startswith("lm_"):
            (own / path.name).symlink_to(path)
    description = json.loads((own / "onnx_export.json").read_text())
    graphs = json.loads((theirs / "onnx_export.json").read_text())["graphs"]
    description["graphs"] = {**graphs, "vision": description["graphs"]["vision"]}
    (own / "onnx_export.json").write_text(json.dumps(description, indent=1))


def build(preset: str, dtypes: tuple[str, ...]) -> dict:
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
    for name in dtypes:  # "bfloat16", "float32", or a variant of EXPORTS
        dtype, _, variant = name.partition("-")
        onnx = WORK / f"{preset}-{name}" / "onnx_ort"
        if not onnx.exists():
            start = time.perf_counter()
            gdn, attention, graphs = EXPORTS[variant]
            export_onnx(
                export,
                onnx,
                dtype=dtype,
                gdn=gdn,
                readout="std",
                graphs=graphs,
                attention=attention,
            )
            times[f"onnx_{name}_s"] = time.perf_counter() - start
            log(f"{preset} {name} onnx in {times[f'onnx_{name}_s']:.1f} s")
    return times


def tiny() -> None:
    """The tiny checkpoint in float32 on the GPU, in each configuration: parity with the float32
    reference, invariance, and a short latency table."""
    import gc

    from reference.mso1 import Reference
    from runtime.executor import load_engine
    from tools import bench

    report = {"environment": environment(), "build": build("tiny", ("float32",))}
    export, engines = WORK / "tiny-export", WORK / "tiny-float32"
    reference = Reference(export, dtype="float32", device=DEVICE)
    for name in ("dynamic", "static+graphs"):
        configure(VARIANTS[name][1])
        executor = load_engine(str(export), str(engines), "onnxruntime")
        parity = bench.parity(executor, reference, bench.question_sets())
        report[name] = {
            "backend": executor.backend.name,
            "parity": parity["summary"],
            "flips": parity["flips"],
            "invariance": invariance(executor),
            "latency": bench.latency(executor, None, runs=10),
        }
        log(f"tiny {name} ({executor.backend.name})\n" + bench.parity_table(parity))
        log(bench.latency_table(report[name]["latency"]))
        save("tiny.json", report)
        del executor
        gc.collect()


def invariance(executor) -> dict:
    """Each question alone, all together and reversed: identical answers, byte for byte; where
    not, the largest difference of any value of the answer."""
    from reference.questions import gate_questions, request_body, speed_bench_questions
    from tools import bench

    executor.prefix_cache.size = 0  # every request runs the vision tower and the prefix
    executor.prefix_cache.entries.clear()
    image = bench.encode(bench.screen_image(1600, 900, 1), "PNG")
    questions = {**speed_bench_questions(12), **gate_questions()}

    def answers(qs, still=image):
        return bench.without_latency(executor.answer(request_body(still, qs, "image/png")))

    def gap(a: dict, b: dict) -> float:
        return bench.largest_difference(a, b)

    together = answers(questions)
    backwards = answers(dict(reversed(list(questions.items()))))
    alone = {q: answers({q: questions[q]})[q] for q in questions}
    differ = {q: gap(together[q], alone[q]) for q in questions if alone[q] != together[q]}
    differ_reversed = {
        q: gap(together[q], backwards[q]) for q in questions if backwards[q] != together[q]
    }
    repeat = json.dumps(answers(questions)) == json.dumps(together)
    # an image size met for the first time: its first answers (the dynamic vision session)
    # against the third (a fixed-shape session, when those are on)
    fresh = bench.encode(bench.screen_image(1280, 720, 2), "PNG")
    first = [answers({"q0": questions["q0"]}, fresh)["q0"] for _ in range(2)]
    executor.settle()  # the size came back: its fixed-shape session is being built
    first.append(answers({"q0": questions["q0"]}, fresh)["q0"])
    new_size = gap(first[0], first[2]) if first[0] != first[2] else 0.0
    result = {
        "alone_differs": differ,
        "reversed_differs": differ_reversed,
        "repeatable": repeat,
        "new_image_size_first_vs_third": new_size,
    }
    log(f"invariance: {result}")
    return result


def invariance_bf16() -> None:
    """The tiny checkpoint in BF16 on the GPU: invariance with one question per pass (the plan)
    and with questions batched together (the plan before), in each backend configuration."""
    import gc

    from runtime.executor import load_engine

    report = {"environment": environment(), "build": build("tiny", ("bfloat16",))}
    export, engines = WORK / "tiny-export", WORK / "tiny-bfloat16"
    for name in ("dynamic", "static+graphs"):
        configure(VARIANTS[name][1])
        for batch in (1, 16):
            os.environ["OMNIJEV_QUESTION_BATCH"] = str(batch)
            executor = load_engine(str(export), str(engines), "onnxruntime")
            executor.prefix_cache.size = 0
            report[f"{name}, question batch {batch}"] = invariance(executor)
            save("invariance_bf16.json", report)
            del executor
            gc.collect()
    os.environ.pop("OMNIJEV_QUESTION_BATCH")


def build4b() -> None:
    """The 4b export, then its ONNX files (bfloat16, float32, bfloat16 standard-op) and the tiny
    GPU run side by side (each export is mostly one CPU thread; the machine has sixteen)."""
    times = build(BIG, ())
    started = time.perf_counter()
    jobs = {
        name: subprocess.Popen([sys.executable, "-u", __file__, *args])
        for name, args in {
            "onnx_bfloat16": ["onnx4b", TIMED],
            "onnx_float32": ["onnx4b", "float32"],
            # the chunked Gated DeltaNet in standard ops (64 tokens a pass), to time against
            # ONNX Runtime's token-sequential LinearAttention
            "onnx_bfloat16-std": ["onnx4b", f"{TIMED}-std"],
            # the vision tower with standard-op attention, to time against the fused one
            "onnx_bfloat16-stdvision": ["onnx4b", f"{TIMED}-stdvision"],
            "tiny": ["tiny"],
        }.items()
        if not (BIG == "tiny" and name == "tiny")  # a dry run on the CPU builds tiny once
    }
    for name, job in jobs.items():
        times[f"{name}_exit"] = job.wait()
        times[f"{name}_done_s"] = time.perf_counter() - started
        log(f"{name}: exit {times[f'{name}_exit']} after {times[f'{name}_done_s']:.0f} s")
    sizes = {
        p.name: sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) / 1e9
        for p in WORK.iterdir()
        if p.name.startswith(BIG)
    }
    save("build4b.json", {"environment": environment(), "times": times, "sizes_gb": sizes})
    log(json.dumps(sizes))


def onnx4b() -> None:
    dtype = sys.argv[2]
    save(f"onnx4b-{dtype}.json", build(BIG, (dtype,)))


# the configurations timed side by side: (engines, settings). The default; the vision tower with
# standard-op attention; fixed-shape sessions
# (which let ONNX Runtime fold the shape arithmetic) with CUDA graphs replayed per shape; the same
# with questions batched (fewer passes, not invariant in BF16); the standard-op Gated DeltaNet.
SETTINGS = ("OMNIJEV_STATIC_SHAPES", "OMNIJEV_CUDA_GRAPHS", "OMNIJEV_QUESTION_BATCH")
GRAPHS_ON = {"OMNIJEV_STATIC_SHAPES": "1", "OMNIJEV_CUDA_GRAPHS": "1"}
GRAPHS_OFF = {"OMNIJEV_STATIC_SHAPES": "0", "OMNIJEV_CUDA_GRAPHS": "0"}
VARIANTS = {
    "dynamic": (TIMED, GRAPHS_OFF),
    "std-vision": (f"{TIMED}-stdvision", GRAPHS_OFF),
    "static+graphs": (TIMED, GRAPHS_ON),
    "static+graphs+batched": (TIMED, {**GRAPHS_ON, "OMNIJEV_QUESTION_BATCH": "16"}),
    "std-gdn+static+graphs": (f"{TIMED}-std", GRAPHS_ON),
}


def configure(settings: dict) -> None:
    """Exactly these settings in the environment the executor reads at load."""
    for key in SETTINGS:
        os.environ.pop(key, None)
    os.environ.update(settings)


def device_used() -> int:
    import torch

    if not torch.cuda.is_available():
        return 0
    free, total = torch.cuda.mem_get_info()
    return total - free


def speed_bench_request() -> bytes:
    from reference.questions import speed_bench_questions
    from tools import bench

    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, 1), "PNG")
    return bench.body(image, "image/png", speed_bench_questions(12))


def time_variant(name: str, settings: dict, export: Path, engines: Path, runs: int) -> dict:
    """Load, warm up and time one configuration; its answers, peak memory and invariance."""
    import gc

    import torch

    from runtime.executor import load_engine
    from tools import bench

    configure(settings)
    before = device_used()
    start = time.perf_counter()
    executor = load_engine(str(export), str(engines), "onnxruntime")
    loaded = time.perf_counter() - start
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    cold = time.perf_counter() - start
    backend = executor.backend
    result = {
        "settings": settings,
        "backend": backend.name,
        "load_s": loaded,
        "cold_start_s": cold,
        "shared_weight_bytes": backend.weights.nbytes,
        "device_bytes_after_load": device_used() - before,
    }
    resident = result["device_bytes_after_load"] / 2**30
    log(f"{name}: cold start {cold:.1f} s ({backend.name}), {resident:.1f} GiB after load")
    result["rows"] = bench.latency(executor, None, runs=runs)
    result["static_graphs_on"] = dict(backend.static_graphs_on)
    result["sessions"] = len(backend._slots)
    log(f"{name}\n" + bench.latency_table(result["rows"]))
    with PeakMemory() as peak:
        image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, 1), "PNG")
        executor.answer(bench.body(image, "image/png", bench.choice_with(255)))
    result["peak_device_bytes_255"] = peak.peak - before
    result["speed_bench_answers"] = bench.without_latency(executor.answer(speed_bench_request()))
    result["invariance"] = invariance(executor)
    del executor, backend
    gc.collect()
    torch.cuda.empty_cache()
    return result


def latency4b() -> None:
    """Each configuration in LATENCY (default: all), then the reference unless REFERENCE=0."""
    export = WORK / f"{BIG}-export"
    runs = int(os.environ.get("RUNS", "20"))
    chosen = os.environ.get("LATENCY", ",".join(VARIANTS)).split(",")
    report = {"environment": environment(), "variants": {}}
    for name in chosen:
        engines_name, settings = VARIANTS[name]
        engines = WORK / f"{BIG}-{engines_name}"
        try:
            if engines_name.endswith("-stdvision"):
                linked_engines(engines, WORK / f"{BIG}-{TIMED}")
            report["variants"][name] = time_variant(name, settings, export, engines, runs)
        except Exception as error:  # keep what the other variants measured
            log(f"{name} failed: {error!r}")
            report["variants"][name] = {"error": repr(error)}
        save("latency4b.json", report)
    save("latency4b.json", report)
    if os.environ.get("REFERENCE", "1") == "1":
        references()
    summary(report)


def references() -> None:
    """The reference in BF16, plain and with fla-core, each in its own process."""
    for name in ("plain", "fla"):
        started = time.perf_counter()
        env = dict(os.environ)
        if name == "fla":  # transformers' fast Gated DeltaNet kernels, when importable
            env["PYTHONPATH"] = env.get("PYTHONPATH", "") + ":" + os.environ.get("FLA", "")
        code = subprocess.run(
            [sys.executable, "-u", __file__, "reference4b", name], env=env, timeout=400
        ).returncode
        log(f"reference {name}: exit {code} in {time.perf_counter() - started:.0f} s")


def reference4b() -> None:
    """The reference in bfloat16 on the same GPU: each workload, and its speed-bench answer."""
    import importlib.util

    from reference.mso1 import Reference
    from tools import bench

    name = sys.argv[2]
    runs = int(os.environ.get("REF_RUNS", "5"))
    start = time.perf_counter()
    reference = Reference(WORK / f"{BIG}-export", dtype="bfloat16", device=DEVICE)
    report = {
        "fla_importable": importlib.util.find_spec("fla") is not None,
        "load_s": time.perf_counter() - start,
        "runs": runs,
        "rows": {},
    }
    report["speed_bench_response"] = reference.answer(speed_bench_request())
    save(f"reference4b-{name}.json", report)
    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, 1), "PNG")
    for workload, questions in bench.workloads().items():
        times = bench.time_runs(reference.answer, bench.body(image, "image/png", questions), runs)
        report["rows"][workload] = {
            "median_ms": 1e3 * sorted(times)[len(times) // 2],
            "runs_ms": [1e3 * t for t in times],
        }
        log(f"reference {name} {workload}: {report['rows'][workload]['median_ms']:.0f} ms")
        save(f"reference4b-{name}.json", report)


def summary(report: dict) -> None:
    """The latency table of each variant with the plain reference's medians beside."""
    from tools import bench

    reference = OUT / "reference4b-plain.json"
    theirs = json.loads(reference.read_text())["rows"] if reference.exists() else {}
    text = []
    for name, variant in report["variants"].items():
        if "rows" not in variant:
            continue
        invariant = not variant["invariance"]["alone_differs"]
        for row in variant["rows"]:
            ref = theirs.get(row["workload"])
            if ref:
                row["reference_median_ms"] = ref["median_ms"]
                row["speedup"] = ref["median_ms"] / row["median_ms"]
        text.append(
            f"### {name} ({variant['backend']}), invariant {invariant}, "
            f"cold start {variant['cold_start_s']:.1f} s, "
            f"peak device memory for 255 options {variant['peak_device_bytes_255'] / 2**30:.1f} GiB"
        )
        text.append(bench.latency_table(variant["rows"]))
    save("latency4b.json", report)
    save("latency4b.md", "\n\n".join(text))
    log("\n\n".join(text))


def parity4b() -> None:
    """The 4b checkpoint in float32: engines against the float32 reference over four images."""
    from reference.mso1 import Reference
    from runtime.executor import load_engine
    from tools import bench

    times = build(BIG, ("float32",))
    export, engines = WORK / f"{BIG}-export", WORK / f"{BIG}-float32"
    executor = load_engine(str(export), str(engines), "onnxruntime")
    reference = Reference(export, dtype="float32", device=DEVICE)
    save("reference4b-float32-speed-bench.json", reference.answer(speed_bench_request()))
    report = bench.parity(executor, reference, bench.question_sets())
    report.update(build=times, backend=executor.backend.name, environment=environment())
    save("parity4b.json", report)
    save("parity4b.md", bench.parity_table(report))
    log(bench.parity_table(report))


STAGES = {  # Executor methods timed as the stages of Executor.stages
    "vision": "vision",
    "prefix": "run_prefix",
    "questions": "run_question",
    "options": "run_options",
    "heads": "respond",
}


def staged(executor) -> None:
    """Wraps each stage's method in a profiler range named after the stage (this instance only)."""
    import torch

    for stage, method in STAGES.items():
        original = getattr(executor, method)

        def wrapped(*args, _stage=stage, _original=original, **kwargs):
            with torch.profiler.record_function(f"stage:{_stage}"):
                return _original(*args, **kwargs)

        setattr(executor, method, wrapped)


def kernels_by_stage(trace: dict) -> dict:
    """GPU kernels of a Chrome trace grouped by the stage range their launch fell in: the time,
    launch count and largest kernels of each stage, and each stage's wall time."""
    events = trace["traceEvents"]
    ranges = [
        (e["ts"], e["ts"] + e["dur"], e["name"].removeprefix("stage:"))
        for e in events
        if e.get("cat") == "user_annotation" and e["name"].startswith("stage:")
    ]
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    stages: dict = {}
    for stage in [*STAGES, "other"]:
        wall = sum(end - start for start, end, name in ranges if name == stage) / 1e3
        stages[stage] = {"wall_ms": wall, "kernel_ms": 0.0, "launches": 0, "kernels": {}}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        launched = launches.get(e.get("args", {}).get("correlation"))
        stage = next(
            (n for start, end, n in ranges if launched is not None and start <= launched <= end),
            "other",
        )
        row = stages[stage]
        row["kernel_ms"] += e["dur"] / 1e3
        row["launches"] += 1
        totals = row["kernels"].setdefault(e["name"][:90], [0.0, 0])
        totals[0] += e["dur"] / 1e3
        totals[1] += 1
    for row in stages.values():
        top = sorted(row["kernels"].items(), key=lambda kv: -kv[1][0])[:8]
        row["kernels"] = [{"name": n, "ms": round(t, 3), "count": c} for n, (t, c) in top]
    return stages


def stage_table(title: str, wall_ms: float, stages: dict) -> str:
    lines = [
        f"== {title}: wall {wall_ms:.1f} ms",
        "| stage | wall ms | kernel ms | launches | largest kernels (ms × count) |",
        "| --- | ---: | ---: | ---: | --- |",
    ]
    for stage, row in stages.items():
        top = "; ".join(f"{k['name'][:48]} {k['ms']:.2f}×{k['count']}" for k in row["kernels"][:3])
        lines.append(
            f"| {stage} | {row['wall_ms']:.1f} | {row['kernel_ms']:.1f} | {row['launches']} "
            f"| {top} |"
        )
    return "\n".join(lines)


def profile4b() -> None:
    """One warm request of each workload under CUPTI, kernels attributed to the executor's
    stages (the issue's per-stage profile for a missed target). PROFILE=name picks a variant."""
    import torch

    from runtime.executor import load_engine
    from tools import bench

    name = os.environ.get("PROFILE", "dynamic")
    engines_name, settings = VARIANTS[name]
    configure(settings)
    executor = load_engine(str(WORK / f"{BIG}-export"), str(WORK / f"{BIG}-{engines_name}"))
    executor.prefix_cache.size = 0
    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, 1), "PNG")
    report, text = {"variant": name, "backend": executor.backend.name}, []
    staged(executor)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    for workload in ("1 question", "12 questions", "255 options"):
        request = bench.body(image, "image/png", bench.workloads()[workload])
        for _ in range(3):
            executor.answer(request)
        trace_path = OUT / f"trace-{workload.replace(' ', '-')}.json"
        with torch.profiler.profile(activities=activities) as prof:
            started = time.perf_counter()
            executor.answer(request)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            wall = 1e3 * (time.perf_counter() - started)
        OUT.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        stages = kernels_by_stage(json.loads(trace_path.read_text()))
        trace_path.unlink()  # tens of MB: the table is what is kept
        prepare = 1e3 * executor.stages["prepare"]
        report[workload] = {"wall_ms": wall, "prepare_ms": prepare, "stages": stages}
        text.append(stage_table(workload, wall, stages))
        text.append(f"prepare (host, before the first stage): {prepare:.1f} ms")
        log(text[-2] + "\n" + text[-1])
        save("profile4b.json", report)
    save("profile4b.md", "\n\n".join(text))


if __name__ == "__main__":
    modes = {"tiny": tiny, "build4b": build4b, "latency4b": latency4b, "parity4b": parity4b}
    modes.update(reference4b=reference4b, onnx4b=onnx4b, invariance_bf16=invariance_bf16)
    modes["profile4b"] = profile4b
    modes["references"] = lambda: (
        references(),
        summary(json.loads((OUT / "latency4b.json").read_text())),
    )
    modes[sys.argv[1]]()
