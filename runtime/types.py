"""Data passed between the pipeline stages: a compiled request, its prepared layout, readouts.

Follows the shapes of the reference's `MSO1.ask_branch` (docs/contract.md §4.5, §5): every stage
reads and writes these dataclasses, so the reference, the ONNX Runtime and the TensorRT paths share
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from runtime.errors import ExecutionError

QUESTION_TYPES = ("noul", "choice", "score")
TYPE_IDS = {"noul": 0, "choice": 1, "score": 2}  # OptionScorer's log_tau order
V11_TEMPERATURES = {"noul": 1.1991, "choice": 1.1199, "score": 1.1909}
V11_NOUL_BIAS = 0.05310856608843584


@dataclass(frozen=True)
class Question:
    """One question after the contract: answer keys and rendered option texts, in order."""

    id: str
    type: str  # "noul" | "choice" | "score"
    instructions: str
    keys: tuple[str, ...]
    option_texts: tuple[str, ...]  # already cut to 200 code points


@dataclass(frozen=True)
class Request:
    """A request that passed the contract (docs/contract.md §2); the image is still encoded."""

    image_mime: str  # "image/png" or "image/jpeg"
    image_bytes: bytes  # decoded base64, magic bytes already checked against the MIME type
    questions: tuple[Question, ...]
    # runtime.images.OpenedImage: Pillow's header, opened by the contract, decoded once from it
    opened: object | None = field(default=None, compare=False, repr=False)
    # runtime.video.VideoFile or VideoMosaic where the state is a video (no image then)
    video: object | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class PreparedImage:
    """Decoded and preprocessed image (docs/contract.md §4.7-4.8)."""

    width: int  # original size
    height: int
    rgb: np.ndarray  # uint8 [H, W, 3], Pillow's convert("RGB")
    # float32 [patches, 1536]; None when prepared with pack=False (the device makes them)
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]  # (1, H/16, W/16)
    # uint8 [H', W', 3] after the resize: runtime.images.device_pixel_values makes pixel_values
    # from it on the device (an eighth of the bytes to upload)
    resized: np.ndarray | None = None
    # sha256 of the encoded image, when the device resizes it (prepare_image(resize=False))
    digest: bytes | None = None

    @property
    def image_tokens(self) -> int:
        return grid_tokens(self.grid_thw)


@dataclass(frozen=True)
class VideoFrames:
    """Decoded frames, uint8 [H, W, 3] each, with their times in seconds, the clip's length and
    the pixels each frame's resize may keep (runtime.video.video_frames)."""

    frames: tuple[np.ndarray, ...]
    timestamps: tuple[int | float, ...]
    duration: int | float
    most_pixels: int


@dataclass(frozen=True)
class PreparedVideo:
    """A video's frames, each prepared as an image (docs/model.md §8.2): one image input each,
    their placeholder runs in order in one prefix."""

    frames: tuple[PreparedImage, ...]
    timestamps: tuple[int | float, ...]  # seconds, as the prompt writes them
    duration: int | float

    @property
    def image_tokens(self) -> int:
        return sum(frame.image_tokens for frame in self.frames)

    @property
    def grids(self) -> tuple[tuple[int, int, int], ...]:
        return tuple(frame.grid_thw for frame in self.frames)


def grid_tokens(grid_thw: tuple[int, int, int]) -> int:
    """Image tokens of a patch grid: one per 2×2 block of patches."""
    return (grid_thw[1] // 2) * (grid_thw[2] // 2)


@dataclass(frozen=True)
class Row:
    """One (question, option) row after the prefix (docs/contract.md §4.5), row-local indices."""

    tokens: tuple[int, ...]
    zq: int
    u: int
    targets: tuple[tuple[int, int], ...]  # (position predicting, token)
    first: int | None


@dataclass(frozen=True)
class QuestionLayout:
    """A question's single-question sequence and its rows."""

    question: Question
    prompt: str
    token_ids: tuple[int, ...]  # expanded: the image run is N copies of 248056
    opens: tuple[int, ...]
    closes: tuple[int, ...]
    rows: tuple[Row, ...]
    positions: np.ndarray  # int64 [3, len(token_ids)], M-RoPE positions of the whole sequence


@dataclass(frozen=True)
class Prepared:
    """Everything the model side needs for one request."""

    image: PreparedImage | PreparedVideo
    layouts: tuple[QuestionLayout, ...]
    prefix_length: int  # the reference's L
    input_tokens: int  # L + sum of row lengths
    prepare_seconds: float = 0.0
    # (pass shape, runtime.passes.Plan) made while preparing, off the execution thread
    planned: tuple | None = field(default=None, compare=False, repr=False)
    # everything the image prefix depends on (runtime.image_prefix.prefix_key), made while
    # preparing: the prefix cache's key, and which requests may share one image prefix
    image_key: str | None = field(default=None, compare=False, repr=False)
    # several requests merged into one (runtime.batch): the image prefix each question's rows
    # read, numbered in order of first appearance; None: every question reads the one image's
    owners: tuple[int, ...] | None = field(default=None, compare=False, repr=False)

    @property
    def clip(self) -> bool:
        """Whether the request is about a video's frames rather than one image."""
        return isinstance(self.image, PreparedVideo)

    @property
    def questions(self) -> tuple[Question, ...]:
        return tuple(layout.question for layout in self.layouts)


@dataclass
class QuestionReadout:
    """Model outputs of one question, as the heads consume them (docs/contract.md §5-6)."""

    zq: np.ndarray  # float32 [D]: the first row's zq hidden state
    u: np.ndarray  # float32 [K, D]: one per option
    picked: list[np.ndarray] = field(default_factory=list)  # per option float32 [n_k] log-probs
    first: list[float | None] = field(default_factory=list)  # per option first-token log-prob
    # the outputs of the heads' MLPs of zq and u (`runtime.heads.mlp_names`: name -> rows),
    # made on the device right behind the passes (`Executor.mlps_behind`); None: made by the heads
    mlps: dict[str, np.ndarray] | None = None


@dataclass(frozen=True)
class Calibration:
    """Per-type temperatures and the Noul log-odds bias (head_meta.json, contract §7.1)."""

    temperatures: dict[str, float]
    noul_bias: float

    @classmethod
    def v11(cls) -> Calibration:
        """The OmniJev v1.1 release's calibration."""
        return cls(dict(V11_TEMPERATURES), V11_NOUL_BIAS)

    def validate(self) -> Calibration:
        """Refuse non-positive, non-finite or missing temperatures and a non-finite bias."""
        temps = self.temperatures
        if not isinstance(temps, dict) or any(t not in temps for t in QUESTION_TYPES):
            raise ExecutionError("invalid calibration")
        for t in QUESTION_TYPES:
            if not _is_number(temps[t]) or not math.isfinite(temps[t]) or temps[t] <= 0:
                raise ExecutionError("invalid calibration")
        if not _is_number(self.noul_bias) or not math.isfinite(self.noul_bias):
            raise ExecutionError("invalid calibration")
        return self


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
