"""`omnijev parity` and `omnijev bench`: agreement with the float32 reference and latency.

Follows the validation method of `recipe/omnijev/validate.py` (docs/contract.md §11) and the
reference's `speed_bench.py` workloads (docs/contract.md §10.1, §12.2); both print a table last.
"""

from __future__ import annotations

import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from runtime.config import RuntimeConfig

BENCH_SIZE = (1600, 900)  # the latency still of docs/contract.md §12.2
WARM_RUNS = 20  # the "at least 20 warm runs"
OPTIONS_255 = 255  # the largest Choice the contract allows


def quantile(values: list[float], f: float) -> float:
    """validate.py's q(f) = sorted[min(n − 1, int(f·n))]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(f * len(ordered)))]


# -- images ------------------------------------------------------------------------------------


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def pattern_image(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    rgb = np.stack([(7 * x + 3 * y) % 256, (x * y + 13) % 256, ((x ^ y) * 5) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def screen_image(width: int, height: int, seed: int) -> Image.Image:
    """A screenshot-like still: windows, buttons and text lines drawn deterministically."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), (235, 238, 242))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 120))
        x1, y1 = x0 + int(rng.integers(120, 600)), y0 + int(rng.integers(60, 400))
        colour = tuple(int(c) for c in rng.integers(40, 250, size=3))
        draw.rectangle([x0, y0, x1, y1], fill=colour, outline=(20, 20, 20), width=2)
        for line in range(3):
            draw.text(
                (x0 + 10, y0 + 10 + 16 * line), f"item {seed}.{line} OK Cancel", fill=(0, 0, 0)
            )
    return image


def photo_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like still: smooth gradients with noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / 97 + seed),
            128 + 90 * np.cos(y / 71),
            128 + 80 * np.sin((x + y) / 53),
        ],
        axis=-1,
    )
    noisy = base + rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def parity_images() -> list[tuple[str, bytes, str]]:
    """Four different stills, PNG and JPEG: (name, bytes, mime)."""
    w, h = BENCH_SIZE
    return [
        ("screen.png", encode(screen_image(w, h, 1), "PNG"), "image/png"),
        ("screen.jpg", encode(screen_image(w, h, 1), "JPEG"), "image/jpeg"),
        ("photo.jpg", encode(photo_image(1280, 720, 2), "JPEG"), "image/jpeg"),
        ("pattern.png", encode(pattern_image(640, 480), "PNG"), "image/png"),
    ]


# -- workloads ---------------------------------------------------------------------------------


def choice_with(options: int) -> dict[str, dict]:
    words = [f"option {i}" for i in range(options)]
    return {
        "wide": {
            "type": "choice",
            "instructions": "Which label fits the image best?",
            "options": [{"key": w, "text": w} for w in words] + [{"abstain": True}],
        }
    }


def workloads() -> dict[str, dict[str, dict]]:
    from reference.questions import gate_questions, speed_bench_questions

    loads = {f"{n} question{'s' * (n > 1)}": speed_bench_questions(n) for n in (1, 3, 6, 12)}
    loads["32 options"] = {"choice32": gate_questions()["choice32"]}
    loads["255 options"] = choice_with(OPTIONS_255)
    return loads


def body(image: bytes, mime: str, questions: dict[str, dict]) -> bytes:
    from reference.questions import request_body

    return request_body(image, questions, mime)


# -- parity ------------------------------------------------------------------------------------


def without_latency(response: dict) -> dict[str, dict]:
    """A response's answers without their latency fields: what must repeat byte for byte."""
    return {
        qid: {k: v for k, v in answer.items() if not k.startswith("latency")}
        for qid, answer in response["answers"].items()
    }


def answer_values(answer: dict) -> dict[str, float]:
    values = {k: answer[k] for k in ("noul", "abstain", "confidence") if k in answer}
    values.update({f"p:{k}": v for k, v in answer.get("probabilities", {}).items()})
    return values


def largest_difference(reference: dict, candidate: dict) -> float:
    ref, cand = answer_values(reference), answer_values(candidate)
    return max(abs(ref[k] - cand.get(k, float("inf"))) for k in ref)


def decision(answer: dict) -> tuple[str, float]:
    """The decision and the margin between the top two values (validate.py)."""
    if "noul" in answer:
        return ("yes" if answer["noul"] >= 0.5 else "no"), abs(answer["noul"] - 0.5) * 2
    probs = sorted(answer["probabilities"].values(), reverse=True)
    margin = probs[0] - probs[1] if len(probs) > 1 else 1.0
    return answer.get("choice", answer.get("score")), margin


def compare(reference: dict, candidate: dict) -> dict:
    """validate.py's compare over one (image, question set)."""
    rows, flips = [], []
    for qid, ref in reference["answers"].items():
        cand = candidate["answers"][qid]
        rows.append(largest_difference(ref, cand))
        (ref_decision, margin), (cand_decision, _) = decision(ref), decision(cand)
        if ref_decision != cand_decision:
            flips.append(
                {"question": qid, "reference": ref_decision, "got": cand_decision, "margin": margin}
            )
    same_tokens = reference["usage"]["input_tokens"] == candidate["usage"]["input_tokens"]
    return {"differences": rows, "flips": flips, "input_tokens_equal": same_tokens}


def progress(done: int, total: int, what: str, started: float) -> None:
    """One line a step on stderr, so a long run is never silent."""
    elapsed = time.perf_counter() - started
    print(f"  {what}: {done}/{total} ({elapsed:.0f} s)", file=sys.stderr, flush=True)


def parity(executor, reference, sets: dict[str, dict[str, dict]]) -> dict:
    results, differences, flips, token_mismatches = [], [], [], 0
    images, started = parity_images(), time.perf_counter()
    total = len(images) * len(sets)
    for name, image, mime in images:
        for set_name, questions in sets.items():
            progress(len(results), total, f"parity {name} {set_name}", started)
            request = body(image, mime, questions)
            ref, got = reference.answer(request), executor.answer(request)
            result = compare(ref, got)
            differences += result["differences"]
            flips += [dict(f, image=name, set=set_name) for f in result["flips"]]
            token_mismatches += not result["input_tokens_equal"]
            results.append({"image": name, "set": set_name, **result})
    summary = {
        "answers": len(differences),
        "median": quantile(differences, 0.5),
        "p90": quantile(differences, 0.9),
        "p99": quantile(differences, 0.99),
        "max": max(differences),
        "within_0.01": sum(d <= 0.01 for d in differences),
        "decisions_unlike_reference": len(flips),
        "input_tokens_unequal": token_mismatches,
    }
    return {"summary": summary, "flips": flips, "runs": results}


def question_sets() -> dict[str, dict[str, dict]]:
    from reference.questions import gate_questions, speed_bench_questions

    return {"speed_bench": speed_bench_questions(12), "gate": gate_questions()}


def parity_table(report: dict) -> str:
    s = report["summary"]
    lines = [
        "| answers | median | p90 | p99 | max | within 0.01 | decisions unlike ref | "
        "input_tokens unequal |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| {s['answers']} | {s['median']:.2e} | {s['p90']:.2e} | {s['p99']:.2e} | "
        f"{s['max']:.2e} | {s['within_0.01']} | {s['decisions_unlike_reference']} | "
        f"{s['input_tokens_unequal']} |",
    ]
    return "\n".join(lines)


# -- latency -----------------------------------------------------------------------------------


def median_ms(call, runs: int, warm: int = 1) -> float:
    """Median wall milliseconds of `runs` calls of `call()` after `warm` untimed ones."""
    for _ in range(warm):
        call()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return round(1e3 * statistics.median(times), 3)


def time_runs(
    answer, request: bytes, runs: int, stages: dict | None = None, settle=None
) -> list[float]:
    """Wall seconds of `runs` warm calls; with `stages`, collects the executor's per-stage times.
    `settle` waits for sessions built in the background after the first call."""
    answer(request)  # warm-up: sessions built, graphs captured, caches filled
    if settle is not None:
        settle()
    answer(request)
    answer(request)
    times, per_stage = [], {}
    for _ in range(runs):
        start = time.perf_counter()
        answer(request)
        times.append(time.perf_counter() - start)
        for stage, seconds in (stages or {}).items():
            per_stage.setdefault(stage, []).append(seconds)
    if stages is not None:
        stages.clear()
        stages.update({k: statistics.median(v) for k, v in per_stage.items()})
    return times


def latency(
    executor, reference=None, runs: int = WARM_RUNS, prefix_cache: bool = False
) -> list[dict]:
    """Each workload from request JSON to response. The image is the same in every run, so the
    cross-request prefix cache is off unless asked for: the numbers are the full path's."""
    image = encode(screen_image(*BENCH_SIZE, seed=1), "PNG")
    if not prefix_cache:
        executor.prefix_cache.size = 0
        executor.prefix_cache.clear()
    rows, chosen, started = [], workloads(), time.perf_counter()
    for name, questions in chosen.items():
        progress(len(rows), len(chosen), f"latency {name}, {runs} runs", started)
        request = body(image, "image/png", questions)
        ours = time_runs(executor.answer, request, runs, executor.stages, executor.settle)
        row = {
            "workload": name,
            "median_ms": 1e3 * statistics.median(ours),
            "p90_ms": 1e3 * quantile(ours, 0.9),
            "stages_ms": {k: round(1e3 * v, 2) for k, v in executor.stages.items()},
        }
        if reference is not None:
            theirs = time_runs(reference.answer, request, max(5, runs // 4))
            row["reference_median_ms"] = 1e3 * statistics.median(theirs)
            row["speedup"] = row["reference_median_ms"] / row["median_ms"]
        rows.append(row)
    return rows


STAGES = ("prepare", "vision", "prefix", "questions", "options", "heads")


def latency_table(rows: list[dict]) -> str:
    """Median and p90 per workload, the reference beside, and the median of each stage."""
    lines = [
        "| workload | median ms | p90 ms | reference median ms | speed-up | "
        + " | ".join(STAGES)
        + " |",
        "| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(STAGES),
    ]
    for r in rows:
        ref = f"{r['reference_median_ms']:.1f}" if "reference_median_ms" in r else "-"
        speed = f"{r['speedup']:.1f}×" if "speedup" in r else "-"
        stages = " | ".join(f"{r.get('stages_ms', {}).get(s, 0.0):.1f}" for s in STAGES)
        lines.append(
            f"| {r['workload']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {ref} | {speed} | "
            f"{stages} |"
        )
    return "\n".join(lines)


# -- command line ------------------------------------------------------------------------------


def cli_parity(args) -> int:
    from reference.mso1 import Reference
    from runtime.executor import load_engine

    executor = load_engine(args.checkpoint, args.engines, RuntimeConfig.from_args(args))
    reference = Reference(args.checkpoint, dtype="float32", device=args.device)
    report = parity(executor, reference, question_sets())
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(parity_table(report))
    return 0


def cli_bench(args) -> int:
    from runtime.executor import load_engine

    if getattr(args, "host_only", False):  # no engines: the host stages alone
        return print_host_profile(args.runs, None, getattr(args, "out", None))
    started = time.perf_counter()
    executor = load_engine(args.checkpoint, args.engines, RuntimeConfig.from_args(args))
    executor.answer(json.dumps(executor.warm_up_request()).encode())
    cold = time.perf_counter() - started
    reference = None
    if args.reference_dtype:
        from reference.mso1 import Reference

        reference = Reference(args.checkpoint, dtype=args.reference_dtype, device=args.device)
    rows = latency(executor, reference, args.runs)
    if args.out:
        Path(args.out).write_text(json.dumps({"cold_start_s": cold, "rows": rows}, indent=1))
    print(f"cold start (load + warm-up): {cold:.2f} s")
    print(latency_table(rows))
    print_host_profile(args.runs, executor)
    return 0


def print_host_profile(runs: int, executor=None, out: str | None = None) -> int:
    """The per-stage host profile (tools.hoststages) with the executor's tokenizer, heads,
    calibration and device, or the built-in tokenizer and 4b-sized synthetic heads."""
    from tools import hoststages

    kept = {}
    if executor is not None:
        kept = dict(tokenizer=executor.tokenizer, heads=executor.heads)
        kept.update(calibration=executor.calibration, device=str(executor.device))
    results = hoststages.profile(host_requests(), runs=runs, **kept)
    if out:
        Path(out).write_text(json.dumps({"host_stages_ms": results}, indent=1))
    print(f"host stages ({hoststages.machine()}, upload to {kept.get('device', 'default')})")
    print(hoststages.table(results))
    return 0


HOST_WORKLOADS = ("1 question", "12 questions", "255 options")  # issue 13's host profile
HOST_FORMATS = (("PNG", "image/png"), ("JPEG", "image/jpeg"))


def host_requests() -> dict[str, bytes]:
    """The host profile's requests: the 1600×900 screen still as PNG and JPEG, each workload."""
    loads = workloads()
    still = screen_image(*BENCH_SIZE, seed=1)
    out = {}
    for fmt, mime in HOST_FORMATS:
        data = encode(still, fmt)
        for name in HOST_WORKLOADS:
            out[f"{fmt} {name}"] = body(data, mime, loads[name])
    return out
