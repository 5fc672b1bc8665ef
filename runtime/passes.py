"""Plans the rectangle passes of the portable engines (ONNX Runtime, TensorRT): image prefix,
question texts, options, each a rectangle of rows of one length bucket; and the image prefix's
pass and the splits every engine shares (the torch engine packs the rest: runtime.packing).

Follows the prefix-reuse executor of the native worker (docs/model.md §12.1) with one change: the
splits are fixed points of each question's own sequence, never the reference's cross-question
prefix `L`, and every pass has a fixed row count per length bucket (and, for options, per family
of the question's own option count), so the shape a question runs in, and its rows' contents,
never depend on the other questions (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.config import QUESTION_BATCH
from runtime.constants import (
    QUESTION_TOKENS,
    SMALL_OPTION_TOKENS,
    WIDE_OPTION_TOKENS,
)
from runtime.constants import VISION_END_ID as VISION_END
from runtime.contract import MAX_OPTIONS
from runtime.images import CLIP_PREFIX, FACTOR, MAX_PIXELS
from runtime.types import Prepared, QuestionLayout

PREFIX_STEP = 64  # image-prefix length bucket: one CUDA graph per 64 tokens of prefix
# A clip's prefix (its frames, their times) is longer and rarer: it rounds up in steps of 512 to
# at most CLIP_PREFIX tokens, which are also its keys where a backend fixes them: nine prefix
# shapes and one key count more.
CLIP_PREFIX_STEP = 512
MAX_IMAGE_TOKENS = MAX_PIXELS // FACTOR**2  # 588: the resize keeps an image within MAX_PIXELS
TEXT_STEP = 16  # question-text length bucket (bench questions are 11-17 tokens)
OPTION_STEP = 8  # option length bucket (bench options are 2-7 tokens, a few 18-20)
# Questions share passes of a FIXED row count per length bucket, padding rows filling the rest,
# and options likewise: the shape a question runs in is then a function of its own lengths only,
# and a row's outputs in a fixed-shape pass are byte-identical whatever the other rows hold and
# wherever the row sits. Batches whose size followed the number of questions moved answers in
# BF16 (the kernels follow the batch shape). RuntimeConfig.question_batch is the question
# passes' row count (QUESTION_ROWS where the caller has none).
QUESTION_ROWS = QUESTION_BATCH  # RuntimeConfig's default: the 12 speed-bench questions in one
OPTION_ROWS = 64  # the reference's option chunk (docs/model.md §8.4): 255 options in 4 passes
# Option passes come in two families, chosen by the question's OWN number of options (so a row's
# shape is still a function of its question alone): (most options, rows, token slots). Small
# passes are faster for a few options, the wide ones for many.
SMALL_QUESTION_OPTIONS = 32
OPTION_FAMILIES = (
    (SMALL_QUESTION_OPTIONS, 32, SMALL_OPTION_TOKENS),  # 32 rows × 8, 16 × 16, 8 × 24, ...
    (MAX_OPTIONS, OPTION_ROWS, WIDE_OPTION_TOKENS),  # 64 rows × 8, 32 × 16, 16 × 24, ...
)


def bucket(n: int, step: int) -> int:
    """Round a length up to its bucket, so that shapes repeat across requests."""
    return max(step, -(-n // step) * step)


def batch_bucket(n: int, cap: int) -> int:
    """Rows per pass: the next power of two, at most `cap`."""
    size = 1
    while size < n:
        size *= 2
    return min(size, cap)


def rows_for(length: int, rows: int, tokens: int) -> int:
    """Rows of every pass of this length bucket: `rows`, or fewer (a power of two, at least
    one) where `rows` × `length` would exceed `tokens`."""
    size = 1
    while size * 2 * length <= tokens and size * 2 <= rows:
        size *= 2
    return size


def option_family(count: int, families: tuple = OPTION_FAMILIES) -> tuple[int, int]:
    """(rows, token slots) of the option passes of a question with `count` options."""
    for most, rows, tokens in families:
        if count <= most:
            return rows, tokens
    raise ValueError(f"at most {MAX_OPTIONS} options, got {count}")


def padded(values: list[int], filler: int) -> list[int]:
    return values + [filler] * (batch_bucket(max(len(values), 1), 1 << 30) - len(values))


@dataclass
class Pass:
    """One pass over right-padded rows; arrays follow the ONNX inputs of docs/design.md."""

    input_ids: np.ndarray  # int64 [B, T]
    positions: np.ndarray  # int64 [3, B, T]
    lengths: np.ndarray  # int64 [B]
    src: np.ndarray  # int64 [B]
    # int64 [B]: the image prefix each row continues, an index into the pass's stacked
    # prefixes (prefix_k.{i} [R, ...]; Prepared.owners); all zeros where the pass reads one
    prefix_rows: np.ndarray
    read_rows: list[int] = field(default_factory=list)  # flat indices into B * T
    targets: list[tuple[int, int]] = field(default_factory=list)  # (flat index, token)
    # for a piece of a longer pass: where its readouts go in the whole pass's outputs
    read_index: list[int] = field(default_factory=list)
    target_index: list[int] = field(default_factory=list)

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_ids.shape  # type: ignore[return-value]

    def arrays(self, pad: bool = True) -> dict[str, np.ndarray]:
        """Row inputs. Readout lists are padded with reads of token 0 at row 0 to a power of two
        (never empty), so that shapes repeat across requests: one captured graph or fixed-shape
        session serves many. Every readout is per row; the padding changes no real one. With
        `pad` False (a backend that reads outside its graphs in pieces of its own) the target
        lists keep their length, and `target_rows` holds each row once (sorted), `target_slots`
        which of them each target reads: a question's options' first tokens are all read at
        one row (its zq, and an alone question's `<|opt|>`), 510 of the 255-option pass's
        1,420 targets, where a row's log-softmax over the vocabulary is the readout's work."""
        read = padded(self.read_rows, 0)
        rows = [t[0] for t in self.targets] or [0]
        tokens = [t[1] for t in self.targets] or [0]
        slots = None
        if pad:
            rows, tokens = padded(rows, 0), padded(tokens, 0)
        else:
            rows, slots = np.unique(np.asarray(rows, dtype=np.int64), return_inverse=True)
        arrays = {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "lengths": self.lengths,
            "src": self.src,
            "prefix_rows": self.prefix_rows,
            "read_rows": np.asarray(read, dtype=np.int64),
            "target_rows": np.asarray(rows, dtype=np.int64),
            "target_tokens": np.asarray(tokens, dtype=np.int64),
        }
        if slots is not None:
            arrays["target_slots"] = slots.astype(np.int64)
        return arrays


@dataclass
class QuestionPass:
    """Question-text rows; `members[i]` is the question index of row i."""

    rows: Pass
    members: list[int]
    zq_read: dict[int, int]  # question -> index into hidden readouts
    first_read: dict[tuple[int, int], int]  # (question, option) -> index into logprobs


@dataclass
class OptionPass:
    """Option rows continuing the states of one question pass."""

    rows: Pass
    question_pass: int
    members: list[tuple[int, int]]  # (question, option) per row
    u_read: dict[tuple[int, int], int]  # -> index into hidden readouts
    text_reads: dict[tuple[int, int], list[int]]  # -> indices into logprobs, in token order


@dataclass
class Plan:
    prefix: Pass
    prefix_length: int  # valid tokens of the image prefix
    questions: list[QuestionPass]
    options: list[OptionPass]


def owner(prepared: Prepared, qi: int) -> int:
    """The image prefix question `qi`'s rows read: its request's in a merged batch, else 0."""
    return prepared.owners[qi] if prepared.owners else 0


def prefix_starts(prepared: Prepared) -> list[int]:
    """Each question's image prefix length (`image_prefix_length` of its image's questions)."""
    groups: dict[int, list[int]] = {}
    for qi in range(len(prepared.layouts)):
        groups.setdefault(owner(prepared, qi), []).append(qi)
    starts = [0] * len(prepared.layouts)
    for members in groups.values():
        n = image_prefix_length(tuple(prepared.layouts[qi] for qi in members))
        for qi in members:
            starts[qi] = n
    return starts


def longest_prefix(prefix_length: int, image_tokens: int, clip: bool = False) -> int:
    """The prefix bucket of this prompt about the largest image the resize makes
    (MAX_IMAGE_TOKENS image tokens), or CLIP_PREFIX for a clip: the keys of every prefix where
    a backend fixes them (`Capabilities.fixed_prefix_keys`)."""
    if clip:
        return CLIP_PREFIX
    return bucket(prefix_length - image_tokens + MAX_IMAGE_TOKENS, PREFIX_STEP)


def image_prefix_length(layouts: tuple[QuestionLayout, ...]) -> int:
    """Tokens through the last <|vision_end|> (a video's frames come one after another),
    identical for every question by the prompt template."""
    ids = layouts[0].token_ids
    end = len(ids) - ids[::-1].index(VISION_END)
    for layout in layouts[1:]:
        if layout.token_ids[:end] != ids[:end]:
            raise ValueError("questions do not share the image prefix")
    return end


def empty_pass(batch: int, length: int) -> Pass:
    return Pass(
        input_ids=np.zeros((batch, length), dtype=np.int64),
        positions=np.zeros((3, batch, length), dtype=np.int64),
        lengths=np.ones(batch, dtype=np.int64),
        src=np.zeros(batch, dtype=np.int64),
        prefix_rows=np.zeros(batch, dtype=np.int64),
    )


def fill_row(p: Pass, row: int, ids: list[int], positions: np.ndarray, src: int = 0) -> None:
    n = len(ids)
    p.input_ids[row, :n] = ids
    p.positions[:, row, :n] = positions
    # padded tokens keep counting so that rotary tables stay finite; they are masked anyway
    last = positions[:, -1:] if n else np.zeros((3, 1), dtype=np.int64)
    p.positions[:, row, n:] = last + np.arange(1, p.input_ids.shape[1] - n + 1)
    p.lengths[row] = n
    p.src[row] = src


def plan_prefix(prepared: Prepared) -> tuple[Pass, int]:
    """The image prefix's pass (of owner 0's image, in a merged batch) and its length."""
    layout = prepared.layouts[0]
    n = prefix_starts(prepared)[0]
    p = empty_pass(1, bucket(n, CLIP_PREFIX_STEP if prepared.clip else PREFIX_STEP))
    fill_row(p, 0, list(layout.token_ids[:n]), layout.positions[:, :n])
    return p, n


def question_span(layout: QuestionLayout, start: int) -> tuple[list[int], np.ndarray]:
    """The question's own text: from the image prefix to its zq token inclusive."""
    end = layout.opens[0]
    return list(layout.token_ids[start:end]), layout.positions[:, start:end]


def option_span(layout: QuestionLayout, k: int) -> tuple[list[int], np.ndarray]:
    """Option k's block <|opt|> … <|/opt|>, at the positions it has as the question's only
    option (the reference branches each row straight after the question, docs/model.md §8.4)."""
    ids = list(layout.token_ids[layout.opens[k] : layout.closes[k] + 1])
    base = int(layout.positions[0, layout.opens[0]])
    return ids, np.broadcast_to(base + np.arange(len(ids)), (3, len(ids))).astype(np.int64)


def plan_questions(prepared: Prepared, spans: list, rows: int) -> list[QuestionPass]:
    """Question texts (`spans`, each question's `question_span`) by length bucket, `rows` rows
    a pass (fewer for long buckets: rows_for) whatever the count asked."""
    groups: dict[int, list[int]] = {}
    for qi, (ids, _) in enumerate(spans):
        groups.setdefault(bucket(len(ids), TEXT_STEP), []).append(qi)
    passes = []
    for length, members in sorted(groups.items()):
        size = rows_for(length, rows, QUESTION_TOKENS)
        for chunk_start in range(0, len(members), size):
            chunk = members[chunk_start : chunk_start + size]
            passes.append(question_pass(prepared, spans, chunk, length, size))
    return passes


def question_pass(
    prepared: Prepared, spans: list, chunk: list[int], length: int, rows: int
) -> QuestionPass:
    """A pass of `rows` rows of `length` tokens holding the texts of the questions `chunk`, with
    their readouts: the zq row and the options' first tokens."""
    p = empty_pass(rows, length)
    qp = QuestionPass(rows=p, members=chunk, zq_read={}, first_read={})
    for row, qi in enumerate(chunk):
        ids, positions = spans[qi]
        # the row continues its image's after-prefix states (its `src`) and reads its prefix
        fill_row(p, row, ids, positions, owner(prepared, qi))
        p.prefix_rows[row] = owner(prepared, qi)
        read_zq(qp, p.read_rows, p.targets, prepared, qi, row * length + len(ids) - 1)
    return qp


def read_zq(
    qp: QuestionPass, read_rows: list[int], targets: list, prepared: Prepared, qi: int, zq: int
) -> None:
    """Question `qi`'s readouts at its zq token (`zq`, a flat index of its pass): the hidden
    state, and (but for Score) each option's first token's log-probability there."""
    qp.zq_read[qi] = len(read_rows)
    read_rows.append(zq)
    layout = prepared.layouts[qi]
    if layout.question.type == "score":
        return
    for k, option_row in enumerate(layout.rows):
        if option_row.first is not None:
            qp.first_read[(qi, k)] = len(targets)
            targets.append((zq, option_row.first))


def plan_options(prepared: Prepared, question_passes: list[QuestionPass]) -> list[OptionPass]:
    """The options of one question pass's questions by family (option_family of the question's
    option count) and length bucket (OPTION_STEP), the family's rows a pass (fewer for long
    buckets: rows_for), each row continuing its question's row."""
    passes = []
    for pi, qp in enumerate(question_passes):
        groups: dict[tuple[tuple[int, int], int], list[tuple[int, int, int]]] = {}
        for source, qi in enumerate(qp.members):
            layout = prepared.layouts[qi]
            family = option_family(len(layout.opens))
            for k, (o, c) in enumerate(zip(layout.opens, layout.closes, strict=True)):
                length = bucket(c - o + 1, OPTION_STEP)
                groups.setdefault((family, length), []).append((qi, k, source))
        for ((family_rows, family_tokens), length), rows in sorted(groups.items()):
            size = rows_for(length, family_rows, family_tokens)
            for chunk_start in range(0, len(rows), size):
                chunk = rows[chunk_start : chunk_start + size]
                p = empty_pass(size, length)
                op = OptionPass(rows=p, question_pass=pi, members=[], u_read={}, text_reads={})
                fill_options(op, prepared.layouts, chunk, length)
                # an option row reads the image prefix of the question row it continues
                p.prefix_rows[: len(chunk)] = qp.rows.prefix_rows[[s for _, _, s in chunk]]
                passes.append(op)
    return passes


def fill_options(
    op: OptionPass, layouts: tuple[QuestionLayout, ...], chunk: list, length: int
) -> None:
    """`fill_row` of each option of `chunk` ((question, option, source row) per row) with its
    `option_span`, then its reads: the u row and, but for Score, each text token from the one
    before. An option's tokens are text, so its three M-RoPE positions are equal and count on
    from the question's first option through the padding: one array operation for the
    pass."""
    p = op.rows
    bases = np.zeros(len(chunk), dtype=np.int64)
    for row, (qi, k, source) in enumerate(chunk):
        layout = layouts[qi]
        start, end = layout.opens[k], layout.closes[k] + 1
        ids = layout.token_ids[start:end]
        n = end - start
        p.input_ids[row, :n] = ids
        p.lengths[row] = n
        p.src[row] = source
        bases[row] = layout.positions[0, layout.opens[0]]
        op.members.append((qi, k))
        op.u_read[(qi, k)] = len(p.read_rows)
        p.read_rows.append(row * length + n - 1)
        if layout.question.type == "score":
            op.text_reads[(qi, k)] = []
            continue
        first = len(p.targets)
        p.targets.extend((row * length + j - 1, ids[j]) for j in range(1, n - 1))
        op.text_reads[(qi, k)] = list(range(first, len(p.targets)))
    p.positions[:, : len(chunk)] = bases[:, None] + np.arange(length)


def plan(prepared: Prepared, question_rows: int = QUESTION_ROWS) -> Plan:
    """The rectangle passes of a request: question passes of `question_rows` rows, option
    passes of their family's (fewer for long buckets), whatever else the request asks. A merged
    batch (`Prepared.owners`) plans its requests' questions as one request's, each row reading
    its own image's prefix (`Pass.prefix_rows`) and, for a question row, its image's
    after-prefix states (`src`); the plan's `prefix` is then the first image's."""
    prefix, n = plan_prefix(prepared)
    starts = prefix_starts(prepared)
    spans = [question_span(layout, starts[qi]) for qi, layout in enumerate(prepared.layouts)]
    questions = plan_questions(prepared, spans, question_rows)
    return Plan(prefix, n, questions, plan_options(prepared, questions))
