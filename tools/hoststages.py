"""Per-stage host times of requests: strict JSON to GPU-ready inputs, heads to response bytes.

Times the project's own functions stage by stage, as the executor and the server run them
(`Executor.prepare`, `runtime.passes.plan`, `Executor.respond`, `server.app.encode`); the bench
requests come from `tools.bench.host_requests`, the command line is `tools.hostprofile`.
"""

from __future__ import annotations

import inspect
import json
import statistics
import time

import numpy as np

HIDDEN = 2560  # the 4b's hidden size: the heads' real cost (runtime.heads.HIDDEN)
RUNS = 20  # warm runs per workload; the median is reported
HEADS_SEED = 0
# the stages in request order; "host total" is timed end to end, not summed
STAGES = (
    "strict JSON",
    "contract",
    "base64 + canonical",
    "image header",
    "decode",
    "resize",
    "patchify/normalise",
    "tokenisation",
    "layout",
    "positions",
    "plan + pass arrays",
    "upload",
    "heads",
    "finishing",
    "response JSON",
)
HOST_TOTAL = "host total"
# the executor's path on a GPU: prepare(pack=False, resize=False), the decoded image uploaded,
# resized and patched on the device (where `prepare` can)
HOST_TOTAL_DEVICE = "host total, resize + patches on device"
# the executor's other way to the vision input (runtime.images.device_pixel_values): not summed
DEVICE_UPLOAD = "upload uint8 + device patches"
# the executor's default on CUDA (RuntimeConfig.early_heads): the torch backend's plan (fitted,
# joint passes), and where it has two or more joint passes, the heads and the answers (but their
# latency) of the questions each but the last finishes made while the later passes run
# (Executor.early_answers): not on the request's path, so timed on their own (EARLY_HEADS),
# and the rest after the last readouts. The image goes the executor's way: resize and patches
# on the device, on the host for a CPU upload
HOST_TOTAL_EARLY = "host total, early heads"
EARLY_HEADS = "early heads and answers, beside the later passes"
# the executor's default on CUDA with the torch backend: as HOST_TOTAL_EARLY, the decoded image
# sent up whole (its resize and patches are the image graph's, in the vision stage), and the
# MLPs of the questions left after the early heads made on the device behind the passes
# (RuntimeConfig.mlps_behind), their outputs coming with the readouts (not host work)
HOST_TOTAL_BEHIND = "host total, the worker's CUDA path (image graph, early heads, MLPs behind)"
EVERY_RUN = "runs_ms"  # each run's milliseconds by stage and total, in run order (not in the table)


# what the stages and the end-to-end total are timed with: wall time, or (use_cpu_time) the
# CPU seconds of the timing thread and of the process, which a machine busy with other work
# inflates far less (the stages run on one thread with PyTorch on one thread and
# TOKENIZERS_PARALLELISM=false; the total's CPU time counts the image thread's too)
TIMERS = {"stage": time.perf_counter, "total": time.perf_counter}


def use_cpu_time() -> None:
    TIMERS.update(stage=time.thread_time, total=time.process_time)


class Clock:
    """Adds the seconds since the previous lap to the stage's list."""

    def __init__(self, times: dict[str, list[float]]):
        self.times = times
        self.last = TIMERS["stage"]()

    def lap(self, stage: str) -> None:
        now = TIMERS["stage"]()
        self.times.setdefault(stage, []).append(now - self.last)
        self.last = now


def synthetic_heads(hidden: int = HIDDEN, seed: int = HEADS_SEED):
    """Heads of the 4b's shapes with small random weights: the cost of the real ones."""
    from runtime.heads import Heads, head_shapes

    rng = np.random.default_rng(seed)
    tensors = {
        name: (rng.standard_normal(shape) * 0.02).astype(np.float32)
        for name, shape in head_shapes(hidden).items()
    }
    return Heads(tensors, hidden)


def synthetic_readouts(prepared, hidden: int, seed: int = HEADS_SEED) -> list:
    """Readouts shaped as the engines return them: zq, u and every option's target log-probs."""
    from runtime.types import QuestionReadout

    rng = np.random.default_rng(seed)
    readouts = []
    for layout in prepared.layouts:
        k = len(layout.rows)
        readouts.append(
            QuestionReadout(
                zq=rng.standard_normal(hidden).astype(np.float32),
                u=rng.standard_normal((k, hidden)).astype(np.float32),
                picked=[-rng.random(len(row.targets)).astype(np.float32) for row in layout.rows],
                first=[None if row.first is None else -0.5 for row in layout.rows],
            )
        )
    return readouts


def device_for(name: str | None):
    import torch

    if name:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def upload(prepared, work, device, image_graph: bool = False) -> None:
    """The executor's host-to-device copies: pixel values, then each pass's int64 arrays in one
    copy (`runtime.executor.upload_ints`, where the runtime has it). `image_graph`: the decoded
    image goes up whole, as `Executor.vision` sends it to a backend with the image graph (the
    torch backend's default on CUDA: the resize and the patches are the vision stage's)."""
    import torch

    from runtime import executor

    def tensor(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, dtype).contiguous()

    whole = prepared.image.pixel_values is None and prepared.image.resized is None
    if image_graph and whole:
        tensors = [executor.to_device(prepared.image.rgb, device, torch.uint8)]
    elif prepared.image.pixel_values is None:  # prepared with pack=False
        upload_resized(prepared, device)
        tensors = []
    else:
        tensors = [tensor(prepared.image.pixel_values, torch.bfloat16)]
    passes = [work.prefix, *(q.rows for q in work.questions), *(o.rows for o in work.options)]
    arrays = [rows.arrays() for rows in passes]
    for jp in work.joint:  # a joint pass's rows go up together (Executor.run_joint)
        rows = (jp.question.rows, *(op.rows for op in jp.parts))
        arrays.append({f"{i}.{k}": a for i, r in enumerate(rows) for k, a in r.arrays().items()})
    for named in arrays:
        if hasattr(executor, "upload_ints"):
            tensors.append(executor.upload_ints(named, device))
        else:  # the runtime before a pass's arrays went up in one copy
            tensors += [tensor(a, torch.int64) for a in named.values()]
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def upload_resized(prepared, device) -> None:
    """The executor's device path: the resized (or, prepared with resize=False, the decoded)
    uint8 image through pinned memory, resized there if need be, patches made there."""
    from functools import partial

    import torch

    from runtime.executor import to_device
    from runtime.images import device_image_patches

    upload = partial(to_device, device=device, dtype=torch.uint8)
    device_image_patches(prepared.image, upload).to(torch.bfloat16)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_once(body: bytes, tokenizer, heads, calibration, device, times: dict) -> None:
    """One request through every host stage, each timed on its own."""
    from runtime import heads as heads_module
    from runtime import images, processing
    from runtime.contract import compile_request
    from runtime.finish import finish_answer
    from runtime.heads import question_mu
    from runtime.passes import plan
    from runtime.strict_json import parse_body
    from runtime.types import Prepared, PreparedImage, QuestionLayout

    clock = Clock(times)
    obj = parse_body(body)
    clock.lap("strict JSON")
    request = compile_request(obj)
    clock.lap("contract")
    # the image part of the contract again, stage by stage; subtracted from "contract" below
    encoded = obj["state"]["images"][0].partition(",")[2]
    data = images.decode_base64(encoded)
    clock.lap("base64 + canonical")
    images.open_header(data, request.image_mime).close()
    clock.lap("image header")
    times["contract"][-1] -= times["base64 + canonical"][-1] + times["image header"][-1]
    opened = getattr(request, "opened", None)  # the contract's open header, where kept
    rgb = images.decode_rgb(request.image_bytes, request.image_mime, *([opened] if opened else []))
    clock.lap("decode")
    resized = images.resize_rgb(rgb, *images.smart_resize(*rgb.shape[:2]))
    clock.lap("resize")
    pixel_values, grid = images.normalize_and_pack(resized)
    clock.lap("patchify/normalise")
    image = PreparedImage(rgb.shape[1], rgb.shape[0], rgb, pixel_values, grid)
    if hasattr(images, "device_pixel_values"):
        image = PreparedImage(rgb.shape[1], rgb.shape[0], rgb, pixel_values, grid, resized)
    questions = request.questions
    prompts = [processing.render_prompt(q) for q in questions]
    if hasattr(processing, "encode_questions"):
        ids = processing.encode_questions(questions, tokenizer, image.image_tokens)
    else:  # the runtime before the template's ids were kept
        ids = processing.encode_prompts(prompts, tokenizer, image.image_tokens)
    clock.lap("tokenisation")
    processing.check_sequence_lengths(questions, ids)
    prefix, opens, closes = processing.prefix_and_marks(ids)
    processed = processing.processed_tokens(prefix, opens, closes)
    processing.check_request_totals(processed, processing.read_tokens(questions, opens, closes))
    rows = [
        processing.question_rows(i, prefix, o, c)
        for i, o, c in zip(ids, opens, closes, strict=True)
    ]
    clock.lap("layout")
    positions = [processing.sequence_positions(question_ids, image) for question_ids in ids]
    clock.lap("positions")
    layouts = tuple(
        QuestionLayout(q, p, tuple(i), tuple(o), tuple(c), tuple(r), pos)
        for q, p, i, o, c, r, pos in zip(
            questions, prompts, ids, opens, closes, rows, positions, strict=True
        )
    )
    prepared = Prepared(image, layouts, prefix, processed)
    work = plan(prepared)
    for rows in [work.prefix, *(q.rows for q in work.questions), *(o.rows for o in work.options)]:
        rows.arrays()
    clock.lap("plan + pass arrays")
    upload(prepared, work, device)
    clock.lap("upload")
    if getattr(prepared.image, "resized", None) is not None:
        upload_resized(prepared, device)
        clock.lap(DEVICE_UPLOAD)
    readouts = synthetic_readouts(prepared, heads.hidden)
    clock.last = TIMERS["stage"]()  # the readouts stand in for the engines: not host work
    pairs = list(zip(questions, readouts, strict=True))
    if hasattr(heads_module, "questions_mu"):  # the heads layer by layer over the questions
        mus = heads_module.questions_mu(heads, [(q.type, r) for q, r in pairs])
    else:
        mus = [question_mu(heads, q.type, r) for q, r in pairs]
    clock.lap("heads")
    answers = {
        q.id: finish_answer(q.type, q.keys, mu, calibration, 0.01, 0.01)
        for q, mu in zip(questions, mus, strict=True)
    }
    clock.lap("finishing")
    response = {"model": "m", "answers": answers, "usage": {"input_tokens": processed}}
    json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    clock.lap("response JSON")


def total_once(
    body: bytes,
    tokenizer,
    heads,
    calibration,
    device,
    pack: bool = True,
    early: list[float] | None = None,
    behind: bool = False,
) -> float:
    """The same path end to end with the runtime's own entry points (prepare, plan, respond);
    `pack` False resizes and makes the patches on the device from the uploaded uint8 image;
    `early` (a list) plans as the torch backend does and makes the early heads before the
    clock resumes, their seconds appended to it (HOST_TOTAL_EARLY); `behind` then hands the
    other questions their MLP outputs with the readouts (HOST_TOTAL_BEHIND)."""
    from runtime import finish
    from runtime.contract import compile_request
    from runtime.finish import answer_question
    from runtime.passes import plan
    from runtime.processing import prepare
    from runtime.strict_json import parse_body

    # the plan made while the image decodes, as Executor.prepare makes it, where prepare can
    # (asked before the clock starts: not part of a request's time)
    accepted = inspect.signature(prepare).parameters
    planner = {"planner": plan if early is None else gpu_plan} if "planner" in accepted else {}
    unpacked = dict(planner)
    if device.type == "cuda" and "allocate" in accepted:  # a PNG decoded into pinned memory
        from runtime.executor import pinned_uint8

        unpacked["allocate"] = pinned_uint8
    started = TIMERS["total"]()
    request = compile_request(parse_body(body))
    if pack:
        prepared = prepare(request, tokenizer, **planner)
    else:
        prepared = prepare(request, tokenizer, pack=False, resize=False, **unpacked)
    work = prepared.planned if prepared.planned is not None else plan(prepared)
    upload(prepared, work, device, image_graph=behind)
    between = TIMERS["total"]()
    readouts = synthetic_readouts(prepared, heads.hidden)
    if early is not None:
        early.append(early_heads(prepared, work, heads, readouts, calibration))
    if behind:
        made_behind(heads, prepared, readouts)
    resumed = TIMERS["total"]()
    questions = prepared.questions
    if hasattr(finish, "answer_questions"):  # as Executor.respond can call it
        made = finish.answer_questions(heads, calibration, questions, readouts, 0.01, 0.01)
    else:
        pairs = zip(questions, readouts, strict=True)
        made = [answer_question(heads, calibration, q, r, 0.01, 0.01) for q, r in pairs]
    answers = {q.id: answer for q, answer in zip(questions, made, strict=True)}
    response = {"model": "m", "answers": answers, "usage": {"input_tokens": 0}}
    json.dumps(response, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    return TIMERS["total"]() - resumed + between - started


def gpu_plan(prepared):
    """The plan of the torch backend on a GPU (Executor.plan_of there): fitted passes, the
    questions in joint passes of up to its measured token slots."""
    from runtime.backends.compiled import JOINT_TOKENS
    from runtime.passes import QUESTION_ROWS, plan

    return plan(prepared, QUESTION_ROWS, fit=True, joint=True, joint_tokens=JOINT_TOKENS)


def early_heads(prepared, work, heads, readouts: list, calibration) -> float:
    """Executor.early_answers on the synthetic readouts: each joint pass's finished questions
    through the heads and the finishing as a group (`runtime.finish.finish_early`), what they
    made kept in the readouts; the seconds it took."""
    from runtime.finish import finish_early
    from runtime.passes import early_heads_fit, finished_by_joint

    started = TIMERS["total"]()
    if early_heads_fit(work):
        for ready in filter(None, finished_by_joint(work)):
            questions = [prepared.questions[qi] for qi in ready]
            finish_early(heads, calibration, questions, [readouts[qi] for qi in ready])
    return TIMERS["total"]() - started


def made_behind(heads, prepared, readouts: list) -> None:
    """The MLP outputs the executor's passes hand the questions not answered early
    (`Executor.mlps_behind`), made here by the heads' device MLPs into `readouts`."""
    late = [(q.type, r) for q, r in zip(prepared.questions, readouts, strict=True) if r.mu is None]
    wanted = [heads.first_inputs(kind, r, True) for kind, r in late]
    made: list[dict] = [{} for _ in late]
    heads.device_mlps.run(wanted, made)
    for (_, r), outputs in zip(late, made, strict=True):
        r.mlps = outputs


def can_hand_mlps(heads) -> bool:
    """Whether this runtime takes MLP outputs with the readouts (`QuestionReadout.mlps`) and
    the heads' MLPs are on a device."""
    from runtime.types import QuestionReadout

    has = "mlps" in QuestionReadout.__dataclass_fields__
    return has and getattr(heads, "device_mlps", None) is not None


def has_early_heads() -> bool:
    """Whether this runtime makes early heads and answers (`runtime.finish.finish_early`)."""
    from runtime import finish

    return hasattr(finish, "finish_early")


def can_unpack() -> bool:
    """Whether this runtime's `prepare` can leave the resize and the patches to the device."""
    from runtime.processing import prepare

    return "resize" in inspect.signature(prepare).parameters


def profile(
    requests: dict[str, bytes],
    tokenizer=None,
    heads=None,
    calibration=None,
    runs: int = RUNS,
    device: str | None = None,
) -> dict[str, dict[str, float]]:
    """Median milliseconds per stage for each request, `host total` timed end to end, and
    every run's under EVERY_RUN."""
    from runtime.finish import Calibration
    from runtime.tokenizer import load_tokenizer

    tokenizer = tokenizer or load_tokenizer(None)
    heads = heads or synthetic_heads()
    calibration = calibration or Calibration.v11()
    dev = device_for(device)
    unpacks = can_unpack()
    host_image = dev.type == "cpu"  # the early path's image goes the executor's way
    results = {}
    for name, request in requests.items():
        times: dict[str, list[float]] = {}
        totals = []
        unpacked, with_early, early, with_behind = [], [], [], []
        for run in range(runs + 2):  # two warm-up runs
            if run < 2:
                profile_once(request, tokenizer, heads, calibration, dev, {})
                total_once(request, tokenizer, heads, calibration, dev)
                continue
            profile_once(request, tokenizer, heads, calibration, dev, times)
            totals.append(total_once(request, tokenizer, heads, calibration, dev))
            if unpacks:
                unpacked.append(total_once(request, tokenizer, heads, calibration, dev, False))
            if unpacks and has_early_heads():
                with_early.append(
                    total_once(request, tokenizer, heads, calibration, dev, host_image, early)
                )
            if unpacks and has_early_heads() and can_hand_mlps(heads):
                args = (request, tokenizer, heads, calibration, dev, host_image, [], True)
                with_behind.append(total_once(*args))
        row = {stage: 1e3 * statistics.median(times[stage]) for stage in STAGES}
        row["sum of stages"] = sum(row[stage] for stage in STAGES)
        row[HOST_TOTAL] = 1e3 * statistics.median(totals)
        if unpacked:
            row[HOST_TOTAL_DEVICE] = 1e3 * statistics.median(unpacked)
        if with_early:
            row[HOST_TOTAL_EARLY] = 1e3 * statistics.median(with_early)
            row[EARLY_HEADS] = 1e3 * statistics.median(early)
        if with_behind:
            row[HOST_TOTAL_BEHIND] = 1e3 * statistics.median(with_behind)
        if DEVICE_UPLOAD in times:
            row[DEVICE_UPLOAD] = 1e3 * statistics.median(times[DEVICE_UPLOAD])
        every = {**times, HOST_TOTAL: totals, HOST_TOTAL_DEVICE: unpacked}
        every.update({HOST_TOTAL_EARLY: with_early, EARLY_HEADS: early})
        every[HOST_TOTAL_BEHIND] = with_behind
        row[EVERY_RUN] = {k: [round(1e3 * t, 3) for t in v] for k, v in every.items() if v}
        results[name] = row
    return results


def table(results: dict[str, dict[str, float]]) -> str:
    """Stages down, requests across, median milliseconds."""
    names = list(results)
    lines = [
        "| stage (median ms) | " + " | ".join(names) + " |",
        "| --- |" + " ---: |" * len(names),
    ]
    totals = (HOST_TOTAL, HOST_TOTAL_DEVICE, DEVICE_UPLOAD, HOST_TOTAL_EARLY, EARLY_HEADS)
    totals += (HOST_TOTAL_BEHIND,)
    for stage in (*STAGES, "sum of stages", *totals):
        if any(stage not in results[n] for n in names):
            continue
        cells = " | ".join(f"{results[n][stage]:.2f}" for n in names)
        lines.append(f"| {stage} | {cells} |")
    return "\n".join(lines)


def machine() -> str:
    import os
    import platform

    import torch

    return (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, python {platform.python_version()}"
    )
