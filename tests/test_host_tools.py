"""The host profile (`python -m tools.hostprofile`) and the closed-loop load generator
(`python -m tools.loadtest`) run: a small request through every stage, a stub HTTP worker."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tools import hoststages as hostprofile
from tools import loadtest

STUB_SECONDS = 0.005  # the stub worker's answer time


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(STUB_SECONDS)
        status = 200 if self.headers.get("Content-Type") == "application/json" else 415
        body = json.dumps({"ok": True}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_loadtest_counts_closed_loop_answers(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"
        report = loadtest.run_load(url, b"{}", clients=2, seconds=0.5, warm_up=0.1)
    finally:
        server.shutdown()
    assert report["statuses"] == {"200": report["ok"]} and report["ok"] > 10
    # two clients, ~5 ms an answer: at most 2 / 5 ms, and closed-loop, so not far below
    assert 20 < report["requests_per_s"] <= 2 / STUB_SECONDS
    assert report["latency_ms"]["p50"] >= 1e3 * STUB_SECONDS
    assert "requests/s" in loadtest.summary(report)


def test_host_profile_times_every_stage():
    from runtime.finish import Calibration
    from runtime.tokenizer import load_tokenizer
    from tools.bench import body, encode, pattern_image

    request = body(
        encode(pattern_image(96, 64), "PNG"),
        "image/png",
        {"q": {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}}},
    )
    heads, tokenizer = hostprofile.synthetic_heads(hidden=64), load_tokenizer(None)
    device = hostprofile.device_for("cpu")
    times: dict[str, list[float]] = {}
    hostprofile.profile_once(request, tokenizer, heads, Calibration.v11(), device, times)
    assert set(hostprofile.STAGES) <= set(times)
    assert all(len(times[stage]) == 1 for stage in hostprofile.STAGES)
    total = hostprofile.total_once(request, tokenizer, heads, Calibration.v11(), device)
    assert 0 < total < 10
    row = {stage: 1.0 for stage in (*hostprofile.STAGES, "sum of stages", "host total")}
    assert "| host total | 1.00 |" in hostprofile.table({"PNG": row})


def test_host_profile_makes_early_heads_as_the_executor_does():
    """The early-heads total (`early`): the torch backend's plan, the heads and answers of the
    questions every joint pass but the last finishes made before the clock resumes, their mu
    the same bytes as those of every question's heads at once."""
    from reference.questions import speed_bench_questions
    from runtime.contract import compile_request
    from runtime.finish import Calibration
    from runtime.heads import questions_mu
    from runtime.processing import prepare
    from runtime.strict_json import parse_body
    from runtime.tokenizer import load_tokenizer
    from tools.bench import body, encode, pattern_image

    request = body(encode(pattern_image(96, 64), "PNG"), "image/png", speed_bench_questions(12))
    heads, tokenizer = hostprofile.synthetic_heads(hidden=64), load_tokenizer(None)
    prepared = prepare(compile_request(parse_body(request)), tokenizer)
    work = hostprofile.gpu_plan(prepared)
    assert len(work.joint) == 2 and not work.questions  # the bench's 12: options of 8 and 24
    readouts = hostprofile.synthetic_readouts(prepared, heads.hidden)
    calibration = Calibration.v11()
    assert hostprofile.early_heads(prepared, work, heads, readouts, calibration) > 0
    early = [qi for qi, r in enumerate(readouts) if r.mu is not None]
    assert early == [qi for qi, r in enumerate(readouts) if r.fields is not None]
    last = work.joint[-1]
    late = {*last.question.zq_read, *(qi for qi, _ in last.question.first_read)}
    late |= {qi for op in last.parts for qi, _ in (*op.u_read, *op.text_reads)}
    assert early == [qi for qi in range(12) if qi not in late] and 0 < len(early) < 12
    fresh = hostprofile.synthetic_readouts(prepared, heads.hidden)
    together = questions_mu(
        heads, [(q.type, r) for q, r in zip(prepared.questions, fresh, strict=True)]
    )
    assert all(readouts[qi].mu.tobytes() == together[qi].tobytes() for qi in early)
    seconds: list[float] = []
    device = hostprofile.device_for("cpu")
    total = hostprofile.total_once(request, tokenizer, heads, calibration, device, False, seconds)
    assert 0 < total < 10 and len(seconds) == 1 and seconds[0] > 0


def test_host_profile_keeps_every_run():
    """`profile` gives the medians the table prints and, under EVERY_RUN, every run's time."""
    from tools.bench import body, encode, pattern_image

    request = body(
        encode(pattern_image(96, 64), "PNG"),
        "image/png",
        {"q": {"type": "noul", "instructions": "A dialog is visible."}},
    )
    heads = hostprofile.synthetic_heads(hidden=64)
    row = hostprofile.profile({"PNG": request}, heads=heads, runs=3, device="cpu")["PNG"]
    runs = row[hostprofile.EVERY_RUN]
    assert len(runs[hostprofile.HOST_TOTAL]) == 3 and len(runs["decode"]) == 3
    median = sorted(runs[hostprofile.HOST_TOTAL])[1]  # of three runs, rounded to 1 µs
    assert abs(row[hostprofile.HOST_TOTAL] - median) < 1e-3
    assert "| host total |" in hostprofile.table({"PNG": row})


def test_median_ms_times_runs_after_warm_calls():
    from tools.bench import median_ms

    calls = []
    assert median_ms(lambda: calls.append(1), runs=5, warm=2) >= 0.0
    assert len(calls) == 7


def test_trace_stages_splits_kernels_at_syncs_and_shows_the_host_gap(tmp_path):
    """scripts/trace_stages.py on a written Chrome trace: kernels go to the stage whose sync
    ended after them, and a long gap (the host launching late) is named."""
    import gzip
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "trace_stages.py"
    spec = importlib.util.spec_from_file_location("trace_stages", path)
    stages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stages)

    def kernel(name: str, ts: float, dur: float) -> dict:
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}

    events = [
        kernel("a", 0, 10), kernel("b", 10.4, 10),
        {"ph": "X", "name": "cudaDeviceSynchronize", "ts": 15, "dur": 10},
        kernel("c", 30, 5), kernel("late", 535, 5), kernel("d", 540.4, 5),
        {"ph": "X", "name": "cudaDeviceSynchronize", "ts": 540, "dur": 10},
    ]  # fmt: skip
    trace = tmp_path / "trace.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    split = stages.stage_kernels(stages.load(str(trace)), ["vision", "options"])
    assert [(s, [k["name"] for k in ks]) for s, ks in split] == [
        ("vision", ["a", "b"]), ("options", ["c", "late", "d"]),
    ]  # fmt: skip
    text = "\n".join(stages.describe(*split[1]))
    assert "idle 0.50 ms" in text and "gap   0.500 ms before late" in text
    assert "gap" not in "\n".join(stages.describe(*split[0])).split("\n", 1)[1]
