"""The torch backend on the CPU (eager PyTorch, float32, tiny checkpoint): the same graphs, feeds
and outputs as the ONNX files; parity with the float32 reference and invariance to the other
questions, their order and repetition; the packed passes' readouts and the attention and readout
forms it runs."""

from __future__ import annotations

import json

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

    # packed passes, as on the GPU (question_batch is the portable engines' only)
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
    """A backend that records each run's graph and runs it on `backend`, with capabilities of
    its own to change."""

    def __init__(self, backend):
        self.backend, self.routed = backend, []
        self.capabilities = backend.capabilities

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def run(self, graph, feeds, outputs):
        self.routed.append(graph)
        return self.backend.run(graph, feeds, outputs)


def test_backend_has_the_onnx_graphs_names_and_dtypes(engines, executor):
    """`vision` and `lm_state` (the image prefix) as the ONNX files; `lm_packed` for the rest."""
    from runtime.backends.ort import OrtBackend
    from runtime.constants import PACKED_GRAPH

    backend, ort = executor.backend, OrtBackend(engines[1])
    assert backend.name == "torch-cpu+float32"
    assert backend.max_pass_tokens is None
    assert backend.has_graph(PACKED_GRAPH) and not backend.has_graph("lm_rows")
    assert backend.output_names(PACKED_GRAPH) == ["hidden", "logprobs"]
    for graph in ("vision", "lm_state"):
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


# a Choice whose option texts all begin "a red", one of them nothing more
SHARED_LEAD = {
    "lead": {
        "type": "choice",
        "instructions": "Which object is it?",
        "options": [{"key": "plain", "text": "a red"}]
        + [{"key": f"k{i}", "text": f"a red {w}"} for i, w in enumerate(
            ["dog", "cat", "car", "box", "cup", "hat", "pen", "bag", "bed", "bus", "fan",
             "jar", "key", "map", "mug", "net", "pot", "rug", "saw", "toy", "van", "wig",
             "bat", "bow", "can", "fig", "gem", "hen", "ink", "jet", "kit", "lid", "log"]
        )],
    }
}  # fmt: skip


def test_a_question_whose_options_share_a_lead_matches_the_float32_reference(executor, reference):
    """Options sharing their leading tokens (one option's whole text among them), beside a
    Score of 40 levels (which read no text): the reference's answers."""
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
    # with a wide question, whose rows fill most of a packed pass (runtime.packing)
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

    def read(flat, feeds, outputs):
        reads.append(tuple(feeds["input_ids"].shape))
        return plain(flat, feeds, outputs)

    monkeypatch.setattr(backend, "read", read)
    skipped = fresh.readouts(prepared)
    work = prepared.planned[1]
    passes = len(work.passes)
    assert len(reads) == passes and work.prefix.shape not in reads
    every = Recording(backend)
    every.capabilities = replace(backend.capabilities, optional_readouts=False)
    reading = load_engine_on(engines, fresh.config, every, fresh.choices)
    reads.clear()
    kept = reading.readouts(prepared)
    assert reads[0] == work.prefix.shape and len(reads) == passes + 1
    for a, b in zip(skipped, kept, strict=True):
        assert np.array_equal(a.zq, b.zq) and np.array_equal(a.u, b.u)
        assert all(np.array_equal(x, y) for x, y in zip(a.picked, b.picked, strict=True))


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


def test_the_torch_engine_packs_its_passes(executor):
    """The torch backend runs packed passes (`Capabilities.packed`): its plan is the packing
    planner's, each pass of a PACK_SIZES size, whatever `question_batch` says."""
    from runtime.packing import PACK_SIZES, PackedPlan, plan

    assert executor.backend.capabilities.packed and executor.pass_shape() == ("packed",)
    prepared = executor.prepare(
        json.loads(request_body(pattern_png(64, 64), speed_bench_questions(3), "image/png"))
    )
    work = executor.work_of(prepared)
    assert isinstance(work, PackedPlan) and prepared.planned[0] == ("packed",)
    assert [p.size for p in work.passes] == [p.size for p in plan(prepared).passes]
    assert all(p.size in PACK_SIZES and 0 < p.used <= p.size for p in work.passes)
    assert executor.build_shapes() == 0  # nothing is captured on the CPU


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
    bytes it has with the row repeated for each, across pieces (READOUT_PIECE rows a piece)."""
    from runtime.backends.compiled import READOUT_PIECE

    backend = executor.backend
    generator = torch.Generator().manual_seed(2)
    count = READOUT_PIECE + 7  # rows over two pieces
    flat = torch.randn(count + 40, backend.table.shape[1], generator=generator)
    rows = torch.randperm(count + 40, generator=generator)[:count].sort().values
    slots = torch.randint(0, count, (2 * count,), generator=generator)
    tokens = torch.randint(0, backend.vocab, (len(slots),), generator=generator)
    once = backend.readout(flat, rows, tokens, slots)
    repeated = backend.readout(flat, rows[slots], tokens)
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
    from runtime.constants import PACKED_GRAPH
    from runtime.executor import load_engine

    config = RuntimeConfig.from_env(backend="torch", question_batch=16, prefix_cache=0)
    executor = load_engine(str(engines[0]), str(engines[1]), config)
    body = request_body(pattern_png(320, 224), speed_bench_questions(3), "image/png")
    eager = executor.answer(body)
    backend = executor.backend
    backend.compiled = True
    backend.functions = TorchBackend.make_functions(backend)
    assert backend.functions[PACKED_GRAPH].keywords["blocks"]["delta"] is not None
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


def test_torch_passes_leave_the_empty_state_empty(executor):
    empty = executor.runner.empty_state()
    executor.answer(request_body(pattern_png(96, 64), speed_bench_questions(3), "image/png"))
    assert executor.runner.empty_state() is empty
    assert all(not t.any() for t in [*empty.k, *empty.v, *empty.conv, *empty.rec, empty.mask])


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


def test_mlps_behind_the_passes_give_the_heads_own_answers(engines, on_device, monkeypatch):
    """The heads' MLPs enqueued behind the passes (`mlps_behind`, on with device heads): every
    question brings its MLP outputs with its readouts, the heads make none of them again, and
    the answers are those of the MLPs run by the heads, byte for byte."""
    executor = variant(engines, on_device)
    assert executor.heads.device_mlps.behind_usable
    questions = {**speed_bench_questions(12), **gate_questions(), **choice_with(70)}
    body = request_body(pattern_png(320, 224), questions, "image/png")
    prepared = executor.prepare(json.loads(body))
    made = executor.readouts(prepared)
    assert all(r.mlps is not None for r in made)
    trips = []
    mlps = executor.heads.device_mlps
    run = mlps.run  # the executor's own MLPs: the heads' trips pass through this instance
    monkeypatch.setattr(mlps, "run", lambda *a: trips.append(a) or run(*a))
    behind = without_latency(executor.answer(body))
    assert sum(len(rest) for rest, _ in trips) == 0  # the heads make no MLP trip of their own
    apart = variant(engines, on_device, mlps_behind=False)
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


def test_a_clip_reads_its_prefix_alone_at_a_clips_keys(engines, executor):
    """With fixed keys a clip's prefix runs in steps of CLIP_PREFIX_STEP and is padded to
    CLIP_PREFIX keys, read from a pass of one prefix and never merged; its answers move by
    rounding at most against the unpadded run."""
    from bench.clips import clip, video_url
    from runtime.images import CLIP_PREFIX
    from runtime.passes import CLIP_PREFIX_STEP
    from runtime.run_passes import Stopwatch
    from tests.video_clips import video_body

    padded = variant(engines, executor, fixed_prefix_keys=True)
    plain = variant(engines, executor)
    data, mime = clip(6, 96, 64, fps=3, seed=5)
    body = video_body({"video": video_url(data, mime)}, gate_questions())
    prepared = padded.prepare(json.loads(body))
    work = padded.work_of(prepared)
    assert work.prefix.input_ids.shape[1] == CLIP_PREFIX_STEP
    prefix, _ = padded.image_state(prepared, Stopwatch({}))
    assert prefix.mask.shape[1] == CLIP_PREFIX and int(prefix.mask.sum()) == work.prefix_length
    assert padded.batch_key(prepared)[0] is None and padded.prefix_slots(1) == 1
    report = compare(plain.answer(body), padded.answer(body))
    assert not report["flips"] and max(report["differences"]) <= 1e-5


@pytest.mark.parametrize("grid", [(1, 4, 6), (1, 48, 86), (3, 8, 10), (1, 2, 400)])
def test_the_vision_tables_blended_on_the_device_are_the_hosts(engines, executor, grid):
    """The position embeddings a new image size needs, blended where the tower runs, have the
    bytes of `vision_inputs`' on the host (the same float32 products and sums, in order)."""
    from runtime.image_prefix import vision_pos_embed
    from runtime.model.vision import vision_inputs

    made = executor.prefix.vision_tables(grid)
    host = vision_inputs(grid, vision_pos_embed(engines[0]), executor.prefix.model_config)
    for name, tensor in made.items():
        theirs = torch.from_numpy(host[name]).to(tensor.dtype)
        assert tensor.cpu().float().numpy().tobytes() == theirs.float().numpy().tobytes(), name


def test_a_smaller_prefix_stack_goes_into_the_first_rows_of_the_wider_graphs_buffers(executor):
    """Where a packed graph reading GRAPH_PREFIXES image prefixes is built, a pass of fewer runs
    it with its prefixes in the first rows of that graph's input buffers (no padded stack, no
    copy into the graph's own); where none is built (a clip's pass), its feeds stay as given."""
    from runtime.backends.compiled import GRAPH_PREFIXES, PACKED_GRAPH
    from runtime.backends.graphs import Slot

    backend = executor.backend
    body = {
        "input_ids": torch.zeros(8, dtype=torch.int64),
        "prefix_k.0": torch.randn(1, 2, 5, 4),
        "prefix_mask": torch.ones(1, 5, dtype=torch.bool),
        "src_rec.0": torch.randn(1, 2, 4, 4),
    }
    assert backend.stacked_in_place(body) is body  # no wider graph built
    wide = {
        n: (GRAPH_PREFIXES, *t.shape[1:]) if n != "input_ids" else t.shape for n, t in body.items()
    }
    key = (PACKED_GRAPH, *((n, tuple(wide[n]), t.dtype) for n, t in body.items()))
    slots = backend.slots[PACKED_GRAPH]
    slots.install(key, Slot(inputs={}, outputs={}))
    try:
        placed = backend.stacked_in_place(body)
        assert placed["input_ids"] is body["input_ids"]
        for name in ("prefix_k.0", "prefix_mask", "src_rec.0"):
            buffer = backend.state_buffer(name, wide[name], body[name].dtype)
            assert placed[name] is buffer and torch.equal(buffer[:1], body[name])
    finally:
        slots.slots.entries.pop(key)
