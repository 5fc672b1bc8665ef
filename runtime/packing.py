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
    place_options(made, prepared, group, shares)
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


def place_options(
    made: PackedPass, prepared: Prepared, group: list[Piece], shares: list[int]
) -> None:
    """The option rows of `group`'s questions, after their text rows (row i the text of
    `group[i]`) and the tokens placed so far: each block <|opt|> … <|/opt|> (`option_span`, at
    the positions it has as its question's only option) past the question's shared leading
    tokens, which its text row holds. Every option of the pass at once, as arrays: Python a row
    at a time costs ~11 µs a row on the CPU machine, 2.9 ms for a Choice of 255 options."""
    layouts = [prepared.layouts[piece.question] for piece in group]
    ids, opens, closes = option_blocks(layouts)
    parents = np.repeat(np.arange(len(group)), [len(layout.opens) for layout in layouts])
    shared = np.asarray([shares[piece.question] for piece in group])[parents]
    lengths = closes + 1 - opens - shared
    total = int(lengths.sum())
    starts = made.used + np.cumsum(lengths) - lengths  # flat index of each row's first token
    step = np.arange(total) - np.repeat(starts - made.used, lengths)  # token within its row
    bases = np.asarray([int(layout.positions[0, layout.opens[0]]) for layout in layouts])
    span = slice(made.used, made.used + total)
    rows = np.arange(len(group), len(group) + len(parents))
    made.input_ids[span] = ids[np.repeat(opens + shared, lengths) + step]
    made.positions[:, span] = np.repeat(bases[parents] + shared, lengths) + step
    made.token_row[span] = np.repeat(rows, lengths)
    made.token_step[span] = step
    made.row_start[rows], made.row_length[rows] = starts, lengths
    made.row_parent[rows] = parents
    made.row_prefix[rows] = np.asarray([owner(prepared, p.question) for p in group])[parents]
    made.used += total
    read_options(made, layouts, [piece.question for piece in group], ids, opens, closes, parents)


def option_blocks(layouts: list[QuestionLayout]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The token ids from each question's first option to its last, end to end, and where
    each option block opens and closes in them (int64)."""
    regions = [layout.token_ids[layout.opens[0] : layout.closes[-1] + 1] for layout in layouts]
    sizes = [len(region) for region in regions]
    ids = np.fromiter((token for region in regions for token in region), np.int64, sum(sizes))
    offsets = np.cumsum(sizes) - sizes
    opens, closes = (
        np.concatenate(
            [np.asarray(getattr(layout, marks)) - layout.opens[0] + at
             for layout, at in zip(layouts, offsets, strict=True)]
        )
        for marks in ("opens", "closes")
    )  # fmt: skip
    return ids, opens, closes


def read_options(
    made: PackedPass,
    layouts: list[QuestionLayout],
    questions: list[int],
    ids: np.ndarray,
    opens: np.ndarray,
    closes: np.ndarray,
    parents: np.ndarray,
) -> None:
    """The option rows' readouts, the rows placed (`place_options`): u's hidden state at a
    row's last token, and (but for Score) each text token j of its block (1 ≤ j ≤ its length -
    2) read at token j - 1, which lies in the text row's last shared tokens where j - 1 is one
    of them, else in the option's own row."""
    rows = np.arange(len(layouts), len(layouts) + len(parents))
    starts, lengths = made.row_start[rows], made.row_length[rows]
    shared = closes + 1 - opens - lengths
    members = [(qi, k) for qi, layout in zip(questions, layouts, strict=True)
               for k in range(len(layout.opens))]  # fmt: skip
    op = made.options
    op.members.extend(members)
    op.u_read.update((member, len(made.read_rows) + i) for i, member in enumerate(members))
    made.read_rows.extend((starts + lengths - 1).tolist())
    score = np.asarray([layout.question.type == "score" for layout in layouts])[parents]
    reads = np.where(score, 0, np.maximum(closes - 1 - opens, 0))
    first_read = np.cumsum(reads) - reads
    j = np.arange(int(reads.sum())) - np.repeat(first_read, reads) + 1
    text_end = made.row_start[parents] + made.row_length[parents]
    in_text = j - 1 < np.repeat(shared, reads)
    row_of = np.where(in_text, np.repeat(text_end, reads), np.repeat(starts, reads))
    at = row_of - np.repeat(shared, reads) + j - 1
    firsts = (len(made.targets) + first_read).tolist()
    made.targets.extend(zip(at.tolist(), ids[np.repeat(opens, reads) + j].tolist(), strict=True))
    op.text_reads.update(
        (member, list(range(first, first + count)))
        for member, first, count in zip(members, firsts, reads.tolist(), strict=True)
    )
