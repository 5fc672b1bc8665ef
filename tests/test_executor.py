"""The executor on ONNX Runtime (CPU, float32, tiny checkpoint): parity with the float32
reference, invariance to the other questions and their order, repeatability, `omnijev run`."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from bench.parity import compare, without_latency
from bench.workloads import encode, photo_image
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from tests.engine_fixtures import tiny_engines
from tests.spec import ANSWER_FIELDS

PARITY = 1.0001e-4  # the 1e-4 on answers rounded to four decimals: one unit of the last


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


@pytest.fixture(scope="module")
def executor(engines):
    from runtime.executor import load_engine

    export, engine_dir = engines
    return load_engine(str(export), str(engine_dir), "onnxruntime")


@pytest.fixture(scope="module")
def reference(engines):
    from reference.mso1 import Reference

    return Reference(engines[0], dtype="float32", device="cpu")


IMAGES = {
    "pattern.png": (pattern_png(640, 480), "image/png"),
    "photo.jpg": (encode(photo_image(800, 600, 3), "JPEG"), "image/jpeg"),
}


@pytest.mark.parametrize("image_name", sorted(IMAGES))
@pytest.mark.parametrize("questions", ["speed_bench", "gate"])
def test_matches_float32_reference(executor, reference, image_name, questions):
    image, mime = IMAGES[image_name]
    qs = speed_bench_questions(12) if questions == "speed_bench" else gate_questions()
    body = request_body(image, qs, mime)
    ours, theirs = executor.answer(body), reference.answer(body)
    result = compare(theirs, ours)
    assert result["input_tokens_equal"]
    assert max(result["differences"]) <= PARITY, result
    assert not result["flips"]
    assert list(ours["answers"]) == list(qs)


def test_readouts_match_reference_states(executor, reference):
    """Below the rounding: the hidden states and log-probabilities themselves agree."""
    from reference.questions import build_request
    from runtime.contract import compile_request
    from runtime.processing import prepare

    request = compile_request(build_request(pattern_png(320, 224), gate_questions()))
    prepared = prepare(request, executor.tokenizer)
    ours, theirs = executor.readouts(prepared), reference.readouts(prepared)
    for a, b in zip(ours, theirs, strict=True):
        assert np.allclose(a.zq, b.zq, atol=1e-4, rtol=1e-4)
        assert np.allclose(a.u, b.u, atol=1e-4, rtol=1e-4)
        for pa, pb in zip(a.picked, b.picked, strict=True):
            assert np.allclose(pa, pb, atol=1e-4, rtol=1e-5)
        for fa, fb in zip(a.first, b.first, strict=True):
            assert (fa is None) == (fb is None)
            assert fa is None or abs(fa - fb) <= 1e-4


def test_answer_does_not_depend_on_other_questions_or_order(executor):
    executor.prefix.cache.entries.clear()
    executor.prefix.cache.size = 0  # recompute the image prefix for every request
    image, mime = IMAGES["pattern.png"]
    questions = {**speed_bench_questions(12), **gate_questions()}
    together = without_latency(executor.answer(request_body(image, questions, mime)))
    reversed_qs = dict(reversed(list(questions.items())))
    backwards = without_latency(executor.answer(request_body(image, reversed_qs, mime)))
    assert list(backwards) == list(reversed_qs)
    for qid, question in questions.items():
        alone = without_latency(executor.answer(request_body(image, {qid: question}, mime)))
        assert json.dumps(alone[qid]) == json.dumps(together[qid]), qid
        assert json.dumps(backwards[qid]) == json.dumps(together[qid]), qid


def test_repeated_requests_are_identical(executor):
    image, mime = IMAGES["photo.jpg"]
    body = request_body(image, speed_bench_questions(6), mime)
    first = without_latency(executor.answer(body))
    for _ in range(2):
        assert json.dumps(without_latency(executor.answer(body))) == json.dumps(first)


def test_response_shape(executor):
    image, mime = IMAGES["pattern.png"]
    response = executor.answer(request_body(image, speed_bench_questions(3), mime))
    assert list(response) == ["model", "answers", "usage"]
    assert response["model"] == "tinnel123/OmniJev"
    assert response["usage"]["output_tokens"] == 0
    q0, q1, q2 = (response["answers"][q] for q in ("q0", "q1", "q2"))
    assert list(q0) == ANSWER_FIELDS["choice"]
    assert list(q1) == ANSWER_FIELDS["noul"]
    assert list(q2) == ANSWER_FIELDS["score"]
    assert q0["latency_total_s"] > 0


def test_cli_run(engines, tmp_path):
    export, engine_dir = engines
    request = tmp_path / "request.json"
    request.write_bytes(request_body(pattern_png(64, 48), speed_bench_questions(1)))
    command = [
        sys.executable,
        "-m",
        "runtime.cli",
        "run",
        str(request),
        "--checkpoint",
        str(export),
        "--engines",
        str(engine_dir),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "q0" in json.loads(done.stdout)["answers"]
    request.write_text('{"questions": {}}')
    refused = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1
    assert refused.stderr.strip() == "request requires state"


def test_prefix_cache_reuses_the_image_prefix_without_changing_answers(executor):
    from runtime.lru import LRU

    image, mime = IMAGES["photo.jpg"]
    body = request_body(image, speed_bench_questions(3), mime)
    executor.prefix.cache = LRU(0)
    computed = without_latency(executor.answer(body))
    executor.prefix.cache = LRU(2)
    first = without_latency(executor.answer(body))
    second = without_latency(executor.answer(body))
    assert (executor.prefix.cache.misses, executor.prefix.cache.hits) == (1, 1)
    assert json.dumps(first) == json.dumps(computed) == json.dumps(second)
    for size in ((64, 48), (96, 64)):  # two more images evict the first (LRU of 2)
        executor.answer(request_body(pattern_png(*size), speed_bench_questions(1)))
    executor.answer(body)
    assert executor.prefix.cache.misses == 4 and len(executor.prefix.cache.entries) == 2


def test_prefix_keys_of_images_the_device_resizes(executor):
    """prepare(resize=False) keys the image prefix by the encoded image's digest: the same
    request gives the same key, another image another key, and the key is not the one of the
    same image resized on the host (the two kinds never meet in one worker)."""
    from runtime.contract import compile_request
    from runtime.image_prefix import prefix_key
    from runtime.passes import plan
    from runtime.processing import prepare
    from runtime.strict_json import parse_body

    def key(image: bytes, resize: bool) -> str:
        obj = parse_body(request_body(image, speed_bench_questions(1)))
        prepared = prepare(compile_request(obj), executor.tokenizer, pack=False, resize=resize)
        return prefix_key(prepared.image, plan(prepared).prefix)

    first, other = pattern_png(96, 64), pattern_png(64, 48)
    assert key(first, False) == key(first, False)
    assert key(first, False) != key(other, False)
    assert key(first, True) == key(first, True) != key(first, False)


def static_executor(engines):
    """An executor on ONNX Runtime sessions with their shapes fixed."""
    from runtime.backends.ort import OrtBackend
    from runtime.executor import load_engine

    backend = OrtBackend(engines[1], static_shapes=True)
    return load_engine(str(engines[0]), str(engines[1]), "onnxruntime", backend=backend)


def test_static_shape_sessions_give_the_same_answers(engines, executor):
    """`OrtBackend(static_shapes=True)` (on CUDA by default): one session per shape signature
    with its dimensions fixed (the way to CUDA graphs on ONNX Runtime), built in the background
    while the dynamic session answers; the answers must not move when the fixed sessions take
    over."""
    static = static_executor(engines)
    assert static.backend.static
    static.prefix.cache.size = 0  # the image must go through vision again
    image, mime = IMAGES["pattern.png"]
    body = request_body(image, speed_bench_questions(6), mime)
    expected = json.dumps(without_latency(executor.answer(body)))
    assert json.dumps(without_latency(static.answer(body))) == expected  # dynamic meanwhile
    assert static.settle() > 0  # the first sight of each signature started a build
    assert static.backend.stats()["fixed_graphs"] == ["lm_rows", "lm_state"]
    before = static.backend.stats()["fixed_runs"]
    assert json.dumps(without_latency(static.answer(body))) == expected
    assert static.backend.stats()["fixed_runs"] > before  # passes really ran in fixed sessions
    # the image size has now come back: its vision pass gets a fixed session too
    static.settle()
    assert "vision" in static.backend.stats()["fixed_graphs"]
    assert json.dumps(without_latency(static.answer(body))) == expected
    assert static.settle() == 0  # nothing new to build
    assert static.backend.name == "onnxruntime-cpu+static"


def test_a_failed_fixed_shape_build_leaves_the_dynamic_session_answering(
    engines, executor, monkeypatch
):
    static = static_executor(engines)

    def refuse(graph, shapes):
        raise RuntimeError("no memory for another session")

    monkeypatch.setattr(static.backend, "_static_session", refuse)
    image, mime = IMAGES["pattern.png"]
    body = request_body(image, speed_bench_questions(2), mime)
    expected = json.dumps(without_latency(executor.answer(body)))
    assert json.dumps(without_latency(static.answer(body))) == expected
    assert static.settle() > 0 and static.backend.stats()["slots"] == 0
    assert static.backend.stats()["failed_builds"] > 0
    assert json.dumps(without_latency(static.answer(body))) == expected
    assert static.settle() == 0  # failed signatures are not tried again


def test_graph_sessions_replay_under_their_own_ids_while_fixed_ones_build(engines, executor):
    """A dynamic session that took CUDA graphs (the vision graph can) answers under a graph id
    per signature while that signature's fixed-shape session is still being built, never under
    ONNX Runtime's default id (which would replay another shape's graph). On the CPU the ids are
    ignored; the dispatch and the answers are what is checked."""
    static = static_executor(engines)
    static.backend.graphs_on["vision"] = True
    static.prefix.cache.size = 0
    image, mime = IMAGES["pattern.png"]
    body = request_body(image, speed_bench_questions(1), mime)
    expected = json.dumps(without_latency(executor.answer(body)))
    for _ in range(2):  # the second sight of the size starts the vision session's build
        assert json.dumps(without_latency(static.answer(body))) == expected
    # the dynamic vision session's one slot, reused for the size; the fixed sessions of the other
    # passes, built in the background meanwhile, may already hold slots of their own
    dynamic = [key for key in static.backend.slots.slots if key[1][0] == "dynamic"]
    assert static.backend.stats()["dynamic_graphs"] == ["vision"] and len(dynamic) == 1
    static.settle()
    assert json.dumps(without_latency(static.answer(body))) == expected
    assert "vision" in static.backend.stats()["fixed_graphs"]  # now the fixed session's


def test_batched_questions_answer_alike_on_the_cpu(engines, executor):
    """RuntimeConfig.question_batch (rows of a question pass) still computes the same rows; on
    the CPU in float32 the answers agree byte for byte (on the GPU in BF16 they need not: see
    runtime/passes.py)."""
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    image, mime = IMAGES["pattern.png"]
    body = request_body(image, {**speed_bench_questions(6), **gate_questions()}, mime)
    one = json.dumps(without_latency(executor.answer(body)))
    config = RuntimeConfig(backend="onnxruntime", question_batch=2)
    fewer = load_engine(str(engines[0]), str(engines[1]), config, backend=executor.backend)
    assert fewer.pass_shape() == (2,)
    assert json.dumps(without_latency(fewer.answer(body))) == one


def test_patches_made_on_the_device_give_the_same_answers(executor):
    """On a GPU the executor uploads the uint8 resized image and makes the patches there
    (`prepare(pack=False)`); the answers are the host-packed ones, byte for byte."""
    from runtime.contract import compile_request
    from runtime.processing import prepare
    from runtime.strict_json import parse_body

    executor.prefix.cache.clear()
    image, mime = IMAGES["pattern.png"]
    obj = parse_body(request_body(image, speed_bench_questions(3), mime))
    packed = prepare(compile_request(obj), executor.tokenizer, pack=True)
    unpacked = prepare(compile_request(obj), executor.tokenizer, pack=False)
    assert unpacked.image.pixel_values is None
    one = json.dumps(without_latency(executor.execute(packed)))
    executor.prefix.cache.clear()
    assert json.dumps(without_latency(executor.execute(unpacked))) == one
    # and as a GPU executor prepares: the decoded image resized on the device as well
    unresized = prepare(compile_request(obj), executor.tokenizer, pack=False, resize=False)
    assert unresized.image.resized is None
    executor.prefix.cache.clear()
    assert json.dumps(without_latency(executor.execute(unresized))) == one


def test_the_pass_plan_is_made_while_preparing(executor):
    from runtime.passes import plan

    obj = json.loads(request_body(pattern_png(320, 224), speed_bench_questions(3), "image/png"))
    prepared = executor.prepare(obj)
    shape, work = prepared.planned
    (rows,) = shape
    assert shape == executor.pass_shape() == (executor.config.question_batch,)
    assert work.prefix.input_ids.tolist() == plan(prepared, rows).prefix.input_ids.tolist()
    expected = executor.execute(prepared)
    assert executor.work_of(prepared) is work  # the prepared plan serves
    stale = dataclasses.replace(prepared, planned=((rows + 1,), work))
    again = executor.work_of(stale)  # a plan for other question rows is made again
    assert again is not work and again.questions[0].rows.shape == work.questions[0].rows.shape
    assert without_latency(executor.execute(stale)) == without_latency(expected)


def test_the_empty_state_is_made_once_and_stays_empty(executor):
    """Every prefix pass continues one empty state; no pass writes into its sources."""
    empty = executor.runner.empty_state()
    executor.prefix.cache.clear()
    body = request_body(pattern_png(96, 64), speed_bench_questions(3), "image/png")
    executor.answer(body)
    assert executor.runner.empty_state() is empty
    tensors = [*empty.k, *empty.v, *empty.conv, *empty.rec, empty.mask]
    assert all(not t.any() for t in tensors)
