"""Answers prepared requests through the engines: vision once, the image prefix once, each
question's text once, every option once, then readouts, heads and finishing.

Follows the native worker's prefix-reuse executor (docs/model.md §12.1) and `MSO1._finish`; the pass
layout is planned by `runtime.passes` so that an answer never depends on the other questions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from itertools import chain, pairwise
from pathlib import Path

import numpy as np
import torch

from runtime.backends import Backend, choose_backend
from runtime.config import RuntimeConfig
from runtime.constants import IMAGE_GRAPH, IMAGE_PAD_ID, JOINT_GRAPH, JOINT_PREFIXES, MODEL_ID
from runtime.heads import mlp_names, product_rows
from runtime.images import NORMALIZED, device_image_patches
from runtime.lru import LRU
from runtime.manifest import verify_engine_dir
from runtime.passes import (
    FIT_TOKENS,
    OPTION_STEP,
    PREFIX_STEP,
    JointPass,
    OptionPass,
    Pass,
    Plan,
    QuestionPass,
    bucket,
    early_heads_fit,
    finished_by_joint,
    plan,
    plan_prefix,
)
from runtime.types import (
    TYPE_IDS,
    Prepared,
    PreparedImage,
    Question,
    QuestionReadout,
    grid_tokens,
)

# An image prefix kept across requests (RuntimeConfig.prefix_cache entries) is ~50 MiB of Gated
# DeltaNet state plus 32 KiB of K/V per prefix token on the 4b (docs/model.md §11).
WARM_UP_SIZE = (96, 64)  # the worker's warm-up image (docs/contract.md §1.2)
# the vision tower's position and rotary tables depend only on the patch grid: kept on the
# device for this many grids (host arithmetic and copies of ~10 MB a request on the 4b otherwise)
VISION_TABLES = 8
# image prefixes' passes by patch grid (`Executor.prefix_rows`): the template's tokens through
# <|vision_end|> and their positions follow from the grid alone
PREFIX_ROWS = 8
# the question `prefix_rows` lays out for a grid's prefix (any question shares its prefix)
PREFIX_PROBE = Question(
    id="prefix", type="choice", instructions="", keys=("a",), option_texts=("a",)
)
GPU_STAGES = ("vision", "prefix", "questions", "options", "readouts")  # Executor.stages' laps

log = logging.getLogger("omnijev.executor")


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


@dataclass
class StartedPrefix:
    """A request's vision tower and image prefix, enqueued as soon as its image was decoded
    (`Executor.start_prefix`): the prefix's pass and the states it gives, taken once."""

    image: PreparedImage
    rows: Pass
    states: tuple[State, State]
    taken: bool = False

    def take(self, image: PreparedImage, rows: Pass) -> tuple[State, State] | None:
        """The states, if they are the prefix of this image and these rows and not yet taken
        (a second execution of the same prepared request runs its prefix again)."""
        if self.taken or self.image is not image or not same_pass(self.rows, rows):
            return None
        self.taken = True
        return self.states


def same_pass(a: Pass, b: Pass) -> bool:
    """Whether two passes have the same tokens, positions, lengths and sources."""
    pairs = ((a.input_ids, b.input_ids), (a.positions, b.positions))
    pairs += ((a.lengths, b.lengths), (a.src, b.src))
    return all(np.array_equal(x, y) for x, y in pairs)


def layer_index(name: str) -> int:
    return int(name.rsplit(".", 1)[1])


class Executor:
    """Holds the loaded model (export + engines) and answers prepared requests."""

    model_id = MODEL_ID

    def __init__(self, checkpoint: Path, engines: Path, config: RuntimeConfig | None = None):
        from runtime.export_format import load_export, start_verify

        laps = [time.perf_counter()]
        self.export = load_export(Path(checkpoint), verify=False)
        # the export's files hash on a thread of their own while the rest loads (6.1 s of the
        # 4b's 13.9 s load on the H200's host, as long as the backend's load beside it); the
        # executor exists only once they match, and a mismatch is the refusal it names first
        verifying = start_verify(self.export)
        laps.append(time.perf_counter())
        try:
            self.load_components(Path(checkpoint), Path(engines), config, laps)
        finally:
            verifying.result()
        laps.append(time.perf_counter())
        # where a start spends its time (logged; the cold-start records keep it)
        steps = ("export check", "tokenizer and heads", "engine check", "backend", "hash wait")
        spans = zip(steps, pairwise(laps), strict=True)
        self.load_seconds = {step: round(b - a, 2) for step, (a, b) in spans}
        log.info("loaded in %s s", self.load_seconds)
        self.after_load()

    def load_components(
        self, checkpoint: Path, engines: Path, config: RuntimeConfig | None, laps: list[float]
    ) -> None:
        """The tokenizer, heads, engine check and backend, each step's end in `laps`."""
        from runtime.heads import Heads

        self.model_config = self.export.config
        self.dims = Dims.from_config(self.model_config)
        self.tokenizer = self.export.tokenizer  # the export check loaded and checked it
        self.heads = Heads.from_safetensors(checkpoint / "heads.safetensors")
        self.calibration = self.export.calibration
        self.config = config or RuntimeConfig.from_env()
        laps.append(time.perf_counter())
        # nothing of the engine directory is loaded before its manifest vouches for it
        verify_engine_dir(engines, checkpoint)
        laps.append(time.perf_counter())
        self.backend: Backend = choose_backend(engines, self.config, checkpoint)
        laps.append(time.perf_counter())

    def after_load(self) -> None:
        """What the executor derives from its loaded backend and heads."""
        self.device = self.backend.device
        self.pos_embed = self._vision_pos_embed()
        self._pixel_table = torch.from_numpy(NORMALIZED).to(self.device)
        if self.config.on(self.config.device_heads, self.device.type == "cuda"):
            if not self.heads.use_device(self.device):
                log.warning(
                    "heads: the device's products fail the check, the heads stay on the CPU"
                )
            elif not self.heads.device_mlps.behind_usable:
                log.warning("heads: the MLPs behind the passes fail the check, not used")
        self._lm_dtypes = self.backend.input_dtypes("lm_state")
        # the backend runs a pass without readout outputs without its readout
        self.backend_skips_readouts = bool(getattr(self.backend, "optional_readouts", False))
        # the log-probability lists padded to a power of two, unless the backend reads them in
        # fixed pieces outside its graphs (the torch backend: 255 options' padding was 6 of
        # 18 pieces of 128 rows over the 248,079-row table)
        self.pad_targets = bool(getattr(self.backend, "padded_targets", True))
        self.image_token = int(self.model_config.get("image_token_id", IMAGE_PAD_ID))
        # a hit reuses the very tensors the same inputs gave: bit-identical answers either way
        self.prefix_cache: LRU[str, tuple[State, State]] = LRU(self.config.prefix_cache)
        self._vision_tables: LRU[tuple, dict[str, torch.Tensor]] = LRU(VISION_TABLES)
        self._prefix_rows: LRU[tuple, Pass] = LRU(PREFIX_ROWS)
        # one thread at a time enqueues on the backend (its graphs' buffers, the LRUs above):
        # an image thread's early prefix (`start_prefix`) and the executing thread's passes
        self.enqueue_lock = threading.Lock()
        self._empty: State | None = None  # empty_state, made on first use
        self.stages: dict[str, float] = {}  # seconds per stage of the last request
        self.stage_sync = None  # a callable that waits for the device: per-stage device time

    # -- request side -------------------------------------------------------------------

    def prepare(self, obj: dict) -> Prepared:
        from runtime.contract import compile_image, compile_request
        from runtime.processing import prepare, start_image_of

        # on a GPU the decoded uint8 image travels (4.3 MB for the bench still, not 14 MB of
        # float32 patches) and the resize and the patches are made there, byte for byte the
        # host's: the resize took 6-7 ms of the H200 host's preparation
        host = self.device.type == "cpu"
        # the plan is made while the image decodes: it needs the rows, not the pixels; a PNG
        # decodes straight into pinned memory, which the upload then reads as it is
        # the image decodes from the moment it has passed the contract, the questions' checks
        # beside it (2.7 ms for 255 options on the H200's host); a refusal stops the early prefix
        image = compile_image(obj)
        allocate = None if host else pinned_uint8
        refused = threading.Event()
        on_image = partial(self.start_prefix, refused=refused) if self.config.early_prefix else None
        pending = start_image_of(image, host, host, allocate, on_image)
        try:
            request = compile_request(obj, image)
            return prepare(
                request,
                self.tokenizer,
                pack=host,
                resize=host,
                planner=self.plan_of,
                allocate=allocate,
                on_image=on_image,
                pending=pending,
            )
        except BaseException:
            refused.set()
            raise
        finally:
            # a raised error's traceback holds this frame, and the future holds a refused
            # image's error: the cycle would keep the request's bytes until a collection
            del pending

    def start_prefix(
        self, image: PreparedImage, refused: threading.Event | None = None
    ) -> StartedPrefix | None:
        """The vision tower and the image prefix of a just-decoded image, enqueued from the
        image thread while the request's text is still tokenised and planned; `readouts` takes
        them where the plan's prefix is this one. None where they could not start or the
        request was refused meanwhile: its execution then runs them itself (and meets whatever
        stopped them)."""
        if refused is not None and refused.is_set():
            return None
        try:
            rows = self.prefix_rows(tuple(int(x) for x in image.grid_thw))
            with self.enqueue_lock, torch.inference_mode():
                states = self.image_prefix(image, rows)
        except Exception as error:  # the execution path runs them again and raises in order
            log.warning("the image prefix did not start early: %s", error)
            return None
        return StartedPrefix(image, rows, states)

    def prefix_rows(self, grid: tuple[int, ...]) -> Pass:
        """The image prefix's pass for a patch grid (`runtime.passes.plan_prefix` of a probe
        question): every request with this grid has it, whatever its questions."""
        from runtime.processing import lay_out, with_positions

        def make() -> Pass:
            drafts, length, processed = lay_out([PREFIX_PROBE], self.tokenizer, grid_tokens(grid))
            layouts = tuple(with_positions(drafts, grid))
            probe = Prepared(None, layouts, prefix_length=length, input_tokens=processed)
            return plan_prefix(probe)[0]

        return self._prefix_rows.get_or_make(grid, make)

    def plan_of(self, prepared: Prepared) -> tuple:
        """(pass shape, plan) of a request, as `readouts` takes them from `Prepared.planned`."""
        shape = self.pass_shape()
        return shape, plan(prepared, *shape, joint=self.joint, joint_tokens=self.joint_tokens)

    def pass_shape(self) -> tuple[int, bool]:
        """(question pass rows, fitted passes) of this executor's plans: fitted where the
        backend keeps a row's bytes whatever the row count (`rows_fit`) and not turned off."""
        fit = self.config.fit_rows is not False and self.backend.rows_fit
        return self.config.question_batch, bool(fit)

    @property
    def joint_tokens(self) -> int:
        """The most token slots a joint pass may hold: where the backend keeps a row's bytes."""
        return int(getattr(self.backend, "joint_tokens", FIT_TOKENS))

    @property
    def joint(self) -> bool:
        """Whether option passes run joined with their questions' rows (`lm_joint`): where the
        backend has the graph, with fitted passes (the backend then keeps a row's bytes up to
        `joint_tokens` rows), and not turned off."""
        if self.config.joint_passes is False or not self.backend.has_graph(JOINT_GRAPH):
            return False
        return self.pass_shape()[1]

    def warm_up_request(self) -> dict:
        return warm_up_request()

    def settle(self) -> int:
        """Waits for the backend's fixed-shape sessions still being built; how many there were."""
        return self.backend.settle()

    def answer(self, body: bytes) -> dict:
        from runtime.strict_json import parse_body

        return self.execute(self.prepare(parse_body(body)))

    # -- model side ---------------------------------------------------------------------

    def execute(self, prepared: Prepared) -> dict:
        started = time.perf_counter()
        readouts = self.readouts(prepared)
        heads_started = time.perf_counter()
        response = self.respond(prepared, readouts, heads_started - started)
        self.stages["prepare"] = prepared.prepare_seconds
        self.stages["heads"] = time.perf_counter() - heads_started
        return response

    def respond(self, prepared: Prepared, readouts: list[QuestionReadout], seconds: float) -> dict:
        from runtime.finish import answer_questions

        total = prepared.prepare_seconds + seconds
        per_question = total / len(prepared.layouts)
        questions = prepared.questions
        made = answer_questions(
            self.heads,
            self.calibration,
            questions,
            readouts,
            round(per_question, 4),
            round(total, 4),
        )
        answers = {q.id: answer for q, answer in zip(questions, made, strict=True)}
        usage = {"input_tokens": prepared.input_tokens, "output_tokens": 0}
        return {"model": MODEL_ID, "answers": answers, "usage": usage}

    def readouts(self, prepared: Prepared) -> list[QuestionReadout]:
        """Hidden states and log-probabilities of every question, through the engines. Every
        pass is enqueued before any readout comes back to the host (one wait, at the end): the
        joint passes (`plan(joint=True)`), then each question pass and straight after it its
        options, while its states are the freshest."""
        shape, planned = self.pass_shape(), prepared.planned
        work = planned[1] if planned and planned[0] == shape else None
        if work is None or work.joined != self.joint:
            work = self.plan_of(prepared)[1]
        clock = Stopwatch(self.stages, self.stage_sync)
        with self.enqueue_lock, torch.inference_mode():
            started = prepared.started
            states = None
            if isinstance(started, StartedPrefix):
                states = started.take(prepared.image, work.prefix)
            if states is None:
                states = self.image_prefix(prepared.image, work.prefix, clock)
            else:
                clock.lap("vision")
                clock.lap("prefix")
            prefix, prefix_state = states
            asked: list[tuple[QuestionPass, dict]] = []
            answered: list[tuple[OptionPass, dict]] = []
            taken = HostReadouts()
            early = self.early_heads_on(work)
            landed: list[tuple] = []  # joint passes read on the host early, all but the last
            read_early: list[tuple] = []  # their (pass, outputs) pairs, as `asked`, `answered`
            lanes = Lanes(self.backend, self.device)
            for k, jp in enumerate(work.joint):
                lane = self.lane_of(jp)
                with lanes.entered(lane):
                    out, parts_out = self.run_joint(jp, prefix, prefix_state, lane)
                    if early and k < len(work.joint) - 1:
                        landed.append(self.copy_back([out, *parts_out]))
                        read_early += [(jp.question, out), *zip(jp.parts, parts_out, strict=True)]
                    else:
                        asked.append((jp.question, out))
                        answered.extend(zip(jp.parts, parts_out, strict=True))
                clock.lap("options")
            lanes.join()
            made = self.early_answers(prepared, work, landed, taken) if early else {}
            for pi, qp in enumerate(work.questions):
                out, state = self.run_question(qp, prefix, prefix_state)
                asked.append((qp, out))
                clock.lap("questions")
                for op in work.options:
                    if op.question_pass == pi:
                        answered.append((op, self.run_options(op, prefix, state)))
                clock.lap("options")
            late = [qi for qi in range(len(prepared.layouts)) if qi not in made]
            behind = self.mlps_behind(prepared, late, [*read_early, *asked, *answered])
            # the MLPs' outputs and every readout copied behind the passes into pinned memory
            # (copy_back's event follows both), then one wait
            mlp_copies = self.host_copies(behind.outputs) if behind is not None else {}
            event, copies = self.copy_back([out for _, out in (*asked, *answered)])
        # waited for without the lock: the next request's image prefix enqueues meanwhile
        if event is not None:
            event.synchronize()
        with torch.inference_mode():
            arrays = [(hidden.numpy(), logprobs.numpy()) for hidden, logprobs in copies]
            for (qp, _), (hidden, logprobs) in zip(asked, arrays[: len(asked)], strict=True):
                taken.take_question(qp, hidden, logprobs)
            for (op, _), (hidden, logprobs) in zip(answered, arrays[len(asked) :], strict=True):
                taken.take_options(op, hidden, logprobs)
            clock.lap("readouts")
        collected = taken.collect(prepared, late)
        if behind is not None:
            behind.hand_out(late, collected, mlp_copies)
        made.update(zip(late, collected, strict=True))
        return [made[qi] for qi in range(len(prepared.layouts))]

    def mlps_behind(
        self, prepared: Prepared, late: list[int], reads: list[tuple]
    ) -> MlpsBehind | None:
        """The heads' MLPs of the `late` questions' zq and u rows, enqueued on the device right
        behind the passes that read them (`DeviceMLPs.behind`): their outputs come back with
        the readouts, in place of a trip of those rows to the host, back to the device and
        back again in the heads. `reads` are the request's (pass, outputs) pairs in the order
        `HostReadouts` takes them. None where the heads' MLPs are not on the device, where
        `behind` did not give `apply`'s bytes at load, or where it is turned off."""
        mlps = self.heads.device_mlps
        if mlps is None or not mlps.behind_usable or self.config.mlps_behind is False:
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
        inputs = gather_rows(rows, self.heads.hidden, self.device)
        return MlpsBehind(mlps.behind(inputs), spans)

    def lane_of(self, jp: JointPass) -> int:
        """The lane a joint pass runs in (`TorchBackend.lanes`), by its own options' length
        bucket, so that a shape always replays its one lane's graph: options of the shortest
        bucket in lane 0, longer ones in lane 1. The 12 speed-bench questions' two joint passes
        (options of 8 and of 24 tokens) then run at once."""
        if int(getattr(self.backend, "lanes", 1)) < 2:
            return 0
        return 1 if jp.parts[0].rows.shape[1] > OPTION_STEP else 0

    def early_heads_on(self, work: Plan) -> bool:
        """Whether the heads of the questions a joint pass finishes run while the later joint
        passes execute: on CUDA by default, where the plan lets them (`early_heads_fit`)."""
        wanted = self.config.on(self.config.early_heads, self.device.type == "cuda")
        # passes in two lanes run at once: the first ends with the second, and its heads then
        # only split the heads in two batches (12 questions on the H200: 41.7 ms a request
        # with them after the last pass, 43.6 with them early; h200-2026-12-04)
        one_lane = len({self.lane_of(jp) for jp in work.joint}) == 1
        return wanted and one_lane and early_heads_fit(work)

    def copy_back(self, outputs: list[dict[str, torch.Tensor]]) -> tuple:
        """Passes' readouts copied into pinned host memory behind them in the stream, and the
        event that says they are there (and whatever was enqueued before it): (event or None,
        [(hidden, logprobs) per output]); in place of a pageable `.cpu()` a tensor, each a wait
        and a copy at pageable speed."""
        pairs = [(o["hidden"].float(), o["logprobs"].float()) for o in outputs]
        if self.device.type != "cuda":
            return None, pairs
        copies = [tuple(map(pinned_copy, pair)) for pair in pairs]
        event = torch.cuda.Event()
        event.record()
        return event, copies

    def host_copies(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        """Device tensors as host arrays: copies into pinned memory enqueued on the stream, not
        waited for (the next `copy_back`'s event follows them); the tensors themselves on the
        CPU."""
        if self.device.type != "cuda":
            return {name: tensor.numpy() for name, tensor in tensors.items()}
        return {name: pinned_copy(tensor).numpy() for name, tensor in tensors.items()}

    def early_answers(
        self, prepared: Prepared, work: Plan, landed: list[tuple], taken: HostReadouts
    ) -> dict[int, QuestionReadout]:
        """The readouts of every question whose readouts all come from the joint passes that
        `landed` (each but the last), with its heads' output and answer but the latency fields
        (`finish_early`), each group made as soon as its last pass is on the host, while the
        passes after it run; their rows' readouts go into `taken`. The same bytes as with every
        question at once (the heads keep a row's bytes whatever the rows beside it:
        `Heads.stackable`, `DeviceMLPs.usable`). What the heads or the finishing refuse is left
        to `respond`, which raises the refusals in order."""
        from runtime.finish import finish_early

        made: dict[int, QuestionReadout] = {}
        finished = finished_by_joint(work)
        for jp, (event, copies), ready in zip(work.joint[:-1], landed, finished, strict=True):
            if event is not None:
                event.synchronize()
            (hidden, logprobs), *parts = [(h.numpy(), p.numpy()) for h, p in copies]
            taken.take_question(jp.question, hidden, logprobs)
            for op, (hidden, logprobs) in zip(jp.parts, parts, strict=True):
                taken.take_options(op, hidden, logprobs)
            if not ready:
                continue
            readouts = taken.collect(prepared, ready)
            questions = [prepared.questions[qi] for qi in ready]
            finish_early(self.heads, self.calibration, questions, readouts)
            made.update(zip(ready, readouts, strict=True))
        return made

    # -- passes -------------------------------------------------------------------------

    def _vision_pos_embed(self) -> np.ndarray:
        from safetensors import safe_open

        with safe_open(str(self.export.dir / "vision.safetensors"), framework="pt") as f:
            return f.get_tensor("model.visual.pos_embed.weight").float().numpy()

    def image_prefix(
        self, image: PreparedImage, rows: Pass, clock: Stopwatch | None = None
    ) -> tuple[State, State]:
        """(prefix, after prefix) states of an image and its prefix's pass: from the prefix
        cache, else the vision tower and the prefix pass enqueued (laps "vision", "prefix")."""
        key = prefix_key(image, rows) if self.prefix_cache.size > 0 else None
        laps = clock.lap if clock is not None else lambda stage: None
        cached = self.prefix_cache.get(key) if key is not None else None
        if cached is not None:
            laps("vision")
            laps("prefix")
            return cached
        features = self.vision(image)
        laps("vision")
        states = self.run_prefix(rows, features)
        laps("prefix")
        if key is not None:
            self.prefix_cache.put(key, states)
        return states

    def vision(self, image: PreparedImage) -> torch.Tensor:
        feeds = dict(self.vision_tables(tuple(int(x) for x in image.grid_thw)))
        rows = image.image_tokens
        # zero rows up to the prefix's bucket: the pass takes image rows in order, so the extra
        # rows are never read, and the prefix pass's shapes repeat across image sizes
        dtype = self._lm_dtypes["image_features"]
        features = torch.zeros(
            bucket(rows, PREFIX_STEP), self.dims.hidden, dtype=dtype, device=self.device
        )
        graph = self.vision_graph(image)
        if graph == IMAGE_GRAPH:
            feeds["rgb"] = self.tensor(image.rgb, torch.uint8)
        else:
            dtypes = self.backend.input_dtypes("vision")
            feeds["pixel_values"] = self.pixel_values(image, dtypes["pixel_values"])
        self.backend.run(graph, feeds, {self.output_name(graph, "image_features"): features[:rows]})
        return features

    def vision_graph(self, image: PreparedImage) -> str:
        """`image` (the backend resizes and packs the decoded image inside the tower's graph)
        where the backend has it and the image is left to the device whole; else `vision`."""
        whole = image.pixel_values is None and image.resized is None
        return IMAGE_GRAPH if whole and self.backend.has_graph(IMAGE_GRAPH) else "vision"

    def pixel_values(self, image: PreparedImage, dtype: torch.dtype) -> torch.Tensor:
        """The vision tower's patches: packed on the host, or made on the device from the uint8
        resized image (`prepare(pack=False)`) or from the decoded one, resized there too
        (`prepare(pack=False, resize=False)`, byte for byte the host's resize)."""
        if image.pixel_values is not None:
            return self.tensor(image.pixel_values, dtype)
        upload = partial(self.tensor, dtype=torch.uint8)
        return device_image_patches(image, upload, self._pixel_table).to(dtype).contiguous()

    def vision_tables(self, grid: tuple[int, ...]) -> dict[str, torch.Tensor]:
        """`pos_embeds`, `cos` and `sin` of one patch grid on the device (an LRU by grid)."""
        from runtime.model.vision import vision_inputs

        def make() -> dict[str, torch.Tensor]:
            dtypes = self.backend.input_dtypes("vision")
            inputs = vision_inputs(grid, self.pos_embed, self.model_config)
            return {name: self.tensor(inputs[name], dtypes[name]) for name in inputs}

        return self._vision_tables.get_or_make(grid, make)

    def output_name(self, graph: str, wanted: str) -> str:
        names = self.backend.output_names(graph)
        return wanted if wanted in names else names[0]

    def tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """`to_device` on this executor's device."""
        return to_device(array, self.device, dtype)

    def empty_state(self) -> State:
        """A state with no past (P = Q = 1, masked) and zero recurrent state: exactly empty.
        Made once: passes only read their sources (the prefix cache keeps these very tensors
        across requests already), and making it took 64 allocations and fills a request."""
        if self._empty is None:
            self._empty = self.make_empty_state()
        return self._empty

    def make_empty_state(self) -> State:
        d, dt = self.dims, self._lm_dtypes
        kv = dict(dtype=dt["prefix_k.0"], device=self.device) if d.attention_layers else {}
        zeros_kv = [
            torch.zeros(1, d.kv_heads, 1, d.head_dim, **kv) for _ in range(d.attention_layers)
        ]
        return State(
            k=zeros_kv,
            v=[t.clone() for t in zeros_kv],
            mask=torch.zeros(1, 1, dtype=torch.bool, device=self.device),
            conv=[
                torch.zeros(
                    1, d.conv_channels, d.conv_state, dtype=dt["src_conv.0"], device=self.device
                )
                for _ in range(d.delta_layers)
            ],
            rec=[
                torch.zeros(
                    1,
                    d.value_heads,
                    d.key_dim,
                    d.value_dim,
                    dtype=dt["src_rec.0"],
                    device=self.device,
                )
                for _ in range(d.delta_layers)
            ],
        )

    def feeds(
        self, arrays: dict[str, np.ndarray], features: torch.Tensor, prefix: State, src: State
    ) -> dict:
        feeds = self.upload_ints(arrays)
        feeds["image_features"] = features
        feeds["prefix_mask"] = prefix.mask
        feeds["src_mask"] = src.mask
        for i in range(self.dims.attention_layers):
            feeds[f"prefix_k.{i}"], feeds[f"prefix_v.{i}"] = prefix.k[i], prefix.v[i]
            feeds[f"src_k.{i}"], feeds[f"src_v.{i}"] = src.k[i], src.v[i]
        for j in range(self.dims.delta_layers):
            feeds[f"src_conv.{j}"], feeds[f"src_rec.{j}"] = src.conv[j], src.rec[j]
        return feeds

    def upload_ints(self, arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """`upload_ints` to this executor's device."""
        return upload_ints(arrays, self.device)

    def outputs(
        self, rows: Pass, arrays: dict[str, np.ndarray], with_state: bool, lend: bool = False
    ) -> dict[str, torch.Tensor]:
        """Tensors the pass writes; with `lend`, its states go straight into the buffers the
        backend reads the next passes' sources from, where it has them (no copy in)."""
        d, dt = self.dims, self._lm_dtypes
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
        lender = getattr(self.backend, "state_buffer", None) if lend else None
        for name, (shape, dtype) in shapes.items():
            if lender is not None:  # the pass's rows of the lent buffer (source_rows)
                whole = lender(f"src_{name}", (self.source_rows(b), *shape[1:]), dtype)
                out[f"out_{name}"] = whole[:b]
            else:
                out[f"out_{name}"] = torch.empty(shape, dtype=dtype, device=self.device)
        return out

    def source_rows(self, rows: int) -> int:
        """Rows of the buffers a question pass lends its states into: the question passes'
        row count, whatever this pass's (fitted passes have fewer), so that an option pass's
        sources have one shape per question length and its CUDA graph does not also follow
        the number of questions asked; the rows past the pass's are never read."""
        return max(rows, self.config.question_batch)

    def lent(self, out: dict[str, torch.Tensor], rows: Pass) -> dict[str, torch.Tensor]:
        """A question pass's outputs with each state as the whole buffer it was written into
        (`outputs`); the outputs as they are where they were not written there."""
        lender = getattr(self.backend, "state_buffer", None)
        widest = self.source_rows(rows.shape[0])
        if lender is None or widest == rows.shape[0]:
            return out
        whole = dict(out)
        for name, part in out.items():
            if name.startswith("out_"):
                buffer = lender(f"src_{name[4:]}", (widest, *part.shape[1:]), part.dtype)
                if buffer.data_ptr() != part.data_ptr():  # a pass split in pieces, say
                    return out
                whole[name] = buffer
        return whole

    def run_pass(
        self,
        rows: Pass,
        features: torch.Tensor,
        prefix: State,
        src: State,
        with_state: bool,
        lend: bool = False,
    ) -> dict[str, torch.Tensor]:
        if not with_state and not self.backend.has_graph("lm_rows"):
            with_state = True  # an engine directory without the readout-only variant
        limit = self.backend.max_pass_tokens
        if limit and rows.shape[1] > limit:
            return self.run_split(rows, features, prefix, src, with_state, limit)
        graph = "lm_state" if with_state else "lm_rows"
        arrays = rows.arrays(self.pad_targets)
        outputs = self.outputs(rows, arrays, with_state, lend)
        if not rows.read_rows and not rows.targets and self.backend_skips_readouts:
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
        t = rows.shape[1]
        arrays = rows.arrays()
        hidden = torch.empty(len(arrays["read_rows"]), self.dims.hidden, device=self.device)
        logprobs = torch.empty(len(arrays["target_tokens"]), device=self.device)
        index = self.tensor(rows.src, torch.int64)
        lengths = self.tensor(rows.lengths, torch.int64)
        # each row's source past, gathered once: every later piece reads it before its own tokens
        own_k = [[src.k[i][index]] for i in range(self.dims.attention_layers)]
        own_v = [[src.v[i][index]] for i in range(self.dims.attention_layers)]
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
            for i in range(self.dims.attention_layers):
                own_k[i].append(out[f"out_k.{i}"])
                own_v[i].append(out[f"out_v.{i}"])
            done = start + piece.shape[1]
            if done < t:
                own_mask = torch.arange(done, device=self.device)[None, :] < lengths[:, None]
                state = State(
                    k=[torch.cat(parts, dim=2) for parts in own_k],
                    v=[torch.cat(parts, dim=2) for parts in own_v],
                    mask=torch.cat([past_mask, own_mask], dim=1),
                    conv=[out[f"out_conv.{j}"] for j in range(self.dims.delta_layers)],
                    rec=[out[f"out_rec.{j}"] for j in range(self.dims.delta_layers)],
                )
        result = {"hidden": hidden, "logprobs": logprobs}
        if with_state:
            for i in range(self.dims.attention_layers):
                result[f"out_k.{i}"] = torch.cat(own_k[i][1:], dim=2)
                result[f"out_v.{i}"] = torch.cat(own_v[i][1:], dim=2)
            for j in range(self.dims.delta_layers):
                result[f"out_conv.{j}"] = out[f"out_conv.{j}"]
                result[f"out_rec.{j}"] = out[f"out_rec.{j}"]
        return result

    def state_from(self, out: dict[str, torch.Tensor], rows: Pass) -> State:
        """The pass's states as sources; the mask has a row for each row of the state tensors
        (more than the pass's where they are whole lent buffers: `lent`), the extra ones empty."""
        d = self.dims
        states = [t for name, t in out.items() if name.startswith("out_")]
        lengths = np.zeros(states[0].shape[0] if states else rows.shape[0], dtype=np.int64)
        lengths[: rows.shape[0]] = rows.lengths
        # through pinned memory: a pageable upload here made the host wait for the pass it
        # follows (6-8 ms a pass on the H200), so the next pass was enqueued only then
        lengths = self.tensor(lengths, torch.int64)
        positions = torch.arange(rows.shape[1], device=self.device)
        return State(
            k=[out[f"out_k.{i}"] for i in range(d.attention_layers)],
            v=[out[f"out_v.{i}"] for i in range(d.attention_layers)],
            mask=positions[None, :] < lengths[:, None],
            conv=[out[f"out_conv.{j}"] for j in range(d.delta_layers)],
            rec=[out[f"out_rec.{j}"] for j in range(d.delta_layers)],
        )

    def run_prefix(self, rows: Pass, features: torch.Tensor) -> tuple[State, State]:
        """The image prefix (the plan's `prefix` pass): its K/V become every later row's shared
        past."""
        empty = self.empty_state()
        out = self.run_pass(rows, features, empty, empty, with_state=True)
        state = self.state_from(out, rows)
        prefix = State(k=state.k, v=state.v, mask=state.mask, conv=[], rec=[])
        after = State(k=empty.k, v=empty.v, mask=empty.mask, conv=state.conv, rec=state.rec)
        return prefix, after

    def run_question(
        self, qp: QuestionPass, prefix: State, after_prefix: State
    ) -> tuple[dict[str, torch.Tensor], State]:
        """A question pass; its states go where the option passes read them (`state_buffer`):
        valid until the next question pass of the same shape, which runs after these options."""
        out = self.run_pass(
            qp.rows, self.dummy_features(), prefix, after_prefix, with_state=True, lend=True
        )
        return out, self.state_from(self.lent(out, qp.rows), qp.rows)

    def run_options(
        self, op: OptionPass, prefix: State, question_state: State
    ) -> dict[str, torch.Tensor]:
        return self.run_pass(op.rows, self.dummy_features(), prefix, question_state, False)

    def run_joint(
        self, jp: JointPass, prefix: State, after_prefix: State, lane: int = 0
    ) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        """A joint pass: (the question rows' readouts, each part's option rows' readouts); in
        `lane` > 0 on that lane's graphs (the caller has made the lane's stream current)."""
        arrays = jp.question.rows.arrays(self.pad_targets)
        named, outputs = dict(arrays), self.outputs(jp.question.rows, arrays, with_state=False)
        prefixes = JOINT_PREFIXES[: len(jp.parts)]
        for prefix_name, op in zip(prefixes, jp.parts, strict=True):
            options = op.rows.arrays(self.pad_targets)
            named.update({prefix_name + name: a for name, a in options.items()})
            for name, tensor in self.outputs(op.rows, options, with_state=False).items():
                outputs[prefix_name + name] = tensor
        feeds = self.feeds(named, self.dummy_features(), prefix, after_prefix)
        lanes = {"lane": lane} if lane else {}  # other backends have one lane
        self.backend.run(JOINT_GRAPH, feeds, outputs, **lanes)
        readouts = ("hidden", "logprobs")
        mine = {name: outputs[name] for name in readouts}
        return mine, [{name: outputs[p + name] for name in readouts} for p in prefixes]

    def dummy_features(self) -> torch.Tensor:
        dtype = self._lm_dtypes["image_features"]
        return torch.zeros(1, self.dims.hidden, dtype=dtype, device=self.device)


def prefix_key(image: PreparedImage, rows: Pass) -> str:
    """Everything the image prefix depends on: its pass's tokens and positions, and the resized
    uint8 image, which fixes the pixel values (0.9 ms to hash against 2.1 for the decoded RGB)."""
    digest = hashlib.sha256()
    digest.update(rows.input_ids.tobytes())
    digest.update(rows.positions.tobytes())
    if image.digest is not None:  # the encoded image's, made while preparing
        digest.update(image.digest)
    else:
        pixels = image.resized if image.resized is not None else image.rgb
        digest.update(np.asarray(pixels.shape, dtype=np.int64).tobytes())
        digest.update(memoryview(np.ascontiguousarray(pixels)).cast("B"))
    return digest.hexdigest()


def slice_pass(rows: Pass, start: int, end: int) -> Pass:
    """Tokens [start, end) of every row; readouts inside them, remembered by their index."""
    width = end - start
    piece = Pass(
        input_ids=np.ascontiguousarray(rows.input_ids[:, start:end]),
        positions=np.ascontiguousarray(rows.positions[:, :, start:end]),
        lengths=np.clip(rows.lengths - start, 0, width),
        src=np.arange(rows.shape[0], dtype=np.int64) if start else rows.src,
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


class Lanes:
    """The streams of one request's joint passes: a lane's stream first waits for what the
    caller's stream had enqueued when this was made (the image prefix), and `join` makes the
    caller's stream wait for every lane used."""

    def __init__(self, backend: Backend, device: torch.device):
        self.backend = backend
        self.used: dict[int, torch.cuda.Stream] = {}
        self.fork = None
        if device.type == "cuda" and int(getattr(backend, "lanes", 1)) > 1:
            self.fork = torch.cuda.Event()
            self.fork.record()

    @contextmanager
    def entered(self, lane: int) -> Iterator[None]:
        stream = self.backend.lane_stream(lane) if lane and self.fork is not None else None
        if stream is None:
            yield
            return
        if lane not in self.used:
            stream.wait_event(self.fork)
            self.used[lane] = stream
        with torch.cuda.stream(stream):
            yield

    def join(self) -> None:
        for stream in self.used.values():
            torch.cuda.current_stream().wait_stream(stream)


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


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A device tensor's copy into pinned host memory, enqueued behind its work, not waited
    for."""
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor, non_blocking=True)


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


def pinned_uint8(shape: tuple[int, ...]) -> np.ndarray:
    """A uint8 array in pinned host memory, for a decode to write the image into: its upload
    then copies nothing on the host (0.42 ms of a 1600 × 900 image on the H200's host, against
    0.15 ms for the transfer; h200-2026-12-03). The array keeps its tensor, so the memory lives
    as long as the prepared request, whose readouts wait for the device after the upload."""
    return torch.empty(shape, dtype=torch.uint8, pin_memory=True).numpy()


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


@dataclass
class MlpsBehind:
    """The heads' MLP outputs a request's passes made on the device (`Executor.mlps_behind`):
    by MLP name, and where each question's rows are in them."""

    outputs: dict[str, torch.Tensor]  # name -> [N, width] on the device
    spans: dict[int, dict[str, tuple[int, int]]]  # question -> name -> (start, end)

    def hand_out(
        self, which: list[int], readouts: list[QuestionReadout], host: dict[str, np.ndarray]
    ) -> None:
        """Each question's rows of the outputs, now on the host, into its readout's `mlps`."""
        for qi, readout in zip(which, readouts, strict=True):
            if qi in self.spans:
                readout.mlps = {n: host[n][a:b] for n, (a, b) in self.spans[qi].items()}


@dataclass
class HostReadouts:
    """A request's readouts on the host as its passes' outputs arrive: `zq` by question,
    `first` and `picked` by (question, option), and where each option's u is: (the pass's
    hidden readouts, its row there), gathered once a question in `collect`. Taken an option at
    a time, 255 options' readouts took 1.2 ms on the 2-core CI machine after the device was
    done; a pass's in one indexing, handing out views, 0.5 ms."""

    zq: dict[int, np.ndarray] = field(default_factory=dict)
    first: dict[tuple[int, int], float] = field(default_factory=dict)
    # the first text tokens' log-probabilities where the question part read them (`open_read`)
    opened: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)
    u_at: dict[tuple[int, int], tuple[np.ndarray, int]] = field(default_factory=dict)
    picked: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)

    def take_question(self, qp: QuestionPass, hidden: np.ndarray, logprobs: np.ndarray) -> None:
        """A question pass's readouts: its questions' zq and first-token log-probabilities."""
        for qi, index in qp.zq_read.items():
            self.zq[qi] = hidden[index]
        if qp.first_read:
            index = np.fromiter(qp.first_read.values(), np.intp, len(qp.first_read))
            self.first.update(zip(qp.first_read, logprobs[index].tolist(), strict=True))
        if qp.open_read:
            self.opened.update(gathered(qp.open_read, logprobs))

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

    def picked_of(self, qi: int, k: int) -> np.ndarray | None:
        """Option k's text log-probabilities in token order: those its question part read over
        the options' shared leading tokens (if any), then its option pass's."""
        picked, opened = self.picked.get((qi, k)), self.opened.get((qi, k))
        if opened is None:
            return picked
        return opened if picked is None or not len(picked) else np.concatenate([opened, picked])

    def collect(self, prepared: Prepared, which: list[int]) -> list[QuestionReadout]:
        """The readouts of the questions `which`, in that order."""
        readouts = []
        for qi in which:
            k = len(prepared.layouts[qi].rows)
            picked = [self.picked_of(qi, j) for j in range(k)]
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


def warm_up_image() -> str:
    """The worker's warm-up image: a 96×64 PNG whose pixel (x, y) is RGB (x, y, 128)."""
    import base64
    import io

    from PIL import Image

    w, h = WARM_UP_SIZE
    x, y = np.meshgrid(np.arange(w), np.arange(h))
    rgb = np.stack([x, y, np.full_like(x, 128)], axis=-1).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def warm_up_request() -> dict:
    """The request the worker runs before it reports ready (docs/contract.md §1.2)."""
    return {
        "model": MODEL_ID,
        "state": {"images": [warm_up_image()]},
        "questions": {
            "noul": {
                "type": "noul",
                "instructions": "The image is mostly blue.",
                "region": {"box": [0, 0, 48, 32]},
            },
            "choice": {
                "type": "choice",
                "instructions": "Which colour dominates?",
                "criteria": {"red": None, "green": "Mostly green", "blue": None},
            },
            "score": {
                "type": "score",
                "instructions": "How bright is the image?",
                "levels": ["dark", "medium", "bright"],
            },
        },
    }


def load_engine(
    checkpoint: str, engines: str, config: RuntimeConfig | str | None = None
) -> Executor:
    """The executor of a checkpoint and its engines; `config` may name just the backend."""
    if isinstance(config, str):
        config = RuntimeConfig.from_env(backend=config)
    return Executor(Path(checkpoint), Path(engines), config)


def cli_run(args) -> int:
    """`omnijev run REQUEST.json --checkpoint DIR --engines DIR`: answer in process."""
    from runtime.errors import BodyError, ContractError

    executor = load_engine(args.checkpoint, args.engines, RuntimeConfig.from_args(args))
    body = Path(args.request).read_bytes()
    try:
        response = executor.answer(body)
    except (BodyError, ContractError) as error:
        print(str(error), file=sys.stderr)
        return 1
    print(json.dumps(response, ensure_ascii=False))
    return 0
