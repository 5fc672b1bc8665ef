"""`omnijev parity`: agreement of the engine's answers with the float32 reference.

Follows the validation method of `recipe/omnijev/validate.py` (docs/contract.md §11) over the
parity stills and question sets of `bench.workloads`; prints a table last.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench.workloads import body, parity_images, quantile, question_sets
from runtime.config import RuntimeConfig


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


class Remembered:
    """A reference that answers each body once: its answers serve every comparison after."""

    def __init__(self, reference):
        self.reference, self.answers = reference, {}

    def answer(self, body: bytes) -> dict:
        if body not in self.answers:
            self.answers[body] = self.reference.answer(body)
        return self.answers[body]


def parity(executor, reference, sets: dict[str, dict[str, dict]], more: int = 0) -> dict:
    """`executor`'s answers against `reference`'s (anything with `answer(body) -> dict`) on
    every parity still (`more`: seeded stills beside the four) and question set: the
    differences' quantiles and every flip."""
    results, differences, flips, token_mismatches = [], [], [], 0
    images, started = parity_images(more), time.perf_counter()
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


def paired(engine: dict, low: dict) -> dict:
    """Answer by answer, whether the engine or the BF16 reference lies nearer the float32 one
    (the two `parity` reports of the same requests): near equal shares say the engine's larger
    distance is chance, a lopsided one that it has a cause."""
    ours = [d for run in engine["runs"] for d in run["differences"]]
    theirs = [d for run in low["runs"] for d in run["differences"]]
    return {
        "answers": len(ours),
        "engine_nearer": sum(a < b for a, b in zip(ours, theirs, strict=True)),
        "reference_nearer": sum(a > b for a, b in zip(ours, theirs, strict=True)),
    }


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


def cli_parity(args) -> int:
    from reference.mso1 import Reference
    from runtime.executor import load_engine

    executor = load_engine(args.checkpoint, args.engines, RuntimeConfig.from_args(args))
    reference = Remembered(Reference(args.checkpoint, dtype="float32", device=args.device))
    report = parity(executor, reference, question_sets(), args.more_images)
    if args.bf16_reference:
        # the bar for a BF16 engine: how far the reference itself moves in BF16
        low = Reference(args.checkpoint, dtype="bfloat16", device=args.device)
        report["bf16_reference"] = parity(low, reference, question_sets(), args.more_images)
        report["paired"] = paired(report, report["bf16_reference"])
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(parity_table(report))
    if args.bf16_reference:
        print("the BF16 reference against the float32 one:")
        print(parity_table(report["bf16_reference"]))
        pairs = report["paired"]
        print(
            f"answer by answer: the engine nearer float32 in {pairs['engine_nearer']} of "
            f"{pairs['answers']}, the BF16 reference in {pairs['reference_nearer']}"
        )
    return 0
