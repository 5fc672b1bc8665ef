"""Decision heads and LM features in float32: NumPy, with the linear layers and erf on PyTorch
(docs/contract.md §6).

Follows the reference's `OptionScorer` (Choice, Noul), `OrdinalScoreHead` (Score) and the six
LM features of `lm_option_feats` / `branch.py`; weights come from the export's `heads.safetensors`.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from runtime.errors import ExecutionError
from runtime.export_format import N_FEATS, head_shapes
from runtime.types import TYPE_IDS, QuestionReadout

log = logging.getLogger("omnijev.heads")

HIDDEN = 2560  # Qwen3.5-4B hidden size (contract §6.1)

EMPTY_SUM = np.float32(-1e4)  # lm_option_feats masks an empty option's sum with -1e4 before dist
FEAT_SCALE = np.float32(10.0)  # sum/10 and n/10 in the features
SOFTPLUS_THRESHOLD = 20.0  # torch softplus default (beta 1): linear above this
ORDINAL_FLOOR = np.float32(1e-8)  # OrdinalScoreHead clamps each level probability to this

# Exact GELU needs erf; NumPy has none. PyTorch's float64 erf/erfc are libm-accurate (tested
# against math.erf), far below a float32 ulp, and 10× faster than a series in NumPy. The linear
# layers run on PyTorch too (`F.linear`, as the reference's `nn.Linear`): NumPy's OpenBLAS and
# PyTorch's OpenMP pools spinning against each other made one 4-option question take 18 ms on
# 2 cores, against 1.3 ms with one library (measured with 4b-sized heads).
SQRT_HALF = math.sqrt(0.5)
# The MLPs whose first Linear reads D-wide rows (the large weights): `questions_mu` runs each of
# them over every question's rows before the next. 12 questions, 4b-sized heads, two cores:
# 17.7 ms of CPU question by question, 11.5 ms layer by layer, each question its own
# product (MKL's sgemm for a few rows: ~0.15 ms for one row, ~0.5 ms for 4-5 against a 10 MiB
# weight). Without MKL's reproducibility mode a row's bytes also followed the row count (1-3
# and 5-7 rows differed) and the thread count; with it (runtime/__init__.py) only 1-3 rows do,
# hence MIN_PRODUCT_ROWS, and one product over all the questions' rows gives their own bytes.
FIRST_LINEAR_ORDER = ("head.que", "head.opt", "ord.z", "ord.cut")
# Every product has at least this many rows (zero rows fill the rest, then are dropped): MKL
# 2024.2 (AVX-512, default and strict modes) runs 1-3 rows through other kernels, whose rows
# differ from the same rows in a larger product; from 4 rows on they were equal, at any offset,
# up to 300 rows (1024 × 2560 with bias). With that, the MLPs above take every question's rows
# in ONE product, each weight read once, and a question still gets the bytes it gets alone;
# `Heads.stackable` checks the property layer by layer on the machine at hand and keeps
# per-question products where it does not hold.
MIN_PRODUCT_ROWS = 4
# A Linear with fewer outputs than this (the 1-wide score, abstain, feature and ordinal outputs)
# runs as a product of this many, its weight's extra rows zero: MKL's matrix-vector kernel for
# one output gave a row other bytes in products of other row counts, a 2-, 4- or 8-wide product
# did not (16-wide did not hold; MKL 2024.2). So those layers stack too, one
# product for every question's rows; `Heads.stackable` still checks each on the machine at hand.
NARROW_WIDTH = 4
# Every Linear of the heads, for the row-invariance check (`Heads.stackable`)
HEAD_LINEARS = (
    *(f"{mlp}.{i}" for mlp in FIRST_LINEAR_ORDER for i in (0, 2)),
    "head.feat",
    "head.score",
    "head.feat_lin",
    "head.abstain",
)
# the rows (sub-products at offsets) that check checks against one product of STACK_CHECK_ROWS
STACK_CHECK_ROWS = 320
STACK_CHECK_SIZES = (4, 5, 7, 8, 13, 16, 33, 64, 255)
STACK_CHECK_OFFSETS = (0, 5, 37)
# On a CUDA device the four MLPs above run as products of exactly this many rows (zero rows fill
# the last), the worker's FIXED_GEMM_M (docs/contract.md §5): one kernel for any number of
# questions, so a row's bytes follow only its own inputs; `DeviceMLPs.usable` checks that at load.
# The MLPs are most of the heads' host time, and on the GPU the heads take about half as long with
# them there (the same answer bytes).
DEVICE_ROWS = 64
DEVICE_TOLERANCE = 1e-5  # heads' tolerance against the reference (docs/contract.md §9.3): the check


def erf64(a: np.ndarray) -> np.ndarray:
    """erf in float64 (PyTorch's vectorized libm-accurate kernel)."""
    return torch.special.erf(torch.from_numpy(np.asarray(a, dtype=np.float64))).numpy()


def erfc64(a: np.ndarray) -> np.ndarray:
    """erfc in float64, without cancellation for large positive arguments."""
    return torch.special.erfc(torch.from_numpy(np.asarray(a, dtype=np.float64))).numpy()


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU x·Φ(x) of a tensor on any device: float64 inside, one rounding to
    float32."""
    x64 = x.double()
    # Φ(x) = ½·erfc(−x/√2) stays accurate for very negative x, where 1 + erf(x/√2) cancels
    return (x64 * 0.5 * torch.special.erfc(-x64 * SQRT_HALF)).float()


def gelu(x: np.ndarray) -> np.ndarray:
    """`exact_gelu` of a host array."""
    return exact_gelu(torch.from_numpy(np.asarray(x))).numpy()


def sigmoid(x: np.ndarray) -> np.ndarray:
    """Logistic function in float64 without overflow, rounded to float32."""
    x64 = np.asarray(x, dtype=np.float64)
    e = np.exp(-np.abs(x64))
    return np.where(x64 >= 0, 1.0 / (1.0 + e), e / (1.0 + e)).astype(np.float32)


def softplus(x: np.ndarray) -> np.ndarray:
    """torch softplus (beta 1, threshold 20): x above the threshold, else log1p(exp(x))."""
    x64 = np.asarray(x, dtype=np.float64)
    soft = np.log1p(np.exp(np.minimum(x64, SOFTPLUS_THRESHOLD)))
    return np.where(x64 > SOFTPLUS_THRESHOLD, x64, soft).astype(np.float32)


def softmax(x: np.ndarray) -> np.ndarray:
    """Softmax of a float32 vector in float32, shifted by its maximum."""
    e = np.exp(x - x.max())
    return (e / e.sum(dtype=np.float32)).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Log-softmax of a float32 vector in float32: (x − max) − log Σ exp(x − max)."""
    shifted = x - x.max()
    return (shifted - np.log(np.exp(shifted).sum(dtype=np.float32))).astype(np.float32)


def inference():
    """torch's inference mode, unless already on: entering it again costs ~10 µs, and a
    request's heads make a few small products per question (questions_mu enters it once)."""
    return nullcontext() if torch.is_inference_mode_enabled() else torch.inference_mode()


def same_rows(apply: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """Whether `apply` gives each row of `x` the bytes it gives it among all of `x`, for the
    STACK_CHECK_SIZES rows at each of STACK_CHECK_OFFSETS."""
    full = apply(x)
    return all(
        torch.equal(apply(x[at : at + rows]), full[at : at + rows])
        for rows in STACK_CHECK_SIZES
        for at in STACK_CHECK_OFFSETS
    )


def _quiet(method: Callable) -> Callable:
    """Overflow becomes inf/nan without warnings: outputs are checked for finiteness instead."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return method(*args, **kwargs)

    return wrapper


def _check_output(values: np.ndarray, count: int) -> np.ndarray:
    if values.ndim != 1 or values.shape[0] == 0 or values.shape[0] != count:
        raise ExecutionError("invalid head output")
    if not np.isfinite(values).all():
        raise ExecutionError("invalid head output")
    return values


def _as_input(value, shape: tuple[int, ...]) -> np.ndarray:
    array = np.asarray(value, dtype=np.float32)
    if array.shape != shape or not np.isfinite(array).all():
        raise ExecutionError("invalid head input")
    return array


class Heads:
    """The OptionScorer and OrdinalScoreHead weights of one export, applied in float32."""

    def __init__(self, tensors: dict[str, np.ndarray], hidden: int | None = None):
        if "head.opt.0.weight" not in tensors:
            raise ValueError("heads: head.opt.0.weight is missing")
        d = int(tensors["head.opt.0.weight"].shape[-1]) if hidden is None else hidden
        expected = head_shapes(d)
        missing = sorted(set(expected) - set(tensors))
        extra = sorted(set(tensors) - set(expected))
        if missing or extra:
            raise ValueError(f"heads: missing {missing}, unexpected {extra}")
        self.hidden = d
        self.w: dict[str, np.ndarray] = {}
        for name, shape in expected.items():
            array = np.asarray(tensors[name])
            if array.dtype != np.float32:
                raise ValueError(f"heads: {name} is {array.dtype}, expected float32")
            if tuple(array.shape) != shape:
                got, want = list(array.shape), list(shape)
                raise ValueError(f"heads: {name} has shape {got}, expected {want}")
            if not np.isfinite(array).all():
                raise ValueError(f"heads: {name} is not finite")
            self.w[name] = np.ascontiguousarray(array)
        self.t = {name: torch.from_numpy(array) for name, array in self.w.items()}
        self.products = {layer: self.product_weights(layer) for layer in HEAD_LINEARS}
        self.device_mlps: DeviceMLPs | None = None  # use_device
        self.stackable = frozenset(layer for layer in HEAD_LINEARS if self.rows_invariant(layer))

    def product_weights(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Linear `layer`'s (weight, bias) as its products use them: at least NARROW_WIDTH
        outputs, zero rows filling the rest."""
        weight, bias = self.t[f"{layer}.weight"], self.t[f"{layer}.bias"]
        missing = NARROW_WIDTH - weight.shape[0]
        if missing <= 0:
            return weight, bias
        weight = torch.cat([weight, weight.new_zeros(missing, weight.shape[1])])
        return weight, torch.cat([bias, bias.new_zeros(missing)])

    def rows_invariant(self, layer: str) -> bool:
        """Whether Linear `layer` gives a row the same bytes in a product of any number
        (≥ MIN_PRODUCT_ROWS) of rows, wherever the row sits (STACK_CHECK_*). Layers that do
        not keep one product a question."""
        weight, bias = self.products[layer]
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(STACK_CHECK_ROWS, weight.shape[1], generator=generator)
        with torch.inference_mode():
            return same_rows(lambda rows: torch.nn.functional.linear(rows, weight, bias), x)

    def use_device(
        self, device: torch.device | str, mlps_class: type[DeviceMLPs] | None = None
    ) -> bool:
        """Run the four D-wide MLPs on `device` from now on, if it gives a row the same bytes
        in any product and agrees with the host (DeviceMLPs.usable); whether it does.
        `mlps_class`: what makes them (DeviceMLPs, or a subclass of it)."""
        self.device_mlps = None
        try:
            mlps = (mlps_class or DeviceMLPs)(self, torch.device(device))
            if mlps.usable():
                self.device_mlps = mlps
        except RuntimeError as error:  # a device that cannot run them
            log.warning("heads: the device's MLPs failed (%s)", error)
        return self.device_mlps is not None

    @classmethod
    def from_safetensors(cls, path: str | Path, hidden: int | None = None) -> Heads:
        """Load `heads.safetensors` (all F32), checking names, shapes and finiteness."""
        from safetensors.numpy import load_file

        return cls(load_file(str(path)), hidden)

    def _dense(self, name: str, x: np.ndarray) -> np.ndarray:
        """`nn.Linear` in float32 on rows [N, in], as a product of at least MIN_PRODUCT_ROWS
        rows and NARROW_WIDTH outputs."""
        rows = x.shape[0]
        if rows < MIN_PRODUCT_ROWS:
            x = np.concatenate([x, np.zeros((MIN_PRODUCT_ROWS - rows, x.shape[1]), x.dtype)])
        inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
        weight, bias = self.products[name]
        width = self.t[f"{name}.bias"].shape[0]
        with inference():
            return torch.nn.functional.linear(inputs, weight, bias).numpy()[:rows, :width]

    def _stacked(self, name: str, x: np.ndarray, sizes: Sequence[int]) -> np.ndarray:
        """`_dense` of several questions' rows (`sizes` each, in order), each question's
        bytes as its own product gives them: one product where `name` is stackable, else one
        a question."""
        if name in self.stackable or len(sizes) == 1:
            return self._dense(name, x)
        ends = np.cumsum(sizes)
        return np.concatenate(
            [self._dense(name, x[end - size : end]) for size, end in zip(sizes, ends, strict=True)]
        )

    def _mlp(self, name: str, x: np.ndarray, first: dict | None = None) -> np.ndarray:
        """Linear → exact GELU → Linear; `first` may hold the MLP's output already (`{name}`),
        or its first Linear's (`{name}.0`)."""
        if first and name in first:
            return first[name]
        inner = first.get(f"{name}.0") if first else None
        if inner is None:
            inner = self._dense(f"{name}.0", x)
        return self._dense(f"{name}.2", gelu(inner))

    def first_inputs(self, question_type: str, readout: QuestionReadout, ordinal: bool) -> dict:
        """What `question_mu` feeds each MLP's first Linear: {mlp name: input}, or {} for
        inputs that `question_mu` refuses (it then raises in its own order)."""
        try:
            zq, u = self._inputs(readout.zq, readout.u)
        except ExecutionError:
            return {}
        zq_mlp, u_mlp = mlp_names(question_type, ordinal)
        return {zq_mlp: zq[None, :], u_mlp: u}

    def _inputs(self, zq, u) -> tuple[np.ndarray, np.ndarray]:
        u = np.asarray(u, dtype=np.float32)
        if u.ndim != 2 or u.shape[0] == 0:
            raise ExecutionError("invalid head input")
        return _as_input(zq, (self.hidden,)), _as_input(u, (u.shape[0], self.hidden))

    @_quiet
    def option_scorer(
        self,
        zq: np.ndarray,
        u: np.ndarray,
        feats: np.ndarray | None,
        type_id: int,
        first: dict | None = None,
    ) -> tuple[np.ndarray, np.float32]:
        """OptionScorer logits [K] and the abstain logit (0 for Noul, as the reference's vector).

        `feats` None means a head without LM features (head_meta `lm_feats` false); `first`
        holds first-Linear outputs already made from these inputs (`questions_mu`)."""
        zq, u = self._inputs(zq, u)
        que = self._mlp("head.que", zq[None, :], first)
        opt = self._mlp("head.opt", u, first)
        return self.scorer_outputs(que, opt, [u.shape[0]], feats, [type_id])[0]

    def scorer_outputs(
        self,
        que: np.ndarray,
        opt: np.ndarray,
        sizes: Sequence[int],
        feats: np.ndarray | None,
        type_ids: Sequence[int],
    ) -> list[tuple[np.ndarray, np.float32]]:
        """OptionScorer after its two MLPs, for several questions at once: each question's
        question-MLP row (`que` [J, W]), its `sizes[j]` option-MLP rows (`opt` [ΣK, W]) and
        LM features (`feats` [ΣK, 6] or None) → (logits [K], abstain) a question; every
        Linear over all the questions' rows at once (`_stacked`), each question's bytes."""
        total = sum(sizes)
        # tanh row by row: a row of a longer array could meet other SIMD lanes than alone
        g = np.stack([np.tanh(row) for row in que])
        h = opt * np.repeat(g, sizes, axis=0)
        if feats is not None:
            feats = _as_input(feats, (total, N_FEATS))
            h = h + self._stacked("head.feat", feats, sizes)
        logit = self._stacked("head.score", h, sizes)[:, 0]
        if feats is not None:
            logit = logit + self._stacked("head.feat_lin", feats, sizes)[:, 0]
        taus = [np.exp(self.w["head.log_tau"][type_id]) for type_id in type_ids]
        logit = (logit / np.repeat(np.array(taus, np.float32), sizes)).astype(np.float32)
        # Noul has no abstain option: its question rows go through the product all the same
        abstains = self._stacked("head.abstain", g, [1] * len(sizes))[:, 0]
        outputs, at = [], 0
        for size, type_id, tau, raw in zip(sizes, type_ids, taus, abstains, strict=True):
            abstain = np.float32(0.0)
            if type_id != TYPE_IDS["noul"]:
                abstain = np.float32(raw / tau)
            if not np.isfinite(abstain):
                raise ExecutionError("invalid head output")
            outputs.append((_check_output(logit[at : at + size], size), abstain))
            at += size
        return outputs

    def option_logits(
        self, zq: np.ndarray, u: np.ndarray, feats: np.ndarray | None, type_id: int
    ) -> np.ndarray:
        """The reference's `OptionScorer.logits` vector: [K option logits, abstain] float32."""
        logit, abstain = self.option_scorer(zq, u, feats, type_id)
        return np.append(logit, abstain).astype(np.float32)

    @_quiet
    def option_mu(
        self,
        zq: np.ndarray,
        u: np.ndarray,
        feats: np.ndarray | None,
        type_id: int,
        first: dict | None = None,
    ) -> np.ndarray:
        """mu [K]: Noul sigmoid(logit); otherwise softmax([logits…, abstain])[:K]."""
        logit, abstain = self.option_scorer(zq, u, feats, type_id, first)
        return _check_output(option_probabilities(logit, abstain, type_id), logit.shape[0])

    @_quiet
    def ordinal_mu(self, zq: np.ndarray, u: np.ndarray, first: dict | None = None) -> np.ndarray:
        """OrdinalScoreHead's cumulative-link level probabilities [K], levels in caller order."""
        zq, u = self._inputs(zq, u)
        return self.ordinal_levels(
            self._mlp("ord.z", zq[None, :], first)[0, 0], self._mlp("ord.cut", u, first)[:, 0]
        )

    @_quiet
    def ordinal_levels(self, z: np.floating, raw: np.ndarray) -> np.ndarray:
        """OrdinalScoreHead after its two MLPs: the level probabilities [K] from the question's
        location `z` and the levels' raw cut points."""
        # torch's CPU cumsum accumulates float32 in double and rounds each partial sum
        steps = np.cumsum(softplus(raw[1:]).astype(np.float64)).astype(np.float32)
        theta = raw[0] + np.concatenate([np.zeros(1, np.float32), steps])
        cdf = sigmoid(theta - z)
        cdf[-1] = np.float32(1.0)
        p = np.concatenate([cdf[:1], cdf[1:] - cdf[:-1]])
        return _check_output(np.maximum(p, ORDINAL_FLOOR).astype(np.float32), raw.shape[0])


def mlp_names(question_type: str, ordinal: bool = True) -> tuple[str, str]:
    """The MLPs a question's zq row and u rows go through: the ordinal head's for Score (with
    `ordinal`), else the OptionScorer's."""
    if question_type == "score" and ordinal:
        return "ord.z", "ord.cut"
    return "head.que", "head.opt"


def premade(inputs: dict, readout: QuestionReadout) -> dict:
    """The MLP outputs a readout brought for these first inputs (`QuestionReadout.mlps`, made
    on the device behind the passes), or {} where it brought none or not all of them."""
    if not inputs or readout.mlps is None or not set(inputs) <= set(readout.mlps):
        return {}
    return {name: readout.mlps[name] for name in inputs}


def product_rows(rows: int) -> int:
    """Rows of the DEVICE_ROWS-row products that hold `rows` rows."""
    return -(-rows // DEVICE_ROWS) * DEVICE_ROWS


def option_probabilities(logit: np.ndarray, abstain: np.floating, type_id: int) -> np.ndarray:
    """The scorer's normalisation: Noul sigmoid(logit); otherwise softmax([logits…, abstain])
    without the abstain entry."""
    if type_id == TYPE_IDS["noul"]:
        return sigmoid(logit)
    return softmax(np.append(logit, abstain).astype(np.float32))[:-1]


def option_sums(values: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each option's float32 sum of its log-probabilities, added left to right as the
    reference's index_add does: all options at once, one row each (cumsum is sequential), the
    rows padded with -0.0, which leaves every float32 sum as it is (0.0 would turn -0.0 into
    0.0). An empty option's row sums to -0.0."""
    padded = np.full((sizes.size, max(int(sizes.max()), 1)), -0.0, np.float32)
    padded[np.arange(padded.shape[1]) < sizes[:, None]] = values
    return np.cumsum(padded, axis=1, dtype=np.float32)[:, -1]


def lm_features(picked: Sequence[np.ndarray], first: Sequence[float | None]) -> np.ndarray:
    """The six LM features [K, 6] of one question's options (contract §6.2), float32."""
    return options_features([(picked, first)])


def options_features(
    questions: Sequence[tuple[Sequence[np.ndarray], Sequence[float | None]]],
) -> np.ndarray:
    """`lm_features` of several questions' (picked, first), their rows one after another
    [ΣK, 6]: element by element over every option at once, the log-softmax a question."""
    rows, firsts, sizes = [], [], []
    for picked, first in questions:
        k = len(picked)
        if k == 0 or len(first) != k:
            raise ExecutionError("invalid head input")
        rows += [np.asarray(values, dtype=np.float32).reshape(-1) for values in picked]
        firsts += [0.0 if f is None else f for f in first]
        sizes.append(k)
    lengths = np.array([row.size for row in rows])
    values = np.concatenate(rows)
    if not np.isfinite(values).all():
        raise ExecutionError("invalid head input")
    counts = lengths.astype(np.float32)
    valid = counts > 0
    sums = np.where(valid, option_sums(values, lengths), np.float32(0))
    mean = np.where(valid, sums / np.maximum(counts, np.float32(1)), np.float32(0))
    masked = np.where(valid, sums, EMPTY_SUM).astype(np.float32)
    ends = np.cumsum(sizes)
    dist = np.concatenate(
        [log_softmax(masked[end - k : end]) for k, end in zip(sizes, ends, strict=True)]
    )
    first_values = np.array(firsts, dtype=np.float32)
    if not np.isfinite(first_values).all():
        raise ExecutionError("invalid head input")
    columns = [sums / FEAT_SCALE, mean, counts / FEAT_SCALE, dist, first_values]
    feats = np.stack([*columns, valid.astype(np.float32)], axis=1)
    return feats.astype(np.float32)


def question_mu(
    heads: Heads,
    question_type: str,
    readout: QuestionReadout,
    ordinal: bool = True,
    lm_feats: bool = True,
    first: dict | None = None,
) -> np.ndarray:
    """mu of one question from its readout: the ordinal head for Score, else the OptionScorer.

    For LM features `readout.picked`/`first` need one entry per option (an empty array and None
    for an option without text, as a plain Noul's)."""
    if question_type not in TYPE_IDS:
        raise ExecutionError("invalid head input")
    if question_type == "score" and ordinal:
        return heads.ordinal_mu(readout.zq, readout.u, first)
    feats = lm_features(readout.picked, readout.first) if lm_feats else None
    return heads.option_mu(readout.zq, readout.u, feats, TYPE_IDS[question_type], first)


def dense_layer(heads: Heads, layer: str, jobs: list[tuple[np.ndarray, dict, str]]) -> None:
    """`layer` on each job's rows, into `outputs[key]` (`Heads._stacked`: one product over all
    of them where the layer is stackable, else a product a job)."""
    if not jobs:
        return
    sizes = [rows.shape[0] for rows, _, _ in jobs]
    product = heads._stacked(layer, np.concatenate([rows for rows, _, _ in jobs]), sizes)
    at = 0
    for (_, outputs, key), size in zip(jobs, sizes, strict=True):
        outputs[key] = product[at : at + size]
        at += size


def host_mlps(heads: Heads, wanted: list[dict], made: list[dict]) -> None:
    """The MLPs of FIRST_LINEAR_ORDER on the host, each Linear over every question's rows
    that want it (`dense_layer`): first Linears, then second ones."""
    for name in FIRST_LINEAR_ORDER:
        pairs = zip(wanted, made, strict=True)
        jobs = [(inputs[name], out, f"{name}.0") for inputs, out in pairs if name in inputs]
        dense_layer(heads, f"{name}.0", jobs)
    for name in FIRST_LINEAR_ORDER:
        jobs = [(gelu(m[f"{name}.0"]), m, name) for m in made if f"{name}.0" in m]
        dense_layer(heads, f"{name}.2", jobs)


def questions_mu(
    heads: Heads,
    items: Sequence[tuple[str, QuestionReadout]],
    ordinal: bool = True,
    lm_feats: bool = True,
) -> list[np.ndarray]:
    """`question_mu` of several (type, readout) pairs, each Linear applied to every question's
    rows at once (the MLPs' first Linears, then their second ones, then the scorer's), so that
    a weight (10 MiB at D = 2560) is read from memory once rather than once a question: one
    product over all the questions' rows for the layers in `heads.stackable` (the same bytes as
    alone, checked at load), else the questions in turn; the MLPs on the device where
    `heads.use_device` put them. The same refusals in the same order: a request that any
    question refuses is answered again question by question, which raises the first."""
    wanted = [
        heads.first_inputs(kind, readout, ordinal) if kind in TYPE_IDS else {}
        for kind, readout in items
    ]
    # the MLP outputs made behind the passes where a readout brought them, the rest here
    made = [premade(inputs, readout) for inputs, (_, readout) in zip(wanted, items, strict=True)]
    rest = [{} if outputs else inputs for inputs, outputs in zip(wanted, made, strict=True)]
    with torch.inference_mode(), np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if any(rest) and heads.device_mlps is not None:
            heads.device_mlps.run(rest, made)
        elif any(rest):
            host_mlps(heads, rest, made)
        if all(wanted):
            try:
                return heads_together(heads, items, made, ordinal, lm_feats)
            except ExecutionError:
                pass  # refused: question by question below raises the first refusal in order
        return [
            question_mu(heads, kind, readout, ordinal, lm_feats, outputs)
            for (kind, readout), outputs in zip(items, made, strict=True)
        ]


def heads_together(
    heads: Heads,
    items: Sequence[tuple[str, QuestionReadout]],
    made: list[dict],
    ordinal: bool,
    lm_feats: bool,
) -> list[np.ndarray]:
    """mu of questions whose inputs `Heads.first_inputs` took and whose MLPs `made` holds: the
    OptionScorer's remaining Linears over every scored question's rows at once
    (`Heads.scorer_outputs`), the ordinal head's arithmetic a question."""
    mus: list[np.ndarray | None] = [None] * len(items)
    scored = []
    for i, ((kind, _), outputs) in enumerate(zip(items, made, strict=True)):
        if kind == "score" and ordinal:
            mus[i] = heads.ordinal_levels(outputs["ord.z"][0, 0], outputs["ord.cut"][:, 0])
        else:
            scored.append(i)
    if scored:
        sizes = [made[i]["head.opt"].shape[0] for i in scored]
        type_ids = [TYPE_IDS[items[i][0]] for i in scored]
        feats = None
        if lm_feats:
            feats = options_features([(items[i][1].picked, items[i][1].first) for i in scored])
        que = np.concatenate([made[i]["head.que"] for i in scored])
        opt = np.concatenate([made[i]["head.opt"] for i in scored])
        outputs = heads.scorer_outputs(que, opt, sizes, feats, type_ids)
        for i, type_id, (logit, abstain) in zip(scored, type_ids, outputs, strict=True):
            mu = option_probabilities(logit, abstain, type_id)
            mus[i] = _check_output(mu, logit.shape[0])
    return mus


class DeviceMLPs:
    """The heads' MLPs of FIRST_LINEAR_ORDER (Linear → exact GELU → Linear, float32) on a
    device, in products of DEVICE_ROWS rows; GELU in float64 as `gelu` on the host. Each MLP's
    product is a slot of `runtime.backends.graphs.GraphSlots` (a CUDA graph on CUDA), and a
    request's rows go up in one host buffer and come back in another, with one wait (`apply`)."""

    def __init__(self, heads: Heads, device: torch.device):
        from runtime.backends.graphs import GraphSlots

        self.heads = heads
        self.device = device
        # a stream of their own, non-blocking and of high priority: the worker runs a request's
        # heads while the next request's passes run on the default stream (server/admission.py)
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device, priority=-1) if cuda else None
        # the host's product weights (Heads.products): a narrow layer NARROW_WIDTH wide
        self.t = {
            layer: tuple(tensor.to(device) for tensor in heads.products[layer])
            for mlp in FIRST_LINEAR_ORDER
            for layer in (f"{mlp}.0", f"{mlp}.2")
        }
        self.widths = {layer: heads.t[f"{layer}.bias"].shape[0] for layer in self.t}
        if self.stream is not None:  # the weights were copied on the default stream
            self.stream.wait_stream(torch.cuda.current_stream(device))
        self.lock = threading.Lock()  # the slots' and host buffers' one user at a time
        slots = functools.partial(
            GraphSlots, device, self.bind, self.launch, len(FIRST_LINEAR_ORDER), cuda
        )
        self.slots = slots(stream=self.stream)
        self.host: dict[str, torch.Tensor] = {}  # `buffer`'s, pinned on CUDA
        # `behind`'s slots, apart from `apply`'s: its products wait in the passes' stream after
        # the call returns, while `apply` may fill its own buffers on the MLPs' stream
        self.queued = slots()
        self.behind_usable = False  # `usable` sets it: `behind` gives `apply`'s bytes

    def streamed(self):
        """The context that puts work on the MLPs' own stream (none on the CPU)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def dense(self, layer: str, x: torch.Tensor) -> torch.Tensor:
        """Linear `layer` on rows [N, in] of the device, in products of DEVICE_ROWS rows."""
        weight, bias = self.t[layer]
        rows = x.shape[0]
        x = torch.nn.functional.pad(x, (0, 0, 0, product_rows(rows) - rows))
        pieces = [
            torch.nn.functional.linear(x[at : at + DEVICE_ROWS], weight, bias)
            for at in range(0, x.shape[0], DEVICE_ROWS)
        ]
        return torch.cat(pieces)[:rows, : self.widths[layer]]

    def mlp(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return self.dense(f"{name}.2", exact_gelu(self.dense(f"{name}.0", x)))

    def bind(self, key: tuple, feeds: dict, outputs: dict):
        """A slot for MLP `key[0]`: device buffers shaped as one product's rows in and out."""
        from runtime.backends.graphs import Slot

        def on_device(tensors: dict) -> dict:
            return {
                n: torch.empty(t.shape, dtype=t.dtype, device=self.device)
                for n, t in tensors.items()
            }

        return Slot(on_device(feeds), on_device(outputs), state=key[0])

    def launch(self, slot) -> None:
        slot.outputs["y"].copy_(self.mlp(slot.state, slot.inputs["x"]))

    def run(self, wanted: list[dict], made: list[dict]) -> None:
        """Each MLP over every question's rows that want it (`Heads.first_inputs`), into
        `made[i][name]`."""
        batches = []
        for name in FIRST_LINEAR_ORDER:
            owners = [(i, inputs[name]) for i, inputs in enumerate(wanted) if name in inputs]
            if owners:
                rows = np.concatenate([x for _, x in owners]).astype(np.float32, copy=False)
                batches.append((name, owners, rows))
        results = self.apply([(name, rows) for name, _, rows in batches])
        for (name, owners, _), values in zip(batches, results, strict=True):
            at = 0
            for i, x in owners:
                made[i][name] = values[at : at + x.shape[0]]
                at += x.shape[0]

    def apply(self, batches: list[tuple[str, np.ndarray]]) -> list[np.ndarray]:
        """Each (MLP name, host rows [N, D]) through its MLP, the outputs on the host: every
        input row into one host buffer (zero rows fill each MLP's last product), each product
        through its slot on the MLPs' stream, one wait at the end."""
        widths = [self.widths[f"{name}.2"] for name, _ in batches]
        sizes = [product_rows(rows.shape[0]) for _, rows in batches]
        with self.lock, torch.inference_mode(), self.streamed():
            inputs = self.buffer("in", sum(sizes) * self.heads.hidden)
            outputs = self.buffer("out", sum(n * w for n, w in zip(sizes, widths, strict=True)))
            views, at, out_at = [], 0, 0
            for (name, rows), size, width in zip(batches, sizes, widths, strict=True):
                x = inputs[at * self.heads.hidden : (at + size) * self.heads.hidden]
                x = x.view(size, self.heads.hidden)
                x.numpy()[: rows.shape[0]] = rows
                x.numpy()[rows.shape[0] :] = 0
                y = outputs[out_at : out_at + size * width].view(size, width)
                for piece in range(0, size, DEVICE_ROWS):
                    rows_in, rows_out = (
                        x[piece : piece + DEVICE_ROWS],
                        y[piece : piece + DEVICE_ROWS],
                    )
                    self.slots.run((name,), {"x": rows_in}, {"y": rows_out})
                views.append(y[: rows.shape[0]])
                at, out_at = at + size, out_at + size * width
            if self.stream is not None:
                self.stream.synchronize()
            return [view.numpy().copy() for view in views]  # the buffers serve the next call

    def behind(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each MLP over rows already on the device (name -> [N, D], N a multiple of
        DEVICE_ROWS, zero rows filling the last product), enqueued on the current stream behind
        what is there and not waited for: name -> outputs [N, width] on the device. The
        executor enqueues them right behind a request's passes (`Executor.mlps_behind`), so
        that their rows never go to the host and back before the heads."""
        made = {}
        with self.lock, torch.inference_mode():
            for name, x in rows.items():
                y = torch.empty(x.shape[0], self.widths[f"{name}.2"], device=self.device)
                for at in range(0, x.shape[0], DEVICE_ROWS):
                    piece = slice(at, at + DEVICE_ROWS)
                    self.queued.run((name,), {"x": x[piece]}, {"y": y[piece]})
                made[name] = y
        return made

    def buffer(self, name: str, size: int) -> torch.Tensor:
        """A float32 host buffer of at least `size` elements, pinned on CUDA, kept for later
        calls."""
        held = self.host.get(name)
        if held is None or held.numel() < size:
            grown = max(size, 2 * held.numel()) if held is not None else size
            pinned = self.device.type == "cuda"
            held = torch.empty(grown, dtype=torch.float32, pin_memory=pinned)
            self.host[name] = held
        return held[:size]

    def usable(self) -> bool:
        """Whether every MLP gives a row the same bytes whatever the other rows of its product
        and wherever it sits (STACK_CHECK_*), and agrees with the host's MLP within
        DEVICE_TOLERANCE (no TF32 or other reduced precision on the way)."""
        if self.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest":
            return False
        generator = torch.Generator().manual_seed(0)
        for name in FIRST_LINEAR_ORDER:
            x = torch.randn(STACK_CHECK_ROWS, self.heads.hidden, generator=generator)
            on_device = functools.partial(self.mlp_on_host_rows, name)
            if not same_rows(on_device, x):
                return False
            with torch.inference_mode():
                host = torch.from_numpy(self.heads._mlp(name, x[:DEVICE_ROWS].numpy()))
            if not torch.allclose(
                on_device(x[:DEVICE_ROWS]), host, rtol=DEVICE_TOLERANCE, atol=DEVICE_TOLERANCE
            ):
                return False
        self.behind_usable = self.behind_agrees()
        return True

    def behind_agrees(self) -> bool:
        """Whether `behind` gives every row `apply`'s bytes: two products of each MLP, twice
        (the first product eager, the others through the captured graph where it captures)."""
        generator = torch.Generator().manual_seed(1)
        for name in FIRST_LINEAR_ORDER:
            x = torch.randn(2 * DEVICE_ROWS, self.heads.hidden, generator=generator)
            expected = self.mlp_on_host_rows(name, x)
            for _ in range(2):
                with torch.inference_mode():
                    made = self.behind({name: x.to(self.device)})[name].cpu()
                if not torch.equal(made, expected):
                    return False
        return True

    def mlp_on_host_rows(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The MLP of host rows as a request's rows go (`apply`), back on the host."""
        return torch.from_numpy(self.apply([(name, x.numpy())])[0])
