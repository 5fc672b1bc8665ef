"""Heads and LM features: fixtures, a PyTorch re-implementation from the spec, invalid outputs."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from runtime.errors import ExecutionError
from runtime.export_format import HEAD_SHAPES, head_shapes
from runtime.heads import (
    Heads,
    erf64,
    erfc64,
    gelu,
    lm_features,
    option_probabilities,
    question_mu,
)
from runtime.types import QuestionReadout
from tests.spec import FIXTURES

FEATURES = json.loads((FIXTURES / "features.json").read_text())
HEADS_CASES = json.loads((FIXTURES / "heads.json").read_text())["cases"]
TOLERANCE = 1e-5  # contract §6.5: absolute, relative above 1

torch = pytest.importorskip("torch")
F = torch.nn.functional


def close(actual, expected, tolerance: float = TOLERANCE) -> None:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape
    bound = tolerance * np.maximum(np.abs(expected), 1.0)
    assert np.all(np.abs(actual - expected) <= bound), (actual, expected)


# -- LM features -----------------------------------------------------------------------------


def test_features_fixture() -> None:
    rows = FEATURES["rows"]
    for group in FEATURES["groups"]:
        picked = [np.array(rows[i]["picked"], np.float32) for i in group]
        first = [rows[i]["first"] for i in group]
        feats = lm_features(picked, first)
        assert feats.dtype == np.float32 and feats.shape == (len(group), 6)
        for row, i in zip(feats, group, strict=True):
            close(row, rows[i]["feats"], 1e-6)


def test_features_empty_option_in_group() -> None:
    feats = lm_features([np.array([-3.0, -4.0], np.float32), np.zeros(0, np.float32)], [-1.5, None])
    assert feats[1].tolist()[:3] == [0.0, 0.0, 0.0] and feats[1, 5] == 0.0
    assert feats[1, 3] == pytest.approx(-1e4 + 7.0, abs=1e-2)
    assert feats[0].tolist() == pytest.approx([-0.7, -3.5, 0.2, 0.0, -1.5, 1.0])


def test_plain_noul_features_are_zero() -> None:
    assert lm_features([np.zeros(0, np.float32)], [None]).tolist() == [[0.0] * 6]


def per_option_sums(picked: list[np.ndarray]) -> np.ndarray:
    """The features' sums one option at a time, left to right (the form `option_sums`
    replaced)."""
    sums = np.zeros(len(picked), np.float32)
    for i, values in enumerate(picked):
        if values.size:
            sums[i] = np.cumsum(values, dtype=np.float32)[-1]
    return sums


def test_features_sum_each_option_as_alone() -> None:
    """All options summed at once give each option the bytes of its own left-to-right sum:
    signed zeros, empty options, long and short ones, tiny and large values."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        picked = []
        for _ in range(int(rng.integers(1, 40))):
            values = -rng.exponential(rng.choice([1e-3, 1.0, 30.0]), int(rng.integers(0, 12)))
            values = values.astype(np.float32)
            if values.size and rng.random() < 0.2:
                values[rng.integers(0, values.size)] = -0.0
            if values.size and rng.random() < 0.1:
                values[:] = rng.choice([-0.0, 0.0])
            picked.append(values)
        first = [None if rng.random() < 0.3 else float(rng.normal()) for _ in picked]
        feats = lm_features(picked, first)
        assert feats[:, 0].tobytes() == (per_option_sums(picked) / np.float32(10)).tobytes()


@pytest.mark.parametrize(
    ("picked", "first"),
    [([], []), ([np.zeros(1)], []), ([np.array([np.nan])], [None]), ([np.zeros(1)], [np.inf])],
)
def test_features_refuse_bad_input(picked, first) -> None:
    with pytest.raises(ExecutionError):
        lm_features(picked, first)


# -- exact GELU ------------------------------------------------------------------------------


def test_erf_against_libm() -> None:
    a = np.concatenate([np.linspace(-12, 12, 4001), [0.0, 2.4999999, 2.5, 1e-8, -1e-8]])
    want = np.array([math.erf(v) for v in a])
    assert np.max(np.abs(erf64(a) - want) / np.maximum(np.abs(want), 1e-300)) < 1e-13
    b = np.linspace(0, 25, 2001)
    want_c = np.array([math.erfc(v) for v in b])
    # below the split erfc is 1 − erf: relative error up to ~3e-13 where erfc is small
    assert np.max(np.abs(erfc64(b) - want_c) / want_c) < 1e-12


def test_gelu_against_torch() -> None:
    x = np.concatenate([np.linspace(-10, 10, 20001), [0.0, -40.0, 40.0]]).astype(np.float32)
    ours = gelu(x)
    assert ours.dtype == np.float32
    # torch float32 (its vectorized erf is approximate): within 1e-6, relative above 1
    close(ours, F.gelu(torch.from_numpy(x)).numpy(), 1e-6)
    # x·½·erfc(−x/√2) from libm in float64 (torch's float64 1 + erf flushes the far tail to 0),
    # rounded once: within one float32 rounding everywhere, tails included
    exact = np.array([v * 0.5 * math.erfc(-v / math.sqrt(2.0)) for v in x.astype(np.float64)])
    assert np.all(np.abs(ours - exact) <= 0.5 * np.spacing(np.abs(exact).astype(np.float32)))


# -- weights ---------------------------------------------------------------------------------


def test_head_shapes_match_contract() -> None:
    shapes = head_shapes(2560)
    assert len(HEAD_SHAPES) == 25
    assert shapes["head.opt.0.weight"] == (1024, 2560)
    assert shapes["head.opt.2.weight"] == (1024, 1024)
    assert shapes["head.que.0.bias"] == (1024,)
    assert shapes["head.score.weight"] == (1, 1024)
    assert shapes["head.log_tau"] == (3,)
    assert shapes["head.feat.weight"] == (1024, 6)
    assert shapes["head.feat_lin.weight"] == (1, 6)
    assert shapes["ord.z.0.weight"] == (512, 2560)
    assert shapes["ord.cut.2.weight"] == (1, 512)
    small = head_shapes(64)
    assert small["head.opt.0.weight"] == (128, 64) and small["ord.z.0.weight"] == (64, 64)


def random_tensors(hidden: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in head_shapes(hidden).items():
        fan_in = shape[-1] if name.endswith(".weight") else 1
        out[name] = (rng.standard_normal(shape, dtype=np.float32) / np.sqrt(fan_in)).astype(
            np.float32
        )
    out["head.log_tau"] = np.array([0.1, -0.2, 0.3], np.float32)
    return out


def write_heads(hidden: int, folder: Path) -> tuple[int, dict[str, np.ndarray], Heads]:
    """Random weights written to a heads.safetensors and loaded back."""
    from safetensors.numpy import save_file

    tensors = random_tensors(hidden, seed=hidden)
    path = folder / "heads.safetensors"
    save_file(tensors, str(path))
    heads = Heads.from_safetensors(path, hidden)
    assert heads.hidden == hidden and Heads.from_safetensors(path).hidden == hidden
    return hidden, tensors, heads


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[int, dict[str, np.ndarray], Heads]:
    return write_heads(64, tmp_path_factory.mktemp("heads64"))


@pytest.fixture(scope="module")
def full_size(tmp_path_factory) -> tuple[int, dict[str, np.ndarray], Heads]:
    return write_heads(2560, tmp_path_factory.mktemp("heads2560"))


class SpecHeads:
    """OptionScorer and OrdinalScoreHead in PyTorch, written from docs/contract.md §6.3-6.4."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.w = {k: torch.from_numpy(v) for k, v in tensors.items()}

    def linear(self, name: str, x):
        return F.linear(x, self.w[f"{name}.weight"], self.w[f"{name}.bias"])

    def mlp(self, name: str, x):
        return self.linear(f"{name}.2", F.gelu(self.linear(f"{name}.0", x)))

    def logits(self, zq, u, feats, type_id: int):
        g = torch.tanh(self.mlp("head.que", zq))
        h = self.mlp("head.opt", u) * g + self.linear("head.feat", feats)
        tau = torch.exp(self.w["head.log_tau"][type_id])
        direct = self.linear("head.feat_lin", feats)[:, 0]
        logit = (self.linear("head.score", h)[:, 0] + direct) / tau
        last = torch.zeros(1) if type_id == 0 else self.linear("head.abstain", g) / tau
        return torch.cat([logit, last])

    def mu(self, zq, u, feats, type_id: int):
        lg = self.logits(zq, u, feats, type_id)
        return torch.sigmoid(lg[:-1]) if type_id == 0 else torch.softmax(lg, 0)[:-1]

    def ordinal(self, zq, u):
        z = self.mlp("ord.z", zq)[0]
        r = self.mlp("ord.cut", u)[:, 0]
        theta = r[0] + torch.cat([torch.zeros(1), torch.cumsum(F.softplus(r[1:]), 0)])
        cdf = torch.sigmoid(theta - z)
        cdf = torch.cat([cdf[:-1], torch.ones(1)])
        return torch.cat([cdf[:1], cdf[1:] - cdf[:-1]]).clamp(min=1e-8)


SPEC_CASES = [(64, 0, 1), (64, 1, 1), (64, 1, 2), (64, 1, 5), (64, 2, 4), (64, 1, 12)]
SPEC_CASES += [(2560, 0, 1), (2560, 1, 5), (2560, 2, 4)]  # the release's shapes, one per type


@pytest.mark.parametrize(("hidden", "type_id", "k"), SPEC_CASES)
def test_heads_match_spec_torch(request, hidden: int, type_id: int, k: int) -> None:
    fixture = "written" if hidden == 64 else "full_size"
    _, tensors, heads = request.getfixturevalue(fixture)
    rng = np.random.default_rng(100 * type_id + k)
    zq = rng.standard_normal(hidden, dtype=np.float32) * 2
    u = rng.standard_normal((k, hidden), dtype=np.float32) * 2
    feats = np.zeros((k, 6), np.float32)
    if type_id:
        feats = rng.standard_normal((k, 6), dtype=np.float32)
    spec = SpecHeads(tensors)
    tzq, tu, tf = torch.from_numpy(zq), torch.from_numpy(u), torch.from_numpy(feats)
    with torch.no_grad():
        close(heads.option_logits(zq, u, feats, type_id), spec.logits(tzq, tu, tf, type_id))
        close(heads.option_mu(zq, u, feats, type_id), spec.mu(tzq, tu, tf, type_id))
        close(heads.ordinal_mu(zq, u), spec.ordinal(tzq, tu))
    mu = heads.option_mu(zq, u, feats, type_id)
    assert mu.dtype == np.float32 and mu.shape == (k,)
    if type_id:
        assert mu.sum() < 1.0  # the abstain entry takes the rest


def test_ordinal_one_level_is_certain(written) -> None:
    hidden, _, heads = written
    mu = heads.ordinal_mu(np.ones(hidden, np.float32), np.ones((1, hidden), np.float32))
    assert mu.tolist() == [1.0]


def test_heads_without_lm_features(written) -> None:
    hidden, _, heads = written
    zq = np.full(hidden, 0.5, np.float32)
    u = np.full((2, hidden), -0.25, np.float32)
    with_zero = heads.option_scorer(zq, u, np.zeros((2, 6), np.float32), 1)[0]
    without = heads.option_scorer(zq, u, None, 1)[0]
    # zero features still add feat's and feat_lin's biases; None adds nothing
    assert not np.allclose(with_zero, without)


def test_question_mu_picks_the_head(written) -> None:
    hidden, _, heads = written
    rng = np.random.default_rng(7)
    readout = QuestionReadout(
        zq=rng.standard_normal(hidden, dtype=np.float32),
        u=rng.standard_normal((3, hidden), dtype=np.float32),
        picked=[np.array([-1.0, -2.0], np.float32), np.zeros(0, np.float32), np.array([-0.5])],
        first=[-1.0, None, -0.5],
    )
    feats = lm_features(readout.picked, readout.first)
    score = question_mu(heads, "score", readout)
    np.testing.assert_array_equal(score, heads.ordinal_mu(readout.zq, readout.u))
    choice = question_mu(heads, "choice", readout)
    np.testing.assert_array_equal(choice, heads.option_mu(readout.zq, readout.u, feats, 1))
    scorer = question_mu(heads, "score", readout, ordinal=False)
    np.testing.assert_array_equal(scorer, heads.option_mu(readout.zq, readout.u, feats, 2))
    with pytest.raises(ExecutionError):
        question_mu(heads, "other", readout)


# -- loading and invalid output ----------------------------------------------------------------


def test_load_refuses_bad_tensors(written) -> None:
    hidden, tensors, _ = written
    with pytest.raises(ValueError, match="shape"):
        Heads(tensors, hidden + 1)
    with pytest.raises(ValueError, match="missing"):
        Heads({k: v for k, v in tensors.items() if k != "ord.cut.2.bias"})
    with pytest.raises(ValueError, match="float32"):
        Heads({**tensors, "head.log_tau": tensors["head.log_tau"].astype(np.float64)})
    with pytest.raises(ValueError, match="not finite"):
        Heads({**tensors, "head.log_tau": np.array([0.0, np.nan, 0.0], np.float32)})


def test_invalid_head_output(written) -> None:
    hidden, _, heads = written
    zq = np.ones(hidden, np.float32)
    huge = np.full((2, hidden), 3e38, np.float32)  # finite input whose products overflow
    with pytest.raises(ExecutionError, match="^invalid head output$"):
        heads.option_mu(zq, huge, np.zeros((2, 6), np.float32), 1)
    with pytest.raises(ExecutionError, match="^invalid head output$"):
        heads.ordinal_mu(zq, huge)


@pytest.mark.parametrize("what", ["empty", "width", "feats", "nan"])
def test_invalid_head_input(written, what: str) -> None:
    hidden, _, heads = written
    zq = np.ones(hidden, np.float32)
    u = np.ones((2, hidden), np.float32)
    feats = np.zeros((2, 6), np.float32)
    if what == "empty":
        u = np.zeros((0, hidden), np.float32)
    elif what == "width":
        u = np.ones((2, hidden + 1), np.float32)
    elif what == "feats":
        feats = np.zeros((3, 6), np.float32)
    else:
        zq[0] = np.nan
    with pytest.raises(ExecutionError, match="^invalid head input$"):
        heads.option_mu(zq, u, feats, 1)


# -- heads.json ----------------------------------------------------------------------------------


def sequence(seed: int, n: int) -> np.ndarray:
    """The fixture generator's inputs: integer arithmetic, float64 division, one float32 cast."""
    i = np.arange(n, dtype=np.int64)
    x = (i * 2654435761 + seed * 40503) % 2**32
    return (x / 2**32 * 4.0 - 2.0).astype(np.float32)


def test_sequence_is_the_generators() -> None:
    # the same formula in plain Python integers and floats
    expected = [(((i * 2654435761) + 5 * 40503) % 2**32) / 2**32 * 4.0 - 2.0 for i in range(50)]
    assert sequence(5, 50).tolist() == np.array(expected, np.float32).tolist()


@pytest.mark.parametrize("case", HEADS_CASES, ids=[c["name"] for c in HEADS_CASES])
def test_heads_fixture_normalization(case: dict) -> None:
    # what can be checked without the real heads: mu from the fixture's own logits
    logits = np.array(case["logits"], np.float32)
    k = case["options"]
    assert logits.shape == (k + 1,)
    close(option_probabilities(logits[:k], logits[k], case["type_id"]), case["mu"], 1e-6)


@pytest.mark.real_heads
@pytest.mark.parametrize("case", HEADS_CASES, ids=[c["name"] for c in HEADS_CASES])
def test_heads_fixture_real(case: dict) -> None:
    path = os.environ.get("OMNIJEV_REAL_HEADS")
    if not path or not Path(path).is_file():
        pytest.skip("set OMNIJEV_REAL_HEADS to the release's heads.safetensors")
    heads = Heads.from_safetensors(path, 2560)
    # Input placement, from the generator (Levius-Fubuki tests/omnijev/generate_fixtures.py
    # `head_cases`, and its heads.rs): u ← seeds[0] (K·D values, row-major), zq ← seeds[1],
    # feats ← seeds[2] (K·6, row-major), except Noul whose feats are zeros.
    seeds, k, type_id = case["seeds"], case["options"], case["type_id"]
    u = sequence(seeds[0], k * 2560).reshape(k, 2560)
    zq = sequence(seeds[1], 2560)
    feats = np.zeros((k, 6), np.float32)
    if type_id != 0:
        feats = sequence(seeds[2], k * 6).reshape(k, 6)
    close(heads.option_logits(zq, u, feats, type_id), case["logits"])
    close(heads.option_mu(zq, u, feats, type_id), case["mu"])
    close(heads.ordinal_mu(zq, u), case["ordinal"])


THREADS_CHECK = """
import runtime, torch, torch.nn.functional as F, hashlib, os
assert os.environ["MKL_CBWR"] == "AUTO,STRICT"
weight = torch.randn(1024, 2560, generator=torch.Generator().manual_seed(0)) * 0.02
digests = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    h = hashlib.sha256()
    for rows in range(1, 14):
        x = torch.randn(rows, 2560, generator=torch.Generator().manual_seed(rows))
        h.update(F.linear(x, weight).numpy().tobytes())
    digests.append(h.hexdigest())
print(digests[0] == digests[1])
"""


def test_head_products_do_not_depend_on_the_thread_count():
    """`import runtime` puts MKL in its strict mode: an option head's first product (1024 × 2560,
    1-13 rows) is the same bytes on 1 and 2 threads (MKL's default mode rounded 5-7 rows
    differently). A fresh process, as MKL reads the mode at its first call."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    done = subprocess.run(
        [sys.executable, "-c", THREADS_CHECK], env=env, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "True"
