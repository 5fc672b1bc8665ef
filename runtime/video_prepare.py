"""Prepares a request about a video: its frames as images, the reference's video prompt, token
ids with one placeholder run a frame, and M-RoPE positions as `get_rope_index` lays them out.

Follows docs/model.md §8.2 (the prompt) and §5 (several image runs); the rest of the layout is
the still's (`runtime.processing.lay_out`), so the prefix holds every frame and the questions
follow it as they follow a still.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from tokenizers import Tokenizer

from runtime.constants import IMAGE_PAD_ID
from runtime.errors import ContractError
from runtime.images import CLIP_PREFIX, image_of_rgb
from runtime.processing import (
    IMAGE_PAD,
    PLACEHOLDER_ERROR,
    PROMPT_TAIL,
    encode_each,
    image_block,
    lay_out,
)
from runtime.types import (
    Prepared,
    PreparedVideo,
    Question,
    QuestionLayout,
    Request,
    VideoFrames,
)

# docs/model.md §8.2: the user message is this text, then `t={ts}s:` and an image a frame, then
# the instructions; the chat template writes the parts one after another, an image as its markup.
VIDEO_INTRO = "A video of {duration:.0f} seconds; {count} frames sampled uniformly in order."
FRAME_TEXT = "t={ts}s:"
IMAGE_MARKUP = f"<|vision_start|>{IMAGE_PAD}<|vision_end|>"
USER_HEAD = "<|im_start|>user\n"


def prepare_video(
    request: Request,
    tokenizer: Tokenizer,
    decoded: VideoFrames,
    planner: Callable[[Prepared], object] | None = None,
    started: float | None = None,
    pack: bool = True,
    resize: bool = True,
    source: bytes | None = None,
) -> Prepared:
    """Prepares each of the video's decoded frames (`runtime.video.video_frames`) as an image,
    tokenizes every question and lays out its rows over one prefix that holds every frame;
    `started`: when the preparation began (the decode's start), for `prepare_seconds`; `pack`
    and `resize` as `runtime.images.prepare_image`'s (False: the device makes them); `source`:
    the digest of the file or mosaic the frames came from, which names them for the prefix cache
    where the device resizes."""
    started = time.perf_counter() if started is None else started
    most = decoded.most_pixels
    video = PreparedVideo(
        frames=tuple(
            image_of_rgb(rgb, pack, resize, most, frame_digest(source, index, most))
            for index, rgb in enumerate(decoded.frames)
        ),
        timestamps=decoded.timestamps,
        duration=decoded.duration,
    )
    prompts = [video_prompt(question, video) for question in request.questions]
    counts = [frame.image_tokens for frame in video.frames]
    ids = encode_video_prompts(prompts, tokenizer, counts)
    drafts, prefix, processed = lay_out(
        request.questions, tokenizer, video.image_tokens, (ids, prompts)
    )
    if prefix > CLIP_PREFIX:  # a mosaic's tiles keep the image budget, a file's frames share less
        raise ContractError(f"video prefix must be at most {CLIP_PREFIX} tokens, got {prefix}")
    layouts = []
    for draft in drafts:
        fields = dict(draft)
        positions = video_positions(fields.pop("ids"), video.grids)
        layouts.append(QuestionLayout(**fields, positions=positions))
    prepared = Prepared(
        image=video, layouts=tuple(layouts), prefix_length=prefix, input_tokens=processed
    )
    planned = planner(prepared) if planner is not None else None
    return replace(prepared, planned=planned, prepare_seconds=time.perf_counter() - started)


def frame_digest(source: bytes | None, index: int, most: int) -> bytes | None:
    """A frame's name for the prefix cache: its source's digest, its place and its budget."""
    if source is None:
        return None
    return hashlib.sha256(
        source + index.to_bytes(2, "little") + most.to_bytes(8, "little")
    ).digest()


def video_user_text(video: PreparedVideo) -> str:
    """The user message's video part: the intro, then each frame's time and image markup."""
    intro = VIDEO_INTRO.format(duration=video.duration, count=len(video.frames))
    frames = "".join(FRAME_TEXT.format(ts=ts) + IMAGE_MARKUP for ts in video.timestamps)
    return intro + frames


def video_prompt(question: Question, video: PreparedVideo) -> str:
    """The question's prompt about the video: the chat template's user turn (trimmed, so the
    instructions lose their trailing whitespace), the generation prompt, every option block."""
    options = "".join(f"<|opt|>{text}<|/opt|>" for text in question.option_texts)
    user = video_user_text(video) + question.instructions.rstrip()
    return f"{USER_HEAD}{user}{PROMPT_TAIL}{options}"


def encode_video_prompts(
    prompts: Sequence[str], tokenizer: Tokenizer, counts: Sequence[int]
) -> list[list[int]]:
    """Each prompt's expanded ids: its text around the placeholders encoded piece by piece (the
    placeholder is a special token, where the tokenizer splits anyway) and `counts[i]` pad ids
    for frame i, as the processor expands them."""
    pieces = [prompt.split(IMAGE_PAD) for prompt in prompts]
    if any(len(parts) != len(counts) + 1 for parts in pieces):
        raise ContractError(PLACEHOLDER_ERROR)
    # every question's prompt holds the same frames' pieces: each text is encoded once
    texts = list(dict.fromkeys(part for parts in pieces for part in parts))
    ids_of = {text: e.ids for text, e in zip(texts, encode_each(tokenizer, texts), strict=True)}
    out = []
    for parts in pieces:
        ids = list(ids_of[parts[0]])
        for count, part in zip(counts, parts[1:], strict=True):
            ids += [IMAGE_PAD_ID] * count
            ids += ids_of[part]
        out.append(ids)
    return out


def image_runs(ids: Sequence[int]) -> list[tuple[int, int]]:
    """(start, length) of each contiguous run of image pad ids, in order."""
    where = np.flatnonzero(np.asarray(ids, dtype=np.int64) == IMAGE_PAD_ID)
    if where.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(where) > 1) + 1
    return [(int(run[0]), int(run.size)) for run in np.split(where, breaks)]


def video_positions(ids: Sequence[int], grids: Sequence[tuple[int, int, int]]) -> np.ndarray:
    """int64 [3, T] (T, H, W) positions of a sequence with one image run a grid, in order: text
    counts on from where the last run left off on every axis, an image's merged patches sit at
    (start, start + row, start + column), and the text after it resumes at start + max(rows,
    columns) (transformers' `get_rope_index`, docs/model.md §5)."""
    runs = image_runs(ids)
    shapes = [(grid[1] // 2, grid[2] // 2) for grid in grids]
    if [length for _, length in runs] != [rows * cols for rows, cols in shapes]:
        raise ContractError(PLACEHOLDER_ERROR)
    positions = np.empty((3, len(ids)), dtype=np.int64)
    at, next_position = 0, 0
    for (start, length), (rows, cols) in zip(runs, shapes, strict=True):
        text = start - at
        positions[:, at:start] = next_position + np.arange(text, dtype=np.int64)
        image_start = next_position + text
        positions[:, start : start + length] = image_block(rows, cols) + image_start
        at, next_position = start + length, image_start + max(rows, cols)
    positions[:, at:] = next_position + np.arange(len(ids) - at, dtype=np.int64)
    return positions
