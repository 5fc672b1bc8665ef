"""Brings a request's readouts back to the host: the passes' hidden rows and log-probabilities
copied into pinned memory behind them (`Landing`), sorted into each question's readout
(`HostReadouts`), and the heads' MLPs enqueued right behind the passes where they run on the
device (`mlps_behind`), their outputs back with the readouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from runtime.heads import Heads, mlp_names, product_rows
from runtime.passes import OptionPass, QuestionPass
from runtime.run_passes import upload_ints
from runtime.types import TYPE_IDS, Prepared, QuestionReadout

Reads = list[tuple[QuestionPass | OptionPass, dict[str, torch.Tensor]]]


@dataclass
class HostReadouts:
    """A request's readouts on the host as its passes' outputs arrive: `zq` by question,
    `first` and `picked` by (question, option), and where each option's u is: (the pass's
    hidden readouts, its row there), gathered once a question in `collect`. A pass's readouts
    are taken in one indexing, handing out views."""

    zq: dict[int, np.ndarray] = field(default_factory=dict)
    first: dict[tuple[int, int], float] = field(default_factory=dict)
    u_at: dict[tuple[int, int], tuple[np.ndarray, int]] = field(default_factory=dict)
    picked: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def take(self, p: QuestionPass | OptionPass, hidden: np.ndarray, logprobs: np.ndarray) -> None:
        """A pass's readouts, by its kind."""
        if isinstance(p, OptionPass):
            self.take_options(p, hidden, logprobs)
        else:
            self.take_question(p, hidden, logprobs)

    def take_question(self, qp: QuestionPass, hidden: np.ndarray, logprobs: np.ndarray) -> None:
        """A question pass's readouts: its questions' zq and first-token log-probabilities."""
        for qi, index in qp.zq_read.items():
            self.zq[qi] = hidden[index]
        if qp.first_read:
            index = np.fromiter(qp.first_read.values(), np.intp, len(qp.first_read))
            self.first.update(zip(qp.first_read, logprobs[index].tolist(), strict=True))

    def take_options(self, op: OptionPass, hidden: np.ndarray, logprobs: np.ndarray) -> None:
        """An option pass's readouts: where its options' u are, and their texts'
        log-probabilities, gathered in one indexing, then views by option."""
        self.u_at.update((pair, (hidden, index)) for pair, index in op.u_read.items())
        if op.text_reads:
            self.picked.update(gathered(op.text_reads, logprobs))

    def options_u(self, qi: int, k: int) -> np.ndarray:
        """Question `qi`'s u, float32 [k, D]: one gather where one pass holds them all."""
        at = [self.u_at[(qi, j)] for j in range(k)]
        source = at[0][0]
        if all(hidden is source for hidden, _ in at):
            u = source[np.fromiter((row for _, row in at), np.intp, k)]
        else:
            u = np.stack([hidden[row] for hidden, row in at])
        return u.astype(np.float32, copy=False)

    def collect(self, prepared: Prepared, which: list[int]) -> list[QuestionReadout]:
        """The readouts of the questions `which`, in that order."""
        readouts = []
        for qi in which:
            k = len(prepared.layouts[qi].rows)
            picked = [self.picked.get((qi, j)) for j in range(k)]
            readouts.append(
                QuestionReadout(
                    zq=self.zq[qi].astype(np.float32),
                    u=self.options_u(qi, k),
                    picked=[np.zeros(0, np.float32) if p is None else p for p in picked],
                    first=[self.first.get((qi, j)) for j in range(k)],
                )
            )
        return readouts


def gathered(reads: dict, logprobs: np.ndarray) -> dict:
    """Each key's float32 log-probabilities at its indices (`reads`: key -> indices), in one
    indexing, then views by key."""
    lists = list(reads.values())
    flat = np.fromiter(chain.from_iterable(lists), np.intp)
    values = logprobs[flat].astype(np.float32, copy=False)
    ends = np.cumsum([len(r) for r in lists]).tolist()
    pieces = [values[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return dict(zip(reads, pieces, strict=True))


@dataclass
class Landing:
    """Passes' readouts (and the heads' MLP outputs made behind them) copied into pinned host
    memory behind their work in the stream, and the event that says they are there: in place of
    a pageable `.cpu()` a tensor, each a wait and a copy at pageable speed. On the CPU the
    tensors themselves, no event."""

    reads: Reads
    copies: list[tuple[torch.Tensor, torch.Tensor]]
    mlps: dict[str, np.ndarray]
    event: torch.cuda.Event | None

    @classmethod
    def enqueue(
        cls, reads: Reads, device: torch.device, mlps: dict[str, torch.Tensor] | None = None
    ) -> Landing:
        cuda = device.type == "cuda"
        # the MLPs' copies first: the event recorded after the readouts' follows both
        hosted = {n: (pinned_copy(t) if cuda else t).numpy() for n, t in (mlps or {}).items()}
        pairs = [(out["hidden"].float(), out["logprobs"].float()) for _, out in reads]
        if not cuda:
            return cls(reads, pairs, hosted, None)
        copies = [(pinned_copy(hidden), pinned_copy(logprobs)) for hidden, logprobs in pairs]
        event = torch.cuda.Event(enable_timing=True)  # Flight: device busy time
        event.record()
        return cls(reads, copies, hosted, event)

    def wait(self) -> None:
        """Waits for the copies (and whatever was enqueued before them)."""
        if self.event is not None:
            self.event.synchronize()

    def into(self, taken: HostReadouts) -> None:
        """The readouts, once on the host, into `taken`."""
        self.wait()
        for (p, _), (hidden, logprobs) in zip(self.reads, self.copies, strict=True):
            taken.take(p, hidden.numpy(), logprobs.numpy())


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into pinned host memory, enqueued behind its work, not waited
    for."""
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor, non_blocking=True)


@dataclass
class MlpsBehind:
    """The heads' MLP outputs a request's passes made on the device (`mlps_behind`): by MLP
    name, and where each question's rows are in them."""

    outputs: dict[str, torch.Tensor]  # name -> [N, width] on the device
    spans: dict[int, dict[str, tuple[int, int]]]  # question -> name -> (start, end)

    def hand_out(
        self, which: list[int], readouts: list[QuestionReadout], host: dict[str, np.ndarray]
    ) -> None:
        """Each question's rows of the outputs, now on the host, into its readout's `mlps`."""
        for qi, readout in zip(which, readouts, strict=True):
            if qi in self.spans:
                readout.mlps = {n: host[n][a:b] for n, (a, b) in self.spans[qi].items()}


def mlps_behind(
    heads: Heads, prepared: Prepared, late: list[int], reads: Reads, device: torch.device
) -> MlpsBehind | None:
    """The heads' MLPs of the `late` questions' zq and u rows, enqueued on the device right
    behind the passes that read them (`DeviceMLPs.behind`): their outputs come back with the
    readouts, in place of a trip of those rows to the host, back to the device and back again
    in the heads. None where the heads' MLPs are not on the device or `behind` did not give
    `apply`'s bytes at load."""
    mlps = heads.device_mlps
    if mlps is None or not mlps.behind_usable:
        return None
    where: dict[tuple, tuple[torch.Tensor, int]] = {}  # readout key -> (hidden, its row)
    for p, out in reads:
        if isinstance(p, OptionPass):
            where.update(((qi, k), (out["hidden"], i)) for (qi, k), i in p.u_read.items())
        else:
            where.update(((qi,), (out["hidden"], i)) for qi, i in p.zq_read.items())
    rows: dict[str, list[tuple[torch.Tensor, int]]] = {}
    spans: dict[int, dict[str, tuple[int, int]]] = {}
    for qi in late:
        kind = prepared.questions[qi].type
        if kind not in TYPE_IDS:
            continue  # the heads refuse it, in its turn
        keys = [(qi,), *((qi, k) for k in range(len(prepared.layouts[qi].rows)))]
        if any(key not in where for key in keys):
            return None
        spans[qi] = {}
        for name, mine in zip(mlp_names(kind), (keys[:1], keys[1:]), strict=True):
            taken = rows.setdefault(name, [])
            spans[qi][name] = (len(taken), len(taken) + len(mine))
            taken.extend(where[key] for key in mine)
    if not rows:
        return None
    return MlpsBehind(mlps.behind(gather_rows(rows, heads.hidden, device)), spans)


def gather_rows(
    rows: dict[str, list[tuple[torch.Tensor, int]]], hidden: int, device: torch.device
) -> dict[str, torch.Tensor]:
    """Each MLP's input rows (name -> [(a pass's hidden readouts, row)]) gathered on the
    device into [N, hidden], N rounded up to whole DEVICE_ROWS-row products with zero rows:
    the readouts of every pass named, and a zero row, as one tensor, and one upload of every
    name's row numbers."""
    sources: dict[int, torch.Tensor] = {}
    for pairs in rows.values():
        for tensor, _ in pairs:
            sources.setdefault(id(tensor), tensor)
    starts, at = {}, 0
    for key, tensor in sources.items():
        starts[key] = at
        at += tensor.shape[0]
    zero = at  # the row past every source: zeros
    zeros = torch.zeros(1, hidden, device=device)
    every = torch.cat([*(tensor.float() for tensor in sources.values()), zeros])
    wanted = {}
    for name, pairs in rows.items():
        taken = [starts[id(tensor)] + row for tensor, row in pairs]
        wanted[name] = np.array(taken + [zero] * (product_rows(len(taken)) - len(taken)))
    uploaded = upload_ints(wanted, device)
    return {name: every.index_select(0, index) for name, index in uploaded.items()}
