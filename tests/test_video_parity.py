"""A clip's answers on the tiny checkpoint, CPU float32: the executor (ONNX Runtime) against the
PyTorch reference on generated clips (PyAV encodes them: moving shapes, 1 to 16 frames, several
sizes, durations and codecs), the M-RoPE positions against transformers' `get_rope_index`, and
the reference's mosaic form against the file form of the same frames."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.clips import clip, video_url
from bench.parity import compare
from reference.questions import gate_questions
from runtime.contract import compile_request
from runtime.errors import ContractError
from runtime.images import CLIP_PREFIX, CLIP_TOKENS
from runtime.processing import prepare
from runtime.strict_json import parse_body
from runtime.video import video_file, video_frames
from tests.engine_fixtures import tiny_engines
from tests.video_clips import mosaic_state, video_body

PARITY = 1.0001e-4  # the 1e-4 on answers rounded to four decimals (tests/test_executor.py)
QUESTIONS = {
    "fell": {"type": "noul", "instructions": "Did the person fall?"},
    "queue": {
        "type": "choice",
        "instructions": "Is the queue moving?",
        "criteria": {"yes": None, "no": "it stands still", "unclear": None},
    },
    "speed": {"type": "score", "instructions": "How fast?", "levels": ["still", "slow", "fast"]},
}
# (frames, width, height, fps, codec): 1 to 16 frames kept of clips up to 40 frames long, so
# the uniform sampling picks; sizes whose resize differs; 0.2 to 8 seconds
CLIPS = [
    (1, 64, 48, 5, "h264"),
    (2, 64, 48, 5, "vp8"),
    (3, 48, 64, 2, "h264"),
    (4, 64, 48, 1, "vp9"),
    (5, 96, 32, 10, "h264"),
    (6, 64, 48, 5, "vp8"),
    (7, 40, 40, 3, "h264"),
    (8, 64, 48, 4, "vp9"),
    (9, 80, 48, 5, "h264"),
    (10, 64, 48, 25, "h264"),
    (11, 32, 96, 5, "vp8"),
    (12, 64, 48, 2, "h264"),
    (13, 48, 48, 5, "vp9"),
    (14, 64, 48, 5, "h264"),
    (15, 64, 40, 6, "vp8"),
    (16, 64, 48, 5, "h264"),
    (17, 64, 48, 5, "h264"),
    (24, 48, 32, 12, "vp9"),
    (30, 64, 48, 30, "h264"),
    (40, 32, 32, 5, "vp8"),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The tiny model's matrices are small: one thread runs them faster on a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return tiny_engines(tmp_path_factory)


@pytest.fixture(scope="module")
def executor(engines):
    from runtime.executor import load_engine

    return load_engine(str(engines[0]), str(engines[1]), "onnxruntime")


@pytest.fixture(scope="module")
def reference(engines):
    from reference.mso1 import Reference

    return Reference(engines[0], dtype="float32", device="cpu")


def file_body(count, width, height, fps, codec, questions=QUESTIONS) -> bytes:
    data, mime = clip(count, width, height, codec, fps, seed=count)
    return video_body({"video": video_url(data, mime)}, questions)


@pytest.mark.parametrize("case", CLIPS, ids=lambda c: "x".join(map(str, c)))
def test_a_clip_matches_the_float32_reference(executor, reference, case):
    body = file_body(*case)
    ours, theirs = executor.answer(body), reference.answer(body)
    result = compare(theirs, ours)
    assert result["input_tokens_equal"]
    assert max(result["differences"]) <= PARITY, result
    assert not result["flips"]
    assert list(ours["answers"]) == list(QUESTIONS)


def test_readouts_match_the_reference_below_the_rounding(executor, reference):
    """Hidden states and log-probabilities of a 16-frame clip agree; another clip's differ, so
    the frames reach the readouts."""
    prepared = prepare(
        compile_request(parse_body(file_body(16, 64, 48, 5, "h264", gate_questions()))),
        executor.tokenizer,
    )
    ours, theirs = executor.readouts(prepared), reference.readouts(prepared)
    for a, b in zip(ours, theirs, strict=True):
        assert np.allclose(a.zq, b.zq, atol=1e-4, rtol=1e-4)
        assert np.allclose(a.u, b.u, atol=1e-4, rtol=1e-4)
        for pa, pb in zip(a.picked, b.picked, strict=True):
            assert np.allclose(pa, pb, atol=1e-4, rtol=1e-5)
    other = prepare(
        compile_request(parse_body(file_body(16, 64, 48, 5, "vp9", gate_questions()))),
        executor.tokenizer,
    )
    assert not np.allclose(executor.readouts(other)[0].zq, ours[0].zq, atol=1e-3)


def test_positions_are_get_rope_index(reference):
    """Every question's whole sequence, several frames of two sizes' grids: the prepared
    positions equal transformers' `get_rope_index` over the frames' grids."""
    body = file_body(5, 96, 32, 10, "h264", gate_questions())
    prepared = prepare(compile_request(parse_body(body)), reference.tokenizer)
    inputs = reference._image_inputs(prepared.image)
    assert len(prepared.image.frames) == 5
    for layout in prepared.layouts:
        ids = torch.tensor([list(layout.token_ids)])
        theirs = reference._positions(ids, inputs)[:, 0].numpy()
        assert np.array_equal(theirs, layout.positions)


@pytest.mark.parametrize("codec", ["h264", "vp9"])
def test_the_mosaic_form_answers_as_the_file_form(executor, codec):
    """The reference's mosaic of a file's decoded frames, with their timestamps and duration,
    gets the file's answers byte for byte."""
    data, mime = clip(9, 64, 48, codec, 3, seed=4)
    decoded = video_frames(video_file(video_url(data, mime)))
    state = mosaic_state(list(decoded.frames), decoded.timestamps, decoded.duration, cols=4)
    as_file = executor.answer(video_body({"video": video_url(data, mime)}, QUESTIONS))
    as_mosaic = executor.answer(video_body(state, QUESTIONS))
    assert without_latency(as_file) == without_latency(as_mosaic)


def test_a_long_clips_frames_share_its_budget_and_its_mosaic_answers_alike(executor):
    """Sixteen 640x480 frames share CLIP_TOKENS: each resized within its share (416x576, where a
    still keeps 480x640), and the mosaic of the frames as resized gets the file's answers (a
    tile already of its resized size passes the resize unchanged)."""
    data, mime = clip(16, 640, 480, "h264", 2, seed=2)
    body = video_body({"video": video_url(data, mime)}, QUESTIONS)
    prepared = executor.prepare(json.loads(body))
    frames = prepared.image.frames
    assert {tuple(frame.grid_thw) for frame in frames} == {(1, 26, 36)}
    assert prepared.image.image_tokens == 16 * 13 * 18 <= CLIP_TOKENS
    video = prepared.image
    state = mosaic_state([f.resized for f in frames], video.timestamps, video.duration)
    as_mosaic = executor.answer(video_body(state, QUESTIONS))
    assert without_latency(executor.answer(body)) == without_latency(as_mosaic)


def test_frames_the_device_resizes_give_the_host_answers(executor):
    """On a GPU each frame's resize and patches are left to the device (byte for byte the
    host's), the frames named by their file's digest for the prefix cache: the same answers."""
    data, mime = clip(6, 320, 240, "h264", 3, seed=6)
    obj = parse_body(video_body({"video": video_url(data, mime)}, QUESTIONS))
    host = prepare(compile_request(obj), executor.tokenizer)
    device = prepare(compile_request(obj), executor.tokenizer, pack=False, resize=False)
    frames = device.image.frames
    assert all(f.resized is None and f.pixel_values is None for f in frames)
    assert len({f.digest for f in frames}) == len(frames) and None not in {f.digest for f in frames}
    one = json.dumps(without_latency(executor.execute(host)))
    assert json.dumps(without_latency(executor.execute(device))) == one


def test_a_mosaic_past_a_clips_prefix_is_refused(executor):
    """A mosaic's tiles keep an image's budget (the reference's): nine 1024x576 tiles, 576
    tokens each, fit a question's 8,192 tokens but not a clip's prefix."""
    tiles = [np.full((576, 1024, 3), 25 * i, dtype=np.uint8) for i in range(9)]
    state = mosaic_state(tiles, list(range(9)), 9, cols=3)
    with pytest.raises(ContractError, match=f"video prefix must be at most {CLIP_PREFIX} tokens"):
        executor.prepare(json.loads(video_body(state, QUESTIONS)))


def without_latency(response: dict) -> dict:
    answers = {
        key: {k: v for k, v in answer.items() if not k.startswith("latency")}
        for key, answer in response["answers"].items()
    }
    return {**response, "answers": answers}
