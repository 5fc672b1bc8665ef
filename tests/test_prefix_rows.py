"""Several image prefixes in one pass (`prefix_rows`): a row's bytes are those it gets in the
same-shaped pass holding its own prefix alone, through ONNX Runtime on the CPU (tiny checkpoint,
float32), the attention forms, and the Triton kernel in Triton's interpreter (chunked, one
program a row, several rows a program)."""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from runtime.passes import OptionPass, Pass, QuestionPass, empty_pass, fill_row
from runtime.run_passes import Dims, PassRunner, State, slice_pass, stack_prefixes
from tests.engine_fixtures import tiny_engines
from tests.interpreted import run_interpreted

PREFIX_TOKENS = 8  # both prefixes' bucket; A holds 7 valid tokens, B 5
PREFIX_LENGTHS = (7, 5)
QUESTION_ROWS = [0, 1, 0, 1]  # the prefix each question row continues
OPTION_SOURCES = [0, 1, 2, 3, 1, 2]  # the question row each option row continues


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


def runner_of(backend, export) -> PassRunner:
    from runtime.model.weights import read_config

    config = read_config(export)
    return PassRunner(backend, Dims.from_config(config), config["image_token_id"])


def token_pass(lengths: list[int], width: int, starts: list[int], seed: int) -> Pass:
    """Rows of random text tokens (no image token), each at positions from its start."""
    rng = np.random.default_rng(seed)
    p = empty_pass(len(lengths), width)
    for row, (n, start) in enumerate(zip(lengths, starts, strict=True)):
        ids = rng.integers(10, 500, n).tolist()
        fill_row(p, row, ids, np.broadcast_to(start + np.arange(n), (3, n)).astype(np.int64))
        p.read_rows.append(row * width + n - 1)  # read k is row k
        p.targets.append((row * width + n - 1, int(ids[0])))
    return p


def prefixes(runner: PassRunner) -> list[tuple[State, State]]:
    """Two image prefixes of one bucket (no image: text tokens stand in for it)."""
    made = []
    for seed, n in enumerate(PREFIX_LENGTHS):
        rows = token_pass([n], PREFIX_TOKENS, [0], seed)
        rows.read_rows, rows.targets = [], []
        made.append(runner.run_prefix(rows, runner.dummy_features()))
    return made


def chain(runner: PassRunner, made, picked: list[int]) -> list[dict]:
    """A question pass whose rows continue `made[QUESTION_ROWS[n]]`'s recurrent states and
    read the prefixes `picked` (stacked) by index, then an option pass continuing it: every
    output, each with a row's bytes at index n."""
    where = {r: k for k, r in enumerate(picked)}
    prefix = stack_prefixes([made[r][0] for r in picked])
    after = stack_prefixes([after for _, after in made])  # S = 2 in every run
    starts = [PREFIX_LENGTHS[r] for r in QUESTION_ROWS]
    question = token_pass([6, 4, 5, 3], 6, starts, seed=7)
    question.src = np.array(QUESTION_ROWS, dtype=np.int64)
    question.prefix_rows = np.array([where.get(r, 0) for r in QUESTION_ROWS], dtype=np.int64)
    option_starts = [starts[s] + 6 for s in OPTION_SOURCES]
    options = token_pass([3, 2, 4, 1, 2, 3], 4, option_starts, seed=8)
    options.src = np.array(OPTION_SOURCES, dtype=np.int64)
    options.prefix_rows = question.prefix_rows[options.src]
    out_q, state = runner.run_question(QuestionPass(question, [0, 1, 2, 3], {}, {}), prefix, after)
    out_q = {name: t.clone() for name, t in out_q.items()}  # lent buffers: the next run's
    return [out_q, runner.run_options(OptionPass(options, 0, [], {}, {}), prefix, state)]


def assert_rows_exact(runner: PassRunner) -> None:
    """Each row of the pass reading both prefixes has the bytes it has where the pass holds
    its own prefix alone (R = 1), at every output of both passes."""
    made = prefixes(runner)
    both = chain(runner, made, [0, 1])
    rows_of = [np.array(QUESTION_ROWS), np.array(QUESTION_ROWS)[OPTION_SOURCES]]
    for r in (0, 1):
        alone = chain(runner, made, [r])
        for part, (got, want) in enumerate(zip(both, alone, strict=True)):
            mine = torch.from_numpy(np.flatnonzero(rows_of[part] == r))
            for name, tensor in want.items():
                index = mine.to(tensor.device)
                assert torch.equal(got[name][index], tensor[index]), (part, name, r)
        # and the other prefix's rows differ: the test can fail
        other = torch.from_numpy(np.flatnonzero(rows_of[0] != r))
        assert not torch.equal(both[0]["hidden"][other], alone[0]["hidden"][other])


def test_onnx_runtime_rows_read_their_own_prefix(engines):
    from runtime.backends.ort import OrtBackend

    backend = OrtBackend(engines[1])
    assert backend.capabilities.prefixes > 1 and "prefix_rows" in backend.input_dtypes("lm_rows")
    assert_rows_exact(runner_of(backend, engines[0]))


def attention_inputs(b: int, r: int, p: int, own: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, t, hd = 4, 2, 5, 8

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    q, shared_k, shared_v = (
        draw(b, heads, t, hd),
        draw(r, kv_heads, p, hd),
        draw(r, kv_heads, p, hd),
    )
    keys, values = draw(b, kv_heads, own, hd), draw(b, kv_heads, own, hd)
    rows = (keys[:, :, : own - t], values[:, :, : own - t], keys[:, :, -t:], values[:, :, -t:])
    mask = torch.rand(b, t, p + own, generator=generator) > 0.3
    return q, shared_k, shared_v, rows, mask


@pytest.mark.parametrize("form", ["grouped", "folded"])
def test_attention_forms_give_a_row_its_bytes_with_its_prefix_alone(form):
    from runtime.model.language import folded_attention, grouped_attention

    attend = grouped_attention if form == "grouped" else folded_attention
    b, p, own = 5, 7, 9
    q, shared_k, shared_v, rows, mask = attention_inputs(b, 3, p, own)
    picks = torch.tensor([2, 0, 2, 1, 0])
    got = attend(q, shared_k, shared_v, picks, *rows, mask, 0.3)
    for r in range(3):
        one = (shared_k[r : r + 1], shared_v[r : r + 1], torch.zeros(b, dtype=torch.int64))
        alone = attend(q, *one, *rows, mask, 0.3)
        mine = picks == r
        assert torch.equal(got[mine], alone[mine]), r
        assert not torch.equal(got[~mine], alone[~mine])
    gathered = grouped_attention(
        q, shared_k[picks], shared_v[picks], torch.arange(b), *rows, mask, 0.3
    )
    assert torch.allclose(got, gathered, atol=1e-6)


KERNEL_CHECK = textwrap.dedent(
    """
    import torch

    from runtime.model.attention_kernels import (
        CHUNK_KEYS, CHUNK_MAX_ROWS, pass_chunk, query_tile, rows_attention, shared_rows)
    from runtime.model.language import grouped_attention

    torch.manual_seed(0)
    large = CHUNK_MAX_ROWS + 2
    # (rows, query heads, KV heads, tokens, head dim, shared keys, past keys, kernel path):
    # chunks of the shared keys (two chunks); more rows, one program a row (two query tiles);
    # several rows a program (the real rows on one prefix, two padding rows on the other)
    cases = [
        (5, 4, 2, 5, 16, CHUNK_KEYS + 9, 3, "chunks"),
        (large, 2, 1, 33, 16, 7, 3, "one"),
        (large, 2, 1, 5, 16, 7, 3, "shared"),
    ]
    for b, heads, kv_heads, t, hd, p, past, path in cases:
        group = heads // kv_heads
        tile = query_tile(group, t)
        tiles = -(-group * t // tile)
        assert (pass_chunk(b) > 0) == (path == "chunks")
        assert (shared_rows(b, tiles, tile) > 0) == (path == "shared")
        q = torch.randn(b, t, heads, hd).transpose(1, 2)
        k, v = (torch.randn(b, t, kv_heads, hd).transpose(1, 2) for _ in range(2))
        shared_k, shared_v = torch.randn(2, kv_heads, p, hd), torch.randn(2, kv_heads, p, hd)
        past_k, past_v = torch.randn(b, kv_heads, past, hd), torch.randn(b, kv_heads, past, hd)
        lengths = torch.randint(1, t + 1, (b,))
        steps = torch.arange(t)
        valid = steps[None] < lengths[:, None]
        own = (steps[None, :, None] >= steps[None, None, :]) & valid[:, None, :]
        seen = torch.rand(b, p + past) > 0.2
        mask = torch.cat([seen[:, None].expand(-1, t, -1), own], dim=-1)
        if path == "shared":
            picks = torch.ones(b, dtype=torch.int64)
            picks[CHUNK_MAX_ROWS:] = 0  # padding rows after the question's rows
            real = torch.arange(b) < CHUNK_MAX_ROWS
        else:
            picks = torch.arange(b) % 2
            real = torch.ones(b, dtype=torch.bool)
        rows = (past_k, past_v, k, v, mask)
        got = rows_attention(q, shared_k, shared_v, picks, *rows, 0.3)
        expected = grouped_attention(q, shared_k, shared_v, picks, *rows, 0.3)
        close = (got - expected)[valid & real[:, None]].abs().max()
        assert close < 1e-5, (path, float(close))
        for r in (0, 1):
            mine = (picks == r) & real
            if not mine.any():
                continue
            zeros = torch.zeros(b, dtype=torch.int64)
            alone = rows_attention(q, shared_k[r : r + 1], shared_v[r : r + 1], zeros, *rows, 0.3)
            assert torch.equal(got[mine], alone[mine]), (path, r)
        print(path)
    """
)


def test_the_attention_kernel_reads_each_rows_prefix():
    assert run_interpreted(KERNEL_CHECK) == ["chunks", "one", "shared"]


def test_prefix_states_stack_along_the_first_dim(engines):
    def state(value: float, p: int = 4) -> State:
        kv = [torch.full((1, 2, p, 8), value), torch.full((1, 2, p, 8), value + 1)]
        return State(k=kv, v=[t + 2 for t in kv], mask=torch.ones(1, p, dtype=torch.bool),
                     conv=[], rec=[])  # fmt: skip

    stacked = stack_prefixes([state(0.0), state(5.0), state(9.0)])
    assert [t.shape for t in stacked.k] == [(3, 2, 4, 8)] * 2 and stacked.mask.shape == (3, 4)
    assert stacked.k[1][:, 0, 0, 0].tolist() == [1.0, 6.0, 10.0]
    assert stacked.v[0][:, 0, 0, 0].tolist() == [2.0, 7.0, 11.0]
    assert stacked.conv == [] and stacked.rec == []
    with pytest.raises(ValueError, match="one length only, got lengths \\[4, 8\\]"):
        stack_prefixes([state(0.0), state(1.0, p=8)])
    with pytest.raises(ValueError, match="no prefix states"):
        stack_prefixes([])


def test_a_pass_carries_its_prefix_rows_into_its_arrays_and_pieces():
    p = empty_pass(3, 10)
    assert p.prefix_rows.tolist() == [0, 0, 0]
    assert p.arrays()["prefix_rows"].dtype == np.int64
    p.prefix_rows = np.array([2, 0, 1], dtype=np.int64)
    assert p.arrays(pad=False)["prefix_rows"].tolist() == [2, 0, 1]
    assert slice_pass(p, 4, 8).prefix_rows.tolist() == [2, 0, 1]


def test_engines_from_before_prefix_rows_are_refused(tmp_path, engines):
    """An engine directory of the previous format, and an ONNX folder whose lm_state has no
    `prefix_rows`: a clear message naming the rebuild, not a shape error at a request."""
    import json

    import onnx
    from onnx import TensorProto, helper

    from runtime.backends.ort import OrtBackend
    from runtime.manifest import EngineDirError, verify_engine_dir

    old = tmp_path / "engines"
    old.mkdir()
    manifest = json.loads((engines[1] / "engines.json").read_text("utf-8"))
    (old / "engines.json").write_text(json.dumps({**manifest, "format": "omnijev-engines/1"}))
    with pytest.raises(EngineDirError, match="'omnijev-engines/1', not omnijev-engines/2; rebuild"):
        verify_engine_dir(old, engines[0])
    folder = tmp_path / "onnx"
    folder.mkdir()
    (folder / "vision.onnx").symlink_to(engines[1] / "onnx_ort" / "vision.onnx")
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["B", "T"])
    out = helper.make_tensor_value_info("hidden", TensorProto.INT64, ["B", "T"])
    graph = helper.make_graph([helper.make_node("Identity", ["input_ids"], ["hidden"])],
                              "lm_state", [ids], [out])  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(folder / "lm_state.onnx"))
    with pytest.raises(RuntimeError, match="no prefix_rows input.*`omnijev export`"):
        OrtBackend(folder)
