"""Answers requests through the engines, top to bottom: prepare (contract, image, tokens, pass
plan) → the image prefix → the passes → the readouts back on the host → heads → finishing.

Follows the native worker's prefix-reuse executor (docs/model.md §12.1) and `MSO1._finish`; the pass
layout is planned by `runtime.passes` so that an answer never depends on the other questions.
Each stage is a module of its own: `runtime.processing`, `runtime.image_prefix`,
`runtime.run_passes`, `runtime.readouts`, `runtime.heads`, `runtime.finish`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import deque
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import torch

from runtime import packing, passes
from runtime.backends import Backend, choose_backend
from runtime.batch import batch_size, merged, same_readouts
from runtime.config import RuntimeConfig
from runtime.constants import IMAGE_PAD_ID, MAX_PREFIXES, MODEL_ID
from runtime.flight import Flight, PassCounts
from runtime.image_prefix import ImagePrefix, prefix_key
from runtime.images import CLIP_PREFIX
from runtime.manifest import verify_engine_dir
from runtime.packing import PackedPlan
from runtime.passes import (
    CLIP_PREFIX_STEP,
    MAX_IMAGE_TOKENS,
    PREFIX_STEP,
    Plan,
    batch_bucket,
    bucket,
    longest_prefix,
    plan,
)
from runtime.readouts import Landing, mlps_behind
from runtime.run_passes import (
    Choices,
    Dims,
    PassRunner,
    State,
    Stopwatch,
    pinned_uint8,
    stack_prefixes,
)
from runtime.types import Prepared, QuestionReadout
from runtime.warm_up import warm_up_companion, warm_up_request

# batches enqueued on the device at once: one running, the next behind it, so that the device
# never waits for the host between them; more would only queue there, out of later batches' reach
IN_FLIGHT = 2

log = logging.getLogger("omnijev.executor")


class Executor:
    """Holds the loaded model (export + engines) and answers requests, alone or several at once
    (`readouts_batch`).

    `backend` is an engine already loaded (else `choose_backend` loads one by `config`);
    `choices` how requests run on it (else those its capabilities give: `Choices.of`)."""

    model_id = MODEL_ID
    splits = True  # `readouts` and `respond`, which the worker runs on threads of their own

    def __init__(
        self,
        checkpoint: Path,
        engines: Path,
        config: RuntimeConfig | None = None,
        backend: Backend | None = None,
        choices: Choices | None = None,
    ):
        from runtime.export_format import load_export, start_verify

        self.config = config or RuntimeConfig.from_env()
        laps = [time.perf_counter()]
        self.export = load_export(Path(checkpoint), verify=False)
        # the export's files hash on a thread of their own while the rest loads; the executor
        # exists only once they match, and a mismatch is the refusal it names first
        verifying = start_verify(self.export)
        laps.append(time.perf_counter())
        try:
            self.load_components(Path(checkpoint), Path(engines), backend, laps)
        finally:
            verifying.result()
        laps.append(time.perf_counter())
        # where a start spends its time (logged; the cold-start records keep it)
        steps = ("export check", "tokenizer and heads", "engine check", "backend", "hash wait")
        spans = zip(steps, pairwise(laps), strict=True)
        self.load_seconds = {step: round(b - a, 2) for step, (a, b) in spans}
        log.info("loaded in %s s", self.load_seconds)
        self.choices = choices or Choices.of(self.backend.capabilities)
        self.after_load()

    def load_components(
        self, checkpoint: Path, engines: Path, backend: Backend | None, laps: list[float]
    ) -> None:
        """The tokenizer, heads, engine check and backend, each step's end in `laps`."""
        from runtime.heads import Heads

        self.model_config = self.export.config
        self.tokenizer = self.export.tokenizer  # the export check loaded and checked it
        self.heads = Heads.from_safetensors(checkpoint / "heads.safetensors")
        self.calibration = self.export.calibration
        laps.append(time.perf_counter())
        # nothing of the engine directory is loaded before its manifest vouches for it
        verify_engine_dir(engines, checkpoint)
        laps.append(time.perf_counter())
        self.backend = backend or choose_backend(engines, self.config, checkpoint)
        laps.append(time.perf_counter())

    def after_load(self) -> None:
        """The stages made of the loaded backend and heads."""
        self.device = self.backend.device
        image_token = int(self.model_config.get("image_token_id", IMAGE_PAD_ID))
        dims = Dims.from_config(self.model_config)
        self.runner = PassRunner(self.backend, dims, image_token)
        self.prefix = ImagePrefix(
            self.runner, self.export.dir, self.model_config, self.config.prefix_cache
        )
        if self.choices.device_heads and not self.heads.use_device(self.device):
            log.warning("heads: the device's products fail the check, the heads stay on the CPU")
        elif self.choices.device_heads and not self.heads.device_mlps.behind_usable:
            log.warning("heads: the MLPs behind the passes fail the check, not used")
        self.stages: dict[str, float] = {}  # seconds per stage of the last request
        self.stage_sync = None  # a callable that waits for the device: per-stage device time
        # requests may run as one batch where the deployment lets them and the backend's
        # batches keep the bytes (`Capabilities.merges`), unless `check_batches` finds otherwise
        self.merges = self.config.merge and self.backend.capabilities.merges
        self.passes = PassCounts()  # what the executed passes held (/metrics)
        self.running: deque[torch.cuda.Event] = deque()  # the device's batches not yet done

    # -- a request, top to bottom ---------------------------------------------------------

    def answer(self, body: bytes) -> dict:
        from runtime.strict_json import parse_body

        return self.execute(self.prepare(parse_body(body)))

    def prepare(self, obj: dict) -> Prepared:
        """The contract, the image decoded on its own thread from the moment it has passed the
        contract, the questions' tokens and rows, and the pass plan (`plan_of`), made while the
        image decodes. On a GPU the decoded uint8 image travels (a few MB, not float32 patches)
        and the resize and the patches are made there, byte for byte the host's; a PNG decodes
        straight into pinned memory, which the upload then reads as it is."""
        from runtime.contract import compile_image, compile_request
        from runtime.processing import prepare, start_image_of

        host = self.device.type == "cpu"
        image = compile_image(obj)
        allocate = None if host else pinned_uint8
        pending = start_image_of(image, host, host, allocate)
        try:
            request = compile_request(obj, image)
            prepared = prepare(
                request,
                self.tokenizer,
                pack=host,
                resize=host,
                planner=self.plan_of,
                allocate=allocate,
                pending=pending,
            )
            key = prefix_key(prepared.image, self.work_of(prepared).prefix)
            return replace(prepared, image_key=key)
        finally:
            # a raised error's traceback holds this frame, and the future holds a refused
            # image's error: the cycle would keep the request's bytes until a collection
            del pending

    def plan_of(self, prepared: Prepared) -> tuple:
        """(pass shape, plan) of a request, as `readouts` takes them from `Prepared.planned`."""
        shape = self.pass_shape()
        if self.choices.packed:
            return shape, packing.plan(prepared)
        return shape, plan(prepared, self.config.question_batch)

    def pass_shape(self) -> tuple:
        """("packed",) where this executor's passes are packed, else (question pass rows,)."""
        if self.choices.packed:
            return ("packed",)
        return (self.config.question_batch,)

    def execute(self, prepared: Prepared) -> dict:
        started = time.perf_counter()
        readouts = self.readouts(prepared)
        heads_started = time.perf_counter()
        response = self.respond(prepared, readouts, heads_started - started)
        self.stages["prepare"] = prepared.prepare_seconds
        self.stages["heads"] = time.perf_counter() - heads_started
        return response

    def batch_key(self, prepared: Prepared) -> tuple[object, float]:
        """(key, share): the requests of one key run their passes as one batch
        (`readouts_batch`): where a pass reads several image prefixes (the backend's
        `Capabilities.prefixes`), those whose image prefixes have one pass shape (every prefix
        where their keys are fixed), else those about one image prefix; a request's share of a
        batch (`runtime.batch.batch_size`). A clip runs alone where keys are fixed
        (`prefix_slots`)."""
        prefixes = self.backend.capabilities.prefixes
        work = self.work_of(prepared)
        if not self.merges or (self.choices.fixed_prefix_keys and prepared.clip):
            key: object = None
        elif self.choices.fixed_prefix_keys:
            key = ("prefix keys", longest_prefix(work.prefix_length, prepared.image.image_tokens))
        elif prefixes > 1:
            key = ("prefix shape", work.prefix.shape)
        else:
            key = prepared.image_key
        return key, batch_size(prepared, prefixes)

    def readouts_batch(self, batch: list[Prepared]) -> list[list[QuestionReadout]]:
        """The readouts of each request of `batch`, of one `batch_key`: their questions in the
        passes of one request (`runtime.batch.merged`), the same bytes as each alone."""
        flight = self.enqueue(batch)
        return [flight.readouts(index) for index in range(len(batch))]

    def check_batches(self) -> bool:
        """Whether requests may run as one batch here: the warm-up request and its companion
        (another image, the same shapes) give the same readout bytes together as each alone.
        Kernels that follow a pass's shape on this machine fail it, and every request then runs
        alone (`batch_key` gives None). Builds a batch's shapes before the first client."""
        if not self.merges:
            return False
        pair = [self.prepare(warm_up_request()), self.prepare(warm_up_companion())]
        alone = [self.readouts(prepared) for prepared in pair]
        together = self.readouts_batch(pair)
        self.merges = all(map(same_readouts, alone, together))
        if not self.merges:
            log.warning("a batch changed the warm-up's readout bytes: every request runs alone")
        return self.merges

    def readouts(self, prepared: Prepared) -> list[QuestionReadout]:
        """Hidden states and log-probabilities of every question, through the engines."""
        return self.enqueue([prepared]).readouts(0)

    def enqueue(self, batch: list[Prepared]) -> Flight:
        """Every pass of `batch` (one request, or several of one `batch_key` merged) enqueued on
        the device, and the copies of their readouts behind them, without waiting: the worker's
        execution thread goes on to the next batch while the device runs this one, and each
        request's readouts are taken on its own thread (`Flight.readouts`)."""
        request, images = (batch[0], None) if len(batch) == 1 else merged(batch)
        work = self.work_of(request)
        clock = Stopwatch(self.stages, self.stage_sync)
        every = list(range(len(request.layouts)))
        started = None
        if self.device.type == "cuda":
            started = torch.cuda.Event(enable_timing=True)
            started.record()
        with torch.inference_mode():
            states = self.image_states(images or [request], clock)
            if isinstance(work, PackedPlan):
                reads = self.runner.run_packed_plan(work, *states, clock)
            else:
                reads = self.runner.run_plan(work, *states, clock)
            behind = self.mlps_behind(request, every, reads)
            outputs = behind.outputs if behind is not None else None
            landing = Landing.enqueue(reads, self.device, outputs)
        self.passes.count(work, len(batch))
        if landing.event is not None:
            self.running.append(landing.event)
        return Flight(request, batch, landing, behind, clock, self.passes, started)

    def room(self) -> None:
        """Returns once fewer than IN_FLIGHT batches are still running on the device: the
        worker waits here before it forms the next batch, so that requests arriving while the
        device is busy join that batch instead of queueing behind it on the device."""
        while self.running and self.running[0].query():
            self.running.popleft()
        while len(self.running) >= IN_FLIGHT:
            self.running.popleft().synchronize()

    def image_states(self, images: list[Prepared], clock: Stopwatch) -> tuple[State, State]:
        """(prefix, after prefix) states of each request's image (`ImagePrefix.states`), stacked
        where there are several (the rows read theirs by `Pass.prefix_rows` and `src`)."""
        made = [self.image_state(p, clock) for p in images]
        slots = self.prefix_slots(len(made))
        if slots == 1:
            return made[0]
        made += [made[0]] * (slots - len(made))  # the first prefix again, which no row reads
        return stack_prefixes([m[0] for m in made]), stack_prefixes([m[1] for m in made])

    def prefix_slots(self, count: int) -> int:
        """The image prefixes a pass of `count` images reads. A pass's shape includes its
        prefix count, and each shape is a CUDA graph of its own: where prefix keys are fixed
        (one graph a packed size) the backend's graph reads its `prefixes` and takes fewer in
        its first rows, so the stack is the images' own (a clip, never merged, has a graph of
        one: its CLIP_PREFIX keys four times over would be 576 MiB of K/V a pass on the 4b);
        elsewhere counts of a power of two keep the shapes few."""
        if self.choices.fixed_prefix_keys:
            return count
        return 1 if count == 1 else batch_bucket(count, MAX_PREFIXES)

    def image_state(self, prepared: Prepared, clock: Stopwatch) -> tuple[State, State]:
        """(prefix, after prefix) states of a request's image, the prefix padded to the longest
        prefix's keys where the choices fix them (kept so in the prefix cache)."""
        work = self.work_of(prepared)
        keys = 0
        if self.choices.fixed_prefix_keys:
            keys = longest_prefix(work.prefix_length, prepared.image.image_tokens, prepared.clip)
        return self.prefix.states(prepared.image, work.prefix, clock, prepared.image_key, keys)

    def respond(self, prepared: Prepared, readouts: list[QuestionReadout], seconds: float) -> dict:
        """The response: heads and finishing of every question."""
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

    # -- the choices a request's execution makes ------------------------------------------

    def work_of(self, prepared: Prepared) -> Plan | PackedPlan:
        """The plan made while preparing, where it was made for this executor's pass shape."""
        shape, planned = self.pass_shape(), prepared.planned
        if planned and planned[0] == shape:
            return planned[1]
        return self.plan_of(prepared)[1]

    def mlps_behind(self, prepared: Prepared, which: list[int], reads: list):
        """The heads' MLPs of the questions `which` enqueued right behind the passes
        (`runtime.readouts.mlps_behind`); None where they are not chosen."""
        if not self.choices.mlps_behind:
            return None
        return mlps_behind(self.heads, prepared, which, reads, self.device)

    # -- the worker's ---------------------------------------------------------------------

    def warm_up_request(self) -> dict:
        return warm_up_request()

    def settle(self) -> int:
        """Waits for the backend's fixed-shape sessions still being built; how many there were."""
        return self.backend.settle()

    def build_shapes(self) -> int:
        """Builds every shape a request the contract admits can need, where the backend
        captures one graph a shape (packed passes on CUDA): the vision tower's patch buckets,
        each image prefix length and each packed pass size, a still's and a clip's; how many
        were built. The worker runs it before it reports ready, so that no request waits for a
        build."""
        if not (self.choices.packed and self.device.type == "cuda"):
            return 0
        before = self.shape_builds()[0]
        prepared = self.prepare(warm_up_request())
        text = self.work_of(prepared).prefix_length - prepared.image.image_tokens
        stills = range(
            bucket(text + 1, PREFIX_STEP),
            bucket(text + MAX_IMAGE_TOKENS, PREFIX_STEP) + 1,
            PREFIX_STEP,
        )
        clips = range(CLIP_PREFIX_STEP, CLIP_PREFIX + 1, CLIP_PREFIX_STEP)
        with torch.inference_mode():
            self.backend.prepare(self.backend.vision_shapes())
            self.build_prefixes(stills, self.prefix.feature_rows(MAX_IMAGE_TOKENS))
            # the stills' graphs read the backend's `prefixes` (`prefix_slots`): one image's
            # states, stacked that many times
            states = self.image_states([prepared], Stopwatch(self.stages))
            every = self.backend.capabilities.prefixes
            self.build_packed(tuple(stack_prefixes([state] * every) for state in states))
            longest = self.build_prefixes(clips, self.prefix.feature_rows(CLIP_PREFIX, clip=True))
            self.build_packed(longest)  # a clip's: CLIP_PREFIX keys, one prefix
            torch.cuda.synchronize(self.device)
        return self.shape_builds()[0] - before

    def build_prefixes(self, lengths: range, features: int) -> tuple[State, State]:
        """Each image prefix pass of `lengths` tokens on `features` rows of image features; the
        states of the last."""
        dummy = torch.zeros(features, self.runner.dims.hidden, device=self.device)
        dummy = dummy.to(self.runner.dtypes["image_features"])
        # a graph slot runs a shape eagerly once, then captures it (GraphSlots), so each shape
        # runs twice here: one run left the capture to the first request that met it
        for length in lengths:
            for _ in range(2):
                states = self.runner.run_prefix(passes.empty_pass(1, length), dummy)
        return states

    def build_packed(self, states: tuple[State, State]) -> None:
        """Each packed pass size, reading `states`' prefixes (twice each, as `build_prefixes`)."""
        for size in packing.PACK_SIZES:
            for _ in range(2):
                self.runner.run_packed(packing.empty_pass(size), *states)

    def shape_builds(self) -> tuple[int, float]:
        """The pass shapes the backend has built so far (compiled and captured, a session made)
        and the seconds their builds took."""
        stats = self.backend.stats()
        return stats["builds"], stats["build_seconds"]

    def prefix_lookups(self) -> tuple[int, int]:
        """The image-prefix cache's (hits, misses) so far."""
        return self.prefix.cache.hits, self.prefix.cache.misses


def load_engine(
    checkpoint: str, engines: str, config: RuntimeConfig | str | None = None, **given
) -> Executor:
    """The executor of a checkpoint and its engines; `config` may name just the backend;
    `given`: the executor's `backend` or `choices`."""
    if isinstance(config, str):
        config = RuntimeConfig.from_env(backend=config)
    return Executor(Path(checkpoint), Path(engines), config, **given)


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
