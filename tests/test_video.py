"""runtime.video and runtime.video_prepare without a model: PyAV decodes generated clips to their
frames, samples them uniformly with their times, the mosaic is cut back into the same frames,
the prompt is the reference's, the decoder's process is bounded, and track counts come from
the container headers."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from bench.clips import clip, encode_clip, moving_frames, video_url
from reference.questions import data_url, pattern_png
from runtime import video
from runtime.contract import compile_request
from runtime.errors import ContractError
from runtime.explain import explain
from runtime.strict_json import parse_body
from runtime.tokenizer import load_tokenizer
from runtime.video_prepare import video_prompt
from runtime.video_tracks import ebml_elements, mp4_tracks, webm_tracks
from tests.video_clips import mosaic_state, video_body
from tools.hostile_videos import encode, repeated

QUESTIONS = {"fell": {"type": "noul", "instructions": "Did it fall?  "}}


def test_sampling_spreads_at_most_16_frames_from_first_to_last() -> None:
    assert video.sample_indices(1) == [0]
    assert video.sample_indices(5) == [0, 1, 2, 3, 4]
    many = video.sample_indices(40)
    assert len(many) == 16 and many[0] == 0 and many[-1] == 39
    assert all(b - a in (2, 3) for a, b in zip(many, many[1:], strict=False))


@pytest.mark.parametrize("codec", ["h264", "vp8", "vp9"])
def test_a_clip_decodes_to_its_frames_and_times(codec: str) -> None:
    """Ten frames at 4 frames a second: all kept, 0.25 s apart, 2.5 s long, each close to the
    frame encoded (lossy codecs: a small mean difference, far below the frames' own)."""
    frames = moving_frames(10, 64, 48, seed=3)
    data = encode_clip(frames, codec, fps=4)
    decoded = video.video_frames(video.video_file(video_url(data, clip(1, 16, 16, codec)[1])))
    assert decoded.timestamps == tuple(round(i * 0.25, 2) for i in range(10))
    assert decoded.duration == 2.5
    for source, frame in zip(frames, decoded.frames, strict=True):
        assert frame.shape == (48, 64, 3) and frame.dtype == np.uint8
        error = np.abs(frame.astype(int) - source).mean()
        assert error < 12, error
    assert np.abs(decoded.frames[0].astype(int) - frames[9]).mean() > 2 * error


def test_a_long_clip_keeps_16_frames_with_their_times() -> None:
    data, mime = clip(40, 32, 32, "h264", fps=8)
    decoded = video.video_frames(video.video_file(video_url(data, mime)))
    picked = video.sample_indices(40)
    assert decoded.timestamps == tuple(round(i / 8, 2) for i in picked)
    assert len(decoded.frames) == 16 and decoded.duration == 5.0


def test_the_mosaic_is_cut_back_into_its_frames() -> None:
    frames = moving_frames(7, 40, 30, seed=1)
    state = mosaic_state(frames, [0, 1, 2, 3, 4, 5, 6], 7, cols=3)
    decoded = video.video_frames(video.video_of_state(state))
    assert decoded.timestamps == (0, 1, 2, 3, 4, 5, 6) and decoded.duration == 7
    assert all(np.array_equal(a, b) for a, b in zip(frames, decoded.frames, strict=True))
    square = {
        **state,
        "video": {**state["video"], "tile": 30, "n_frames": 3, "timestamps": [0, 1, 2]},
    }
    cut = video.video_frames(video.video_of_state(square))
    # a 30-pixel square tile across the 40×30 frames: the second spans two of them
    expected = np.concatenate([frames[0][:, 30:40], frames[1][:, 0:20]], axis=1)
    assert np.array_equal(cut.frames[1], expected)


def test_the_prompt_is_the_references() -> None:
    """docs/model.md §8.2: the intro, then `t={ts}s:` and an image a frame, then the
    instructions without their trailing whitespace (the template trims the user turn)."""
    tokenizer = load_tokenizer(None)
    state = mosaic_state(moving_frames(2, 32, 32), [0, 1.5], 2.6, cols=2)
    request = compile_request(parse_body(video_body(state, QUESTIONS)))
    from runtime.processing import prepare

    prepared = prepare(request, tokenizer)
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    assert video_prompt(request.questions[0], prepared.image) == (
        "<|im_start|>user\nA video of 3 seconds; 2 frames sampled uniformly in order."
        f"t=0s:{image}t=1.5s:{image}Did it fall?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        "<|opt|><|/opt|>"
    )
    ids = prepared.layouts[0].token_ids
    assert ids.count(248056) == 2 * 64  # each 32×32 frame resizes to 256×256: 8×8 tokens
    # the prefix holds both frames: it ends at the last <|vision_end|> or later
    assert prepared.prefix_length > len(ids) - ids[::-1].index(248054) - 1


def test_explain_lists_every_frame() -> None:
    state = mosaic_state(moving_frames(3, 32, 32), [0, 1, 2], 3, cols=3)
    explained = explain(video_body(state, QUESTIONS), load_tokenizer(None))
    frames = explained["video"]["frames"]
    assert len(frames) == 3 and frames[0]["image_grid_thw"] == [1, 16, 16]
    assert explained["video"]["timestamps"] == [0, 1, 2]
    assert sum(1 for t in explained["questions"][0]["token_ids"] if t < 0) == 3


def test_the_decoder_process_is_killed_at_its_deadline() -> None:
    data, mime = clip(3, 32, 32)
    file = video.video_file(video_url(data, mime))
    with pytest.raises(ContractError, match="video must decode within 0 s"):
        video.decode_file(file, seconds=0, slack=0)


def test_a_decoder_that_dies_is_an_invalid_video() -> None:
    data, mime = clip(3, 32, 32)
    file = video.video_file(video_url(data, mime))
    with pytest.raises(ContractError, match="^invalid video$"):
        video.decode_file(file, python="/bin/false")


def fake_decoder(folder: Path, answer: bytes, then: str = "") -> str:
    """An executable that reads its request, writes `answer` and runs `then` (shell)."""
    (folder / "answer").write_bytes(answer)
    script = folder / "decoder"
    script.write_text(f"#!/bin/sh\ncat > /dev/null\ncat '{folder / 'answer'}'\n{then}\n")
    script.chmod(0o755)
    return str(script)


def frames_answer(shape: list[int]) -> bytes:
    meta = {"shapes": [shape], "timestamps": [0.0], "duration": 1.0, "most_pixels": 4}
    return json.dumps({"frames": meta}).encode() + b"\n"


def test_a_decoders_answer_is_json_and_nothing_else(tmp_path: Path) -> None:
    """The worker parses one line of JSON from the decoder, never a pickle: a decoder that an
    exploited container took over reaches nothing through it. Any other answer, or one that
    names frames its file does not hold, is an invalid video; a refusal keeps its message."""
    import pickle

    data, mime = clip(2, 32, 32)
    file = video.video_file(video_url(data, mime))
    forged = pickle.dumps(("frames", ((2, 2, 3),), (0.0,), 1.0, 4))
    for answer in (
        forged,
        b"[1, 2]\n",
        b'{"frames": {"shapes": 3}}\n',
        frames_answer([32, 32, 3]),  # the file holds none of it
        frames_answer([5000, 5000, 3]),
        b"x" * (video.ANSWER_BYTES + 10),
    ):
        with pytest.raises(ContractError, match="^invalid video$"):
            video.decode_file(file, python=fake_decoder(tmp_path, answer))
    refusal = b'{"refused": "video must have at most 8 streams, got 9"}\n'
    with pytest.raises(ContractError, match="^video must have at most 8 streams, got 9$"):
        video.decode_file(file, python=fake_decoder(tmp_path, refusal))


def test_the_answer_is_taken_without_waiting_for_the_decoders_end(tmp_path: Path) -> None:
    """A decoder that has answered is not waited for: its answer counts at once, and a
    process that stays past the slack is killed."""
    data, mime = clip(2, 32, 32)
    file = video.video_file(video_url(data, mime))
    marker = tmp_path / "still running"
    slow = fake_decoder(tmp_path, b'{"refused": "no"}\n', f"sleep 3; touch '{marker}'")
    started = time.monotonic()
    with pytest.raises(ContractError, match="^no$"):
        video.decode_file(file, seconds=20, slack=1, python=slow)
    assert time.monotonic() - started < 2.5
    time.sleep(3)
    assert not marker.exists()


def test_spare_decoders_decode_the_next_files_and_end_with_the_worker() -> None:
    """A request takes the oldest started spare and starts its replacement, so that as many
    spares wait as requests prepare at once; a spare whose stdin closes (the worker ended)
    exits cleanly; each process decodes one file."""
    data, mime = clip(4, 48, 32)
    file = video.video_file(video_url(data, mime))
    first = video.decode_file(file)
    spares = list(video.DECODERS.spares)
    assert len(spares) == video.DECODER_SPARES and all(s.poll() is None for s in spares)
    second = video.decode_file(file)
    assert spares[0].wait(timeout=30) is not None and spares[0] not in video.DECODERS.spares
    assert video.DECODERS.spares[0] is spares[1] and len(video.DECODERS.spares) == 2
    assert all(np.array_equal(a, b) for a, b in zip(first.frames, second.frames, strict=True))
    assert first.most_pixels == video.clip_pixels(4)
    idle = video.start_decoder()
    idle.stdin.close()
    assert idle.wait(timeout=60) == 0


def resident_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_waiting_decoder_holds_its_heap_faulted_in() -> None:
    """A spare, while it waits, faults in DECODER_WARM bytes of heap and keeps them after they
    are freed, so that the frames it decodes next land on pages already there."""
    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc here")
    spare = video.start_decoder()
    try:
        deadline, held = time.monotonic() + 60, 0
        while time.monotonic() < deadline and held < video.DECODER_WARM:
            time.sleep(0.1)
            held = resident_bytes(spare.pid)
        time.sleep(0.5)  # freed by now: `warm_heap` returns at once
        assert resident_bytes(spare.pid) >= video.DECODER_WARM
    finally:
        spare.stdin.close()
        spare.wait(timeout=60)


def frame_files() -> set[str]:
    where = Path(video.frames_dir() or tempfile.gettempdir())
    return {p.name for p in where.glob("omnijev-frames-*")}


def frame_files_left(before: set[str], wait_s: float = 5.0) -> set[str]:
    """Frames files that were not there `before` and stay: another test worker's clip files come
    and go within its decode, a file left behind stays."""
    deadline = time.monotonic() + wait_s
    while (left := frame_files() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_the_frames_come_back_through_a_file_that_is_removed_whatever_the_end() -> None:
    """Decoded, refused, past the deadline, or the decoder dead: no frames file is left, and a
    file cut short is an invalid video, not a reshape error."""
    before = frame_files()
    data, mime = clip(3, 48, 32)
    file = video.video_file(video_url(data, mime))
    frames = video.decode_file(file)
    assert [f.shape for f in frames.frames] == [(32, 48, 3)] * 3
    # the frames are a mapping of the removed file: the pixels the decoder made, and writable
    alone = video.decode_frames(file)
    for mapped, decoded in zip(frames.frames, alone.frames, strict=True):
        assert np.array_equal(mapped, decoded) and mapped.flags.writeable
    with pytest.raises(ContractError):
        video.decode_file(file, seconds=0, slack=0)
    with pytest.raises(ContractError):
        video.decode_file(file, python="/bin/false")
    assert frame_files_left(before) == set()
    handle, path = tempfile.mkstemp()
    os.close(handle)
    meta = video.frames_written(path, frames)
    Path(path).write_bytes(Path(path).read_bytes()[:-1])
    with pytest.raises(ContractError, match="^invalid video$"):
        video.frames_read(path, **meta)
    os.unlink(path)


def test_frames_go_to_shared_memory_only_where_it_holds_the_largest_clip(tmp_path: Path) -> None:
    assert video.frames_dir(tmp_path / "absent") is None
    assert video.frames_dir(tmp_path, largest=1 << 62) is None
    assert video.frames_dir(tmp_path, largest=1) == str(tmp_path)


@pytest.mark.parametrize(("fmt", "codec"), [("mp4", "libx264"), ("webm", "libvpx")])
def test_tracks_are_counted_from_the_headers(fmt: str, codec: str) -> None:
    count = mp4_tracks if fmt == "mp4" else webm_tracks
    one = encode(codec, fmt, 16, 16, frames=2)
    assert count(one) == 1
    assert count(repeated(one, fmt, 1, 12)) == 12
    refused = video_url(repeated(one, fmt, 1, 12), "video/" + fmt)
    with pytest.raises(ContractError, match="at most 8 streams, got 12"):
        video.video_file(refused)
    for cut in (5, 40, len(one) // 2):  # truncated headers: no crash, no invented tracks
        assert count(one[:cut]) <= 1
    assert list(ebml_elements(b"\x00\x00\x00", 0, 3)) == []


def test_a_still_beside_a_file_is_refused() -> None:
    data, mime = clip(2, 32, 32)
    state = {"video": video_url(data, mime), "images": [data_url(pattern_png(32, 32))]}
    with pytest.raises(ContractError, match="takes no state.images"):
        video.video_of_state(state)
