"""Runs a request's planned language-model passes on a backend: each pass's feeds and output
buffers, the states one pass hands the next, passes longer than the engine takes in pieces, and
the packed passes. Every pass is enqueued; nothing here waits for the device.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from runtime.backends import Backend, Capabilities
from runtime.constants import PACKED_GRAPH
from runtime.packing import PackedPass, PackedPlan
from runtime.passes import OptionPass, Pass, Plan, QuestionPass

GPU_STAGES = ("vision", "prefix", "questions", "options", "readouts")  # Stopwatch's laps


@dataclass(frozen=True)
class Dims:
    """Language-model shapes the state tensors need, read from config.json."""

    hidden: int
    attention_layers: int
    kv_heads: int
    head_dim: int
    delta_layers: int
    conv_channels: int
    conv_state: int  # kernel - 1 columns carried between passes
    value_heads: int
    key_dim: int
    value_dim: int

    @classmethod
    def from_config(cls, config: dict) -> Dims:
        text = config.get("text_config", config)
        types = text.get("layer_types") or []
        key_heads, value_heads = text["linear_num_key_heads"], text["linear_num_value_heads"]
        key_dim, value_dim = text["linear_key_head_dim"], text["linear_value_head_dim"]
        return cls(
            hidden=text["hidden_size"],
            attention_layers=sum(t == "full_attention" for t in types),
            kv_heads=text["num_key_value_heads"],
            head_dim=text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"],
            delta_layers=sum(t == "linear_attention" for t in types),
            conv_channels=2 * key_heads * key_dim + value_heads * value_dim,
            conv_state=text["linear_conv_kernel_dim"] - 1,
            value_heads=value_heads,
            key_dim=key_dim,
            value_dim=value_dim,
        )


@dataclass
class State:
    """A batch of states as pass inputs: attention K/V with a validity mask, conv, recurrent."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    mask: torch.Tensor
    conv: list[torch.Tensor]
    rec: list[torch.Tensor]


def stack_prefixes(states: list[State]) -> State:
    """Image-prefix states of one length P (`PassRunner.run_prefix`'s first, each [1, ...]) as
    one state of R prefixes [R, ...], in order: a pass's rows pick theirs by `prefix_rows`."""
    if not states:
        raise ValueError("no prefix states to stack")
    lengths = sorted({s.mask.shape[1] for s in states})
    if len(lengths) > 1:
        raise ValueError(f"prefixes of one length only, got lengths {lengths}")

    def stacked(layers: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        return [torch.cat(parts) for parts in zip(*layers, strict=True)]

    return State(
        k=stacked([s.k for s in states]),
        v=stacked([s.v for s in states]),
        mask=torch.cat([s.mask for s in states]),
        conv=stacked([s.conv for s in states]),
        rec=stacked([s.rec for s in states]),
    )


def padded_prefix(state: State, keys: int) -> State:
    """An image prefix's state (K/V [R, KVH, P, hd], mask [R, P]) with zero keys and values up
    to `keys`, masked: a row gives a masked key the weight exp(MASKED - max), an exact 0, so
    its attention keeps the bytes it has without them (the attention kernel walks the keys in
    the same tiles from the first on, and adds each later tile's zeros)."""
    extra = keys - state.mask.shape[1]
    if extra <= 0:
        return state

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, extra))

    return State(
        k=[pad(t) for t in state.k],
        v=[pad(t) for t in state.v],
        mask=torch.nn.functional.pad(state.mask, (0, extra), value=False),
        conv=state.conv,
        rec=state.rec,
    )


@dataclass(frozen=True)
class Choices:
    """How the executor runs requests on its backend, each a consequence of the backend's
    `Capabilities` (`of`); a test or a measurement may give others to the executor."""

    device_heads: bool  # the heads' D-wide MLPs on the engine's device (Heads.use_device)
    mlps_behind: bool  # those MLPs enqueued right behind the passes, back with the readouts
    fixed_prefix_keys: bool = False  # every prefix padded to the longest's keys (padded_prefix)
    packed: bool = False  # token-packed passes (runtime.packing)

    @classmethod
    def of(cls, capabilities: Capabilities) -> Choices:
        on_device = capabilities.asynchronous
        return cls(
            device_heads=on_device,
            mlps_behind=on_device,
            fixed_prefix_keys=capabilities.fixed_prefix_keys,
            packed=capabilities.packed,
        )


Reads = list[tuple[QuestionPass | OptionPass, dict[str, torch.Tensor]]]


class PassRunner:
    """The passes of a backend: feeds, outputs and states of each."""

    def __init__(self, backend: Backend, dims: Dims, image_token: int):
        self.backend = backend
        self.capabilities = backend.capabilities
        self.device = backend.device
        self.dims = dims
        self.image_token = image_token
        self.dtypes = backend.input_dtypes("lm_state")
        self._empty: State | None = None  # empty_state, made on first use

    # -- a plan ---------------------------------------------------------------------------

    def run_plan(self, work: Plan, prefix: State, after_prefix: State, clock: Stopwatch) -> Reads:
        """Every pass of a rectangle plan after its image prefix: each question pass and
        straight after it its options; each pass's reads, in order."""
        reads: Reads = []
        for pi, qp in enumerate(work.questions):
            out, state = self.run_question(qp, prefix, after_prefix)
            reads.append((qp, out))
            clock.lap("questions")
            for op in work.options:
                if op.question_pass == pi:
                    reads.append((op, self.run_options(op, prefix, state)))
            clock.lap("options")
        return reads

    def run_packed_plan(
        self, work: PackedPlan, prefix: State, after_prefix: State, clock: Stopwatch
    ) -> Reads:
        """Every packed pass of a plan; each one's reads, its texts' and its options'."""
        reads: Reads = []
        for packed in work.passes:
            out = self.run_packed(packed, prefix, after_prefix)
            reads += [(packed.question, out), (packed.options, out)]
        clock.lap("options")
        return reads

    # -- passes ---------------------------------------------------------------------------

    def run_packed(
        self, packed: PackedPass, prefix: State, after_prefix: State
    ) -> dict[str, torch.Tensor]:
        """A packed pass (`lm_packed`): its readouts, the hidden states at its `read_rows` and
        the log-probabilities of its `targets`."""
        arrays = packed.arrays()
        outputs = {
            "hidden": torch.empty(len(arrays["read_rows"]), self.dims.hidden, device=self.device),
            "logprobs": torch.empty(len(arrays["target_tokens"]), device=self.device),
        }
        feeds = self.feeds(arrays, self.dummy_features(), prefix, after_prefix)
        self.backend.run(PACKED_GRAPH, feeds, outputs)
        return outputs

    def run_prefix(self, rows: Pass, features: torch.Tensor) -> tuple[State, State]:
        """The image prefix (the plan's `prefix` pass): its K/V become every later row's shared
        past, its recurrent states every question row's source."""
        empty = self.empty_state()
        out = self.run_pass(rows, features, empty, empty, with_state=True)
        state = self.state_from(out, rows)
        prefix = State(k=state.k, v=state.v, mask=state.mask, conv=[], rec=[])
        after = State(k=empty.k, v=empty.v, mask=empty.mask, conv=state.conv, rec=state.rec)
        return prefix, after

    def run_question(
        self, qp: QuestionPass, prefix: State, after_prefix: State
    ) -> tuple[dict[str, torch.Tensor], State]:
        """A question pass and its states, which its option passes continue."""
        out = self.run_pass(qp.rows, self.dummy_features(), prefix, after_prefix, with_state=True)
        return out, self.state_from(out, qp.rows)

    def run_options(
        self, op: OptionPass, prefix: State, question_state: State
    ) -> dict[str, torch.Tensor]:
        return self.run_pass(op.rows, self.dummy_features(), prefix, question_state, False)

    def run_pass(
        self,
        rows: Pass,
        features: torch.Tensor,
        prefix: State,
        src: State,
        with_state: bool,
    ) -> dict[str, torch.Tensor]:
        if not with_state and not self.backend.has_graph("lm_rows"):
            with_state = True  # an engine directory without the readout-only variant
        limit = self.backend.max_pass_tokens
        if limit and rows.shape[1] > limit:
            return self.run_split(rows, features, prefix, src, with_state, limit)
        graph = "lm_state" if with_state else "lm_rows"
        arrays = rows.arrays(self.capabilities.padded_targets)
        outputs = self.outputs(rows, arrays, with_state)
        if not rows.read_rows and not rows.targets and self.capabilities.optional_readouts:
            outputs.pop("hidden")  # nothing read (the image prefix): no readout to run
            outputs.pop("logprobs")
        self.backend.run(graph, self.feeds(arrays, features, prefix, src), outputs)
        return outputs

    def run_split(
        self,
        rows: Pass,
        features: torch.Tensor,
        prefix: State,
        src: State,
        with_state: bool,
        limit: int,
    ) -> dict[str, torch.Tensor]:
        """A pass longer than the engine takes (the standard-op Gated DeltaNet: one chunk of
        `limit` tokens) as consecutive pieces, each continuing the rows' own state."""
        t, d = rows.shape[1], self.dims
        arrays = rows.arrays()
        hidden = torch.empty(len(arrays["read_rows"]), d.hidden, device=self.device)
        logprobs = torch.empty(len(arrays["target_tokens"]), device=self.device)
        index = self.tensor(rows.src, torch.int64)
        lengths = self.tensor(rows.lengths, torch.int64)
        # each row's source past, gathered once: every later piece reads it before its own tokens
        own_k = [[src.k[i][index]] for i in range(d.attention_layers)]
        own_v = [[src.v[i][index]] for i in range(d.attention_layers)]
        past_mask = src.mask[index]
        state, image_rows, out = src, 0, {}
        for start in range(0, t, limit):
            piece = slice_pass(rows, start, min(t, start + limit))
            count = int((piece.input_ids == self.image_token).sum())
            piece_features = features[image_rows : image_rows + count] if count else features[:1]
            image_rows += count
            out = self.run_pass(piece, piece_features, prefix, state, with_state=True)
            hidden[piece.read_index] = out["hidden"][: len(piece.read_index)]
            logprobs[piece.target_index] = out["logprobs"][: len(piece.target_index)]
            for i in range(d.attention_layers):
                own_k[i].append(out[f"out_k.{i}"])
                own_v[i].append(out[f"out_v.{i}"])
            done = start + piece.shape[1]
            if done < t:
                own_mask = torch.arange(done, device=self.device)[None, :] < lengths[:, None]
                state = State(
                    k=[torch.cat(parts, dim=2) for parts in own_k],
                    v=[torch.cat(parts, dim=2) for parts in own_v],
                    mask=torch.cat([past_mask, own_mask], dim=1),
                    conv=[out[f"out_conv.{j}"] for j in range(d.delta_layers)],
                    rec=[out[f"out_rec.{j}"] for j in range(d.delta_layers)],
                )
        result = {"hidden": hidden, "logprobs": logprobs}
        if with_state:
            for i in range(d.attention_layers):
                result[f"out_k.{i}"] = torch.cat(own_k[i][1:], dim=2)
                result[f"out_v.{i}"] = torch.cat(own_v[i][1:], dim=2)
            for j in range(d.delta_layers):
                result[f"out_conv.{j}"] = out[f"out_conv.{j}"]
                result[f"out_rec.{j}"] = out[f"out_rec.{j}"]
        return result

    # -- feeds, outputs, states -----------------------------------------------------------

    def feeds(
        self, arrays: dict[str, np.ndarray], features: torch.Tensor, prefix: State, src: State
    ) -> dict:
        feeds = upload_ints(arrays, self.device)
        feeds["image_features"] = features
        feeds["prefix_mask"] = prefix.mask
        feeds["src_mask"] = src.mask
        for i in range(self.dims.attention_layers):
            feeds[f"prefix_k.{i}"], feeds[f"prefix_v.{i}"] = prefix.k[i], prefix.v[i]
            feeds[f"src_k.{i}"], feeds[f"src_v.{i}"] = src.k[i], src.v[i]
        for j in range(self.dims.delta_layers):
            feeds[f"src_conv.{j}"], feeds[f"src_rec.{j}"] = src.conv[j], src.rec[j]
        return feeds

    def outputs(
        self, rows: Pass, arrays: dict[str, np.ndarray], with_state: bool
    ) -> dict[str, torch.Tensor]:
        """Tensors the pass writes."""
        d, dt = self.dims, self.dtypes
        b, t = rows.shape
        out = {
            "hidden": torch.empty(len(arrays["read_rows"]), d.hidden, device=self.device),
            "logprobs": torch.empty(len(arrays["target_tokens"]), device=self.device),
        }
        if not with_state:
            return out
        shapes = {}
        for i in range(d.attention_layers):
            for kind in ("k", "v"):
                shapes[f"{kind}.{i}"] = ((b, d.kv_heads, t, d.head_dim), dt["prefix_k.0"])
        for j in range(d.delta_layers):
            shapes[f"conv.{j}"] = ((b, d.conv_channels, d.conv_state), dt["src_conv.0"])
            shapes[f"rec.{j}"] = ((b, d.value_heads, d.key_dim, d.value_dim), dt["src_rec.0"])
        for name, (shape, dtype) in shapes.items():
            out[f"out_{name}"] = torch.empty(shape, dtype=dtype, device=self.device)
        return out

    def state_from(self, out: dict[str, torch.Tensor], rows: Pass) -> State:
        """The pass's states as sources, with the mask of its rows' valid tokens."""
        d = self.dims
        states = [t for name, t in out.items() if name.startswith("out_")]
        lengths = np.zeros(states[0].shape[0] if states else rows.shape[0], dtype=np.int64)
        lengths[: rows.shape[0]] = rows.lengths
        # through pinned memory: a pageable upload here would make the host wait for the pass
        # it follows before it enqueues the next
        lengths = self.tensor(lengths, torch.int64)
        positions = torch.arange(rows.shape[1], device=self.device)
        return State(
            k=[out[f"out_k.{i}"] for i in range(d.attention_layers)],
            v=[out[f"out_v.{i}"] for i in range(d.attention_layers)],
            mask=positions[None, :] < lengths[:, None],
            conv=[out[f"out_conv.{j}"] for j in range(d.delta_layers)],
            rec=[out[f"out_rec.{j}"] for j in range(d.delta_layers)],
        )

    def empty_state(self) -> State:
        """A state with no past (P = Q = 1, masked) and zero recurrent state: exactly empty.
        Made once: passes only read their sources (the prefix cache keeps these very tensors
        across requests already)."""
        if self._empty is None:
            self._empty = self.make_empty_state()
        return self._empty

    def make_empty_state(self) -> State:
        d, dt, device = self.dims, self.dtypes, self.device
        kv = dict(dtype=dt["prefix_k.0"], device=device) if d.attention_layers else {}
        zeros_kv = [
            torch.zeros(1, d.kv_heads, 1, d.head_dim, **kv) for _ in range(d.attention_layers)
        ]
        conv = (1, d.conv_channels, d.conv_state)
        rec = (1, d.value_heads, d.key_dim, d.value_dim)
        return State(
            k=zeros_kv,
            v=[t.clone() for t in zeros_kv],
            mask=torch.zeros(1, 1, dtype=torch.bool, device=device),
            conv=[
                torch.zeros(conv, dtype=dt["src_conv.0"], device=device)
                for _ in range(d.delta_layers)
            ],
            rec=[
                torch.zeros(rec, dtype=dt["src_rec.0"], device=device)
                for _ in range(d.delta_layers)
            ],
        )

    def dummy_features(self) -> torch.Tensor:
        dtype = self.dtypes["image_features"]
        return torch.zeros(1, self.dims.hidden, dtype=dtype, device=self.device)

    def tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`to_device` on the backend's device."""
        return to_device(array, self.device, dtype)


def slice_pass(rows: Pass, start: int, end: int) -> Pass:
    """Tokens [start, end) of every row; readouts inside them, remembered by their index."""
    width = end - start
    piece = Pass(
        input_ids=np.ascontiguousarray(rows.input_ids[:, start:end]),
        positions=np.ascontiguousarray(rows.positions[:, :, start:end]),
        lengths=np.clip(rows.lengths - start, 0, width),
        src=np.arange(rows.shape[0], dtype=np.int64) if start else rows.src,
        prefix_rows=rows.prefix_rows,
    )
    t = rows.shape[1]
    for n, flat in enumerate(rows.read_rows):
        row, col = divmod(flat, t)
        if start <= col < end:
            piece.read_index.append(n)
            piece.read_rows.append(row * width + col - start)
    for n, (flat, token) in enumerate(rows.targets):
        row, col = divmod(flat, t)
        if start <= col < end:
            piece.target_index.append(n)
            piece.targets.append((row * width + col - start, token))
    return piece


class Stopwatch:
    """Adds the seconds since the previous lap to each stage's name (the stages of one request;
    interleaved stages add up). With `sync`, a lap first waits for the device, so that each
    stage holds its own device time; without, a stage holds the time taken to enqueue it."""

    def __init__(self, stages: dict[str, float], sync=None):
        self.stages = stages
        for stage in GPU_STAGES:
            stages.pop(stage, None)
        self.sync = sync
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.sync is not None:
            self.sync()
        now = time.perf_counter()
        self.stages[stage] = self.stages.get(stage, 0.0) + now - self.last
        self.last = now


def to_device(array: np.ndarray, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A host array on the device; on CUDA through one copy into pinned memory (the array may be
    a read-only view, as a decoded image is), none where it is pinned already (`pinned_uint8`),
    and without waiting, so that the host prepares the next pass while the device runs this
    one."""
    if device.type != "cuda":
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype)
    if array.dtype == np.uint8 and array.flags.c_contiguous and array.flags.writeable:
        given = torch.from_numpy(array)  # a decoded image may be pinned: no pass's integers are
        if given.is_pinned():
            return given.to(device, dtype, non_blocking=True)
    kind = torch.from_numpy(np.empty(0, array.dtype)).dtype
    pinned = torch.empty(array.shape, dtype=kind, pin_memory=True)
    pinned.numpy()[...] = array
    return pinned.to(device, dtype, non_blocking=True)


def upload_ints(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """A pass's integer inputs in one host-to-device copy (`to_device`), then views of it by
    name."""
    flat = [np.ascontiguousarray(a, dtype=np.int64).reshape(-1) for a in arrays.values()]
    uploaded = to_device(np.concatenate(flat), device, torch.int64)
    views, at = {}, 0
    for (name, array), part in zip(arrays.items(), flat, strict=True):
        views[name] = uploaded[at : at + part.size].view(array.shape)
        at += part.size
    return views


def pinned_uint8(shape: tuple[int, ...]) -> np.ndarray:
    """A uint8 array in pinned host memory, for a decode to write the image into: its upload
    then copies nothing on the host. The array keeps its tensor, so the memory lives as long as
    the prepared request, whose readouts wait for the device after the upload."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()
