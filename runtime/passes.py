"""Plans the language-model passes of a prepared request: image prefix, question texts, options.

Follows the prefix-reuse executor of the native worker (docs/model.md §12.1) with one change: the
splits are fixed points of each question's own sequence, never the reference's cross-question
prefix `L`, and every pass has a fixed row count per length bucket (and, for options, per family
of the question's own option count), so the shape a question runs in, and its rows' contents,
never depend on the other questions (docs/design.md). Fitted plans (`fit`) give a pass only the
rows it holds, for engines whose arithmetic keeps a row's bytes whatever the row count.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from runtime.config import QUESTION_BATCH
from runtime.constants import (
    OPEN_ID,
    QUESTION_TOKENS,
    SMALL_OPTION_TOKENS,
    WIDE_OPTION_TOKENS,
)
from runtime.constants import VISION_END_ID as VISION_END
from runtime.contract import MAX_OPTIONS
from runtime.images import FACTOR, MAX_PIXELS
from runtime.types import Prepared, QuestionLayout

PREFIX_STEP = 64  # image-prefix length bucket: one CUDA graph per 64 tokens of prefix
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
# Joint passes (`plan(..., joint=True)`): each option pass of a question with at most this many
# options runs with its text's rows as one pass, reading the weights once for both: the passes
# are bound by reading the weights. The wide family's passes joined with the questions beside
# them were slower, so they do not share joint passes.
JOINT_OPTIONS = SMALL_QUESTION_OPTIONS
# A question with more options joins, but alone (`plan(joint=True, fit=True)`): its text
# and its own options only, in joint passes of this family, so that every shape it runs in is a
# function of that question alone and may exceed the token slots the row floors were measured
# for. One 256 × 8 pass holds 255 options of up to 8 tokens, where the wide family's four passes
# each paid a weight read and ~1,300 kernels whatever their rows.
ALONE_ROWS = 256
ALONE_FAMILY = ((MAX_OPTIONS, ALONE_ROWS, ALONE_ROWS * OPTION_STEP),)  # 256 × 8, 128 × 16, ...
# An alone question's text runs on through the leading tokens all its option blocks share
# (`shared_tokens`: at least its first `<|opt|>`; its question part reads the log-probabilities
# of each option's text tokens there), and its option rows start after them: every row began
# with those tokens at the same positions from the same state, so their work was the same in
# each. Its options of at most OPTION_STEP tokens then share one pass as wide as the longest of
# them, in steps of ALONE_STEP.
ALONE_STEP = 2
# The joint-pass lengths whose largest fitted shape the worker builds before it reports ready
# (`bucket_joints`), so that a joint pass of fewer rows of those lengths runs in a built shape:
# texts of 16 and 32 tokens, options of 8 to 32, the traffic suite's. After the built-in
# warm-up, the suite's 160 requests met 8 joint passes in 678 with no built shape of their
# lengths; 21 without these builds, 39 where a pass runs in its own shape only (bench.gpu plans)
BUCKET_TEXTS = (TEXT_STEP, 2 * TEXT_STEP)
BUCKET_OPTIONS = tuple(OPTION_STEP * k for k in range(1, 5))
# Fitted passes (`plan(..., fit=True)`): a pass has the rows its questions or options need (the
# next power of two, at most its bucket's fixed count) instead of the fixed count. Only for an
# engine whose arithmetic gives a row the same bytes whatever the pass's row count (the torch
# backend checks its products at load and pads those that do not: TorchBackend.fit_rows).
# torch.compile's dynamic shapes specialise a size of 1, so a 1-row pass would run code
# compiled apart from the other row counts: passes keep at least this many rows
MIN_FITTED_ROWS = 2


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


def fitted_rows(count: int, size: int, fit: bool) -> int:
    """Rows of a pass holding `count` rows of a bucket whose fixed count is `size`."""
    if not fit:
        return size
    return min(size, batch_bucket(max(count, MIN_FITTED_ROWS), size))


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
    # (question, option) -> indices into logprobs of its first text tokens, read where the text
    # runs on through the options' shared leading tokens (question_span's `shared`), in token
    # order: the first of the option's text reads, which its option pass's `text_reads` go on
    # from
    open_read: dict[tuple[int, int], list[int]] = field(default_factory=dict)


@dataclass
class OptionPass:
    """Option rows continuing the states of one question pass."""

    rows: Pass
    question_pass: int
    members: list[tuple[int, int]]  # (question, option) per row
    u_read: dict[tuple[int, int], int]  # -> index into hidden readouts
    text_reads: dict[tuple[int, int], list[int]]  # -> indices into logprobs, in token order


@dataclass
class JointPass:
    """An option pass and the rows of the questions it continues, run as one pass (the torch
    backend's `lm_joint`); `question` holds only the questions its rows continue, and the option
    rows' `src` indexes them."""

    question: QuestionPass
    options: OptionPass

    @property
    def tokens(self) -> int:
        """Token slots of the pass: its products' rows."""
        return sum(int(np.prod(p.rows.shape)) for p in (self.question, self.options))


@dataclass
class Plan:
    prefix: Pass
    prefix_length: int  # valid tokens of the image prefix
    questions: list[QuestionPass]
    options: list[OptionPass]
    # with `plan(joint=True)`: the joining questions' option passes with their rows; the
    # question and option passes then hold the other questions only
    joint: list[JointPass] = field(default_factory=list)
    joined: bool = False  # made with `joint`


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


def longest_prefix(prefix_length: int, image_tokens: int) -> int:
    """The prefix bucket of this prompt about the largest image the resize makes
    (MAX_IMAGE_TOKENS image tokens): the keys of every prefix where a backend fixes them
    (`Capabilities.fixed_prefix_keys`)."""
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
    p = empty_pass(1, bucket(n, PREFIX_STEP))
    fill_row(p, 0, list(layout.token_ids[:n]), layout.positions[:, :n])
    return p, n


def question_span(
    layout: QuestionLayout, start: int, shared: int = 0
) -> tuple[list[int], np.ndarray]:
    """The question's own text: from the image prefix to its zq token inclusive, and the
    `shared` leading tokens of its option blocks after it (an alone question's:
    `shared_tokens`)."""
    end = layout.opens[0] + shared
    return list(layout.token_ids[start:end]), layout.positions[:, start:end]


def option_span(layout: QuestionLayout, k: int, shared: int = 0) -> tuple[list[int], np.ndarray]:
    """Option k's block <|opt|> … <|/opt|> (after its `shared` leading tokens), at the
    positions it has as the question's only option (the reference branches each row straight
    after the question, docs/model.md §8.4)."""
    ids = list(layout.token_ids[layout.opens[k] + shared : layout.closes[k] + 1])
    base = int(layout.positions[0, layout.opens[0]]) + shared
    return ids, np.broadcast_to(base + np.arange(len(ids)), (3, len(ids))).astype(np.int64)


def shared_tokens(layout: QuestionLayout) -> int:
    """How many leading tokens every option block of the question has in common (its
    `<|opt|>` at least), leaving each block its last token, the `<|/opt|>` where u is read."""
    blocks = [layout.token_ids[o : c + 1] for o, c in zip(layout.opens, layout.closes, strict=True)]
    most = min(len(block) for block in blocks) - 1
    count = 1
    while count < most and len({block[count] for block in blocks}) == 1:
        count += 1
    return count


def plan_questions(
    prepared: Prepared,
    spans: list,
    rows: int,
    fit: bool = False,
    only: set[int] | None = None,
    read: bool = True,
) -> list[QuestionPass]:
    """Question texts (`spans`, each question's `question_span`) by length bucket, `rows` rows
    a pass (fewer for long buckets: rows_for) whatever the count asked; with `fit`, as many as
    the pass holds (fitted_rows); with `only`, just those questions; without `read`, no
    readouts (joint plans make their question parts again, with them: `joint_pass`)."""
    groups: dict[int, list[int]] = {}
    for qi, (ids, _) in enumerate(spans):
        if only is None or qi in only:
            groups.setdefault(bucket(len(ids), TEXT_STEP), []).append(qi)
    passes = []
    for length, members in sorted(groups.items()):
        size = rows_for(length, rows, QUESTION_TOKENS)
        for chunk_start in range(0, len(members), size):
            chunk = members[chunk_start : chunk_start + size]
            rows_here = fitted_rows(len(chunk), size, fit)
            reads = set(chunk) if read else set()
            passes.append(question_pass(prepared, spans, chunk, length, rows_here, reads))
    return passes


def question_pass(
    prepared: Prepared, spans: list, chunk: list[int], length: int, rows: int, read: set[int]
) -> QuestionPass:
    """A pass of `rows` rows of `length` tokens holding the texts of the questions `chunk`;
    the questions in `read` get their readouts (the zq row and the options' first tokens; for
    a text that runs on through its options' shared leading tokens, question_span's
    `shared`, each option's text tokens read there, the first of its text reads)."""
    p = empty_pass(rows, length)
    qp = QuestionPass(rows=p, members=chunk, zq_read={}, first_read={})
    for row, qi in enumerate(chunk):
        ids, positions = spans[qi]
        # the row continues its image's after-prefix states (its `src`) and reads its prefix
        fill_row(p, row, ids, positions, owner(prepared, qi))
        p.prefix_rows[row] = owner(prepared, qi)
        if qi not in read:
            continue
        # the span holds no <|opt|> but the shared tokens' first (user text cannot hold one)
        shared = len(ids) - ids.index(OPEN_ID) if OPEN_ID in ids else 0
        zq_flat = row * length + len(ids) - 1 - shared
        qp.zq_read[qi] = len(p.read_rows)
        p.read_rows.append(zq_flat)
        layout = prepared.layouts[qi]
        if layout.question.type == "score":
            continue
        targets, ids_all = p.targets, layout.token_ids
        marks = zip(layout.rows, layout.opens, layout.closes, strict=True)
        for k, (option_row, o, c) in enumerate(marks):
            if option_row.first is not None:
                qp.first_read[(qi, k)] = len(targets)
                targets.append((zq_flat, option_row.first))
            # text tokens 1 … count of the block, each read at the token before it
            count = min(shared, c - o - 1)
            if count > 0:
                qp.open_read[(qi, k)] = list(range(len(targets), len(targets) + count))
                at = range(zq_flat + 1, zq_flat + 1 + count)
                targets.extend(zip(at, ids_all[o + 1 : o + 1 + count], strict=True))
    return qp


def plan_options(
    prepared: Prepared,
    question_passes: list[QuestionPass],
    fit: bool = False,
    families: tuple = OPTION_FAMILIES,
    share: bool = False,
) -> list[OptionPass]:
    """The options of one question pass's questions by family (option_family of the question's
    option count among `families`) and length bucket (`option_buckets`), the family's rows a
    pass (fewer for long buckets: rows_for; with `fit`, as many as the pass holds), each row
    continuing its question's row; with `share` (texts through their options' shared leading
    tokens), each row the option's block after them."""
    passes, shares = [], {}
    for pi, qp in enumerate(question_passes):
        groups: dict[tuple[tuple[int, int], int], list[tuple[int, int, int]]] = {}
        for source, qi in enumerate(qp.members):
            layout = prepared.layouts[qi]
            family = option_family(len(layout.opens), families)
            shares[qi] = shared_tokens(layout) if share else 0
            for k, length in enumerate(option_buckets(layout, shares[qi])):
                groups.setdefault((family, length), []).append((qi, k, source))
        for ((family_rows, family_tokens), length), rows in sorted(groups.items()):
            size = rows_for(length, family_rows, family_tokens)
            for chunk_start in range(0, len(rows), size):
                chunk = rows[chunk_start : chunk_start + size]
                p = empty_pass(fitted_rows(len(chunk), size, fit), length)
                op = OptionPass(rows=p, question_pass=pi, members=[], u_read={}, text_reads={})
                fill_options(op, prepared.layouts, chunk, length, shares)
                # an option row reads the image prefix of the question row it continues
                p.prefix_rows[: len(chunk)] = qp.rows.prefix_rows[[s for _, _, s in chunk]]
                passes.append(op)
    return passes


def option_buckets(layout: QuestionLayout, shared: int = 0) -> list[int]:
    """Each option row's length bucket: OPTION_STEP steps; with `shared` (rows after the
    blocks' shared leading tokens), the rows of at most OPTION_STEP tokens all in the bucket of
    the longest of them, in ALONE_STEP steps, so that they share one pass (a function of the
    question alone)."""
    lengths = [c - o + 1 - shared for o, c in zip(layout.opens, layout.closes, strict=True)]
    if not shared:
        return [bucket(n, OPTION_STEP) for n in lengths]
    short = bucket(max((n for n in lengths if n <= OPTION_STEP), default=1), ALONE_STEP)
    return [short if n <= OPTION_STEP else bucket(n, OPTION_STEP) for n in lengths]


def fill_options(
    op: OptionPass,
    layouts: tuple[QuestionLayout, ...],
    chunk: list,
    length: int,
    shares: dict[int, int] | None = None,
) -> None:
    """`fill_row` of each option of `chunk` ((question, option, source row) per row) with its
    `option_span` (after its question's `shares` leading tokens, none where it has none), then
    its reads: the u row and, but for Score, each text token from the one before (those read
    in the question part are its `open_read`). An option's tokens are text, so its three M-RoPE
    positions are equal and count on from the question's first option through the padding:
    one array operation for the pass."""
    p = op.rows
    bases = np.zeros(len(chunk), dtype=np.int64)
    for row, (qi, k, source) in enumerate(chunk):
        layout = layouts[qi]
        shared = shares.get(qi, 0) if shares else 0
        start, end = layout.opens[k] + shared, layout.closes[k] + 1
        ids = layout.token_ids[start:end]
        n = end - start
        p.input_ids[row, :n] = ids
        p.lengths[row] = n
        p.src[row] = source
        bases[row] = layout.positions[0, layout.opens[0]] + shared
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


def plan_joint(
    prepared: Prepared,
    spans: list,
    questions: list[QuestionPass],
    options: list[OptionPass],
    question_rows: int,
    fit: bool,
) -> list[JointPass]:
    """Each option pass with the texts of the questions it continues, in a question part of
    their own (the rows those questions need, as `plan_questions` sizes a pass of their length
    bucket): a question's text runs again in each joint pass that reads it, so that every
    question row and every option row always runs in a joint pass. A question's readouts are
    taken in the first joint pass that holds it."""
    read: set[int] = set()
    joint = []
    for op in options:
        jp = joint_pass(prepared, spans, questions, op, question_rows, fit, read)
        read |= set(jp.question.members)
        joint.append(jp)
    return joint


def joint_pass(
    prepared: Prepared,
    spans: list,
    questions: list[QuestionPass],
    op: OptionPass,
    question_rows: int,
    fit: bool,
    read: set[int] | None = None,
) -> JointPass:
    """The joint pass of option pass `op`: a question part with the questions its rows continue,
    in the question pass's order, and its `src` pointing at those rows; readouts for the
    questions not in `read`."""
    qp = questions[op.question_pass]
    sources = part_sources(op)
    chunk = [qp.members[s] for s in sources]
    length = qp.rows.shape[1]
    rows = question_part_rows(len(chunk), length, question_rows, fit)
    new = set(chunk) - (read or set())
    where = {s: row for row, s in enumerate(sources)}
    real = op.rows.src[: len(op.members)]
    src = np.zeros_like(op.rows.src)
    src[: len(real)] = [where[int(s)] for s in real]
    text = question_pass(prepared, spans, chunk, length, rows, new)
    return JointPass(text, replace(op, rows=replace(op.rows, src=src)))


def part_sources(op: OptionPass) -> list[int]:
    """The question-pass rows the option rows of `op` continue, in order."""
    return sorted({int(s) for s in op.rows.src[: len(op.members)]})


def question_part_rows(count: int, length: int, question_rows: int, fit: bool) -> int:
    """Rows of a joint pass's question part holding `count` questions of `length` tokens."""
    most = rows_for(length, question_rows, QUESTION_TOKENS)
    return max(fitted_rows(count, most, fit), count)


def grown(rows: Pass, count: int) -> Pass:
    """`rows` with filler rows appended up to `count` rows, as a fitted pass pads (`empty_pass`):
    its reads are flat indices row × T + token, so they stay where they were."""
    extra = count - rows.shape[0]
    if extra <= 0:
        return rows
    filler = empty_pass(extra, rows.shape[1])
    return replace(
        rows,
        input_ids=np.concatenate([rows.input_ids, filler.input_ids]),
        positions=np.concatenate([rows.positions, filler.positions], axis=1),
        lengths=np.concatenate([rows.lengths, filler.lengths]),
        src=np.concatenate([rows.src, filler.src]),
        prefix_rows=np.concatenate([rows.prefix_rows, filler.prefix_rows]),
    )


def larger_joints(jp: JointPass, question_rows: int = QUESTION_ROWS) -> list[JointPass]:
    """`jp` with more filler rows in its question part, its option part or both, as the
    planner makes fitted joint passes of the same lengths for more rows (powers of two up to
    each part's count), fewest token slots first. A row's bytes do not follow a fitted pass's
    row count, so each gives `jp`'s rows the same bytes. None for a question joining alone
    (more option rows than the small family's): its shapes are its own."""
    (q_rows, q_length), (o_rows, o_length) = jp.question.rows.shape, jp.options.rows.shape
    q_most = rows_for(q_length, question_rows, QUESTION_TOKENS)
    _, o_family, o_tokens = OPTION_FAMILIES[0]
    o_most = rows_for(o_length, o_family, o_tokens)
    if q_rows > q_most or o_rows > o_most:
        return []
    sizes = [
        (q, o)
        for q in doublings(q_rows, q_most)
        for o in doublings(o_rows, o_most)
        if (q, o) != (q_rows, o_rows)
    ]
    sizes.sort(key=lambda size: (size[0] * q_length + size[1] * o_length, size))
    return [
        JointPass(
            replace(jp.question, rows=grown(jp.question.rows, q)),
            replace(jp.options, rows=grown(jp.options.rows, o)),
        )
        for q, o in sizes
    ]


def bucket_joints(question_rows: int = QUESTION_ROWS) -> list[JointPass]:
    """The largest fitted joint pass of each BUCKET_TEXTS × BUCKET_OPTIONS pair of lengths, of
    filler rows: built before the worker is ready, each serves every joint pass of its lengths
    (`larger_joints`)."""
    _, o_family, o_tokens = OPTION_FAMILIES[0]
    made = []
    for text in BUCKET_TEXTS:
        for option in BUCKET_OPTIONS:
            rows = empty_pass(rows_for(text, question_rows, QUESTION_TOKENS), text)
            options = empty_pass(rows_for(option, o_family, o_tokens), option)
            made.append(
                JointPass(QuestionPass(rows, [], {}, {}), OptionPass(options, 0, [], {}, {}))
            )
    return made


def doublings(start: int, most: int) -> list[int]:
    """`start`, twice it, ... up to `most`."""
    made = [start]
    while made[-1] * 2 <= most:
        made.append(made[-1] * 2)
    return made


def joins(layout: QuestionLayout) -> bool:
    """Whether a question's rows run in joint passes: by its own option count, so that where
    a row runs never depends on the other questions."""
    return len(layout.opens) <= JOINT_OPTIONS


def plan(
    prepared: Prepared,
    question_rows: int = QUESTION_ROWS,
    fit: bool = False,
    joint: bool = False,
) -> Plan:
    """The passes of a request; question passes have `question_rows` rows, option passes their
    family's (fewer for long buckets), whatever else the request asks; with `fit`, each pass
    only the rows it holds (MIN_FITTED_ROWS at least); with `joint`, the questions that `joins`
    in joint passes, and with `fit` too every other question alone in joint passes of its own
    (`plan_alone`); the rest in question and option passes as before. A merged batch
    (`Prepared.owners`) plans its requests' questions as one request's, each row reading its
    own image's prefix (`Pass.prefix_rows`) and, for a question row, its image's after-prefix
    states (`src`); the plan's `prefix` is then the first image's."""
    prefix, n = plan_prefix(prepared)
    layouts = prepared.layouts
    joining = {qi for qi, layout in enumerate(layouts) if joint and joins(layout)}
    alone = set() if not (joint and fit) else set(range(len(layouts))) - joining
    starts = prefix_starts(prepared)
    spans = [
        question_span(layout, starts[qi], shared_tokens(layout) if qi in alone else 0)
        for qi, layout in enumerate(layouts)
    ]
    apart = set(range(len(layouts))) - joining - alone
    questions = plan_questions(prepared, spans, question_rows, fit, only=apart)
    work = Plan(prefix, n, questions, plan_options(prepared, questions, fit), joined=joint)
    if joining:
        mine = plan_questions(prepared, spans, question_rows, fit, only=joining, read=False)
        theirs = plan_options(prepared, mine, fit)
        work.joint = plan_joint(prepared, spans, mine, theirs, question_rows, fit)
    for qi in sorted(alone):
        work.joint += plan_alone(prepared, spans, qi, question_rows)
    return work


def plan_alone(prepared: Prepared, spans: list, qi: int, question_rows: int) -> list[JointPass]:
    """Question `qi`'s text (its span through the options' `shared_tokens`) and its options in
    ALONE_FAMILY passes (fitted), each in a joint pass, holding nothing of any other question:
    the shapes are a function of that question alone, whatever their token slots."""
    mine = plan_questions(prepared, spans, question_rows, fit=True, only={qi}, read=False)
    theirs = plan_options(prepared, mine, fit=True, families=ALONE_FAMILY, share=True)
    return plan_joint(prepared, spans, mine, theirs, question_rows, True)


def early_heads_fit(work: Plan) -> bool:
    """Whether a plan's heads can start before its last pass: two or more joint passes, no
    other pass (which would wait to be enqueued until those heads were done), and a question
    that a pass before the last finishes (one question alone in several passes, as 255
    options, finishes only with the last: waiting for the others would only cost time)."""
    if len(work.joint) < 2 or work.questions:
        return False
    return any(finished_by_joint(work))


def finished_by_joint(work: Plan) -> list[list[int]]:
    """For each joint pass but the last, the questions it finishes (in order): those whose
    every readout (the text's hidden state and first log-probabilities, each option's hidden
    state and text) comes from it or an earlier joint pass. Their heads need nothing from the
    passes after it (`Executor.early_answers`)."""
    last: dict[int, int] = {}  # question -> the last joint pass with a readout of it
    for k, jp in enumerate(work.joint):
        keys = [*jp.question.zq_read, *(qi for qi, _ in jp.question.first_read)]
        keys += [qi for qi, _ in jp.question.open_read]
        op = jp.options
        keys += [qi for qi, _ in op.u_read] + [qi for qi, _ in op.text_reads]
        last.update(dict.fromkeys(keys, k))
    early = range(len(work.joint) - 1)
    return [[qi for qi, at in sorted(last.items()) if at == k] for k in early]
