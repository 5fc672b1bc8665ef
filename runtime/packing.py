"""Plans a prepared request's packed passes: every question's text row and option rows end to end
in one flat token dimension, in as few passes of PACK_SIZES token slots as hold them. The tokens
every option block of a question begins with (`<|opt|>` at least) end its text row, computed
once, and each option row holds the rest of its block.

A row is a function of its question alone (its tokens, positions and reads), and the engine's
arithmetic of a row never follows the pass it is in (runtime.model.packed), so any packing gives
every answer the same bytes: the planner only has to fill passes well. Follows the splits of
docs/design.md "Language-model passes": image prefix, question text through zq, each option
block continuing its question's text.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from runtime.model.packed import ROW_TABLES, TEXT_ROWS
from runtime.passes import (
    OptionPass,
    Pass,
    QuestionPass,
    option_span,
    owner,
    plan_prefix,
    prefix_starts,
    question_span,
    read_zq,
)
from runtime.types import Prepared, QuestionLayout

# The token slots of a packed pass, each one compiled and captured graph built before the
# worker is ready. At least 256: below that the matrix-product libraries give a row other bytes
# as the row count changes (cuBLAS BF16 on the H100, MKL float32 here), from 256 to 8,192 the
# same at any count and any place; the backend checks its machine's products at every size
# before it merges requests (runtime.model.packed.products_differ). Steps of an eighth to a
# quarter keep the suite's passes about nine tenths full; the largest holds any one question
# the contract admits (8,192 tokens)
PACK_SIZES = (
    256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048,
    2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192,
)  # fmt: skip
MAX_PACK = PACK_SIZES[-1]
# rows a pass of N token slots holds at most (its row tables' length, less the empty row): the
# kernels' grids cover every row, so a row table sized to N would launch mostly idle programs;
# an option block is at least three tokens (<|opt|> text <|/opt|>)
TOKENS_PER_ROW = 4


def rows_of(size: int) -> int:
    """Rows a pass of `size` token slots holds."""
    return size // TOKENS_PER_ROW


def pack_size(tokens: int, rows: int) -> int:
    """The smallest PACK_SIZES entry holding `tokens` tokens in `rows` rows."""
    for size in PACK_SIZES:
        if tokens <= size and rows <= rows_of(size):
            return size
    raise ValueError(f"a packed pass holds at most {MAX_PACK} tokens, got {tokens}")


@dataclass
class Piece:
    """A question's rows as the planner packs them: its index, option count and tokens."""

    question: int
    options: int
    tokens: int


@dataclass
class PackedPass:
    """One packed pass: tokens [N], rows [R + 1] (the last empty), and the readouts of its rows
    as the heads take them (`question`: texts, `options`: option rows), both indexing this
    pass's `read_rows` (hidden states) and `targets` (log-probabilities)."""

    input_ids: np.ndarray  # int64 [N]
    positions: np.ndarray  # int64 [3, N]
    token_row: np.ndarray  # int64 [N]: padding tokens in the empty last row
    token_step: np.ndarray  # int64 [N]
    row_start: np.ndarray  # int64 [R + 1]
    row_length: np.ndarray
    row_parent: np.ndarray  # -1: a text row, continuing its image prefix
    row_prefix: np.ndarray  # the image prefix a row reads (Prepared.owners)
    question: QuestionPass
    options: OptionPass
    read_rows: list[int] = field(default_factory=list)  # flat token indices
    targets: list[tuple[int, int]] = field(default_factory=list)  # (flat token index, token)
    used: int = 0  # tokens that are not padding

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        """The pass's integer inputs by their graph names, and its readout lists (each row read
        once: `target_rows` sorted, `target_slots` which of them each target reads)."""
        rows = np.asarray([t[0] for t in self.targets] or [0], dtype=np.int64)
        tokens = np.asarray([t[1] for t in self.targets] or [0], dtype=np.int64)
        unique, slots = np.unique(rows, return_inverse=True)
        return {
            "input_ids": self.input_ids,
            "positions": self.positions,
            "token_row": self.token_row,
            "token_step": self.token_step,
            **{name: getattr(self, name) for name in ROW_TABLES},
            "read_rows": np.asarray(self.read_rows or [0], dtype=np.int64),
            "target_rows": unique.astype(np.int64),
            "target_tokens": tokens,
            "target_slots": slots.astype(np.int64),
        }


@dataclass
class PackedPlan:
    """A request's image prefix pass and its packed passes."""

    prefix: Pass
    prefix_length: int
    passes: list[PackedPass]

    @property
    def tokens(self) -> int:
        return sum(p.used for p in self.passes)

    @property
    def slots(self) -> int:
        return sum(p.size for p in self.passes)


def empty_pass(size: int) -> PackedPass:
    """A pass of `size` token slots holding no row: what the warm-up builds each size on."""
    room = rows_of(size)
    return PackedPass(
        input_ids=np.zeros(size, dtype=np.int64),
        positions=np.zeros((3, size), dtype=np.int64),
        token_row=np.full(size, room, dtype=np.int64),
        token_step=np.zeros(size, dtype=np.int64),
        row_start=np.zeros(room + 1, dtype=np.int64),
        row_length=np.zeros(room + 1, dtype=np.int64),
        row_parent=np.full(room + 1, -1, dtype=np.int64),
        row_prefix=np.zeros(room + 1, dtype=np.int64),
        question=QuestionPass(rows=None, members=[], zq_read={}, first_read={}),  # type: ignore[arg-type]
        options=OptionPass(rows=None, question_pass=0, members=[], u_read={}, text_reads={}),  # type: ignore[arg-type]
    )


def shared_length(layout: QuestionLayout) -> int:
    """The leading tokens every option block of the question shares (each block starts at the
    same position after the same text), at most one less than the shortest block, so that each
    option row keeps at least its close, where its u is read."""
    blocks = [layout.token_ids[o : c + 1] for o, c in zip(layout.opens, layout.closes, strict=True)]
    limit = min(len(block) for block in blocks) - 1
    shared = 0
    while shared < limit and all(block[shared] == blocks[0][shared] for block in blocks):
        shared += 1
    return shared


def text_of(
    prepared: Prepared, qi: int, starts: list[int], shared: int
) -> tuple[list[int], np.ndarray]:
    """Question `qi`'s text row: its own text, then the `shared` leading tokens of its options
    (`shared_length`)."""
    layout = prepared.layouts[qi]
    ids, positions = question_span(layout, starts[qi])
    shared_ids, shared_positions = option_span(layout, 0)
    return ids + shared_ids[:shared], np.concatenate([positions, shared_positions[:, :shared]], 1)


def pieces_of(prepared: Prepared, starts: list[int], shares: list[int]) -> list[Piece]:
    """Each question's text and options as one piece. The contract's 8,192 tokens a question
    (its image prefix included) keep every piece within the largest pass."""
    pieces = []
    for qi, layout in enumerate(prepared.layouts):
        count = len(layout.opens)
        blocks = sum(c + 1 - o for o, c in zip(layout.opens, layout.closes, strict=True))
        tokens = len(question_span(layout, starts[qi])[0]) + blocks - (count - 1) * shares[qi]
        if tokens > MAX_PACK or count + 1 > rows_of(MAX_PACK):
            raise ValueError(f"question {qi}: {tokens} tokens exceeds {MAX_PACK}")
        pieces.append(Piece(qi, count, tokens))
    return pieces


def groups_of(pieces: list[Piece]) -> list[list[Piece]]:
    """Pieces in order into passes: a pass is closed when the next piece would take it past the
    largest pass's tokens or rows, or past TEXT_ROWS texts."""
    groups: list[list[Piece]] = []
    tokens = rows = 0
    for piece in pieces:
        piece_rows = 1 + piece.options
        full = (
            not groups
            or tokens + piece.tokens > MAX_PACK
            or rows + piece_rows > rows_of(MAX_PACK)
            or len(groups[-1]) + 1 > TEXT_ROWS
        )
        if full:
            groups.append([])
            tokens = rows = 0
        groups[-1].append(piece)
        tokens += piece.tokens
        rows += piece_rows
    return groups


def plan(prepared: Prepared) -> PackedPlan:
    """The image prefix's pass and the packed passes of a request (or of a merged batch: each
    row reads its own request's image prefix, `Prepared.owners`)."""
    prefix, n = plan_prefix(prepared)
    starts = prefix_starts(prepared)
    shares = [shared_length(layout) for layout in prepared.layouts]  # once a question
    groups = groups_of(pieces_of(prepared, starts, shares))
    return PackedPlan(prefix, n, [packed_pass(prepared, starts, shares, g) for g in groups])


def packed_pass(
    prepared: Prepared, starts: list[int], shares: list[int], group: list[Piece]
) -> PackedPass:
    """The pass of `group`'s questions: their text rows first (in order), then their option
    rows."""
    tokens = sum(p.tokens for p in group)
    rows = sum(1 + p.options for p in group)
    made = empty_pass(pack_size(tokens, rows))
    for row, piece in enumerate(group):
        qi = piece.question
        ids, positions = text_of(prepared, qi, starts, shares[qi])
        place(made, row, ids, positions, -1, owner(prepared, qi))
        read_text(made, prepared, qi, row, shares[qi])
    row = len(group)
    for parent, piece in enumerate(group):
        qi, shared = piece.question, shares[piece.question]
        for k in range(piece.options):
            # the row holds the block past the tokens the question's options begin with
            block, positions = option_span(prepared.layouts[qi], k)
            place(made, row, block[shared:], positions[:, shared:], parent, owner(prepared, qi))
            read_option(made, prepared, qi, k, row, parent, block)
            row += 1
    return made


def place(
    made: PackedPass, row: int, ids: list[int], positions: np.ndarray, parent: int, prefix: int
) -> None:
    """Row `row`'s tokens after the tokens placed so far."""
    start, n = made.used, len(ids)
    span = slice(start, start + n)
    made.input_ids[span] = ids
    made.positions[:, span] = positions
    made.token_row[span] = row
    made.token_step[span] = np.arange(n)
    made.row_start[row], made.row_length[row] = start, n
    made.row_parent[row], made.row_prefix[row] = parent, prefix
    made.used += n


def read_text(made: PackedPass, prepared: Prepared, qi: int, row: int, shared: int) -> None:
    """A text row's readouts: zq's hidden state (its text's last token, before the options'
    `shared` tokens), and (but for Score) each option's first token's log-probability there."""
    zq = int(made.row_start[row] + made.row_length[row] - 1 - shared)
    made.question.members.append(qi)
    read_zq(made.question, made.read_rows, made.targets, prepared, qi, zq)


def read_option(
    made: PackedPass, prepared: Prepared, qi: int, k: int, row: int, parent: int, block: list[int]
) -> None:
    """An option row's readouts: u's hidden state at its last token, and (but for Score) each
    text token of its `block` (`option_span`) read at the token before it, the block's shared
    tokens in its text row (`parent`)."""
    start, n = int(made.row_start[row]), int(made.row_length[row])
    op = made.options
    op.members.append((qi, k))
    op.u_read[(qi, k)] = len(made.read_rows)
    made.read_rows.append(start + n - 1)
    if prepared.layouts[qi].question.type == "score":
        op.text_reads[(qi, k)] = []
        return
    shared = len(block) - n
    text_end = int(made.row_start[parent] + made.row_length[parent])

    def at(j: int) -> int:  # the flat index of the block's token j
        return text_end - shared + j if j < shared else start + j - shared

    first = len(made.targets)
    made.targets.extend((at(j - 1), int(block[j])) for j in range(1, len(block) - 1))
    op.text_reads[(qi, k)] = list(range(first, len(made.targets)))
