"""The torch backend on the CPU (eager PyTorch, float32, tiny checkpoint): the same graphs, feeds
and outputs as the ONNX files; parity with the float32 reference and invariance to the other
questions, their order and repetition; the attention and readout forms it runs."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import pytest
import torch

from bench.parity import compare, without_latency
from bench.workloads import choice_with, encode, photo_image
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from tests.engine_fixtures import tiny_engines

PARITY = 1.0001e-4  # as tests/test_executor.py: one unit of the answers' fourth decimal


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


@pytest.fixture(scope="module")
def executor(engines):
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine
    from runtime.passes import QUESTION_ROWS

    # questions batched in fixed-row passes, as on the GPU
    config = RuntimeConfig.from_env(backend="torch", question_batch=QUESTION_ROWS)
    return load_engine(str(engines[0]), str(engines[1]), config)


@pytest.fixture(scope="module")
def reference(engines):
    from reference.mso1 import Reference

    return Reference(engines[0], dtype="float32", device="cpu")


def variant(engines, executor, prefix_cache: int = 0, **choices):
    """An executor on `executor`'s backend with other `Choices` (and no prefix cache: every
    request runs its image prefix)."""
    from dataclasses import replace

    from runtime.config import RuntimeConfig

    config = RuntimeConfig(backend="torch", question_batch=16, prefix_cache=prefix_cache)
    made = replace(executor.choices, **choices)
    return load_engine_on(engines, config, executor.backend, made)


def load_engine_on(engines, config, backend, choices):
    from runtime.executor import load_engine

    return load_engine(str(engines[0]), str(engines[1]), config, backend=backend, choices=choices)


class Recording:
    """A backend that records each run's graph and lane and runs it on `backend` (whose lanes
    are its own), declaring `lanes` lanes: the executor's routing, without two CUDA streams."""

    def __init__(self, backend, lanes: int):
        from dataclasses import replace

        self.backend, self.routed = backend, []
        self.capabilities = replace(backend.capabilities, lanes=lanes)

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def run(self, graph, feeds, outputs, lane=0):
        self.routed.append((graph, lane))
        return self.backend.run(graph, feeds, outputs)

    def lane_stream(self, lane: int):
        return None  # the caller's stream: the CPU has one


def test_backend_has_the_onnx_graphs_names_and_dtypes(engines, executor):
    from runtime.backends.ort import OrtBackend

    backend, ort = executor.backend, OrtBackend(engines[1])
    assert backend.name == "torch-cpu+float32"
    assert backend.max_pass_tokens is None
    for graph in ("vision", "lm_state", "lm_rows"):
        assert backend.has_graph(graph)
        assert backend.output_names(graph) == ort.output_names(graph), graph
        assert backend.input_dtypes(graph) == ort.input_dtypes(graph), graph


@pytest.mark.parametrize("questions", ["speed_bench", "gate"])
def test_matches_float32_reference(executor, reference, questions):
    qs = speed_bench_questions(12) if questions == "speed_bench" else gate_questions()
    for image, mime in (
        (pattern_png(640, 480), "image/png"),
        (encode(photo_image(800, 600, 3), "JPEG"), "image/jpeg"),
    ):
        body = request_body(image, qs, mime)
        result = compare(reference.answer(body), executor.answer(body))
        assert result["input_tokens_equal"]
        assert max(result["differences"]) <= PARITY, result
        assert not result["flips"]


def test_a_question_alone_with_a_shared_lead_matches_the_float32_reference(executor, reference):
    """A question with more options than join others runs alone, its text through the leading
    tokens its options share (one option's whole text among them; a Score's levels too, which
    read no text): the reference's answer."""
    from tests.test_passes import SHARED_LEAD

    levels = {
        "type": "score",
        "instructions": "How red?",
        "levels": [f"red {i}" for i in range(40)],
    }
    body = request_body(pattern_png(320, 224), {**SHARED_LEAD, "reds": levels}, "image/png")
    result = compare(reference.answer(body), executor.answer(body))
    assert result["input_tokens_equal"]
    assert max(result["differences"]) <= PARITY, result
    assert not result["flips"]


def test_agrees_with_onnx_runtime_below_the_rounding(engines, executor):
    from reference.questions import build_request
    from runtime.contract import compile_request
    from runtime.executor import load_engine
    from runtime.processing import prepare

    ort = load_engine(str(engines[0]), str(engines[1]), "onnxruntime")
    request = compile_request(build_request(pattern_png(320, 224), gate_questions()))
    prepared = prepare(request, executor.tokenizer)
    for a, b in zip(executor.readouts(prepared), ort.readouts(prepared), strict=True):
        assert np.allclose(a.zq, b.zq, atol=1e-4, rtol=1e-4)
        assert np.allclose(a.u, b.u, atol=1e-4, rtol=1e-4)
        for pa, pb in zip(a.picked, b.picked, strict=True):
            assert np.allclose(pa, pb, atol=1e-4, rtol=1e-5)


def test_answers_do_not_depend_on_other_questions_order_or_repetition(executor):
    executor.prefix.cache.entries.clear()
    executor.prefix.cache.size = 0
    image = pattern_png(320, 224)
    # with a wide question, which runs alone in joint passes of its own (runtime.passes)
    questions = {**speed_bench_questions(12), **gate_questions(), **choice_with(70)}

    def answers(qs: dict) -> dict:
        return without_latency(executor.answer(request_body(image, qs, "image/png")))

    together = answers(questions)
    backwards = answers(dict(reversed(list(questions.items()))))
    assert json.dumps(answers(questions)) == json.dumps(together)
    for qid, question in questions.items():
        alone = answers({qid: question})
        assert json.dumps(alone[qid]) == json.dumps(together[qid]), qid
        assert json.dumps(backwards[qid]) == json.dumps(together[qid]), qid


def test_early_heads_give_the_answers_of_heads_after_every_pass(engines, executor):
    """With two or more joint passes, the questions the earlier passes finish get their heads
    and answers while the later passes run (`Choices.early_heads`, on CUDA): the same answer
    bytes as every question's heads after the last pass, and only the last pass's questions
    left for `respond`."""
    questions = {**speed_bench_questions(12), **gate_questions(), **choice_with(70)}
    body = request_body(pattern_png(320, 224), questions, "image/png")
    with_early = variant(engines, executor, early_heads=True)
    prepared = with_early.prepare(json.loads(body))
    work = prepared.planned[1]
    assert len(work.joint) > 2
    made = with_early.readouts(prepared)
    early = [r.mu is not None for r in made]
    assert [r.fields is not None for r in made] == early  # and their answers but latency
    on = without_latency(with_early.answer(body))
    without = variant(engines, executor, early_heads=False)
    assert not any(r.mu is not None for r in without.readouts(prepared))
    off = without_latency(without.answer(body))
    last = work.joint[-1]
    reads = [*last.question.zq_read, *(qi for qi, _ in last.question.first_read)]
    reads += [qi for qi, _ in last.options.u_read] + [qi for qi, _ in last.options.text_reads]
    finished_last = set(reads)
    assert early == [qi not in finished_last for qi in range(len(questions))]
    assert any(early) and not all(early)
    assert json.dumps(on) == json.dumps(off)


def test_joint_lanes_split_the_bench_passes_and_keep_the_answers(engines, executor):
    """Lanes (`Capabilities.lanes`, two CUDA streams on the GPU): the 12 speed-bench questions'
    joint passes go to both lanes by their options' length, a lane's pass runs on that lane's
    graphs and buffers, and the answers keep their bytes. On the CPU the lanes share the
    caller's stream: this checks the executor's routing, the H200 the concurrency."""
    from dataclasses import replace

    from runtime.run_passes import Choices, lane_of

    body = request_body(pattern_png(320, 224), speed_bench_questions(12), "image/png")
    one_lane = variant(engines, executor, early_heads=True)
    prepared = one_lane.prepare(json.loads(body))
    work = prepared.planned[1]
    assert executor.choices.lanes == 1  # one lane on the CPU
    assert one_lane.early_heads_on(work)  # two joint passes, one lane
    one = without_latency(one_lane.answer(body))
    recording = Recording(executor.backend, lanes=2)
    choices = replace(Choices.of(recording.capabilities), early_heads=True)
    assert choices.lanes == 2
    two = load_engine_on(engines, one_lane.config, recording, choices)
    lanes = [lane_of(jp, 2) for jp in work.joint]
    assert set(lanes) == {0, 1}
    assert not two.early_heads_on(work)  # passes in two lanes end together
    for jp, lane in zip(work.joint, lanes, strict=True):
        assert lane == (jp.options.rows.shape[1] > 8)
    assert json.dumps(without_latency(two.answer(body))) == json.dumps(one)
    assert [lane for graph, lane in recording.routed if graph == "lm_joint"] == lanes
    with pytest.raises(ValueError, match="lm_rows has no lane 1"):
        executor.backend.run("lm_rows", {}, {}, lane=1)


def test_joint_passes_give_the_readouts_of_separate_passes(engines, executor):
    """A question pass and its option passes run as joint passes (one product per layer over
    both): every readout is the separate passes' (float32 on the CPU, within its rounding)."""
    from tests.test_passes import SHARED_LEAD

    # the wide ones join alone, their texts through their options' shared leading tokens
    questions = {**gate_questions(), **choice_with(70), **SHARED_LEAD}
    request = json.loads(request_body(pattern_png(320, 224), questions, "image/png"))
    prepared = executor.prepare(request)
    assert executor.choices.joint and prepared.planned[1].joint
    for wide in (len(questions) - 2, len(questions) - 1):
        assert any(jp.question.members == [wide] for jp in prepared.planned[1].joint)
        assert any(jp.question.open_read for jp in prepared.planned[1].joint)
    joint = executor.readouts(prepared)
    separate = variant(engines, executor, prefix_cache=8, joint=False).readouts(prepared)
    for a, b in zip(joint, separate, strict=True):
        assert np.allclose(a.zq, b.zq, atol=1e-5, rtol=0)
        assert np.allclose(a.u, b.u, atol=1e-5, rtol=0)
        assert [f is None for f in a.first] == [f is None for f in b.first]
        for fa, fb in zip(a.first, b.first, strict=True):
            assert fa is None or abs(fa - fb) <= 1e-5
        for pa, pb in zip(a.picked, b.picked, strict=True):
            assert pa.shape == pb.shape and np.allclose(pa, pb, atol=1e-5, rtol=0)


def test_a_pass_that_reads_nothing_runs_no_readout(engines, executor, monkeypatch):
    """The image prefix reads no row: its pass runs without the readout (a 128-row piece over
    the whole vocabulary), every other pass with it, and the answers stay the same bytes as
    where the backend runs every readout."""
    from dataclasses import replace

    body = request_body(pattern_png(320, 224), gate_questions(), "image/png")
    fresh = variant(engines, executor)
    prepared = fresh.prepare(json.loads(body))
    backend, reads = executor.backend, []
    plain = backend.read

    def read(flat, feeds, outputs, joint):
        reads.append(tuple(feeds["input_ids"].shape))
        return plain(flat, feeds, outputs, joint)

    monkeypatch.setattr(backend, "read", read)
    skipped = fresh.readouts(prepared)
    work = prepared.planned[1]
    passes = len(work.joint) + len(work.questions) + len(work.options)
    assert len(reads) == passes and work.prefix.shape not in reads
    every = Recording(backend, lanes=1)
    every.capabilities = replace(backend.capabilities, optional_readouts=False)
    reading = load_engine_on(engines, fresh.config, every, fresh.choices)
    reads.clear()
    kept = reading.readouts(prepared)
    assert reads[0] == work.prefix.shape and len(reads) == passes + 1
    for a, b in zip(skipped, kept, strict=True):
        assert np.array_equal(a.zq, b.zq) and np.array_equal(a.u, b.u)
        assert all(np.array_equal(x, y) for x, y in zip(a.picked, b.picked, strict=True))


@pytest.mark.parametrize("duck", [False, True])
def test_joint_blocks_are_one_graph_whatever_the_rows(executor, duck):
    """With `invariant_compilation` (no duck sizing) each joint block traces to one graph for
    every request's row counts, so a question's rows never run in a graph of their own
    because of the other questions (on the GPU each graph picks its own reduction
    configurations, and with them a row's bytes); with duck sizing the same requests make more
    graphs."""
    import torch.fx.experimental._config as shapes

    from runtime.backends.compiled import invariant_compilation
    from runtime.model.language import JOINT_BLOCKS, joint_body

    invariant_compilation()
    graphs: dict[str, int] = {}

    def counted(name: str):
        def backend(gm, example_inputs):
            graphs[name] = graphs.get(name, 0) + 1
            return gm.forward

        return torch.compile(JOINT_BLOCKS[name], dynamic=True, backend=backend)

    backend = executor.backend
    kept = backend.functions
    joint = {name: counted(name) for name in JOINT_BLOCKS}
    backend.functions = {**kept, "lm_joint": partial(joint_body, backend.language, blocks=joint)}
    image = pattern_png(96, 64)
    bodies = [
        json.dumps(executor.warm_up_request()).encode(),
        *(request_body(image, speed_bench_questions(n), "image/png") for n in (3, 12)),
    ]
    if duck:  # the control: two requests already make more graphs (half a minute less)
        bodies = bodies[:2]
    try:
        with shapes.patch(use_duck_shape=duck):
            for body in bodies:
                executor.execute(executor.prepare(json.loads(body)))
    finally:
        backend.functions = kept
    assert set(graphs) == set(JOINT_BLOCKS)
    if duck:
        assert sum(graphs.values()) > len(JOINT_BLOCKS), graphs
    else:
        assert graphs == dict.fromkeys(JOINT_BLOCKS, 1)


@pytest.mark.parametrize("p, own", [(7, 6), (8, 16), (1, 641)])
def test_folded_attention_is_grouped_attention(p, own):
    """Also where folded_attention pads the keys to KEY_ALIGN (7 and 6 keys; the prefix pass's
    1 + 641) and where it does not."""
    from runtime.model.language import folded_attention, grouped_attention

    generator = torch.Generator().manual_seed(0)
    b, heads, kv_heads, t, hd = 3, 4, 2, 5, 8

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    q, shared_k, shared_v = (
        draw(b, heads, t, hd),
        draw(1, kv_heads, p, hd),
        draw(1, kv_heads, p, hd),
    )
    keys, values = draw(b, kv_heads, own, hd), draw(b, kv_heads, own, hd)
    # the rows' past and their own keys, as mix gives them
    rows = (keys[:, :, : own - t], values[:, :, : own - t], keys[:, :, -t:], values[:, :, -t:])
    mask = torch.rand(b, t, p + own, generator=generator) > 0.3
    prefixes = torch.zeros(b, dtype=torch.int64)
    expected = grouped_attention(q, shared_k, shared_v, prefixes, *rows, mask, 0.3)
    got = folded_attention(q, shared_k, shared_v, prefixes, *rows, mask, 0.3)
    assert torch.allclose(got, expected, atol=1e-6)
    # fitted passes: the products over min_tokens // T rows, the same attention
    fitted = folded_attention(q, shared_k, shared_v, prefixes, *rows, mask, 0.3, min_tokens=8 * t)
    assert fitted.shape == got.shape and torch.allclose(fitted, got, atol=1e-6)


def test_a_row_floor_pads_the_product_and_gives_the_rows_their_bytes():
    from runtime.backends.compiled import FLOOR_CANDIDATES, row_floor
    from runtime.model.layers import product

    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(24, 40, generator=generator)
    x = torch.randn(3, 5, 40, generator=generator)
    plain = product(x, weight)
    padded = product(x, weight, {(24, 40): 64})
    assert padded.shape == plain.shape == (3, 5, 24)
    assert torch.allclose(padded, plain, atol=1e-5)
    floor = row_floor(weight, 64)
    assert floor in FLOOR_CANDIDATES
    rows = torch.randn(64, 40, generator=generator)
    floors = {(24, 40): floor}
    full = product(rows, weight, floors)
    assert all(torch.equal(product(rows[:m], weight, floors), full[:m]) for m in (8, 16, 56))


def test_floors_in_an_op_give_the_padded_product_bytes_in_one_graph():
    """The row floor's padding inside `floored_linear` gives the bytes of the product over
    zero rows appended up to the floor, and a compiled block over row counts on both sides of
    the floor traces once, with no size comparison for a cached graph to guard on."""
    import torch.nn.functional as F

    from runtime.model import layers

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(24, 40, generator=generator)
    floors = {(24, 40): 64}
    counts = (8, 16, 56, 64, 72, 128)
    xs = [torch.randn(m, 40, generator=generator) for m in counts]
    in_graph = [F.linear(F.pad(x, (0, 0, 0, max(64 - len(x), 0))), weight)[: len(x)] for x in xs]
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda x: layers.product(x, weight, floors), dynamic=True,
                             backend=backend)  # fmt: skip
    for x, want in zip(xs, in_graph, strict=True):
        assert torch.equal(layers.product(x, weight, floors), want)
        assert torch.equal(compiled(x), want)
    assert len(graphs) == 1
    assert "floored_linear" in str(graphs[0].graph) and "max" not in str(graphs[0].graph)


def test_an_export_unlike_its_hashes_is_refused_though_it_loads_beside_the_hashing(
    engines, tmp_path
):
    """The export's files hash on a thread while the backend loads them: a shard whose bytes
    changed (still a readable safetensors file) loads, and the executor is refused all the
    same, naming the file."""
    import shutil

    from runtime.config import RuntimeConfig
    from runtime.executor import Executor
    from runtime.export_format import ExportError

    export = tmp_path / "export"
    shutil.copytree(engines[0], export)
    shard = sorted(export.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor's data
    shard.write_bytes(bytes(data))
    config = RuntimeConfig.from_env(backend="torch")
    with pytest.raises(ExportError, match=f"export output {shard.name} does not match its SHA"):
        Executor(export, engines[1], config)
    shard.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    assert set(Executor(export, engines[1], config).load_seconds) == {
        "export check",
        "tokenizer and heads",
        "engine check",
        "backend",
        "hash wait",
    }


def test_the_cpu_engine_fits_its_passes_to_the_request(engines, executor):
    """The CPU engine's products pass the row check, so its passes are sized to the request;
    the invariance test above then runs fitted passes of every row count."""
    from runtime.backends.compiled import product_weights
    from runtime.passes import MIN_FITTED_ROWS, QUESTION_ROWS, plan

    backend = executor.backend
    assert backend.rows_fit and executor.pass_shape() == (QUESTION_ROWS, True)
    assert backend.capabilities.rows_fit and backend.capabilities.joint
    assert set(backend.row_floors) == {tuple(w.shape) for w in product_weights(backend.language)}
    prepared = executor.prepare(
        json.loads(request_body(pattern_png(64, 64), speed_bench_questions(1), "image/png"))
    )
    # the CPU's floors hold up to a joint pass's rows: the option passes run with the question
    work = prepared.planned[1]
    assert executor.choices.joint and work.joined and work.questions == work.options == []
    assert {jp.question.rows.shape[0] for jp in work.joint} == {MIN_FITTED_ROWS}
    options = len(prepared.layouts[0].opens)
    fitted = sum(jp.options.rows.shape[0] for jp in work.joint)
    assert fitted < 2 * max(options, MIN_FITTED_ROWS)
    apart = plan(prepared, *executor.pass_shape())
    assert [qp.rows.shape[0] for qp in apart.questions] == [MIN_FITTED_ROWS]
    # without joint passes, a 2-row question pass lends its states into buffers of the
    # question passes' row count, so that its option passes' sources (and CUDA graphs) do not
    # follow the questions asked
    variant(engines, executor, joint=False).execute(prepared)
    sources = {key[1][0] for key in backend.buffers if key[0].startswith("src_rec.")}
    assert sources == {QUESTION_ROWS}  # on the CPU only the lent buffers are kept
    # unfitted: the buckets' fixed row counts again
    fixed = variant(engines, executor, fit=False, joint=False)
    assert fixed.pass_shape() == (QUESTION_ROWS, False)
    plan_fixed = fixed.plan_of(prepared)[1]
    assert [qp.rows.shape[0] for qp in plan_fixed.questions] == [QUESTION_ROWS]


def test_readout_pieces_match_the_plugin_arithmetic():
    from plugins.readout import token_logprobs_std
    from runtime.backends.compiled import logprob_piece, padded_table

    generator = torch.Generator().manual_seed(1)
    embedding = torch.randn(301, 16, generator=generator)
    rows = torch.randn(8, 16, generator=generator)
    tokens = torch.randint(0, 301, (8,), generator=generator)
    table = padded_table(embedding)
    assert table.shape[0] % 64 == 0 and torch.equal(table[:301], embedding)
    got = logprob_piece(rows, table, tokens, vocab=301)
    assert torch.allclose(got, token_logprobs_std(rows, embedding, tokens), atol=1e-6)


def test_the_readout_reads_a_row_once_for_all_its_targets(executor):
    """`readout` with `slots` (each row once, targets naming their row) gives every target the
    bytes it has with the row repeated for each, across pieces (4 rows a piece here)."""
    backend = executor.backend
    generator = torch.Generator().manual_seed(2)
    flat = torch.randn(40, backend.table.shape[1], generator=generator)
    slots = torch.tensor([0, 0, 5, 1, 0, 5, 2, 3, 4, 4, 0, 6, 1])  # 7 rows over two pieces
    rows = torch.tensor([3, 9, 11, 17, 20, 33, 39])
    tokens = torch.randint(0, backend.vocab, (len(slots),), generator=generator)
    once = backend.readout(flat, rows, tokens, slots, piece=4)
    repeated = backend.readout(flat, rows[slots], tokens, piece=4)
    assert once.dtype == torch.float32 and torch.equal(once, repeated)


def test_artifacts_made_with_other_versions_are_refused(tmp_path, monkeypatch):
    from runtime.backends.compiled import check_artifacts, versions

    assert check_artifacts(tmp_path) is None
    made = {**versions(), "torch": "0.0.1"}
    (tmp_path / "engines.json").write_text(
        json.dumps({"torch": {"dir": "torch", "versions": made}})
    )
    with pytest.raises(RuntimeError, match="made with torch 0.0.1"):
        check_artifacts(tmp_path)
    record = {"dir": "torch", "versions": versions(), "sha256": "ab" * 32}
    (tmp_path / "engines.json").write_text(json.dumps({"torch": record}))
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "entry").write_text("compiled")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "home"))
    # this process compiles into a copy: the engine directory stays as its manifest records it
    private = check_artifacts(tmp_path)
    assert private == tmp_path / "home" / "omnijev" / "torch-caches" / ("ab" * 16)
    assert (private / "entry").read_text() == "compiled"
    (private / "new").write_text("a cache miss")
    assert not (tmp_path / "torch" / "new").exists()
    assert check_artifacts(tmp_path) == private  # copied once per tree digest


def test_compiled_layer_blocks_answer_as_the_eager_modules(engines):
    """The GPU's compiled form (vision whole, the passes one decoder layer at a time through
    `BLOCKS`, dynamic shapes) compiled by Inductor for the CPU: the same answers as eager."""
    from runtime.backends.compiled import TorchBackend
    from runtime.config import RuntimeConfig
    from runtime.executor import load_engine

    config = RuntimeConfig.from_env(backend="torch", question_batch=16, prefix_cache=0)
    executor = load_engine(str(engines[0]), str(engines[1]), config)
    body = request_body(pattern_png(320, 224), speed_bench_questions(3), "image/png")
    eager = executor.answer(body)
    backend = executor.backend
    backend.compiled = True
    backend.functions = TorchBackend.make_functions(backend)
    assert backend.functions["lm_rows"].keywords["blocks"]["delta"] is not None
    report = compare(eager, executor.answer(body))
    assert report["input_tokens_equal"] and not report["flips"]
    assert len(report["differences"]) == 3
    assert max(report["differences"]) <= PARITY


def test_torch_artifacts_record_versions_and_where_a_start_spends(engines, tmp_path):
    """`omnijev engines --torch-artifacts` on the CPU (nothing compiles there, the record is the
    same): the versions and hash the backend checks at load, the load and warm-up seconds."""
    from build_engines.engines import build_torch_artifacts
    from runtime.backends.compiled import check_artifacts, versions

    body = request_body(pattern_png(64, 48), speed_bench_questions(2), "image/png")
    record = build_torch_artifacts(engines[0], tmp_path, "float32", [body])
    assert record["versions"] == versions() and len(record["sha256"]) == 64
    assert len(record["warm_up_seconds"]) == 2  # the built-in request, then the one given
    assert 0 < record["load_seconds"] <= record["seconds"]
    assert json.loads((tmp_path / "engines.json").read_text())["torch"] == record
    assert check_artifacts(tmp_path) is not None


def test_fla_cumsum_autotuners_keyed_by_batch_size_get_one_configuration(monkeypatch):
    """pin_fla_cumsum on a stand-in for fla's module (fla needs a GPU): the autotuners whose key
    names the batch size, under triton.heuristics or not, keep their first configuration; the
    others keep all."""
    import sys
    import types

    from runtime.backends.compiled import pin_fla_cumsum

    def tuner(keys):
        return types.SimpleNamespace(configs=["one warp", "two", "four"], keys=keys)

    by_batch, plain, other = tuner(["B", "H", "BT"]), tuner(["B", "H"]), tuner(["H", "BT"])
    module = types.ModuleType("fla.ops.utils.cumsum")
    module.scalar_kernel = types.SimpleNamespace(fn=by_batch)  # as under triton.heuristics
    module.vector_kernel = plain
    module.other_kernel = other
    package = types.ModuleType("fla.ops.utils")
    package.cumsum = module
    for name, value in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("ops"))):
        monkeypatch.setitem(sys.modules, name, value)
    monkeypatch.setitem(sys.modules, "fla.ops.utils", package)
    monkeypatch.setitem(sys.modules, "fla.ops.utils.cumsum", module)
    pin_fla_cumsum()
    assert by_batch.configs == ["one warp"] and plain.configs == ["one warp"]
    assert other.configs == ["one warp", "two", "four"]


def test_torch_passes_leave_the_empty_state_empty(executor):
    empty = executor.runner.empty_state()
    executor.answer(request_body(pattern_png(96, 64), speed_bench_questions(3), "image/png"))
    assert executor.runner.empty_state() is empty
    assert all(not t.any() for t in [*empty.k, *empty.v, *empty.conv, *empty.rec, empty.mask])


def test_the_image_graph_answers_as_the_host_packed_pixels(executor):
    """The GPU's preparation leaves the decoded image whole (`prepare(pack=False, resize=False)`)
    and the `image` graph resizes and packs it ahead of the tower: the same features, so the same
    readouts, as the host's resize and patches through `vision`."""
    from runtime.constants import IMAGE_GRAPH
    from runtime.contract import compile_request
    from runtime.processing import prepare

    body = json.loads(request_body(pattern_png(333, 217), speed_bench_questions(3), "image/png"))
    host = prepare(compile_request(body), executor.tokenizer)
    whole = prepare(compile_request(body), executor.tokenizer, pack=False, resize=False)
    assert whole.image.pixel_values is None and whole.image.resized is None
    assert executor.prefix.vision_graph(host.image) == "vision"
    assert executor.prefix.vision_graph(whole.image) == IMAGE_GRAPH
    with torch.inference_mode():
        assert torch.equal(executor.prefix.vision(whole.image), executor.prefix.vision(host.image))
    for a, b in zip(executor.readouts(whole), executor.readouts(host), strict=True):
        assert np.array_equal(a.zq, b.zq) and np.array_equal(a.u, b.u)
        assert all(np.array_equal(x, y) for x, y in zip(a.picked, b.picked, strict=True))


@pytest.fixture(scope="module")
def on_device(engines, executor):
    """The engine with the heads' large products on its device (here the CPU), and the MLPs
    behind the passes."""
    return variant(engines, executor, device_heads=True, mlps_behind=True)


def test_heads_on_the_engines_device_give_the_same_answers(executor, on_device):
    """`Choices.device_heads` (on CUDA): the heads' large products where the engine runs
    (here the CPU, the same code as on CUDA), the same answers byte for byte as the host's."""
    assert executor.heads.device_mlps is None  # off by default on the CPU
    assert on_device.heads.device_mlps is not None
    body = request_body(
        pattern_png(320, 224), {**speed_bench_questions(6), **gate_questions()}, "image/png"
    )
    assert json.dumps(without_latency(on_device.answer(body))) == json.dumps(
        without_latency(executor.answer(body))
    )


@pytest.mark.parametrize("early", [False, True])
def test_mlps_behind_the_passes_give_the_heads_own_answers(engines, on_device, early, monkeypatch):
    """The heads' MLPs enqueued behind the passes (`mlps_behind`, on with device heads): every
    question the last passes finish brings its MLP outputs with its readouts, the heads make
    none of them again, and the answers are those of the MLPs run by the heads, byte for byte;
    with early heads too (the questions finished early keep the heads' own trip)."""
    executor = variant(engines, on_device, early_heads=early)
    assert executor.heads.device_mlps.behind_usable
    questions = {**speed_bench_questions(12), **gate_questions(), **choice_with(70)}
    body = request_body(pattern_png(320, 224), questions, "image/png")
    prepared = executor.prepare(json.loads(body))
    made = executor.readouts(prepared)
    late = [r.mu is None for r in made]
    assert [r.mlps is not None for r in made] == late and all(late) != early
    trips = []
    mlps = executor.heads.device_mlps
    run = mlps.run  # the executor's own MLPs: the heads' trips pass through this instance
    monkeypatch.setattr(mlps, "run", lambda *a: trips.append(a) or run(*a))
    behind = without_latency(executor.answer(body))
    # the heads' own trips are the early questions' only
    assert sum(len(rest) for rest, _ in trips) == late.count(False)
    apart = variant(engines, on_device, early_heads=early, mlps_behind=False)
    assert not any(r.mlps is not None for r in apart.readouts(prepared))
    assert json.dumps(without_latency(apart.answer(body))) == json.dumps(behind)


def test_prefixes_padded_to_the_longest_keep_answers_and_batches(engines, executor):
    """`Choices.fixed_prefix_keys` (where the torch backend captures a graph per shape): a
    small image's prefix is padded with masked keys to the longest prefix's, its answers move
    by rounding at most, and requests about images of other sizes, whose prefixes now have one
    length, batch with each request's bytes alone."""
    from runtime.batch import same_readouts
    from runtime.passes import longest_prefix
    from runtime.run_passes import Stopwatch

    padded = variant(engines, executor, fixed_prefix_keys=True)
    plain = variant(engines, executor)
    small, large = pattern_png(320, 224), photo_image(900, 700, 0)
    bodies = [
        request_body(small, speed_bench_questions(6), "image/png"),
        request_body(encode(large, "PNG"), {**gate_questions(), **choice_with(9)}, "image/png"),
    ]
    prepared = [padded.prepare(json.loads(body)) for body in bodies]
    work = padded.work_of(prepared[0])
    prefix, _ = padded.image_state(prepared[0], Stopwatch({}))
    keys = longest_prefix(work.prefix_length, prepared[0].image.image_tokens)
    assert prefix.mask.shape[1] == keys > work.prefix.input_ids.shape[1]
    assert int(prefix.mask.sum()) == work.prefix_length
    for body in bodies:
        ours, theirs = padded.answer(body), plain.answer(body)
        report = compare(theirs, ours)
        assert not report["flips"] and max(report["differences"]) <= 1e-5
    alone = [padded.readouts(p) for p in prepared]
    together = padded.readouts_batch(prepared)
    assert all(map(same_readouts, alone, together))


class FirstShapesOnly:
    """The torch backend as a GPU one is after its warm-up: passes of the shapes it has run
    are built, a new shape is not (`Backend.built`); the shapes noted for later are kept."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.ran: set[tuple] = set()
        self.later: list[tuple] = []

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    @staticmethod
    def shape(feeds: dict) -> tuple:
        return tuple(tuple(t.shape) for name, t in sorted(feeds.items()) if "input_ids" in name)

    def built(self, graph: str, feeds: dict, lane: int = 0) -> bool:
        return self.shape(feeds) in self.ran

    def build_later(self, graph: str, feeds: dict, lane: int = 0) -> None:
        self.later.append(self.shape(feeds))

    def run(self, graph: str, feeds: dict, outputs: dict, lane: int = 0) -> None:
        self.ran.add(self.shape(feeds))
        self.backend.run(graph, feeds, outputs, lane)


def test_a_joint_pass_of_a_shape_not_built_runs_in_a_built_larger_one(engines, executor):
    """`PassRunner.run_joint`: a joint pass whose shape is not built runs in a built one of the
    same lengths and more rows, with every readout byte it has in its own shape, and its own
    shape is noted to build when the worker is idle."""
    from runtime.passes import larger_joints
    from runtime.run_passes import PassRunner, Stopwatch

    padded = variant(engines, executor, fixed_prefix_keys=True)
    body = request_body(pattern_png(320, 224), speed_bench_questions(3), "image/png")
    prepared = padded.prepare(json.loads(body))
    jp = padded.work_of(prepared).joint[0]
    bigger = larger_joints(jp)[-1]  # the most rows
    states = padded.image_state(prepared, Stopwatch({}))
    own = [{k: v.clone() for k, v in out.items()} for out in padded.runner.run_joint(jp, *states)]
    runner = padded.runner
    backend = FirstShapesOnly(padded.backend)
    runner = PassRunner(backend, runner.dims, runner.image_token, runner.question_rows)
    runner.run_joint(bigger, *states)  # "built" by a first request
    assert backend.ran == {FirstShapesOnly.shape(runner.joint_feeds(bigger, *states)[0])}
    got = runner.run_joint(jp, *states)
    assert backend.ran == {FirstShapesOnly.shape(runner.joint_feeds(bigger, *states)[0])}
    assert backend.later == [FirstShapesOnly.shape(runner.joint_feeds(jp, *states)[0])]
    for theirs, mine in zip(got, own, strict=True):
        assert all(torch.equal(theirs[name], mine[name]) for name in mine)


def test_a_noted_shape_is_built_on_stand_in_feeds_when_idle(engines, executor):
    """`build_later` notes a joint pass's shape once, `build_pending` builds one noted shape a
    call on stand-in feeds (here the CPU's one run: nothing is captured) and says whether any
    is left; the executor's `build_pending` is the worker's idle step."""
    from runtime.constants import JOINT_GRAPH
    from runtime.passes import larger_joints
    from runtime.run_passes import Stopwatch

    padded = variant(engines, executor, fixed_prefix_keys=True)
    backend = padded.backend
    prepared = padded.prepare(
        json.loads(request_body(pattern_png(320, 224), speed_bench_questions(3), "image/png"))
    )
    jp = padded.work_of(prepared).joint[0]
    states = padded.image_state(prepared, Stopwatch({}))
    assert backend.built(JOINT_GRAPH, padded.runner.joint_feeds(jp, *states)[0])  # the CPU's
    for shape in (jp, *larger_joints(jp)[:1], jp):
        backend.build_later(JOINT_GRAPH, padded.runner.joint_feeds(shape, *states)[0])
    assert len(backend.pending) == 2
    before = backend.slots[JOINT_GRAPH].stats()["builds"]
    assert padded.build_pending() is True
    assert padded.build_pending() is False and not backend.pending
    assert padded.build_pending() is False
    assert backend.slots[JOINT_GRAPH].stats()["builds"] == before + 2


def test_the_common_joint_shapes_are_noted_for_building_before_ready(engines, executor):
    """`Executor.note_buckets`: the largest fitted joint pass of each common pair of lengths,
    noted where the backend has not built it (none on the CPU, where nothing is built per
    shape); each serves every joint pass of its lengths (`larger_joints`)."""
    from runtime.config import RuntimeConfig
    from runtime.passes import BUCKET_OPTIONS, BUCKET_TEXTS, bucket_joints, larger_joints

    assert executor.note_buckets() == 0
    wrapped = FirstShapesOnly(executor.backend)
    config = RuntimeConfig(backend="torch", question_batch=16, prefix_cache=0)
    noting = load_engine_on(
        engines, config, wrapped, replace_choices(executor, fixed_prefix_keys=True)
    )
    assert noting.note_buckets() == len(BUCKET_TEXTS) * len(BUCKET_OPTIONS) == len(wrapped.later)
    joints = bucket_joints(16)
    assert [(jp.question.rows.shape, jp.options.rows.shape) for jp in joints][:4] == [
        ((16, 16), (32, 8)),
        ((16, 16), (16, 16)),
        ((16, 16), (8, 24)),
        ((16, 16), (8, 32)),
    ]
    assert all(larger_joints(jp) == [] for jp in joints)  # none larger: each is its lengths' top


def replace_choices(executor, **choices):
    from dataclasses import replace

    return replace(executor.choices, **choices)
