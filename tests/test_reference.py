"""Tests of the PyTorch reference (`reference/mso1.py`) on the tiny synthetic export, CPU float32:
MSO1's branch path equals one plain forward per row, ignores question order, lays requests out
as preparation does and answers in the contract's response form."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

import reference.mso1 as mso1
from reference.mso1 import IMAGE_PAD, Reference, branch_layout, expand_cache
from reference.questions import gate_questions, pattern_png, request_body, speed_bench_questions
from runtime.contract import compile_request
from runtime.explain import explain
from runtime.processing import prepare
from runtime.strict_json import parse_body
from runtime.types import QuestionReadout
from tests.spec import ANSWER_FIELDS, FIXTURES, rows_as_json

ROOT = Path(__file__).resolve().parents[1]
IMAGE = pattern_png(320, 224)  # smart resize keeps 320×224: grid [1, 14, 20], 70 image tokens
# Issue #3: branch against plain within 1e-5 in float32 as well, on final-norm hidden states and
# log-probabilities: the passes round differently (other shapes; transformers' chunked gated delta
# rule counts its chunks of 64 from the start of each pass), while broken branches land orders of
# magnitude away (docs/measurements/reference-branching.md has the measured margins).
FLOAT32 = 1e-5
ORDER = 1e-6  # answers when only the question order changes
SETS = {"speed_bench": speed_bench_questions(), "gate": gate_questions()}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices are small: on a shared CPU one thread runs them about ten times
    faster than several spinning threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(export_dir) -> Reference:
    return Reference(export_dir)


@pytest.fixture(scope="module")
def exact_reference(reference) -> Reference:
    """The same model in float64; tests pair it with `exact_gated_delta_rule`."""
    model = copy.deepcopy(reference.model).double()
    return Reference.from_parts(model, reference.heads, reference.calibration, reference.tokenizer)


def prepared_of(reference: Reference, questions: dict[str, dict]):
    return prepare(compile_request(parse_body(request_body(IMAGE, questions))), reference.tokenizer)


def exact_gated_delta_rule(
    query,
    key,
    value,
    g,
    beta,
    chunk_size=64,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    **_,
):
    """The gated delta rule token by token in float64 (docs/model.md §3): an oracle without the
    float32 chunk arithmetic of transformers' kernel, so that only the branch logic is compared."""
    q, k, v, b, decay = (x.transpose(1, 2).double() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    batch, heads, steps, k_dim = k.shape
    state = (
        torch.zeros(batch, heads, k_dim, v.shape[-1], dtype=torch.float64)
        if initial_state is None
        else initial_state.double()
    )
    out = torch.empty(batch, heads, steps, v.shape[-1], dtype=torch.float64)
    decay = decay.exp()
    for t in range(steps):
        key_t = k[:, :, t, None, :]  # [B, H, 1, K]
        state = state * decay[:, :, t, None, None]
        delta = (v[:, :, t, None, :] - key_t @ state) * b[:, :, t, None, None]  # [B, H, 1, V]
        state = state + key_t.transpose(-1, -2) @ delta
        out[:, :, t] = (q[:, :, t, None, :] @ state)[:, :, 0]
    return out.transpose(1, 2).to(query.dtype), state if output_final_state else None


def largest_differences(ours: list[QuestionReadout], theirs: list[QuestionReadout]) -> dict:
    """Largest differences of hidden states (zq, u), absolute, and of log-probabilities,
    relative to the log-probability's magnitude where it is above 1: those of the tiny model sit
    near log(1/248,079) = -12.4, where one float32 rounding is 1e-6 (the float32 branch and
    plain forward differed there by 1.9e-5 on an AMD EPYC host, by less on the CI machine)."""
    hidden, logprob = 0.0, 0.0
    for a, b in zip(ours, theirs, strict=True):
        assert a.u.shape == b.u.shape
        assert [p.shape for p in a.picked] == [p.shape for p in b.picked]
        assert [f is None for f in a.first] == [f is None for f in b.first]
        hidden = max(hidden, float(np.abs(a.zq - b.zq).max()), float(np.abs(a.u - b.u).max()))
        for x, y in zip(a.picked, b.picked, strict=True):
            relative = np.abs(x - y) / np.maximum(1.0, np.abs(y))
            logprob = max([logprob, *relative.tolist()])
        for x, y in zip(a.first, b.first, strict=True):
            if x is not None:
                logprob = max(logprob, abs(x - y) / max(1.0, abs(y)))
    return {"hidden": hidden, "logprob": logprob}


def read_counts(readouts: list[QuestionReadout]) -> int:
    return sum(p.size for r in readouts for p in r.picked) + sum(
        f is not None for r in readouts for f in r.first
    )


# -- layout -----------------------------------------------------------------------------------


def fixture_cases() -> list[dict]:
    path = FIXTURES / "processing.json"
    return json.loads(path.read_text("utf-8"))["cases"] if path.exists() else []


def expand_image_run(ids: list[int]) -> list[int]:
    """The fixture writes the image run as one negative count."""
    return [t for token in ids for t in ([IMAGE_PAD] * -token if token < 0 else [token])]


@pytest.mark.skipif(not fixture_cases(), reason=f"reference fixtures not found at {FIXTURES}")
@pytest.mark.parametrize("case", fixture_cases(), ids=lambda case: case["name"])
def test_layout_equals_the_reference_fixture(case):
    sequences = [expand_image_run(q["token_ids"]) for q in case["questions"]]
    layout = branch_layout(sequences, [len(q["keys"]) for q in case["questions"]])
    assert layout.prefix_length == case["prefix_length"]
    assert layout.input_tokens == case["input_tokens"]
    for rows, question in zip(layout.rows, case["questions"], strict=True):
        expected = [
            (r["tokens"], r["zq"], r["u"], r["targets"], r["first"]) for r in question["rows"]
        ]
        got = [(list(r.tokens), r.zq, r.u, [list(t) for t in r.targets], r.first) for r in rows]
        assert got == expected


@pytest.mark.parametrize(
    "questions",
    [SETS["speed_bench"], SETS["gate"], {"q": speed_bench_questions(1)["q0"]}],
    ids=["speed_bench", "gate", "single"],
)
def test_layout_and_input_tokens_equal_explain(reference, questions):
    body = request_body(IMAGE, questions)
    explained = explain(body, reference.tokenizer)
    prepared = prepared_of(reference, questions)
    layout = reference.layout(prepared)
    assert layout.prefix_length == explained["prefix_length"]
    assert layout.input_tokens == explained["input_tokens"]
    for rows, question in zip(layout.rows, explained["questions"], strict=True):
        assert rows_as_json(rows) == question["rows"]
    # The prefix positions MSO1 computes, and the rows continuing at p0, are preparation's.
    length = layout.prefix_length
    ids = torch.tensor([prepared.layouts[0].token_ids[:length]])
    image = reference._image_inputs(prepared.image)
    positions = reference._positions(ids, image)[:, 0].numpy()
    p0 = int(positions.max()) + 1
    for question_layout, rows in zip(prepared.layouts, layout.rows, strict=True):
        np.testing.assert_array_equal(question_layout.positions[:, :length], positions)
        head = question_layout.opens[0] - length
        np.testing.assert_array_equal(
            question_layout.positions[:, length : length + head],
            np.tile(np.arange(p0, p0 + head), (3, 1)),
        )
        assert len(rows[0].tokens) >= head + 2


# -- cache expansion --------------------------------------------------------------------------


def cache_tensors(cache) -> list[torch.Tensor]:
    found = []
    for layer in cache.layers:
        for value in vars(layer).values():
            items = value.values() if isinstance(value, dict) else [value]
            found += [item for item in items if isinstance(item, torch.Tensor)]
    return found


def test_expand_cache_repeats_every_state_and_keeps_the_prefix(reference):
    prepared = prepared_of(reference, speed_bench_questions(3))
    layout = reference.layout(prepared)
    rows = [row for question in layout.rows for row in question]
    with torch.no_grad():
        cache0, p0 = reference._prefix_pass(
            prepared.layouts[0].token_ids[: layout.prefix_length], prepared.image
        )
        before = [t.clone() for t in cache_tensors(cache0)]
        kinds = {type(layer).__name__ for layer in cache0.layers}
        assert kinds == {"LinearAttentionLayer", "DynamicLayer"}  # both state kinds exercised
        expanded = expand_cache(cache0, len(rows))
        for original, copied in zip(cache_tensors(cache0), cache_tensors(expanded), strict=True):
            assert copied.shape == (len(rows) * original.shape[0], *original.shape[1:])
            assert copied.untyped_storage().data_ptr() != original.untyped_storage().data_ptr()
            torch.testing.assert_close(copied, original.expand_as(copied), rtol=0, atol=0)
        reference._branch_chunk(rows, cache0, layout.prefix_length, p0)
    after = cache_tensors(cache0)
    assert len(after) == len(before) == 2 * len(cache0.layers)
    for old, new in zip(before, after, strict=True):
        torch.testing.assert_close(new, old, rtol=0, atol=0)


# -- branch against plain ---------------------------------------------------------------------


@pytest.mark.parametrize("name", SETS)
def test_branch_equals_plain_forward_exactly(exact_reference, monkeypatch, name):
    monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", exact_gated_delta_rule)
    monkeypatch.setattr(qwen3_5, "torch_recurrent_gated_delta_rule", exact_gated_delta_rule)
    prepared = prepared_of(exact_reference, SETS[name])
    branch = exact_reference.readouts(prepared)
    plain = exact_reference.plain_readouts(prepared)
    assert read_counts(branch) > len(branch)  # option-text log-probs were compared too
    differences = largest_differences(branch, plain)
    assert differences == {"hidden": 0.0, "logprob": 0.0}  # float64, exact recurrence


@pytest.mark.parametrize("name", SETS)
def test_branch_equals_plain_forward_in_float32(reference, name):
    prepared = prepared_of(reference, SETS[name])
    branch = reference.readouts(prepared)
    plain = reference.plain_readouts(prepared)
    assert read_counts(branch) > len(branch)  # option-text log-probs were compared too
    differences = largest_differences(branch, plain)
    assert differences["hidden"] <= FLOAT32 and differences["logprob"] <= FLOAT32, differences
    # Not vacuous: the questions' states differ far more than the tolerance.
    assert float(np.abs(branch[0].zq - branch[1].zq).max()) > 1e4 * FLOAT32


def test_chunking_changes_no_readout(exact_reference, monkeypatch):
    monkeypatch.setattr(qwen3_5, "torch_chunk_gated_delta_rule", exact_gated_delta_rule)
    prepared = prepared_of(exact_reference, SETS["speed_bench"])
    whole = exact_reference.readouts(prepared)
    monkeypatch.setenv(mso1.CHUNK_ENV, "4")  # 35 rows: 9 chunks, crossing question boundaries
    chunked = exact_reference.readouts(prepared)
    differences = largest_differences(chunked, whole)
    assert differences == {"hidden": 0.0, "logprob": 0.0}  # float64, exact recurrence


# -- answers ----------------------------------------------------------------------------------


def assert_contract_response(response: dict, questions: dict[str, dict]) -> None:
    assert list(response) == ["model", "answers", "usage"]
    assert response["model"] == "tinnel123/OmniJev"
    assert list(response["answers"]) == list(questions)
    assert list(response["usage"]) == ["input_tokens", "output_tokens"]
    assert response["usage"]["output_tokens"] == 0
    for qid, answer in response["answers"].items():
        assert list(answer) == ANSWER_FIELDS[questions[qid]["type"]]
        assert answer["latency_total_s"] > 0


def test_answer_follows_the_contract(reference):
    questions = SETS["speed_bench"]
    body = request_body(IMAGE, questions)
    response = reference.answer(body)
    assert_contract_response(response, questions)
    assert response["usage"]["input_tokens"] == explain(body, reference.tokenizer)["input_tokens"]
    q0 = response["answers"]["q0"]
    assert list(q0["probabilities"]) == ["click", "type text", "scroll", "wait"]
    assert q0["choice"] == max(q0["probabilities"], key=q0["probabilities"].get)
    score = response["answers"]["q2"]
    assert list(score["probabilities"]) == ["harmless", "needs care", "irreversible"]
    totals = {answer["latency_total_s"] for answer in response["answers"].values()}
    assert len(totals) == 1
    assert abs(q0["latency_s"] * len(questions) - totals.pop()) <= len(questions) * 1e-4


def decisions(answers: dict) -> dict:
    return {
        qid: a.get("choice", a.get("score", a.get("noul", 0) > 0.5)) for qid, a in answers.items()
    }


def probabilities(answer: dict) -> dict:
    values = {k: answer[k] for k in ("noul", "abstain", "confidence") if k in answer}
    return values | answer.get("probabilities", {})


def test_reordering_the_questions_changes_no_answer(reference):
    questions = SETS["speed_bench"]
    reordered = dict(reversed(list(questions.items())))
    forward = reference.answer(request_body(IMAGE, questions))
    backward = reference.answer(request_body(IMAGE, reordered))
    assert list(backward["answers"]) == list(reordered)
    assert decisions(backward["answers"]) == decisions(forward["answers"])
    assert backward["usage"] == forward["usage"]
    for qid, answer in forward["answers"].items():
        ours, theirs = probabilities(answer), probabilities(backward["answers"][qid])
        assert ours.keys() == theirs.keys()
        assert all(abs(ours[k] - theirs[k]) <= ORDER for k in ours), qid


# -- command line -----------------------------------------------------------------------------


def test_cli_prints_a_valid_response(export_dir, reference, tmp_path):
    questions = {qid: SETS["gate"][qid] for qid in ("one_token", "score10", "noul_region")}
    request = tmp_path / "request.json"
    request.write_bytes(request_body(IMAGE, questions))
    command = [
        sys.executable,
        "-m",
        "runtime.cli",
        "reference",
        str(request),
        "--checkpoint",
        str(export_dir),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    response = json.loads(done.stdout)
    assert_contract_response(response, questions)
    expected = reference.answer(request.read_bytes())
    assert response["usage"] == expected["usage"]
    assert decisions(response["answers"]) == decisions(expected["answers"])


def test_cli_reports_a_refusal(reference, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(mso1, "Reference", lambda *args, **kwargs: reference)
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"state": {"images": []}, "questions": {}}))
    args = Namespace(request=str(request), checkpoint="unused", dtype="float32", device=None)
    assert mso1.cli_reference(args) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "state.images must contain exactly one image" in captured.err
