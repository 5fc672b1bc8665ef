"""Prepares a compiled request: prompts, token ids, the row layout and M-RoPE positions.

Follows the reference's `MSO1._prompt`, `_encode_many`, `rows_from_ids`/`_marks` and transformers'
`get_rope_index` (contract.md §4.2-4.6), with the worker's preparation limits (§2.7).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from runtime.constants import CLOSE_ID, IMAGE_PAD_ID, OPEN_ID
from runtime.errors import ContractError
from runtime.types import Prepared, PreparedImage, Question, QuestionLayout, Request, Row

IMAGE_PAD = "<|image_pad|>"
# The chat template's rendering of one user message [image, instructions] with the generation
# prompt and thinking on (no system prompt, no </think>), contract.md §4.2.
PROMPT_HEAD = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
PROMPT_TAIL = "<|im_end|>\n<|im_start|>assistant\n<think>\n"
MAX_SEQUENCE = 8192  # tokens of one question's single-question sequence (processing.rs)
MAX_PROCESSED = 65536  # prefix + all rows, the reference's input_tokens (processing.rs)
MAX_TARGETS = 16384  # option-text log-probs read for Choice and Noul questions (processing.rs)

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
    """Expanded ids of each prompt: its two text parts around `<|image_pad|>`, one batch encode."""
    parts = []
    for prompt in prompts:
        pieces = prompt.split(IMAGE_PAD)
        if len(pieces) != 2:
            raise ContractError(PLACEHOLDER_ERROR)
        parts += pieces
    encodings = tokenizer.encode_batch(parts, add_special_tokens=False)
    run = [IMAGE_PAD_ID] * image_tokens
    return [encodings[i].ids + run + encodings[i + 1].ids for i in range(0, len(parts), 2)]


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
    """int64 [3, T] (T, H, W) positions of a sequence with one image run (contract.md §4.6)."""
    _, grid_h, grid_w = grid_thw
    rows, cols = grid_h // 2, grid_w // 2  # merged 2x2 patches
    n_image = rows * cols
    if image_start + n_image > len(ids):
        raise ContractError(PLACEHOLDER_ERROR)
    text_after = len(ids) - image_start - n_image
    resume = image_start + max(rows, cols)  # text after the image continues from here
    before = np.arange(image_start, dtype=np.int64)
    after = resume + np.arange(text_after, dtype=np.int64)
    image = np.empty((3, n_image), dtype=np.int64)
    image[0] = image_start
    image[1] = image_start + np.repeat(np.arange(rows, dtype=np.int64), cols)
    image[2] = image_start + np.tile(np.arange(cols, dtype=np.int64), rows)
    return np.concatenate([np.tile(before, (3, 1)), image, np.tile(after, (3, 1))], axis=1)


def sequence_positions(ids: Sequence[int], image: PreparedImage) -> np.ndarray:
    """Positions of a question's whole sequence, after checking its image run against the grid."""
    return mrope_positions(ids, find_image_run(ids, image.image_tokens), image.grid_thw)


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


def prepare(request: Request, tokenizer: Tokenizer, image: PreparedImage | None = None) -> Prepared:
    """Decodes the image (unless given), tokenizes every question and lays out its rows."""
    started = time.perf_counter()
    if image is None:
        from runtime.images import prepare_image

        image = prepare_image(request.image_bytes, request.image_mime, request.opened)
    questions = request.questions
    prompts = [render_prompt(q) for q in questions]
    ids = encode_prompts(prompts, tokenizer, image.image_tokens)
    check_sequence_lengths(questions, ids)
    prefix, opens, closes = prefix_and_marks(ids)
    for question, question_opens in zip(questions, opens, strict=True):
        if len(question_opens) != len(question.option_texts):
            raise ContractError(MARKER_ERROR)
    # Both totals come from the markers, so an oversized request is refused before its rows exist.
    processed = processed_tokens(prefix, opens, closes)
    check_request_totals(processed, read_tokens(questions, opens, closes))
    layouts = []
    for question, prompt, question_ids, question_opens, question_closes in zip(
        questions, prompts, ids, opens, closes, strict=True
    ):
        rows = question_rows(question_ids, prefix, question_opens, question_closes)
        layouts.append(
            QuestionLayout(
                question=question,
                prompt=prompt,
                token_ids=tuple(question_ids),
                opens=tuple(question_opens),
                closes=tuple(question_closes),
                rows=tuple(rows),
                positions=sequence_positions(question_ids, image),
            )
        )
    return Prepared(
        image=image,
        layouts=tuple(layouts),
        prefix_length=prefix,
        input_tokens=processed,
        prepare_seconds=time.perf_counter() - started,
    )
