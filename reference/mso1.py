"""The PyTorch reference: answers a request exactly as the released `MSO1.ask_branch` does.

Follows `OJ@5da4b5c mso/infer.py` `ask_branch` and `OJ mso/branch.py` (`rows_from_ids`,
`expand_cache`, `branch_forward`) as docs/model.md §8.4 describes them, on transformers'
`Qwen3_5ForConditionalGeneration`: the shared prefix once, then every (question, option) row in
batched chunks continuing a copy of the prefix cache.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime.constants import CLOSE_ID as OPT_CLOSE
from runtime.constants import DTYPES, MODEL_DTYPES
from runtime.constants import IMAGE_PAD_ID as IMAGE_PAD
from runtime.constants import MODEL_ID as MODEL_NAME
from runtime.constants import OPEN_ID as OPT_OPEN
from runtime.errors import BodyError, ContractError, ExecutionError
from runtime.types import Prepared, PreparedImage, PreparedVideo, QuestionReadout, Row

PAD_ID = 248044  # <|endoftext|>, the tokenizer's pad token, which MSO1 pads rows with (§2.1)
CHUNK_ENV = "MSO_BRANCH_CHUNK"  # rows per branch forward; MSO1's default is 64 (docs/model.md §8.4)
DEFAULT_CHUNK = 64
LOGIT_ROWS = 64  # hidden rows per lm_head call: bounds the float32 [rows, 248079] logits block
MIN_TRANSFORMERS = (5, 7)  # correct Gated DeltaNet continuation from a cache (docs/model.md §9.1)
REFUSED_EXIT = 1  # a 400 or 422 refusal (the exit codes of `omnijev explain`)
UNREADABLE_EXIT = 2  # the request file or the export could not be used
MARKER_ERROR = "every option needs one opening and one closing marker, in order"  # §2.7


# ---------------------------------------------------------------------------------------------
# Layout: the common prefix and the rows (docs/contract.md §4.5), from the single-question sequences


@dataclass(frozen=True)
class BranchLayout:
    """The prefix length `L` and each question's rows, as `ask_branch` derives them."""

    prefix_length: int
    rows: tuple[tuple[Row, ...], ...]  # per question, one row per option

    @property
    def input_tokens(self) -> int:
        """`MSO1.last_input_tokens`: the prefix once plus every row (docs/contract.md §3)."""
        return self.prefix_length + sum(len(row.tokens) for rows in self.rows for row in rows)


def marker_spans(ids: Sequence[int]) -> tuple[list[int], list[int]]:
    """Positions of every `<|opt|>` and `<|/opt|>` (MSO1's `_spans_of`; both are single tokens)."""
    opens = [i for i, token in enumerate(ids) if token == OPT_OPEN]
    closes = [i for i, token in enumerate(ids) if token == OPT_CLOSE]
    return opens, closes


def check_spans(opens: Sequence[int], closes: Sequence[int]) -> None:
    """At least one option, equal counts, each open before its close, alternating, opens[0] ≥ 2."""
    ordered = all(o < c for o, c in zip(opens, closes, strict=False))
    alternating = all(c < o for c, o in zip(closes, opens[1:], strict=False))
    if not opens or len(opens) != len(closes) or not ordered or not alternating or opens[0] < 2:
        raise ContractError(MARKER_ERROR)


def common_prefix_length(sequences: Sequence[Sequence[int]]) -> int:
    """Length of the longest token prefix that every sequence shares."""
    first, shortest = sequences[0], min(len(ids) for ids in sequences)
    length = 0
    while length < shortest and all(ids[length] == first[length] for ids in sequences):
        length += 1
    return length


def rows_from_ids(
    ids: Sequence[int], prefix_length: int, opens: Sequence[int], closes: Sequence[int]
) -> tuple[Row, ...]:
    """Row k = the question's rest after the prefix + option block k (`rows_from_ids`)."""
    head = tuple(ids[prefix_length : opens[0]])
    rows = []
    for open_at, close_at in zip(opens, closes, strict=True):
        tokens = head + tuple(ids[open_at : close_at + 1])
        last = len(tokens) - 1
        text = range(len(head) + 1, last)  # option-text tokens, each predicted from the one before
        rows.append(
            Row(
                tokens=tokens,
                zq=len(head) - 1,
                u=last,
                targets=tuple((t - 1, tokens[t]) for t in text),
                first=tokens[text.start] if len(text) else None,
            )
        )
    return tuple(rows)


def branch_layout(
    sequences: Sequence[Sequence[int]], option_counts: Sequence[int] | None = None
) -> BranchLayout:
    """`ask_branch`'s `L` and rows: the common prefix, stopped one token before the first `<|opt|>`
    of any question so that every row keeps the token where `zq` is read."""
    spans = [marker_spans(ids) for ids in sequences]
    for index, (opens, closes) in enumerate(spans):
        check_spans(opens, closes)
        if option_counts is not None and len(opens) != option_counts[index]:
            raise ContractError(MARKER_ERROR)
    length = common_prefix_length(sequences)
    length = max(1, min([length] + [opens[0] - 1 for opens, _ in spans]))
    rows = tuple(
        rows_from_ids(ids, length, opens, closes)
        for ids, (opens, closes) in zip(sequences, spans, strict=True)
    )
    return BranchLayout(prefix_length=length, rows=rows)


# ---------------------------------------------------------------------------------------------
# Cache expansion (`branch.py` `expand_cache`)


def expand_cache(cache, rows: int):
    """A copy of `cache` whose every tensor is `repeat_interleave`d `rows` times along the batch.

    transformers ≥ 5.5 keeps one object per layer in `cache.layers`: `DynamicLayer` (attention
    `keys`/`values` [B, KVH, L, hd]) and `LinearAttentionLayer` (dicts `conv_states` {0: [B, C, K]}
    and `recurrent_states` {0: [B, HV, dk, dv]} plus flags). Every layer is copied attribute by
    attribute, so any state a version adds is expanded too. The forward then updates the copies in
    place (`copy_`) or by concatenation; `cache` stays as it was for the next chunk.
    """
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ExecutionError("the reference needs a transformers cache with .layers (>= 5.7)")
    expanded = copy.copy(cache)
    expanded.layers = [_expand_object(layer, rows) for layer in layers]
    return expanded


def _expand_object(layer, rows: int):
    clone = copy.copy(layer)
    clone.__dict__ = {name: _expand_value(value, rows) for name, value in vars(layer).items()}
    return clone


def _expand_value(value, rows: int):
    if isinstance(value, torch.Tensor):
        # repeat_interleave always allocates, even for rows == 1, so the original is never shared
        return value.repeat_interleave(rows, dim=0) if value.dim() else value.clone()
    if isinstance(value, dict):
        return {key: _expand_value(item, rows) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_expand_value(item, rows) for item in value)
    return value


def branch_chunk() -> int:
    """Rows per branch forward: `MSO_BRANCH_CHUNK`, default 64."""
    chunk = int(os.environ.get(CHUNK_ENV, DEFAULT_CHUNK))
    if chunk < 1:
        raise ValueError(f"{CHUNK_ENV} must be at least 1")
    return chunk


# ---------------------------------------------------------------------------------------------
# Readouts (docs/contract.md §5, docs/model.md §8.4 step 4)


@dataclass
class RowReadout:
    """What one row yields: its `zq` and `u` states and its option-text log-probabilities."""

    zq: torch.Tensor  # float32 [D]
    u: torch.Tensor  # float32 [D]
    picked: np.ndarray  # float32 [n] option-text log-probs (empty for Score)
    first: float | None


def token_logprobs(
    lm_head: torch.nn.Module, hidden: torch.Tensor, tokens: Sequence[int]
) -> torch.Tensor:
    """`log_softmax(lm_head(h).float())[token]` for each hidden row [M, D] and its token."""
    index = torch.tensor(list(tokens), dtype=torch.long, device=hidden.device)
    values = []
    for start in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = lm_head(hidden[start : start + LOGIT_ROWS]).float()
        picked = index[start : start + LOGIT_ROWS, None]
        values.append(torch.log_softmax(logits, dim=-1).gather(1, picked)[:, 0])
    return torch.cat(values)


def read_rows(
    lm_head: torch.nn.Module,
    hidden: Sequence[torch.Tensor],
    rows: Sequence[Row],
    with_logprobs: Sequence[bool],
) -> list[RowReadout]:
    """Readouts of rows from their final-norm hidden states (`hidden[i]`: [≥ len(row i), D]).

    Each option-text token is read at the position before it; the first one also at `zq`, as if
    the `<|opt|>` marker were absent. Score rows read no log-probabilities (docs/contract.md §5).
    """
    reads = []  # (row, position, token, is the first-token read)
    for index, (row, wanted) in enumerate(zip(rows, with_logprobs, strict=True)):
        if wanted and row.first is not None:
            reads.append((index, row.zq, row.first, True))
        if wanted:
            reads += [(index, position, token, False) for position, token in row.targets]
    values = []
    if reads:
        states = torch.stack([hidden[index][position] for index, position, _, _ in reads])
        tokens = [token for _, _, token, _ in reads]
        values = token_logprobs(lm_head, states, tokens).cpu().tolist()
    picked: list[list[float]] = [[] for _ in rows]
    first: list[float | None] = [None for _ in rows]
    for (index, _, _, is_first), value in zip(reads, values, strict=True):
        if is_first:
            first[index] = value
        else:
            picked[index].append(value)
    return [
        RowReadout(
            zq=hidden[i][row.zq].float(),
            u=hidden[i][row.u].float(),
            picked=np.asarray(picked[i], dtype=np.float32),
            first=first[i],
        )
        for i, row in enumerate(rows)
    ]


def question_readout(rows: Sequence[RowReadout]) -> QuestionReadout:
    """A question's outputs: its FIRST row's `zq` (`br["zq"][g[0]]`), one `u` per option."""
    return QuestionReadout(
        zq=rows[0].zq.cpu().numpy().astype(np.float32),
        u=torch.stack([row.u for row in rows]).cpu().numpy().astype(np.float32),
        picked=[row.picked for row in rows],
        first=[row.first for row in rows],
    )


# ---------------------------------------------------------------------------------------------
# The model


def _check_transformers() -> None:
    import transformers

    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if version < MIN_TRANSFORMERS:
        raise RuntimeError(f"the reference needs transformers >= 5.7, found {version}")


def _pick_device(device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else torch.device("cpu")


def _disable_tf32() -> None:
    """float32 on CUDA as validate.py --fp32 runs it: no TF32 in matmuls or convolutions."""
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False


class Reference:
    """MSO1's branch path over one export: `answer(body)` returns the response JSON object."""

    def __init__(
        self,
        export_dir: str | Path,
        dtype: str = "float32",
        device: str | torch.device | None = None,
    ) -> None:
        from reference.transformers_model import build_transformers_model
        from runtime.export_format import load_export
        from runtime.heads import Heads
        from runtime.tokenizer import load_tokenizer

        if dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {sorted(MODEL_DTYPES)}")
        info = load_export(Path(export_dir))
        torch_device = _pick_device(device)
        model = build_transformers_model(info, DTYPES[dtype], torch_device)
        heads = Heads.from_safetensors(info.heads_path)
        self._setup(model, heads, info.calibration, load_tokenizer(info.dir))

    @classmethod
    def from_parts(cls, model, heads, calibration, tokenizer) -> Reference:
        """A reference over an already built model (tests, benchmarks)."""
        reference = cls.__new__(cls)
        reference._setup(model, heads, calibration, tokenizer)
        return reference

    def _setup(self, model, heads, calibration, tokenizer) -> None:
        _check_transformers()
        self.model = model.eval()
        self.heads = heads
        self.calibration = calibration
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.device.type == "cuda" and self.dtype == torch.float32:
            _disable_tf32()

    # -- request to response ------------------------------------------------------------------

    def answer(self, body: bytes) -> dict:
        """Parse, check, prepare, run and finish one request (docs/contract.md §3)."""
        from runtime.contract import compile_request
        from runtime.finish import answer_question
        from runtime.processing import prepare
        from runtime.strict_json import parse_body

        request = compile_request(parse_body(body))
        start = time.perf_counter()  # MSO1 times encoding through the branch forward
        prepared = prepare(request, self.tokenizer)
        layout = self.layout(prepared)
        readouts = self._branch_readouts(prepared, layout)
        elapsed = time.perf_counter() - start
        per_question = elapsed / len(prepared.questions)
        answers = {
            question.id: answer_question(
                self.heads, self.calibration, question, readout, per_question, elapsed
            )
            for question, readout in zip(prepared.questions, readouts, strict=True)
        }
        return {
            "model": MODEL_NAME,
            "answers": answers,
            "usage": {"input_tokens": layout.input_tokens, "output_tokens": 0},
        }

    def layout(self, prepared: Prepared) -> BranchLayout:
        """The reference's own `L` and rows, from the prepared single-question token ids."""
        sequences = [layout.token_ids for layout in prepared.layouts]
        counts = [len(question.keys) for question in prepared.questions]
        return branch_layout(sequences, counts)

    def readouts(self, prepared: Prepared) -> list[QuestionReadout]:
        """Raw model outputs of every question on the branch path."""
        return self._branch_readouts(prepared, self.layout(prepared))

    def plain_readouts(self, prepared: Prepared) -> list[QuestionReadout]:
        """The comparison baseline: one plain forward over prefix + row for every row."""
        layout = self.layout(prepared)
        prefix = prepared.layouts[0].token_ids[: layout.prefix_length]
        lm_head = self.model.get_output_embeddings()
        outputs = []
        with torch.no_grad():
            image = self._image_inputs(prepared.image)
            features = self._image_features(image)
            for question, rows in zip(prepared.questions, layout.rows, strict=True):
                hidden = [self._plain_hidden(prefix, row, image, features) for row in rows]
                flags = [question.type != "score"] * len(rows)
                outputs.append(question_readout(read_rows(lm_head, hidden, rows, flags)))
        return outputs

    # -- model passes ---------------------------------------------------------------------------

    def _image_inputs(self, image: PreparedImage | PreparedVideo) -> dict:
        """The processor's `pixel_values` and `image_grid_thw`: a video's frames are image
        inputs one after another, their patches concatenated and one grid row each, as
        `proc(text, images=frames)` gives them (docs/model.md §8.2)."""
        frames = image.frames if isinstance(image, PreparedVideo) else (image,)
        pixels = np.concatenate([frame.pixel_values for frame in frames])
        return {
            "pixel_values": torch.from_numpy(np.ascontiguousarray(pixels)).to(self.device),
            "image_grid_thw": torch.tensor(
                [list(frame.grid_thw) for frame in frames], device=self.device
            ),
        }

    def _positions(self, ids: torch.Tensor, image: dict) -> torch.Tensor:
        """`get_rope_index` with `mm_token_type_ids` rebuilt from the ids, as MSO1 does."""
        types = (ids == IMAGE_PAD).int()
        positions, _ = self.model.model.get_rope_index(
            input_ids=ids, mm_token_type_ids=types, image_grid_thw=image["image_grid_thw"]
        )
        return positions

    def _prefix_pass(self, prefix: Sequence[int], image: PreparedImage | PreparedVideo):
        """The prefix once, with the image; returns its cache and the first row position p0."""
        ids = torch.tensor([list(prefix)], device=self.device)
        inputs = self._image_inputs(image)
        positions = self._positions(ids, inputs)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            position_ids=positions,
            mm_token_type_ids=(ids == IMAGE_PAD).int(),
            use_cache=True,
            logits_to_keep=1,
            **inputs,
        )
        return out.past_key_values, int(positions.max()) + 1

    def _branch_chunk(
        self, rows: Sequence[Row], cache0, prefix_length: int, p0: int
    ) -> torch.Tensor:
        """One `branch_forward`: right-padded rows continuing copies of the prefix cache."""
        count, width = len(rows), max(len(row.tokens) for row in rows)
        ids = torch.full((count, width), PAD_ID, dtype=torch.long, device=self.device)
        mask = torch.zeros((count, width), dtype=torch.long, device=self.device)
        for index, row in enumerate(rows):
            ids[index, : len(row.tokens)] = torch.tensor(row.tokens, device=self.device)
            mask[index, : len(row.tokens)] = 1
        prefix_mask = torch.ones((count, prefix_length), dtype=torch.long, device=self.device)
        steps = torch.arange(p0, p0 + width, device=self.device)
        out = self.model(
            input_ids=ids,
            attention_mask=torch.cat([prefix_mask, mask], dim=1),
            position_ids=steps.view(1, 1, width).expand(3, count, width),
            cache_position=torch.arange(prefix_length, prefix_length + width, device=self.device),
            past_key_values=expand_cache(cache0, count),
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[-1]  # the final-norm output (docs/model.md §8.4)

    def _branch_readouts(self, prepared: Prepared, layout: BranchLayout) -> list[QuestionReadout]:
        prefix = prepared.layouts[0].token_ids[: layout.prefix_length]
        flat = [(q, row) for q, rows in enumerate(layout.rows) for row in rows]
        if any(IMAGE_PAD in row.tokens for _, row in flat):
            raise ExecutionError("image placeholders must all lie in the shared prefix")
        lm_head = self.model.get_output_embeddings()
        chunk = branch_chunk()
        read: list[list[RowReadout]] = [[] for _ in layout.rows]
        with torch.no_grad():
            cache0, p0 = self._prefix_pass(prefix, prepared.image)
            for start in range(0, len(flat), chunk):
                part = flat[start : start + chunk]
                rows = [row for _, row in part]
                hidden = self._branch_chunk(rows, cache0, layout.prefix_length, p0)
                flags = [prepared.questions[q].type != "score" for q, _ in part]
                for (q, _), row_read in zip(
                    part, read_rows(lm_head, hidden, rows, flags), strict=True
                ):
                    read[q].append(row_read)
        return [question_readout(rows) for rows in read]

    def _image_features(self, image: dict) -> torch.Tensor:
        """The vision tower's merged rows, one per `<|image_pad|>`, in order."""
        features = self.model.model.get_image_features(
            image["pixel_values"], image["image_grid_thw"]
        )
        # transformers 5.17 wraps the per-image tuple in an output object; older versions did not
        return torch.cat(getattr(features, "pooler_output", features), dim=0)

    def _plain_hidden(
        self, prefix: Sequence[int], row: Row, image: dict, features: torch.Tensor
    ) -> torch.Tensor:
        """Prefix + row as one sequence without a cache (the eager worker's pass, docs/contract.md
        §5), returning the row's final-norm hidden states. The vision rows are computed once per
        request and scattered into the embeddings exactly as the model's own forward does."""
        ids = torch.tensor([list(prefix) + list(row.tokens)], device=self.device)
        embeds = self.model.get_input_embeddings()(ids)
        slots = (ids == IMAGE_PAD)[..., None].expand_as(embeds)
        embeds = embeds.masked_scatter(slots, features.to(embeds.dtype))
        out = self.model(
            inputs_embeds=embeds,
            position_ids=self._positions(ids, image),
            output_hidden_states=True,
            logits_to_keep=1,
        )
        return out.hidden_states[-1][0, len(prefix) :]


# ---------------------------------------------------------------------------------------------
# Command line


def cli_reference(args: argparse.Namespace) -> int:
    """`omnijev reference REQUEST.json --checkpoint DIR`: prints the response JSON. As with
    `omnijev explain`, a refusal prints the worker's message to stderr and exits 1; an unreadable
    request file or export exits 2."""
    try:
        body = Path(args.request).read_bytes()
        reference = Reference(args.checkpoint, dtype=args.dtype, device=args.device)
    except (OSError, ValueError) as error:
        print(error, file=sys.stderr)
        return UNREADABLE_EXIT
    try:
        response = reference.answer(body)
    except (BodyError, ContractError) as error:
        print(error, file=sys.stderr)
        return REFUSED_EXIT
    print(json.dumps(response, ensure_ascii=False))
    return 0
