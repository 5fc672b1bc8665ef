"""Prepares a compiled request: prompts, token ids, the row layout and M-RoPE positions.

Follows the reference's `MSO1._prompt`, `_encode_many`, `rows_from_ids`/`_marks` and transformers'
`get_rope_index` (docs/contract.md §4.2-4.6), with the worker's preparation limits (§2.7). The
prompt template's ids are made once per tokenizer, and the image decodes on its own thread
meanwhile.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from tokenizers import Tokenizer

from runtime.constants import CLOSE_ID, IMAGE_PAD_ID, OPEN_ID, VISION_END_ID
from runtime.errors import ContractError
from runtime.lru import LRU
from runtime.pools import process_pool
from runtime.types import (
    Prepared,
    PreparedImage,
    Question,
    QuestionLayout,
    Request,
    Row,
    grid_tokens,
)

if TYPE_CHECKING:  # runtime.images loads on the first decode, not with this module
    from runtime.images import Allocate

IMAGE_PAD = "<|image_pad|>"
# The chat template's rendering of one user message [image, instructions] with the generation
# prompt and thinking on (no system prompt, no </think>), docs/contract.md §4.2.
PROMPT_HEAD = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n"
MAX_SEQUENCE = 8192  # tokens of one question's single-question sequence (processing.rs)
MAX_PROCESSED = 65536  # prefix + all rows, the reference's input_tokens (processing.rs)
MAX_TARGETS = 16384  # option-text log-probs read for Choice and Noul questions (processing.rs)

# The prompt's fixed text between the request's own texts, split at its special tokens: each
# piece is tokenized once per tokenizer (`Template`), the instructions and option texts per
# request. The texts of §2.6's reserved markers never reach a split prompt (`splittable`).
IMAGE_HEAD = PROMPT_HEAD.split(IMAGE_PAD)[0]  # "<|im_start|>user\n<|vision_start|>"
VISION_END = "<|vision_end|>"
OPEN, CLOSE = "<|opt|>", "<|/opt|>"
SPLIT_AT = (VISION_END, "<|im_end|>", OPEN, CLOSE)  # the specials a request's text sits between
RESERVED = (OPEN, CLOSE, IMAGE_PAD, "<|video_pad|>", "<|vision_start|>", VISION_END)
PROBE = "Is\u00a0it ok?  <|im_end|>x\n\n"  # a check text: spaces, a special token, newlines
TEMPLATES = 4  # tokenizers whose templates are kept (one a checkpoint, tests load a few)
# texts (instructions, option texts) whose ids a template keeps: a deployment asks the same
# questions of many images, and encoding hundreds of option texts costs milliseconds
TEXT_IDS = 4096
# longer texts are encoded every time, so that what clients send cannot make the kept ids large
# (4,096 texts of 8,192 characters and their ids would be over a GB; of 512, some tens of MB)
KEPT_TEXT_CHARS = 512
# Images decoded beside the tokenizer while a request is prepared: one a preparation thread
# (the server prepares two requests at once), the rest waits. Pillow, PyTorch's resize and
# NumPy release the GIL for their work, so the decode runs while this thread tokenizes.
IMAGE_THREADS = 2
# HF tokenizers' batch encode releases the GIL, but its thread pool waits for cores that
# PyTorch's threads hold, an order of magnitude slower beside a busy PyTorch thread; with the
# pool off it costs the same either way, and `encode` one by one holds the GIL throughout. The
# variable is read at each call; an operator's own setting stays.
TOKENIZER_POOL = ("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault(*TOKENIZER_POOL)

PLACEHOLDER_ERROR = "image placeholders must be one contiguous span matching the grid"
MARKER_ERROR = "every option needs one opening and one closing marker, in order"


def render_prompt(question: Question) -> str:
    """The question's prompt text: chat template, then every option block with no separator."""
    # The template trims the user content; it starts with the image markup, so only the
    # instructions' trailing whitespace goes. str.rstrip() strips exactly what str.isspace() says.
    options = "".join(f"<|opt|>{text}<|/opt|>" for text in question.option_texts)
    return f"{PROMPT_HEAD}{question.instructions.rstrip()}{PROMPT_TAIL}{options}"


def encode_prompts(
    prompts: Sequence[str], tokenizer: Tokenizer, image_tokens: int
) -> list[list[int]]:
    """Expanded ids of each prompt: its two text parts around `<|image_pad|>`, encoded."""
    parts = []
    for prompt in prompts:
        pieces = prompt.split(IMAGE_PAD)
        if len(pieces) != 2:
            raise ContractError(PLACEHOLDER_ERROR)
        parts += pieces
    encodings = encode_each(tokenizer, parts)
    run = [IMAGE_PAD_ID] * image_tokens
    return [encodings[i].ids + run + encodings[i + 1].ids for i in range(0, len(parts), 2)]


def encode_each(tokenizer: Tokenizer, texts: Sequence[str]) -> list:
    """Each text's encoding: one batch call, which releases the GIL (`tokenizer.encode` holds it);
    the tokenizer's own thread pool is off (`TOKENIZER_POOL`)."""
    return tokenizer.encode_batch(list(texts), add_special_tokens=False)


@dataclass(frozen=True)
class Template:
    """The ids of the prompt's fixed pieces (docs/contract.md §4.2) under one tokenizer."""

    head: tuple[int, ...]  # before the image run
    tail: tuple[int, ...]  # PROMPT_TAIL: after the instructions, before the first option
    # ids of texts encoded before (text_ids), shared by the preparing threads
    texts: LRU[str, tuple[int, ...]] = field(
        default_factory=lambda: LRU(TEXT_IDS), compare=False, repr=False
    )
    lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)


_templates: dict[int, tuple[Tokenizer, Template | None]] = {}
_templates_lock = threading.Lock()


def template(tokenizer: Tokenizer) -> Template | None:
    """The tokenizer's template ids, made once; None where pieces may not encode alone."""
    with _templates_lock:
        entry = _templates.get(id(tokenizer))
        if entry is not None and entry[0] is tokenizer:
            return entry[1]
    made = make_template(tokenizer)
    with _templates_lock:
        while len(_templates) >= TEMPLATES:
            _templates.pop(next(iter(_templates)))
        _templates[id(tokenizer)] = (tokenizer, made)
    return made


def make_template(tokenizer: Tokenizer) -> Template | None:
    """Pieces encode alone exactly when the tokenizer splits its input at added tokens first
    and no added token can match across a split: its added tokens strip nothing, and none ends
    in the start of a special the prompt is split at. A probe prompt checks the result."""
    added = list(tokenizer.get_added_tokens_decoder().values())
    if any(token.lstrip or token.rstrip for token in added):
        return None
    for token in added:
        for special in SPLIT_AT:
            longer = len(token.content) > len(special) and token.content.startswith(special)
            if longer or any(
                token.content.endswith(special[:k]) and len(token.content) > k
                for k in range(1, len(special) + 1)
            ):
                return None
    head = tokenizer.encode(IMAGE_HEAD, add_special_tokens=False).ids
    tail = tokenizer.encode(PROMPT_TAIL, add_special_tokens=False).ids
    made = Template(head=tuple(head), tail=tuple(tail))
    probe = Question("p", "choice", PROBE, ("a", "b"), (PROBE, ""))
    whole = encode_prompts([render_prompt(probe)], tokenizer, 3)
    return made if split_ids([probe], tokenizer, made, 3) == whole else None


def splittable(questions: Sequence[Question]) -> bool:
    """No instructions or option text holds a reserved marker (the contract refuses them)."""
    texts = (text for q in questions for text in (q.instructions, *q.option_texts))
    return not any(marker in text for text in texts for marker in RESERVED)


def split_ids(
    questions: Sequence[Question], tokenizer: Tokenizer, made: Template, image_tokens: int
) -> list[list[int]]:
    """Each question's expanded ids from the template's ids and the request's texts, encoded
    alone: the same ids as encoding each rendered prompt (`make_template`)."""
    texts = []
    for question in questions:
        texts.append(question.instructions.rstrip())
        texts.extend(question.option_texts)
    ids_of = text_ids(tokenizer, made, texts)
    start = [*made.head, *([IMAGE_PAD_ID] * image_tokens), VISION_END_ID]
    out, at = [], 0
    for question in questions:
        ids = start + list(ids_of[texts[at]])
        ids += made.tail
        for text in texts[at + 1 : at + 1 + len(question.option_texts)]:
            ids.append(OPEN_ID)
            ids += ids_of[text]
            ids.append(CLOSE_ID)
        at += 1 + len(question.option_texts)
        out.append(ids)
    return out


def text_ids(tokenizer: Tokenizer, made: Template, texts: Sequence[str]) -> dict:
    """Each distinct text's ids: kept by the template from an earlier request, else encoded now
    (one batch) and kept if at most KEPT_TEXT_CHARS long. The same ids either way, since a piece
    encodes alone (`make_template`)."""
    distinct = list(dict.fromkeys(texts))
    with made.lock:
        kept = {text: made.texts.get(text) for text in distinct}
    known = {text: ids for text, ids in kept.items() if ids is not None}
    missing = [text for text in distinct if text not in known]
    if missing:
        for text, encoding in zip(missing, encode_each(tokenizer, missing), strict=True):
            known[text] = tuple(encoding.ids)
        with made.lock:
            for text in missing:
                if len(text) <= KEPT_TEXT_CHARS:
                    made.texts.put(text, known[text])
    return known


def encode_questions(
    questions: Sequence[Question], tokenizer: Tokenizer, image_tokens: int
) -> list[list[int]]:
    """Expanded ids of every question's prompt: the template's ids once per tokenizer, then the
    request's texts; the whole prompts where the split may not hold."""
    made = template(tokenizer)
    if made is not None and splittable(questions):
        return split_ids(questions, tokenizer, made, image_tokens)
    return encode_prompts([render_prompt(q) for q in questions], tokenizer, image_tokens)


def encode_question(prompt: str, tokenizer: Tokenizer, image_tokens: int) -> list[int]:
    """Expanded ids of one prompt: the image placeholder becomes `image_tokens` pad ids."""
    return encode_prompts([prompt], tokenizer, image_tokens)[0]


def find_image_run(ids: Sequence[int], image_tokens: int) -> int:
    """Start of the single contiguous run of exactly `image_tokens` pad ids."""
    where = np.flatnonzero(np.asarray(ids, dtype=np.int64) == IMAGE_PAD_ID)
    if where.size != image_tokens or where.size == 0 or where[-1] - where[0] + 1 != where.size:
        raise ContractError(PLACEHOLDER_ERROR)
    return int(where[0])


def mrope_positions(
    ids: Sequence[int], image_start: int, grid_thw: tuple[int, int, int]
) -> np.ndarray:
    """int64 [3, T] (T, H, W) positions of a sequence with one image run (docs/contract.md §4.6)."""
    _, grid_h, grid_w = grid_thw
    rows, cols = grid_h // 2, grid_w // 2  # merged 2x2 patches
    n_image = rows * cols
    if image_start + n_image > len(ids):
        raise ContractError(PLACEHOLDER_ERROR)
    resume = image_start + max(rows, cols)  # text after the image continues from here
    positions = np.empty((3, len(ids)), dtype=np.int64)
    positions[:, :image_start] = np.arange(image_start, dtype=np.int64)
    positions[:, image_start : image_start + n_image] = image_block(rows, cols) + image_start
    after = len(ids) - image_start - n_image
    positions[:, image_start + n_image :] = resume + np.arange(after, dtype=np.int64)
    return positions


@functools.lru_cache(maxsize=16)
def image_block(rows: int, cols: int) -> np.ndarray:
    """The image run's (T, H, W) offsets from its start, row-major over the merged patches: a
    request's questions (and the next requests of the same size) share it, read-only."""
    block = np.zeros((3, rows * cols), dtype=np.int64)
    block[1] = np.repeat(np.arange(rows, dtype=np.int64), cols)
    block[2] = np.tile(np.arange(cols, dtype=np.int64), rows)
    block.flags.writeable = False
    return block


def sequence_positions(ids: Sequence[int], image: PreparedImage) -> np.ndarray:
    """Positions of a question's whole sequence, after checking its image run against the grid."""
    return grid_positions(ids, image.grid_thw)


def grid_positions(ids: Sequence[int], grid_thw: tuple[int, int, int]) -> np.ndarray:
    """`sequence_positions` from the patch grid alone (the image need not be decoded yet)."""
    return mrope_positions(ids, find_image_run(ids, grid_tokens(grid_thw)), grid_thw)


def option_marks(ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Positions of `<|opt|>` and `<|/opt|>`: at least one pair, alternating, the first at ≥ 2."""
    arr = np.asarray(ids, dtype=np.int64)
    opens = np.flatnonzero(arr == OPEN_ID)
    closes = np.flatnonzero(arr == CLOSE_ID)
    ok = opens.size > 0 and opens.size == closes.size and opens[0] >= 2
    # Alternating and ordered: open_0 < close_0 < open_1 < close_1 < ...
    ok = ok and bool(np.all(np.diff(np.stack([opens, closes], axis=1).ravel()) > 0))
    if not ok:
        raise ContractError(MARKER_ERROR)
    return opens.tolist(), closes.tolist()


def common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix shared by every sequence."""
    shortest = min(len(ids) for ids in sequences)
    first = np.asarray(sequences[0][:shortest], dtype=np.int64)
    same = np.ones(shortest, dtype=bool)
    for ids in sequences[1:]:
        same &= np.asarray(ids[:shortest], dtype=np.int64) == first
    differ = np.flatnonzero(~same)
    return int(differ[0]) if differ.size else shortest


def question_rows(
    ids: Sequence[int], prefix: int, opens: list[int], closes: list[int]
) -> list[Row]:
    """One row per option: the question's rest after the prefix plus that option's block."""
    head = list(ids[prefix : opens[0]])
    zq = len(head) - 1
    rows = []
    for start, end in zip(opens, closes, strict=True):
        tokens = head + list(ids[start : end + 1])
        u = len(tokens) - 1
        text = range(len(head) + 1, u)  # option-text tokens, each predicted from the one before
        rows.append(
            Row(
                tokens=tuple(tokens),
                zq=zq,
                u=u,
                targets=tuple((t - 1, tokens[t]) for t in text),
                first=tokens[len(head) + 1] if len(text) else None,
            )
        )
    return rows


def prefix_and_marks(
    ids_per_question: Sequence[Sequence[int]],
) -> tuple[int, list[list[int]], list[list[int]]]:
    """The reference's prefix length L and each question's opens and closes (§4.5)."""
    marks = [option_marks(ids) for ids in ids_per_question]
    opens = [m[0] for m in marks]
    closes = [m[1] for m in marks]
    # The prefix stops at least one token before every first <|opt|>: each row keeps its zq token.
    prefix = max(1, min(common_prefix(ids_per_question), min(o[0] - 1 for o in opens)))
    return prefix, opens, closes


def layout(
    ids_per_question: Sequence[Sequence[int]],
) -> tuple[int, list[list[Row]], list[list[int]], list[list[int]]]:
    """The reference's prefix length L, each question's rows, opens and closes (§4.5)."""
    prefix, opens, closes = prefix_and_marks(ids_per_question)
    rows = [
        question_rows(ids, prefix, o, c)
        for ids, o, c in zip(ids_per_question, opens, closes, strict=True)
    ]
    return prefix, rows, opens, closes


def processed_tokens(prefix: int, opens: list[list[int]], closes: list[list[int]]) -> int:
    """The reference's input_tokens: the prefix once, plus every row (question rest + block)."""
    total = prefix
    for o, c in zip(opens, closes, strict=True):
        total += sum(o[0] - prefix + end - start + 1 for start, end in zip(o, c, strict=True))
    return total


def read_tokens(
    questions: Sequence[Question], opens: list[list[int]], closes: list[list[int]]
) -> int:
    """Option-text log-probs read for non-Score questions: every target, plus each first token."""
    total = 0
    for question, o, c in zip(questions, opens, closes, strict=True):
        if question.type != "score":
            texts = [end - start - 1 for start, end in zip(o, c, strict=True)]
            total += sum(n + (n > 0) for n in texts)
    return total


def check_sequence_lengths(questions: Sequence[Question], ids: Sequence[Sequence[int]]) -> None:
    for question, question_ids in zip(questions, ids, strict=True):
        if len(question_ids) > MAX_SEQUENCE:
            raise ContractError(
                f"question {question.id}: {len(question_ids)} tokens exceeds {MAX_SEQUENCE}"
            )


def check_request_totals(processed: int, targets: int) -> None:
    if processed > MAX_PROCESSED:
        raise ContractError(f"request needs {processed} tokens, above {MAX_PROCESSED}")
    if targets > MAX_TARGETS:
        raise ContractError(f"request reads {targets} option-text tokens, above {MAX_TARGETS}")


def prepare(
    request: Request,
    tokenizer: Tokenizer,
    image: PreparedImage | None = None,
    pack: bool = True,
    resize: bool = True,
    planner: Callable[[Prepared], object] | None = None,
    allocate: Allocate | None = None,
    pending: Future | None = None,
) -> Prepared:
    """Decodes the image (unless given, or `pending` from `start_image_of` already), tokenizes
    every question and lays out its rows.

    With the contract's open image, the decode runs on an image thread while this one tokenizes
    and lays out the rows, positions included (the image run's length and the patch grid follow
    from the header's size); its refusals still come first. `planner` makes `Prepared.planned`
    from the request without its image, on this thread, while the decode runs. `pack` False
    leaves the patches to the device, and `resize` False the resize as well
    (`runtime.images.prepare_image`); `allocate` gives the decoded image's array where the
    decode can write into one (`runtime.images.decode_rgb`).
    """
    from runtime.images import prepare_image

    if request.video is not None:  # several frames, each an image (runtime.video_prepare)
        return request.video.prepare(request, tokenizer, planner, pack, resize)
    started = time.perf_counter()
    if image is None and pending is None:
        encoded = (request.image_mime, request.image_bytes, request.opened)
        pending = start_image_of(encoded, pack, resize, allocate)
        if pending is None:
            image = prepare_image(
                request.image_bytes, request.image_mime, request.opened, pack, resize, allocate
            )
    draft, planned, failure = None, None, None
    try:
        grid = image.grid_thw if image is not None else header_grid(request)
        drafts, prefix, processed = lay_out(request.questions, tokenizer, grid_tokens(grid))
        layouts = tuple(with_positions(drafts, grid))
    except ContractError as error:
        refusal: ContractError | None = error
    else:
        refusal = None
        # the request as the model side sees it, its image (None) still decoding
        draft = Prepared(image=image, layouts=layouts, prefix_length=prefix, input_tokens=processed)
        if planner is not None:
            try:
                planned = planner(draft)
            except Exception as error:  # raised after the image's refusals, as they come first
                failure = error
    try:
        if pending is not None:
            image = pending.result()  # an image refusal is raised here, before the text's
        if refusal is not None:
            raise refusal
        if failure is not None:
            raise failure
    finally:
        # a raised error's traceback holds this frame, whose locals hold the error: the cycle
        # would keep the request's bytes until the next garbage collection
        del pending, refusal, failure
    if image.grid_thw != grid:  # the header's size gave another grid than the decoded image's
        raise ContractError(PLACEHOLDER_ERROR)
    seconds = time.perf_counter() - started
    return replace(draft, image=image, planned=planned, prepare_seconds=seconds)


def start_image_of(
    image: tuple, pack: bool = True, resize: bool = True, allocate: Allocate | None = None
) -> Future | None:
    """`runtime.images.prepare_image` on an image thread, for
    `runtime.contract.compile_image`'s (MIME type, bytes, open image): from the moment the image
    has passed the contract; None without the contract's open image."""
    from runtime.images import prepare_image

    if not isinstance(image, tuple):  # a video decodes while it is prepared
        return None
    mime, data, opened = image
    if opened is None:
        return None
    pool = process_pool("image", IMAGE_THREADS)
    return pool.submit(prepare_image, data, mime, opened, pack, resize, allocate)


def header_grid(request: Request) -> tuple[int, int, int]:
    """The patch grid (1, H/16, W/16) from the open header's size, as the decoded image will
    give (`runtime.images.prepare_image`): the image run's length and the positions follow."""
    from runtime.images import resized_grid, smart_resize

    width, height = request.opened.size
    return resized_grid(smart_resize(height, width))


def lay_out(
    questions: Sequence[Question],
    tokenizer: Tokenizer,
    image_tokens: int,
    encoded: tuple[list[list[int]], list[str]] | None = None,
) -> tuple[list[dict], int, int]:
    """Every question's layout fields but its positions (`with_positions` adds them), after the
    limits' checks; the prefix length and the processed tokens. `encoded`: each question's ids
    and prompt where the caller made them (a video's, runtime.video_prepare)."""
    if encoded is None:
        ids = encode_questions(questions, tokenizer, image_tokens)
        prompts = [render_prompt(question) for question in questions]
    else:
        ids, prompts = encoded
    check_sequence_lengths(questions, ids)
    arrays = [np.asarray(question_ids, dtype=np.int64) for question_ids in ids]
    prefix, opens, closes = prefix_and_marks(arrays)
    for question, question_opens in zip(questions, opens, strict=True):
        if len(question_opens) != len(question.option_texts):
            raise ContractError(MARKER_ERROR)
    # Both totals come from the markers, so an oversized request is refused before its rows exist.
    processed = processed_tokens(prefix, opens, closes)
    check_request_totals(processed, read_tokens(questions, opens, closes))
    drafts = []
    for question, prompt, question_ids, array, question_opens, question_closes in zip(
        questions, prompts, ids, arrays, opens, closes, strict=True
    ):
        rows = question_rows(question_ids, prefix, question_opens, question_closes)
        drafts.append(
            {
                "question": question,
                "prompt": prompt,
                "token_ids": tuple(question_ids),
                "opens": tuple(question_opens),
                "closes": tuple(question_closes),
                "rows": tuple(rows),
                "ids": array,
            }
        )
    return drafts, prefix, processed


def with_positions(drafts: Sequence[dict], grid_thw: tuple[int, int, int]) -> list[QuestionLayout]:
    """The layouts with their M-RoPE positions, each image run checked against the grid."""
    layouts = []
    for draft in drafts:
        fields = dict(draft)
        positions = grid_positions(fields.pop("ids"), grid_thw)
        layouts.append(QuestionLayout(**fields, positions=positions))
    return layouts
