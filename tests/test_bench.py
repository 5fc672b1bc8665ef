"""The measurement tooling runs: the host stages through the runtime's own preparation, the
closed-loop load driver against a stub HTTP worker, and `python -m bench.gpu latency --tiny` on
the CPU end to end."""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from bench import hostprofile, hoststages, load
from bench.latency import median_ms
from bench.workloads import body, encode, pattern_image
from tests.checkpoint_fixtures import copy_export
from tests.engine_fixtures import tiny_engines

ROOT = Path(__file__).resolve().parents[1]

STUB_SECONDS = 0.005  # the stub worker's answer time


class Stub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(STUB_SECONDS)
        status = 200 if self.headers.get("Content-Type") == "application/json" else 415
        answer = json.dumps({"ok": True}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def small_request(questions: dict) -> bytes:
    return body(encode(pattern_image(96, 64), "PNG"), "image/png", questions)


def test_load_driver_sends_every_request_once_and_keeps_each_latency():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"
        report = load.run_load(url, [b"{}"] * 40, clients=2)
    finally:
        server.shutdown()
    assert report["statuses"] == {"200": 40} and report["ok"] == 40
    assert [r["index"] for r in report["records"]] == list(range(40))
    # two clients, ~5 ms an answer: at most 2 / 5 ms, and closed-loop, so not far below
    assert 20 < report["requests_per_s"] <= 2 / STUB_SECONDS
    latency = report["latency_ms"]
    assert 1e3 * STUB_SECONDS <= latency["p50"] <= latency["p90"] <= latency["p99"]
    assert latency["p99"] <= latency["max"] == max(r["latency_ms"] for r in report["records"])
    assert report["server_ms_per_request"] is None  # the stub has no /metrics
    assert report["requests_per_batch"] is None
    assert "| 2 | 40 | 40 |" in load.table([report])


class Busy(BaseHTTPRequestHandler):
    """Answers every other POST 503 with Retry-After 0, as a worker with every slot taken."""

    posts = 0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        Busy.posts += 1
        status = 503 if Busy.posts % 2 else 200
        self.send_response(status)
        self.send_header("Content-Length", "2")
        if status == 503:
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


def test_load_driver_retries_a_busy_answer_after_its_retry_after():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/systemone"
        once = load.run_load(url, [b"{}"] * 10, clients=1)
        retried = load.run_load(url, [b"{}"] * 10, clients=1, retries=3)
    finally:
        server.shutdown()
    assert once["statuses"] == {"200": 5, "503": 5} and once["retries"] == 0
    assert retried["statuses"] == {"200": 10} and retried["retries"] == 10


def test_load_driver_refuses_bad_options_with_a_message(capsys):
    for argv, message in (
        (["--questions", "17"], "--questions must be 1 to 16, got 17"),
        (["--image-size", "big"], "--image-size wants WIDTHxHEIGHT"),
        (["--suite", "bench", "--questions", "5"], "the bench has 1, 3, 6 or 12 questions"),
        (["--clip-frames", "17"], "--clip-frames must be 0 to 16, got 17"),
        (["--clip-frames", "4", "--clip-share", "2"], "--clip-share must be 0 to 1, got 2.0"),
    ):
        with pytest.raises(SystemExit):
            load.parse_args(argv)
        assert message in capsys.readouterr().err


def test_host_profile_times_every_stage_and_keeps_every_run():
    choice = {"type": "choice", "instructions": "Which?", "criteria": {"a": None, "b": None}}
    request = small_request({"q": choice})
    heads = hoststages.synthetic_heads(hidden=64)
    row = hoststages.profile({"PNG": request}, runs=3, heads=heads)["PNG"]
    runs = row[hoststages.EVERY_RUN]
    assert all(len(runs[stage]) == 3 for stage in (*hoststages.STAGES, hoststages.HOST_TOTAL))
    median = statistics.median(runs[hoststages.HOST_TOTAL])  # of three runs, rounded to 1 µs
    assert abs(row[hoststages.HOST_TOTAL] - median) < 1e-3
    # the stages and the total are timed in separate passes of the request, so a busy machine
    # may order them either way: each is a real, bounded time (a short stage may round to 0)
    assert all(0 <= t < 10_000 for stage in runs for t in runs[stage])
    assert min(runs["prepare"]) > 0 and min(runs[hoststages.HOST_TOTAL]) > 0
    assert "| host total |" in hoststages.table({"PNG": row})


def test_host_profile_names_an_unknown_request(capsys):
    with pytest.raises(SystemExit):
        hostprofile.main(["--only", "GIF 1 question", "--python-defaults"])
    assert "unknown request 'GIF 1 question'" in capsys.readouterr().err


def test_median_ms_times_runs_after_warm_calls():
    calls = []
    assert median_ms(lambda: calls.append(1), runs=5, warm=2) >= 0.0
    assert len(calls) == 7


def test_gpu_latency_runs_on_the_cpu_with_the_tiny_model(export_dir, tmp_path):
    """`python -m bench.gpu latency --tiny`: the bench workload through the torch backend on the
    CPU, every run kept, the host stages through the executor's own preparation."""
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    copy_export(export_dir, work / "tiny-export")
    command = [sys.executable, "-m", "bench.gpu", "latency", "--tiny", "--runs", "2"]
    command += ["--workload", "1 question", "--work", str(work), "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| 1 question |" in done.stdout and "| host total |" in done.stdout
    record = json.loads((out / "latency.json").read_text())
    [row] = record["rows"]
    assert row["workload"] == "1 question" and len(row["runs_ms"]) == 2
    assert row["median_ms"] == pytest.approx(statistics.median(row["runs_ms"]), abs=1e-2)
    assert set(record["host_stages_ms"]) == {"PNG 1 question", "JPEG 1 question"}
    assert record["environment"]["command"][1] == "latency"
    manifest = json.loads((work / "engines-tiny-float32" / "engines.json").read_text())
    assert manifest["dtype"] == "float32" and "torch" not in manifest  # no caches on the CPU


def test_load_driver_finds_answers_that_differ_between_runs():
    def answered(values: list[float]) -> dict:
        records = []
        for index, value in enumerate(values):
            response = {"answers": {"q": {"noul": value, "latency_total_s": index * 0.1}}}
            digest = load.answers_digest(json.dumps(response).encode())
            records.append({"index": index, "status": 200, "answers": digest})
        return {"records": records}

    assert load.answers_digest(b"not json") is None
    alone, batched = answered([0.25, 0.5, 0.75]), answered([0.25, 0.5001, 0.75])
    assert load.differing_answers([alone, answered([0.25, 0.5, 0.75])]) == []
    assert load.differing_answers([alone, batched]) == [1]


@pytest.fixture(scope="module")
def executor(tmp_path_factory):
    from runtime.executor import load_engine

    checkpoint, engines = tiny_engines(tmp_path_factory)
    return load_engine(str(checkpoint), str(engines), "onnxruntime")


def test_the_unseen_sizes_measurement_times_first_and_warm_requests(executor):
    """`bench.gpu sizes` on the CPU: each size's first request and its warm runs are timed,
    with the shape builds the first made (none on the CPU: nothing is captured there)."""
    from bench.sizes import UNSEEN, sizes, table

    record = sizes(executor, 0, 1, count=2, runs=2)
    assert [r["size"] for r in record["rows"]] == [list(s) for s in UNSEEN[:2]]
    for row in record["rows"]:
        assert row["questions"] == 1 and len(row["warm_ms"]) == 2
        assert row["ratio"] == pytest.approx(row["first_ms"] / statistics.median(row["warm_ms"]))
        assert row["builds"] == 0
        assert row["plan"]["questions"] == 1 and row["plan"]["passes"] >= 1
    assert record["fit"] is None  # two requests do not fit three terms
    assert "| 1080×2400 |" in table(record)


def test_a_sizes_record_is_planned_again_and_its_times_fitted(executor):
    """`bench.gpu plans --times`: a sizes record's requests made again and planned; the warm
    times fitted on passes and slots; a record of other requests is refused."""
    from bench import traffic
    from bench.sizes import FIT_TERMS, UNSEEN, replanned, table
    from runtime.packing import PACK_SIZES

    rows = []
    for size in UNSEEN[:5]:
        made = traffic.request(0, UNSEEN.index(size), "held-out", 2, size=size)
        rows.append(
            {"size": list(size), "format": made.format, "questions": 2, "first_ms": 9.0,
             "builds": 0, "build_s": 0.0, "warm_ms": [5.0], "ratio": 1.8}
        )  # fmt: skip
    for mine, theirs in zip(rows, replanned(executor, {"rows": rows}, 0, 2)["rows"], strict=True):
        plan = theirs["plan"]
        assert 0 < plan["tokens"] <= plan["slots"] and set(plan["sizes"]) <= set(PACK_SIZES)
        mine["warm_ms"] = [10.0 + 4.0 * plan["passes"] + 3.0 * plan["slots"] / 1e3]
    record = replanned(executor, {"rows": rows}, 0, 2)
    # times that follow the plans exactly are fitted exactly
    assert set(FIT_TERMS) <= set(record["fit"])
    assert max(map(abs, record["fit"]["residual_ms"])) < 1e-6
    assert "warm ≈ " in table(record)
    with pytest.raises(ValueError, match="not the record's"):
        replanned(executor, {"rows": rows}, 0, 3)


def test_the_plan_statistics_count_passes_filled_slots_and_packed_sizes(executor):
    """`bench.gpu plans`: each suite request's packed passes fill their slots at most, every
    pass is of a PACK_SIZES size, and the summary adds them up."""
    from bench.plans import plans, table
    from runtime.packing import PACK_SIZES

    record = plans(executor, 0, 12)
    rows = record["requests"]
    assert len(rows) == 12
    for row in rows:
        assert 0 < row["tokens"] <= row["slots"] == sum(row["sizes"])
        assert row["passes"] == len(row["sizes"]) >= 1 and set(row["sizes"]) <= set(PACK_SIZES)
        assert 0 < row["tflop_tokens"] <= row["tflop_slots"]
    summary = record["summary"]
    assert summary["passes_max"] == max(r["passes"] for r in rows)
    assert 0 < summary["filled"] <= 1
    assert summary["filled"] == sum(r["tokens"] for r in rows) / sum(r["slots"] for r in rows)
    assert sum(summary["sizes"].values()) == sum(r["passes"] for r in rows)
    twelve = plans(executor, 0, 2, questions=12)["summary"]
    assert twelve["requests_12_questions"] == 2 and 0 < twelve["filled_12_questions"] <= 1
    assert "| packed size | passes |" in table(record)


def test_the_servers_cuda_memory_is_read_from_its_metrics():
    """`bench.gpu serve` records the worker's CUDA memory from /metrics beside nvidia-smi's."""
    from bench.gpu import cuda_memory

    text = (
        "# HELP omnijev_cuda_memory_bytes CUDA device memory held by torch\n"
        'omnijev_cuda_memory_bytes{kind="allocated"} 1.5e+10\n'
        'omnijev_cuda_memory_bytes{kind="reserved"} 2.25e+10\n'
        "omnijev_admitted_requests 0.0\n"
    )
    assert cuda_memory(text) == {"torch_allocated_bytes": 1.5e10, "torch_reserved_bytes": 2.25e10}
    assert cuda_memory("omnijev_admitted_requests 0.0\n") == {}


def test_a_malformed_sizes_record_is_named_not_traced(tmp_path, capsys):
    """`plans --times` given a file that is no sizes record says which and why, exit 2."""
    from bench.gpu import parse_args
    from bench.sizes import read_record

    files = {
        "bad.json": ("{", "Expecting"),
        "rowless.json": ('{"rows": []}', "no sizes record"),
        "other.json": ('{"rows": [{"size": [1, 1], "format": "PNG"}]}', "row 0 is not a row"),
    }
    for name, (text, said) in files.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=said):
            read_record(tmp_path / name)
    with pytest.raises(ValueError, match="No such file"):
        read_record(tmp_path / "missing.json")
    with pytest.raises(SystemExit) as exited:
        parse_args(["plans", "--times", str(tmp_path / "other.json")])
    assert exited.value.code == 2
    assert "--times: " in capsys.readouterr().err


def test_the_product_count_is_the_4b_modules_linear_weights():
    """`bench.plans.token_products` counts what the 4b's own modules multiply: each layer's and
    block's linear weights, built on the meta device from the preset's config."""
    import torch

    from bench.plans import MERGE, token_products
    from build_engines.presets import config_kwargs
    from runtime.model.language import DecoderLayer
    from runtime.model.vision import VisionTower

    def linear_weights(module: torch.nn.Module) -> int:
        return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))

    config = config_kwargs("4b")
    tc, vc = config["text_config"], config["vision_config"]
    with torch.device("meta"):
        text = sum(linear_weights(DecoderLayer(tc, kind, "torch")) for kind in tc["layer_types"])
        tower = VisionTower(vc)
    blocks = linear_weights(tower.blocks)
    patch = tower.patch_embed.proj.weight.numel() + blocks
    assert token_products() == (text, patch, linear_weights(tower.merger))
    assert MERGE == vc["spatial_merge_size"] ** 2


def test_the_kernel_profile_sums_each_requests_device_time_by_family(tmp_path_factory):
    """`bench.kernels` on the CPU (operators' own time): each request profiled has its time,
    its families summing to it, its longest kernels in order, and its products' rate from the
    4b count; a kernel's family follows its name. Two of its three requests: the 255-option
    one takes 30 s of the CPU profiler's recording here."""
    from bench.kernels import TOP, family, kernel_profile, requests, table
    from runtime.executor import load_engine

    checkpoint, engines = tiny_engines(tmp_path_factory)
    executor = load_engine(str(checkpoint), str(engines), "torch")
    bodies = requests(0)
    assert set(bodies) == {"q1-png", "q12-jpeg", "o255"}
    record = kernel_profile(executor, {k: bodies[k] for k in ("q1-png", "q12-jpeg")}, runs=1)
    assert set(record) == {"q1-png", "q12-jpeg"}
    for made in record.values():
        assert made["device_ms"] > 0
        assert abs(sum(made["families_ms"].values()) - made["device_ms"]) < 0.01
        assert made["families_ms"]["products"] > 0 and made["products_tflop_per_s"] > 0
        times = [k["ms"] for k in made["top"]]
        assert times == sorted(times, reverse=True) and 0 < len(times) <= TOP
    assert record["q12-jpeg"]["products_tflop"] > record["q1-png"]["products_tflop"]
    assert "| kernel | ms | family |" in table(record)
    named = ["sm90_xmma_gemm_bf16", "nvjet_tst_128x256", "flash_fwd_kernel", "chunk_fwd_kernel_o"]
    assert [family(n) for n in named] == ["products", "products", "attention", "recurrence"]
    assert family("triton_poi_fused_add_0") == "other"


def test_the_kernel_profile_of_another_tree_runs_its_runtime_in_a_process_of_its_own(
    tmp_path_factory, tmp_path, monkeypatch
):
    """`bench.kernels --tree`: the requests profiled by a process importing the given tree's
    runtime (here a copy of this one's, which a marker in the copy proves was the one loaded),
    paths given relative to here; no products counted there. One request of the three, for
    time: the CPU profiler records every operator."""
    import shutil

    from bench import kernels

    one = {"q1-png": kernels.requests(0)["q1-png"]}
    monkeypatch.setattr(kernels, "requests", lambda seed: one)

    checkpoint, engines = tiny_engines(tmp_path_factory)
    tree = tmp_path / "tree"
    caches = shutil.ignore_patterns("__pycache__")
    for package in ("runtime", "reference", "build_engines", "plugins"):
        shutil.copytree(ROOT / package, tree / package, ignore=caches)
    loaded = tmp_path / "loaded"
    marker = f"\nopen({str(loaded)!r}, 'w').write(__file__)\n"
    with (tree / "runtime" / "executor.py").open("a") as module:
        module.write(marker)
    out = tmp_path / "record.json"
    relative = [Path(os.path.relpath(p)) for p in (checkpoint, engines)]
    args = ["--checkpoint", str(relative[0]), "--engines", str(relative[1]), "--runs", "1"]
    assert kernels.main([*args, "--tree", str(tree), "--out", str(out)]) == 0
    assert loaded.read_text() == str(tree / "runtime" / "executor.py")
    made = json.loads(out.read_text())["q1-png"]
    assert made["device_ms"] > 0 and made["families_ms"]["products"] > 0
    assert "products_tflop" not in made


def test_the_bench_serves_the_engine_to_closed_loop_clients_over_http(tmp_path_factory):
    """`omnijev bench`'s clients (`bench.clients`): the worker serves the engine on a loopback
    port, every suite request is answered at each client count, and the answers are compared
    byte for byte across the counts."""
    from bench.clients import client_runs
    from runtime.executor import load_engine

    checkpoint, engines = tiny_engines(tmp_path_factory)
    executor = load_engine(str(checkpoint), str(engines), "torch")
    record = client_runs(executor, (1, 4), requests=8)
    assert [run["clients"] for run in record["runs"]] == [1, 4]
    for run in record["runs"]:
        assert run["ok"] == run["requests"] == 8 and run["requests_per_s"] > 0
        assert "records" not in run
    assert record["answers_differing"] == []


@pytest.mark.parametrize(("text", "counts"), [("1,4,16", (1, 4, 16)), ("0", ()), ("2", (2,))])
def test_the_bench_client_counts_parse(text, counts):
    import argparse

    from runtime.cli import client_counts

    assert client_counts(text) == counts
    for bad in ("a", "1,-4", "0,4"):
        with pytest.raises(argparse.ArgumentTypeError, match="client counts"):
            client_counts(bad)


def test_parity_refuses_a_bad_image_count_with_a_message():
    result = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "parity", "--checkpoint", "c", "--engines", "e",
         "--more-images", "-2"],
        capture_output=True, text=True, cwd=ROOT, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and "the image count is at least 0, got -2" in result.stderr
    assert "Traceback" not in result.stderr


def test_the_admission_bench_serves_every_request_at_each_limit_and_client_count(
    tmp_path_factory, capsys
):
    """`python -m bench.admission`: the worker admitting each limit in turn, every request
    served at each client count (a refused one retried after its Retry-After); a row each."""
    from bench import admission

    checkpoint, engines = tiny_engines(tmp_path_factory)
    out = tmp_path_factory.mktemp("admission") / "admission.json"
    argv = ["--checkpoint", str(checkpoint), "--engines", str(engines), "--backend", "torch"]
    argv += ["--admitted", "1,8", "--clients", "1,4", "--requests", "6", "--image-size", "160x120"]
    assert admission.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["admitted"], r["clients"]) for r in rows] == [(1, 1), (1, 4), (8, 1), (8, 4)]
    assert all(r["ok"] == r["requests"] == 6 for r in rows)
    assert rows[0]["retries"] == 0 and rows[1]["retries"] > 0  # 4 clients, 1 admitted
    assert capsys.readouterr().out.count("| 8 | 4 | 6/6 |") == 1
    with pytest.raises(SystemExit):
        admission.main([*argv[:4], "--admitted", "0,16"])


def test_parity_adds_seeded_stills_and_counts_which_side_lies_nearer_float32():
    from PIL import Image

    from bench.parity import Remembered, paired
    from bench.workloads import parity_images

    images = parity_images(3)
    assert [name for name, _, _ in images[:4]] == [name for name, _, _ in parity_images()]
    assert len({name for name, _, _ in images}) == len({data for _, data, _ in images}) == 7
    for name, data, mime in images[4:]:
        with Image.open(io.BytesIO(data)) as image:
            assert image.format.lower() in mime and image.size[0] >= 720, name

    class Counting:
        calls = 0

        def answer(self, body: bytes) -> dict:
            Counting.calls += 1
            return {"body": body.decode()}

    remembered = Remembered(Counting())
    assert remembered.answer(b"a") == remembered.answer(b"a") == {"body": "a"}
    assert remembered.answer(b"b") == {"body": "b"} and Counting.calls == 2

    engine = {"runs": [{"differences": [0.1, 0.2]}, {"differences": [0.0]}]}
    low = {"runs": [{"differences": [0.3, 0.1]}, {"differences": [0.0]}]}
    assert paired(engine, low) == {"answers": 3, "engine_nearer": 1, "reference_nearer": 1}


DELTA_STEP_CHECK = """
from pathlib import Path
import torch
from bench import delta_step
from runtime.model.packed_kernels import packed_gated_delta

other = delta_step.other_module(Path("runtime/model/packed_kernels.py"))
for name, spec in delta_step.PACKS.items():
    size, table, texts, text_tokens, options, option_tokens = spec
    inputs = delta_step.pack(spec, "cpu", (2, 4, 16, 16))
    rows = inputs[6]
    texts_at = [i for i in range(table) if rows.length[i] > 0 and rows.parent[i] < 0]
    options_at = [i for i in range(table) if rows.parent[i] >= 0]
    assert len(texts_at) == texts and len(options_at) == texts * options, name
    assert all(int(rows.parent[i]) in texts_at for i in options_at), name
    assert int(rows.length.sum()) == texts * (text_tokens + options * option_tokens) <= size
    if name == "1 question":  # the interpreter is slow: one pack through both kernels
        ours, theirs = packed_gated_delta(*inputs), other.packed_gated_delta(*inputs)
        assert torch.equal(ours, theirs) and ours.abs().max() > 0
print("ok")
"""


def test_delta_step_packs_and_loads_another_kernel_file():
    """`bench.delta_step` (the GPU's check of a change to the packed recurrence): its packs
    hold the text and option rows they name, and another file's kernels load under other op
    names beside this tree's and run (this tree's own file: the same bytes), on the CPU."""
    from tests.interpreted import run_interpreted

    assert run_interpreted(DELTA_STEP_CHECK)[-1] == "ok"
