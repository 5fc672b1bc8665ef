"""The torch backend on the H200 in one call per measurement (issue 12): build the 4b export, then
time, check and profile through the library (runtime.executor, tools.bench, build_engines).

    python scripts/gpu_torch.py dev        # build; latency; invariance; profile;
                                           # option/question row-count sweep; caches into $OUT
    python scripts/gpu_torch.py final      # build; device resize; latency; invariance; vision
                                           # enqueue; heads on GPU and CPU; memory; profile;
                                           # the reference with fla-core; kernel crossover; parity
    python scripts/gpu_torch.py cold       # cold start with and without the engine caches,
                                           # and whether both starts answered alike
    python scripts/gpu_torch.py serve      # omnijev serve + 8-client load test (prefix cache
                                           # off; --prefix-cache keeps it); host profiles
    python scripts/gpu_torch.py waits --tiny   # where the host waits for the device
    python scripts/gpu_torch.py coldstart ENGINES   # (run by cold) one process start to ready
    python scripts/gpu_torch.py parity     # build when missing; float32 parity, then the BF16
                                           # engine and the BF16 reference against the same
                                           # float32 answers (--no-bf16 skips both)
    python scripts/gpu_torch.py parts [--emulate-casts]   # two-part joint passes: invariance,
                                           # then 1 and 12 questions' GPU stages
    python scripts/gpu_torch.py refanswers FILE     # (run by parity) the reference, without fla
    python scripts/gpu_torch.py hostprobe  # the heads' host time with real readouts (respond
                                           # in a loop against whole requests; cProfiles)
    python scripts/gpu_torch.py probe      # the option-row kernel's prefetch; the image graph
                                           # on the tiny checkpoint (a short call, no 4b)
    python scripts/gpu_torch.py attention  # the attention kernel's check alone (exit 1: failed)

`OMNIJEV_AOT_BLOCKS=1` in the environment (this process and those it starts) compiles the
language-model blocks ahead of time (runtime.backends.aot): `cold` then measures a start that
loads them without tracing. `--floors-in-graph` pads products to their row floors in the
traced graph again, not inside an op (runtime.model.layers.FLOORS_IN_OP False), for a
comparison, `--folded-attention` the folded products in place of the attention kernel
(runtime.backends.compiled.ATTENTION_KERNEL False), `--attention-chunk N` the kernel's
shared keys in chunks of N (runtime.model.attention_kernels.CHUNK_KEYS), `--joint-parts N` N
parts a joint pass (runtime.passes.JOINT_PARTS), `--recurrent-rows` option rows in the
recurrent kernel, not the block kernel (runtime.model.gdn_kernels.OPTION_BLOCKS),
`--block-tile T,V,W` the block kernel's tile (BLOCK_TOKENS, BLOCK_V, BLOCK_WARPS),
`--conv-copy` the conv kernel's input copied in, not read in place (CONV_IN_PLACE),
`--one-row-attention` one row a program over the shared keys (attention_kernels.SHARED_ROWS
0), `--wide-readout N` a one-question pass's readout pieces (WIDE_READOUT_PIECE), `--pdl` /
`--no-pdl` Inductor's programmatic dependent launch (runtime.backends.compiled.PDL);
`cold --only-without` runs the start without caches alone, `cold --only-with` the start with
the caches a previous call left (without them first where there are none);
`--host` adds `serve`'s host profiles to `final`; `--no-fixed` skips the fixed-row GPU stages,
`--no-separate` the GPU stages with question and option passes apart (joint passes off),
`--whole-profile` adds a cProfile of whole requests (12 questions, 255 options),
`--quick` the host waits, vision enqueue, heads and kernel-profile steps,
`--no-crossover` the crossover of fla's kernels and our rows kernel (`final` only, after the
engine's timings), `--no-kernels` the option-row tiles, `--no-recurrent` the GPU stages
with option rows in the recurrent kernel beside the block kernel, `--no-reference` the
reference's latency, `--no-parity` the float32 parity at the end of `final` (with the
reference it ran past a 390-second guard); SWEEP_UNTIL_S bounds the sweep; a carried
`.gpu-cache/` (the `caches.tar.xz.*` pieces a dev call returned) warms the compilers.

fla-core goes to its own folder, named by FLA_PATH and on PYTHONPATH, so that the float32
reference runs without it (see reference_answers):
    pip install --no-deps --target /tmp/fla .gpu-wheels/torch/fla_core-*.whl
    export FLA_PATH=/tmp/fla PYTHONPATH=/tmp/site:/tmp/fla:$PWD

Results go to $OUT (JSON and Markdown); large artifacts to /tmp/omnijev, which survives between
calls only while the machine stays warm. Every setting is an explicit RuntimeConfig.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORK = Path("/tmp/omnijev")
# `--tiny`: the tiny preset in float32 on the CPU, to try the script without a GPU
TINY = "--tiny" in sys.argv
PRESET = "tiny" if TINY else "4b"
DEVICE = "cpu" if TINY else "cuda"
OUT = Path(os.environ.get("OUT", "/tmp/omnijev-out"))
RUNS = 20  # the warm runs per workload
REFERENCE_RUNS = 10  # the reference with fla-core, per workload
TARGETS_MS = {"1 question": 25, "12 questions": 35, "32 options": 30, "255 options": 50}
# (rows, tokens) of the Gated DeltaNet passes the plan makes (runtime.passes.rows_for): question
# passes 16 × 16 and 8 × 32, option passes 64 × 8, 32 × 16, 16 × 24, prefixes 1 × 64k
STARTED = time.perf_counter()
# the dev call's sweep starts no new setting after this many seconds (10-minute calls)
SWEEP_UNTIL_S = float(os.environ.get("SWEEP_UNTIL_S", 480))
# compiler caches of this machine, kept under WORK; `caches` packs them into $OUT and a later
# call unpacks a carried pack (CACHE_PACK) before compiling
CACHE_DIRS = {"TORCHINDUCTOR_CACHE_DIR": WORK / "inductor", "TRITON_CACHE_DIR": WORK / "triton"}
CACHE_PACK = Path(".gpu-cache")
CACHE_PIECE = "15m"  # $OUT returns files of at most 16 MiB
# (value columns, warps) of the option-row kernel to time beside the fixed one
TILES = [(8, 1), (16, 1), (16, 2), (32, 2), (32, 4), (64, 4)]
# (token slots, value columns, warps) of the option rows' block kernel beside its fixed one
BLOCK_TILES = [(32, 64, 4), (16, 64, 4), (16, 64, 2), (32, 32, 4), (32, 128, 4)]
# rows of the products probed for row-count invariance: a pass's rows × tokens
PRODUCT_ROWS = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 640, 1024]
LOAD_CLIENTS = 8  # issue 13's closed-loop clients
# PyTorch threads of the host profiles after the load test (HOST_THREADS="" skips them)
HOST_THREADS = [int(n) for n in os.environ.get("HOST_THREADS", "4,8").split(",") if n]
READY_LIMIT_S = 400  # the server's start, load and warm-up on the bench workloads
# what a cold-start process logs (its stderr goes to $OUT): Dynamo's recompiles and their
# guards, each Triton autotuning with its seconds
COLD_LOGS = {"TORCH_LOGS": "recompiles", "TRITON_PRINT_AUTOTUNING": "1"}
COLD_LOG_CHARS = 4_000_000
CROSSOVER = [(1, 16), (2, 16), (16, 16), (1, 32), (8, 32), (1, 64), (1, 128), (1, 640)]
# (rows, tokens, source states) of the option-row kernel's timings: the option passes' shapes
OPTION_ROW_SHAPES = ((256, 8, 1), (32, 8, 11), (4, 24, 1), (64, 8, 16), (32, 16, 16), (16, 24, 16))
# (rows, tokens, shared keys, past keys) of the attention kernel's check: an image prefix pass,
# 1 and 12 questions' question parts, option parts of 8 and 24 tokens, 255 options' rows
ATTENTION_SHAPES = (
    (1, 640, 1, 1), (2, 16, 640, 1), (16, 16, 640, 1), (4, 8, 640, 16), (8, 24, 640, 16),
    (256, 8, 640, 16), (256, 6, 640, 16),
)  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One configuration measured: which engine, in which dtype, compiled or not."""

    name: str
    dtype: str = "float32" if TINY else "bfloat16"
    compile: bool = True
    graphs: bool = True


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save(name: str, value) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    text = value if isinstance(value, str) else json.dumps(value, indent=1, default=str)
    (OUT / name).write_text(text)


def environment() -> dict:
    import torch

    from runtime import passes
    from runtime.backends import compiled
    from runtime.model import attention_kernels, layers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    settings = {
        "floors_in_op": layers.FLOORS_IN_OP,
        "joint_parts": passes.JOINT_PARTS,
        "attention_kernel": compiled.ATTENTION_KERNEL,
        "attention_chunk": attention_kernels.CHUNK_KEYS,
        "pdl": compiled.PDL,
    }
    return {"gpu": gpu, "versions": compiled.versions(), **settings}


def apply_flags() -> None:
    """`--floors-in-graph`: the row floors' padding in the traced graph, not inside
    runtime.model.layers.floored_linear; `--folded-attention`: the folded products in place of
    the attention kernel; `--attention-chunk N`: its shared keys in chunks of N (0: none);
    `--joint-parts N`: N parts a joint pass; `--pdl` / `--no-pdl`: Inductor's programmatic
    dependent launch on or off (in this process and the cold-start processes it starts, which
    get the same flags); `--recurrent-rows`: option rows in the recurrent kernel;
    `--block-tile T,V,W`: the block kernel's token slots, value columns and warps;
    `--conv-copy`: the conv kernel's input copied in and a state written for option rows, as
    before CONV_IN_PLACE; `--one-row-attention`: one row a program over the shared keys in
    every pass (attention_kernels.SHARED_ROWS 0); `--wide-readout N`: readout pieces of N
    rows in passes of one question alone (compiled.WIDE_READOUT_PIECE)."""
    if "--floors-in-graph" in sys.argv:
        from runtime.model import layers

        layers.FLOORS_IN_OP = False
    if "--folded-attention" in sys.argv:
        from runtime.backends import compiled

        compiled.ATTENTION_KERNEL = False
    if "--attention-chunk" in sys.argv:
        from runtime.model import attention_kernels

        attention_kernels.CHUNK_KEYS = flag_number("--attention-chunk")
    if "--joint-parts" in sys.argv:
        from runtime import passes

        passes.JOINT_PARTS = flag_number("--joint-parts")
    if "--recurrent-rows" in sys.argv:
        from runtime.model import gdn_kernels

        gdn_kernels.OPTION_BLOCKS = False
    if "--block-tile" in sys.argv:
        from runtime.model import gdn_kernels

        tile = sys.argv[sys.argv.index("--block-tile") + 1].split(",")
        gdn_kernels.BLOCK_TOKENS, gdn_kernels.BLOCK_V, gdn_kernels.BLOCK_WARPS = map(int, tile)
    if "--one-row-attention" in sys.argv:
        from runtime.model import attention_kernels

        attention_kernels.SHARED_ROWS = 0
    if "--wide-readout" in sys.argv:
        from runtime.backends import compiled

        compiled.WIDE_READOUT_PIECE = flag_number("--wide-readout")
    if "--conv-copy" in sys.argv:
        from runtime.model import gdn_kernels

        gdn_kernels.CONV_IN_PLACE = False
    if "--pdl" in sys.argv or "--no-pdl" in sys.argv:
        from runtime.backends import compiled

        compiled.PDL = "--pdl" in sys.argv


def flag_number(flag: str) -> int:
    """The integer after `flag` on the command line."""
    return int(sys.argv[sys.argv.index(flag) + 1])


def build(preset: str = PRESET) -> dict:
    """The preset's synthetic export (the 4b unless `--tiny`), written on this machine (the
    release beside it is dropped)."""
    from build_engines.checkpoints import make_checkpoint, release_path

    export = WORK / f"{preset}-export"
    if export.exists():
        return {"checkpoint_s": 0.0}
    started = time.perf_counter()
    make_checkpoint(preset, 0, export)
    shutil.rmtree(release_path(export), ignore_errors=True)
    seconds = time.perf_counter() - started
    log(f"{preset} export in {seconds:.1f} s")
    return {"checkpoint_s": seconds}


def engine_dir(run: Run, preset: str = PRESET) -> Path:
    """An engine directory naming the dtype (the torch backend needs no ONNX files)."""
    from build_engines.engines import FORMAT, MANIFEST, checkpoint_record, write_manifest

    folder = WORK / f"engines-{preset}-{run.name}"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / MANIFEST).exists():  # what a torch-only `omnijev engines` records
        record = {
            "format": FORMAT,
            "dtype": run.dtype,
            "checkpoint": checkpoint_record(WORK / f"{preset}-export"),
        }
        write_manifest(folder, record)
    return folder


def executor_for(run: Run, engines: Path | None = None, preset: str = PRESET):
    from runtime.backends import compiled
    from runtime.config import RuntimeConfig
    from runtime.executor import Executor
    from runtime.passes import QUESTION_ROWS

    config = RuntimeConfig(
        backend="torch", prefix_cache=0, question_batch=QUESTION_ROWS, cuda_graphs=run.graphs
    )
    engines = engines or engine_dir(run, preset)
    executor = Executor(WORK / f"{preset}-export", engines, config)
    if not run.compile:  # the same modules, eager between the graph captures
        backend = executor.backend
        backend.compiled = False
        backend.functions = compiled.TorchBackend.make_functions(backend)
    return executor


# -- measurements ----------------------------------------------------------------------------


def graph_ms(call, replays: int = 50) -> float:
    """Milliseconds a call takes as a replayed CUDA graph (as the backend runs it: the launch
    overhead of fla's Python wrappers stays out)."""
    import torch

    call()  # autotuning and compilation stay out of the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def crossover() -> dict:
    """fla's fused recurrent and chunked kernels against our rows kernel keeping the final state
    (runtime.model.gdn_kernels.rows_gated_delta's two sides) on the 4b Gated DeltaNet shapes
    (BF16, every token valid, CUDA-graph replays, ms), with the largest differences of our
    outputs and final states to the chunked kernel's; the longest pass ours is the fastest for
    (ROWS_MAX_TOKENS is set by hand from it)."""
    import torch
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    from runtime.model import gdn_kernels

    rows = []
    for b, t in CROSSOVER:
        args = option_rows_inputs(b, t, 1, padded=False)
        q, k, v, g, beta, states, src, lengths, scale = args
        initial = states[src].contiguous()
        row = {"rows": b, "tokens": t}
        results = {}
        for name, kernel in (
            ("recurrent", fused_recurrent_gated_delta_rule),
            ("chunk", chunk_gated_delta_rule),
        ):
            options = dict(g=g, beta=beta, scale=scale, initial_state=initial)
            call = partial(
                kernel, q, k, v, **options, output_final_state=True, use_qk_l2norm_in_kernel=True
            )
            results[name] = call()
            row[f"{name}_ms"] = graph_ms(call)
        ours = partial(gdn_kernels.option_rows, *args, state=True)
        out, final = ours()
        row["ours_ms"] = graph_ms(ours)
        row["ours_out_difference"] = (out.float() - results["chunk"][0].float()).abs().max().item()
        row["ours_state_difference"] = (final - results["chunk"][1].float()).abs().max().item()
        again = ours()
        row["ours_repeatable"] = torch.equal(out, again[0]) and torch.equal(final, again[1])
        rows.append(row)
        log(f"crossover {row}")
    longest = 0
    for t in sorted({r["tokens"] for r in rows}):
        same = [r for r in rows if r["tokens"] == t]
        if all(r["ours_ms"] <= min(r["chunk_ms"], r["recurrent_ms"]) for r in same):
            longest = t
        else:
            break
    return {"rows": rows, "ours_fastest_up_to_tokens": longest}


def fla_recurrent_output(q, k, v, g, beta, state, scale):
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    out, _ = fused_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, scale=scale, initial_state=state,
        output_final_state=False, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return out


def option_rows_inputs(b: int, t: int, sources: int, padded: bool) -> tuple:
    """`option_rows`' arguments on the 4b's Gated DeltaNet shapes (16 key heads, 32 value heads,
    128 × 128 states), `b` rows of `t` tokens from `sources` states, sorted as plans give them;
    `padded`: random lengths (the first row full), padding with g = β = 0 as option passes have,
    else every token valid."""
    import torch

    heads, value_heads, dim = 16, 32, 128
    generator = torch.Generator(device="cuda").manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    q, k = random(b, t, heads, dim).bfloat16(), random(b, t, heads, dim).bfloat16()
    v = random(b, t, value_heads, dim).bfloat16()
    lengths = torch.full((b,), t, device="cuda")
    if padded:
        lengths = torch.randint(1, t + 1, (b,), device="cuda", generator=generator)
        lengths[0] = t
    valid = (torch.arange(t, device="cuda")[None, :] < lengths[:, None])[..., None]
    g = torch.where(valid, -torch.rand(b, t, value_heads, device="cuda"), 0.0)
    beta = torch.where(valid, torch.rand(b, t, value_heads, device="cuda"), 0.0)
    states = random(sources, value_heads, dim, dim) * 0.05
    src = torch.randint(0, sources, (b,), device="cuda", generator=generator).sort().values
    return q, k, v, g, beta, states, src, lengths, dim**-0.5


def option_rows_kernel() -> list[dict]:
    """Our option-row kernel (runtime.model.gdn_kernels: each row reads its source's state in
    place, no final state) at each tile of TILES against fla's fused recurrent kernel on per-row
    gathered states, as the option passes ran before: CUDA-graph replays, the largest output
    difference, and whether a tile gives the fixed tile's bytes."""
    import torch

    from runtime.model import gdn_kernels

    rows = []
    for b, t, sources in OPTION_ROW_SHAPES:
        args = option_rows_inputs(b, t, sources, padded=False)  # every token valid, as fla walks
        q, k, v, g, beta, states, src, _, scale = args

        ours = partial(gdn_kernels.option_rows_gated_delta, *args)
        fla_gathered = partial(
            fla_recurrent_output, q, k, v, g, beta, states[src].contiguous(), scale
        )
        fixed = ours()
        row = {
            "rows": b,
            "tokens": t,
            "sources": sources,
            "ours_ms": graph_ms(ours),
            "fla_gathered_ms": graph_ms(fla_gathered),
            "max_difference": (fixed.float() - fla_gathered().float()).abs().max().item(),
            "repeatable": torch.equal(fixed, ours()),
            "tiles": {},
        }
        for block_v, warps in TILES:
            tile = partial(gdn_kernels.option_rows, *args, block_v=block_v, warps=warps)
            out = tile()
            row["tiles"][f"{block_v}x{warps}"] = {
                "ms": round(graph_ms(tile), 4),
                "same_bytes": torch.equal(out, fixed),
                "max_difference": (out.float() - fixed.float()).abs().max().item(),
            }
        row["blocks"] = block_kernel_tiles(args, fla_gathered(), b, t, sources)
        rows.append(row)
        log(f"option rows {row}")
    return rows


def block_kernel_tiles(args: tuple, expected, b: int, t: int, sources: int) -> dict:
    """The block kernel (gdn_kernels.option_blocks) at each of BLOCK_TILES on `args`: its
    CUDA-graph replays, its largest difference to fla's recurrent kernel (`expected`), and on
    padded rows whether each row keeps its bytes with the rows reversed and alone."""
    import torch

    from runtime.model import gdn_kernels

    if t > gdn_kernels.BLOCK_MAX_TOKENS:
        return {}
    found = {}
    padded = option_rows_inputs(b, t, sources, padded=True)
    reverse = torch.arange(b - 1, -1, -1, device="cuda")
    for tokens, block_v, warps in BLOCK_TILES:
        tile = partial(gdn_kernels.option_blocks, block_tokens=tokens, block_v=block_v, warps=warps)
        name = f"{tokens}x{block_v}x{warps}"
        try:
            out = tile(*args)
            found[name] = {
                "ms": round(graph_ms(partial(tile, *args)), 4),
                "max_difference": (out.float() - expected.float()).abs().max().item(),
                "same_bytes_reversed_alone": same_rows(tile, padded, reverse),
            }
        except Exception as error:  # a tile this Triton or GPU refuses (shared memory, say)
            found[name] = {"error": repr(error)[:300]}
    return found


def same_rows(kernel, args: tuple, reverse) -> bool:
    """Whether each row of the kernel's output keeps its bytes with the rows reversed, and
    the first and last rows alone."""
    import torch

    q, k, v, g, beta, states, src, lengths, scale = args
    b = q.shape[0]

    def rows(index):
        return kernel(
            q[index], k[index], v[index], g[index], beta[index], states, src[index],
            lengths[index], scale,
        )  # fmt: skip

    whole = rows(slice(None))
    same = torch.equal(rows(reverse), whole[reverse])
    for n in (0, b - 1):
        same = same and torch.equal(rows(slice(n, n + 1)), whole[n : n + 1])
    return same


def attention_inputs(b: int, t: int, p: int, past: int) -> tuple:
    """`rows_attention`'s arguments on the 4b's attention shapes (16 query heads, 4 KV heads of
    256), BF16: q and own k, v as `mix` gives them (transposed views), the past one source's
    broadcast view, every shared and past key visible (none in the image prefix's shape), the
    own ones causal over random lengths (the first row full)."""
    import torch

    heads, kv_heads, hd = 16, 4, 256
    generator = torch.Generator(device="cuda").manual_seed(0)

    def random(*shape):
        return torch.randn(*shape, device="cuda", generator=generator).bfloat16()

    q = random(b, t, heads, hd).transpose(1, 2)
    k, v = random(b, t, kv_heads, hd).transpose(1, 2), random(b, t, kv_heads, hd).transpose(1, 2)
    shared_k, shared_v = random(1, kv_heads, p, hd), random(1, kv_heads, p, hd)
    past_k = random(1, kv_heads, past, hd).expand(b, -1, -1, -1)
    past_v = random(1, kv_heads, past, hd).expand(b, -1, -1, -1)
    lengths = torch.randint(1, t + 1, (b,), device="cuda", generator=generator)
    lengths[0] = t
    steps = torch.arange(t, device="cuda")
    valid = steps[None] < lengths[:, None]
    own = (steps[None, :, None] >= steps[None, None, :]) & valid[:, None, :]
    # the image prefix's pass (one shared and one past key) has the empty state's, masked
    seen = torch.full((b, t, p + past), (p, past) != (1, 1), dtype=torch.bool, device="cuda")
    mask = torch.cat([seen, own], dim=-1)
    return q, shared_k, shared_v, past_k, past_v, k, v, mask, hd**-0.5


ATTENTION_CHUNKS = (64, 128, 256)  # shared keys a program, timed beside one program for all


def some_rows(args: tuple, index, chunk: int | None = None):
    """The attention kernel on some of `attention_inputs`' rows (`index` of each per-row
    input; the shared keys as they are)."""
    from runtime.model import attention_kernels

    b = args[0].shape[0]
    picked = (x[index] if x.shape[0] == b else x for x in args[:8])
    return attention_kernels.attend_rows(*picked, args[8], chunk=chunk)


def attention_kernel_check() -> list[dict]:
    """The attention kernel (runtime.model.attention_kernels) against the folded products the
    engine ran before (fixed rows, FIT_TOKENS) on the 4b shapes, BF16: CUDA-graph replays of
    each, each one's largest difference to the attention in float32 on the same inputs over
    the valid tokens, and whether a row gets the same bytes alone (beside copies of itself, in
    a pass of the same rows: the kernels follow the row count), reversed and repeated; where
    a pass reads the shared keys for several rows a program (attention_kernels.SHARED_ROWS),
    the one-row programs' time beside."""
    import torch

    from runtime.model import attention_kernels
    from runtime.model.language import folded_attention, grouped_attention
    from runtime.passes import FIT_TOKENS

    rows = []
    for b, t, p, past in ATTENTION_SHAPES:
        args = attention_inputs(b, t, p, past)
        mask = args[7]
        ours = partial(attention_kernels.rows_attention, *args)
        folded = partial(folded_attention, *args, min_tokens=FIT_TOKENS)
        exact = grouped_attention(*(x.float() for x in args[:7]), mask, args[8])
        valid = mask[:, :, -t:].diagonal(dim1=1, dim2=2)  # a valid token sees itself
        got, before = ours(), folded()
        reverse = torch.arange(b - 1, -1, -1, device="cuda")
        # the rows of a pass get its chunking (chosen by its row count), alone too
        chunk = attention_kernels.pass_chunk(b)
        copies = torch.zeros(b, dtype=torch.long, device="cuda")
        flipped, alone = some_rows(args, reverse, chunk), some_rows(args, copies, chunk)[:1]
        row = {
            "rows": b, "tokens": t, "shared": p, "past": past,
            "kernel_ms": graph_ms(ours), "folded_ms": graph_ms(folded),
            "kernel_difference": (got.float() - exact)[valid].abs().max().item(),
            "folded_difference": (before.float() - exact)[valid].abs().max().item(),
            "same_bytes_alone": torch.equal(alone, got[:1]),
            "same_bytes_reversed": torch.equal(flipped, got[reverse]),
            "repeatable": torch.equal(got, ours()),
        }  # fmt: skip
        tile = attention_kernels.query_tile(16 // 4, t)
        if attention_kernels.shared_rows(b, -(-4 * t // tile), tile, chunk):
            kept, attention_kernels.SHARED_ROWS = attention_kernels.SHARED_ROWS, 0
            try:
                one_row = ours()
                row["one_row_ms"] = graph_ms(ours)
                row["one_row_difference"] = (one_row.float() - exact)[valid].abs().max().item()
            finally:
                attention_kernels.SHARED_ROWS = kept
        for chunk in ATTENTION_CHUNKS:  # the shared keys in chunks, a second kernel merging
            chunked = partial(attention_kernels.attend_rows, *args, chunk=chunk)
            pieces = chunked()
            row[f"chunk{chunk}_ms"] = graph_ms(chunked)
            row[f"chunk{chunk}_difference"] = (pieces.float() - exact)[valid].abs().max().item()
            row[f"chunk{chunk}_same_bytes_alone"] = torch.equal(
                some_rows(args, slice(0, 1), chunk), pieces[:1]
            )
        rows.append(row)
        log(f"attention kernel {row}")
    return rows


def attention_session() -> bool:
    """The attention kernel's check alone (a short call, no export): whether every shape gave
    a row its bytes alone, reversed and repeated, and stayed within 0.05 of float32 (BF16's
    own rounding of the result is 0.004 at most for values below 1)."""
    report = {"environment": environment()}
    rows = attempt(report, "attention_kernel", attention_kernel_check)
    save("attention.json", report)
    print(json.dumps(report, default=str, indent=1))
    keys = ("same_bytes_alone", "same_bytes_reversed", "repeatable")
    return isinstance(rows, list) and all(
        all(r[k] for k in keys) and r["kernel_difference"] < 0.05 for r in rows
    )


def prefetch_probe() -> list[dict]:
    """The option-row kernel with its loads a token ahead against the kernel without (4b shapes,
    rows with padding as option passes have): the same bytes, CUDA-graph replays of each, and
    the largest difference to fla's fused recurrent kernel on gathered states (valid tokens)."""
    import torch

    from runtime.model import gdn_kernels

    rows = []
    for b, t, sources in OPTION_ROW_SHAPES:
        args = option_rows_inputs(b, t, sources, padded=True)
        q, k, v, g, beta, states, src, lengths, scale = args
        valid = torch.arange(t, device="cuda")[None, :] < lengths[:, None]
        ahead = partial(gdn_kernels.option_rows, *args, prefetch=True)
        plain = partial(gdn_kernels.option_rows, *args, prefetch=False)
        out = ahead()
        fla = fla_recurrent_output(q, k, v, g, beta, states[src].contiguous(), scale)
        row = {
            "rows": b,
            "tokens": t,
            "sources": sources,
            "valid_tokens": int(lengths.sum()),
            "same_bytes": torch.equal(out, plain()),
            "repeatable": torch.equal(out, ahead()),
            "padding_zero": bool((out[~valid] == 0).all()),
            "prefetch_ms": round(graph_ms(ahead), 4),
            "plain_ms": round(graph_ms(plain), 4),
            "max_difference_fla": (out.float() - fla.float())[valid].abs().max().item(),
        }
        rows.append(row)
        log(f"prefetch {row}")
    return rows


def image_graph_probe() -> dict:
    """The image graph (resize and patches inside the vision tower's CUDA graph) on the tiny
    checkpoint in BF16 on CUDA, eager modules: its features against the vision graph's on the
    host's pixels (eager launch, capture, replay), a request's readouts by either path, and the
    time of `Executor.vision` by either path on one image (the host's launches included)."""
    import numpy as np
    import torch

    from reference.questions import pattern_png, request_body, speed_bench_questions
    from runtime.contract import compile_request
    from runtime.processing import prepare

    build("tiny")
    executor = executor_for(Run("probe", dtype="bfloat16", compile=False), preset="tiny")
    backend = executor.backend
    body = json.loads(request_body(pattern_png(1600, 900), speed_bench_questions(12)))
    whole = executor.prepare(body)
    host = prepare(compile_request(body), executor.tokenizer)
    found = {"backend": backend.name, "graph": executor.vision_graph(whole.image)}
    with torch.inference_mode():
        image = [executor.vision(whole.image) for _ in range(3)]  # eager, capture, replay
        pixels = [executor.vision(host.image) for _ in range(3)]
        found["image_repeatable"] = all(torch.equal(f, image[0]) for f in image)
        found["same_as_vision"] = all(torch.equal(f, pixels[0]) for f in image + pixels)
        a, b = executor.readouts(whole), executor.readouts(host)
        pairs = zip(a, b, strict=True)
        found["readouts_same"] = all(
            np.array_equal(x.zq, y.zq) and np.array_equal(x.u, y.u) for x, y in pairs
        )

        def timed(graph: str) -> dict:
            executor.vision_graph = lambda image: graph
            executor.vision(whole.image)
            torch.cuda.synchronize()
            times = []
            for _ in range(20):
                started = time.perf_counter()
                executor.vision(whole.image)
                torch.cuda.synchronize()
                times.append(round((time.perf_counter() - started) * 1e3, 3))
            return {"median_ms": round(statistics.median(times), 3), "runs_ms": times}

        found["vision_ms"] = {"image graph": timed("image"), "op by op": timed("vision")}
    found["stats"] = backend.stats()
    log(f"image graph {found}")
    return found


def respond_split(executor, workloads: dict, runs: int = 50) -> dict:
    """Executor.respond of real readouts, split: the heads (`questions_mu`) and the finishing
    (`answer_fields`, latency fields), median ms, at each of HOST_THREADS and one PyTorch
    thread; then the request's whole time at those threads."""
    import resource

    import torch

    from runtime import finish
    from tools import bench

    kept = torch.get_num_threads()
    result = {}
    try:
        for threads in sorted({1, *HOST_THREADS}):
            torch.set_num_threads(threads)
            for name in ("1 question", "12 questions", "255 options"):
                body, prepared = workloads[name]
                readouts = executor.readouts(prepared)
                items = [(q.type, r) for q, r in zip(prepared.questions, readouts, strict=True)]
                row = {
                    "respond_ms": bench.median_ms(
                        partial(executor.respond, prepared, readouts, 0.0), runs
                    ),
                    "questions_mu_ms": bench.median_ms(
                        partial(finish.questions_mu, executor.heads, items), runs
                    ),
                    "with_mlps": sum(r.mlps is not None for r in readouts),
                }
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                times = bench.time_runs(executor.answer, body, 20, executor.stages)
                row["request_ms"] = 1e3 * statistics.median(times)
                row["heads_stage_ms"] = 1e3 * executor.stages["heads"]
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                row["page_faults_per_request"] = faults / 20
                heads_faults = []
                for _ in range(10):
                    readouts = executor.readouts(prepared)
                    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    executor.respond(prepared, readouts, 0.0)
                    after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    heads_faults.append(after - before)
                row["page_faults_in_respond"] = statistics.median(heads_faults)
                result[f"{name}, {threads} threads"] = row
                log(f"respond split {name}, {threads} threads: {row}")
    finally:
        torch.set_num_threads(kept)
    return result


def host_probe_session() -> None:
    """One short call on a warm machine: where the heads' host time goes with real readouts
    (`respond_split`, the heads' cProfile) and the whole requests' cProfile."""
    from server.app import worker_process

    worker_process()
    use_cache_dirs()
    report = {"environment": environment(), "started": time.strftime("%H:%M:%S")}
    attempt(report, "build", build)
    executor = attempt(report, "load", executor_for, Run("bf16"))
    if isinstance(executor, dict):
        save("host-probe.json", report)
        return
    workloads = prepared_workloads(executor)
    attempt(report, "respond_split", respond_split, executor, workloads)
    attempt(report, "heads_profile", heads_profile, executor, workloads)
    attempt(report, "whole_profile", whole_profile, executor, workloads)
    save("host-probe.json", report)


def probe_session() -> None:
    """One short call: `prefetch_probe` and `image_graph_probe`."""
    report = {"environment": environment(), "started": time.strftime("%H:%M:%S")}
    attempt(report, "prefetch", prefetch_probe)
    save("probe.json", report)
    attempt(report, "image_graph", image_graph_probe)
    save("probe.json", report)
    print(json.dumps(report, indent=1, default=str)[:8000])


def product_rows(executor) -> dict:
    """Is a row of each of the pass's products the same bytes whatever the number of rows M?
    (cuBLAS picks its kernel by shape; a split of the inner sum would change a row's bytes.)
    For the weights of one layer of each kind as the backend runs them (fused), BF16 inputs:
    the M of PRODUCT_ROWS whose rows differ from the same rows in a product of 1,024."""
    import torch
    import torch.nn.functional as F

    layers = executor.backend.language.layers
    attn = next(x.self_attn for x in layers if x.kind == "full_attention")
    delta = next(x.linear_attn for x in layers if x.kind != "full_attention")
    weights = {
        "delta.in_proj": delta.in_proj,
        "delta.out_proj": delta.out_proj.weight,
        "attn.qkv": attn.qkv,
        "attn.o_proj": attn.o_proj.weight,
        "mlp.gate_up": layers[0].mlp.gate_up,
        "mlp.down_proj": layers[0].mlp.down_proj.weight,
    }
    result = {}
    for name, weight in weights.items():
        x = torch.randn(max(PRODUCT_ROWS), weight.shape[1], device="cuda", dtype=weight.dtype)
        full = F.linear(x, weight)
        differ = {}
        for m in PRODUCT_ROWS:
            part = F.linear(x[:m], weight)
            if not torch.equal(part, full[:m]):
                differ[m] = (part.float() - full[:m].float()).abs().max().item()
        result[name] = {"shape": list(weight.shape), "differs_at": differ}
        log(f"product rows {name} {result[name]}")
    return result


def traces(executor, workloads: dict, names=("1 question", "12 questions", "255 options")) -> dict:
    """A Chrome trace of one warm GPU-stage run of each workload, the stage clock waiting for
    the device at each lap, into $OUT (gzip); the laps' stage names in order, so that the
    kernels between two synchronisations can be given to their stage."""
    import gzip

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from runtime import executor as executor_module

    laps: list[str] = []
    plain = executor_module.Stopwatch.lap

    def lap(self, stage: str) -> None:
        laps.append(stage)
        plain(self, stage)

    result = {}
    executor.stage_sync = sync
    executor_module.Stopwatch.lap = lap
    try:
        for name in names:
            _, prepared = workloads[name]
            executor.readouts(prepared)
            laps.clear()
            path = WORK / "trace.json"
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                executor.readouts(prepared)
            prof.export_chrome_trace(str(path))
            slug = name.replace(" ", "-")
            with open(path, "rb") as raw, gzip.open(OUT / f"trace-{slug}.json.gz", "wb") as packed:
                shutil.copyfileobj(raw, packed)
            result[name] = list(laps)
    finally:
        executor_module.Stopwatch.lap = plain
        executor.stage_sync = None
    return result


def prepared_workloads(executor) -> dict:
    from tools import bench

    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    return {
        name: (body := bench.body(image, "image/png", qs), executor.prepare(json.loads(body)))
        for name, qs in bench.workloads().items()
    }


def gpu_stages(executor, workloads: dict, runs: int = RUNS) -> list[dict]:
    """Prepared inputs to readouts on the host: vision, prefix, questions, options, readouts
    (no heads: early heads off)."""
    with settings(executor, early_heads=False):
        return stage_times(executor, workloads, runs)


def stage_times(executor, workloads: dict, runs: int) -> list[dict]:
    from tools.bench import quantile

    rows = []
    for name, (_, prepared) in workloads.items():
        for _ in range(3):  # compile, capture, then one replay
            executor.readouts(prepared)
        times, stages = [], {}
        for _ in range(runs):
            sync()
            started = time.perf_counter()
            executor.readouts(prepared)
            times.append(time.perf_counter() - started)
            for stage, seconds in executor.stages.items():
                stages.setdefault(stage, []).append(seconds)
        row = {
            "workload": name,
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * quantile(times, 0.9),
            "runs_ms": [round(1e3 * t, 3) for t in times],  # every run, in order
            "enqueue_ms": {k: round(1e3 * statistics.median(v), 2) for k, v in stages.items()},
            "stages_ms": synced_stages(executor, prepared),
        }
        if name in TARGETS_MS:
            row["target_ms"] = TARGETS_MS[name]
        rows.append(row)
        log(f"gpu stages {row}")
    return rows


@contextmanager
def settings(executor, **changes):
    """The executor under other RuntimeConfig settings, its own again afterwards."""
    kept = executor.config
    executor.config = kept.with_(**changes)
    try:
        yield executor
    finally:
        executor.config = kept


def recurrent_rows(executor, workloads: dict) -> dict:
    """The GPU stages with option rows in the recurrent kernel (gdn_kernels.OPTION_BLOCKS
    off: every graph captured again), beside the block kernel's default; and how far each
    workload's answers move between the two."""
    from runtime.model import gdn_kernels

    if not gdn_kernels.OPTION_BLOCKS:
        return {}
    blocks = {n: executor.answer(b) for n, (b, _) in workloads.items()}
    gdn_kernels.OPTION_BLOCKS = False
    try:
        drop_graphs(executor.backend)
        stages = gpu_stages(executor, workloads)
        moved = {
            name: answers_moved(executor.answer(body), blocks[name])
            for name, (body, _) in workloads.items()
        }
        return {"gpu_stages": stages, "answers": moved}
    finally:
        gdn_kernels.OPTION_BLOCKS = True
        drop_graphs(executor.backend)


def answers_moved(answer: dict, baseline: dict) -> dict:
    """How far one response's answers are from another's: the largest difference and the
    decisions that flipped (tools.bench.compare)."""
    from tools import bench

    compared = bench.compare(answer, baseline)
    return {"max_difference": max(compared["differences"]), "flips": compared["flips"]}


def drop_graphs(backend) -> None:
    """Every captured CUDA graph of the torch backend dropped (GraphSlots.drop_graphs): each
    pass is captured again, with whatever the kernels' settings are now."""
    for slots in (*backend.slots.values(), *getattr(backend, "lane_slots", ())):
        slots.drop_graphs()


def one_lane(executor, workloads: dict) -> list[dict]:
    """The GPU stages of the workloads with two or more joint passes with every joint pass in
    lane 0 (one stream, as before lanes), beside the default (TorchBackend.lanes)."""
    if getattr(executor.backend, "lanes", 1) < 2:
        return []
    several = {n: w for n, w in workloads.items() if len(w[1].planned[1].joint) > 1}
    with lanes(executor.backend, 1):
        return gpu_stages(executor, several)


@contextmanager
def lanes(backend, count: int):
    """The backend with `count` lanes (Executor.lane_of: 1 puts every joint pass in lane 0),
    its own again afterwards."""
    kept = backend.lanes
    backend.lanes = count
    try:
        yield backend
    finally:
        backend.lanes = kept


def fixed_rows(executor, workloads: dict) -> list[dict]:
    """The GPU stages with passes of fixed rows (fit_rows off), beside the fitted default."""
    with settings(executor, fit_rows=False):
        return gpu_stages(executor, workloads)


def separate_passes(executor, workloads: dict) -> dict:
    """The GPU stages with question and option passes apart (joint passes off), beside the
    joint default; and how far each workload's answers move between the two (the same
    arithmetic a row at a time: equal bytes where the kernels keep them)."""
    from tools import bench

    joint = {n: executor.answer(b) for n, (b, _) in workloads.items()}
    with settings(executor, joint_passes=False):
        stages = gpu_stages(executor, workloads)
        moved = {}
        for name, (body, _) in workloads.items():
            apart = executor.answer(body)
            moved[name] = {
                **answers_moved(apart, joint[name]),
                "same_bytes": json.dumps(bench.without_latency(apart))
                == json.dumps(bench.without_latency(joint[name])),
            }
            log(f"joint against separate, {name}: {moved[name]}")
        return {"gpu_stages": stages, "answers": moved}


def synced_stages(executor, prepared, runs: int = 5) -> dict[str, float]:
    """Device time per stage: the stage clock waits for the device at each lap (a few tenths
    of a millisecond more in all than the unsynchronised runs)."""
    stages: dict[str, list[float]] = {}
    executor.stage_sync = sync
    try:
        for _ in range(runs):
            sync()
            executor.readouts(prepared)
            for stage, seconds in executor.stages.items():
                stages.setdefault(stage, []).append(seconds)
    finally:
        executor.stage_sync = None
    return {k: round(1e3 * statistics.median(v), 2) for k, v in stages.items()}


def option_rows_sweep(executor, workloads: dict) -> list[dict]:
    """GPU stages with every option pass of 16, 32 or 64 rows (one family in
    runtime.passes.OPTION_FAMILIES, 8 token slots a row) and question passes of 8 and 16 rows:
    what a pass costs by its size, for choosing the fixed row counts; and whether the
    12-question answers keep their bytes under other row counts (they need not: the kernels
    follow the shape)."""
    from runtime import passes
    from tools import bench

    kept = (passes.OPTION_FAMILIES, executor.config)
    body = workloads["12 questions"][0]
    default = json.dumps(bench.without_latency(executor.answer(body)))
    rows = []
    try:
        for option_rows, question_rows in ((32, 16), (16, 16), (64, 8), (32, 8)):
            if time.perf_counter() - STARTED > SWEEP_UNTIL_S:
                break
            passes.OPTION_FAMILIES = ((passes.MAX_OPTIONS, option_rows, option_rows * 8),)
            executor.config = replace(executor.config, question_batch=question_rows)
            # the plan is made while preparing: prepare again under these row counts
            chosen = {
                n: (b, executor.prepare(json.loads(b)))
                for n, (b, _) in workloads.items()
                if n not in ("3 questions", "6 questions")
            }
            same = json.dumps(bench.without_latency(executor.answer(body))) == default
            for row in gpu_stages(executor, chosen, runs=10):
                row.update(option_rows=option_rows, question_rows=question_rows)
                row["12_questions_same_bytes"] = same
                rows.append(row)
            save("sweep.json", rows)
    finally:
        passes.OPTION_FAMILIES, executor.config = kept
    return rows


def whole_requests(executor, workloads: dict, runs: int = RUNS) -> list[dict]:
    """Request JSON to response (host stages included), the executor's own stage clock; then
    again with early heads off (every question's heads after the last pass), the early prefix
    on, the heads' MLPs after the readouts rather than behind the passes, and every joint pass
    in one lane (early heads where the plan allows them), each variant's runs kept beside its
    median, and whether it gave the default's answer bytes."""
    from tools import bench

    variants = {
        "early_heads_off": lambda: settings(executor, early_heads=False),
        "early_prefix_on": lambda: settings(executor, early_prefix=True),
        "mlps_behind_off": lambda: settings(executor, mlps_behind=False),
    }
    if getattr(executor.backend, "lanes", 1) > 1:
        variants["one_lane"] = lambda: lanes(executor.backend, 1)
    rows = []
    for name, (body, _) in workloads.items():
        times = bench.time_runs(executor.answer, body, runs, executor.stages, executor.settle)
        row = {
            "workload": name,
            "median_ms": 1e3 * statistics.median(times),
            "p90_ms": 1e3 * bench.quantile(times, 0.9),
            "runs_ms": [round(1e3 * t, 3) for t in times],  # every run, in order
            "stages_ms": {k: round(1e3 * v, 2) for k, v in executor.stages.items()},
        }
        answers = json.dumps(bench.without_latency(executor.answer(body)))
        for variant, changed in variants.items():
            with changed():
                took = bench.time_runs(
                    executor.answer, body, runs, executor.stages, executor.settle
                )
                theirs = json.dumps(bench.without_latency(executor.answer(body)))
            row[f"{variant}_same_answers"] = theirs == answers
            row[f"{variant}_median_ms"] = 1e3 * statistics.median(took)
            row[f"{variant}_runs_ms"] = [round(1e3 * t, 3) for t in took]
        rows.append(row)
        log(f"request {rows[-1]}")
    return rows


def invariance(executor) -> dict:
    """The 12 speed-bench and 8 gate questions alone, together, reversed and repeated: the same
    bytes; where not, the largest difference of any value."""
    from reference.questions import gate_questions, request_body, speed_bench_questions
    from tools import bench

    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    questions = {**speed_bench_questions(12), **gate_questions()}

    def answers(qs: dict) -> dict:
        return bench.without_latency(executor.answer(request_body(image, qs, "image/png")))

    together = answers(questions)
    backwards = answers(dict(reversed(list(questions.items()))))
    repeated = answers(questions)
    alone = {q: answers({q: questions[q]})[q] for q in questions}

    def differing(other: dict) -> dict:
        return {
            q: bench.largest_difference(together[q], other[q])
            for q in questions
            if json.dumps(other[q]) != json.dumps(together[q])
        }

    result = {
        "questions": len(questions),
        "alone_differs": differing(alone),
        "reversed_differs": differing(backwards),
        "repeated_differs": differing(repeated),
    }
    result["identical"] = not any(result[k] for k in result if k.endswith("differs"))
    log(f"invariance {result}")
    return result


def vision_enqueue(executor, workloads: dict, runs: int = RUNS) -> dict:
    """Host milliseconds of each step of Executor.vision for the bench still, no device waits
    inside (median of `runs`): what the device waits for before the request's first kernel."""
    import torch

    _, prepared = workloads["1 question"]
    laps: dict[str, list[float]] = {}
    for _ in range(runs + 2):
        with torch.inference_mode():
            vision_laps(executor, prepared, laps)
    result = {step: round(statistics.median(v[2:]), 3) for step, v in laps.items()}
    result.pop("(wait)")
    log(f"vision enqueue {result}")
    return result


def vision_laps(executor, prepared, laps: dict) -> None:
    """One run of vision_enqueue: each step of Executor.vision apart, then the whole."""
    import torch

    from runtime.images import device_pixel_values, resize_rgb_torch, smart_resize

    image = prepared.image
    dtype = executor.backend.input_dtypes("vision")["pixel_values"]
    sync()
    marks = [("start", time.perf_counter())]
    executor.vision_tables(tuple(int(x) for x in image.grid_thw))
    marks.append(("tables", time.perf_counter()))
    uploaded = executor.tensor(image.rgb, torch.uint8)
    marks.append(("upload uint8", time.perf_counter()))
    resized = resize_rgb_torch(uploaded, *smart_resize(*image.rgb.shape[:2]))
    marks.append(("resize", time.perf_counter()))
    device_pixel_values(resized, executor._pixel_table).to(dtype).contiguous()
    marks.append(("patches", time.perf_counter()))
    sync()
    marks.append(("(wait)", time.perf_counter()))
    executor.vision(prepared.image)
    marks.append(("Executor.vision whole", time.perf_counter()))
    sync()
    for (_, before), (step, after) in zip(marks, marks[1:], strict=False):
        laps.setdefault(step, []).append(1e3 * (after - before))


def device_resize() -> dict:
    """The device's resize and patches (runtime.images.resize_rgb_torch, device_pixel_values)
    against the host's, byte for byte, on the bench stills and the resize tests' sizes."""
    import numpy as np
    import torch

    from runtime import images
    from tools import bench

    stills = {
        "screen PNG": np.asarray(bench.screen_image(*bench.BENCH_SIZE, seed=1)),
        "photo": np.asarray(bench.photo_image(1280, 720, 2)),
    }
    for width, height in ((1920, 1080), (2048, 1536), (65, 33), (3000, 17), (97, 4000)):
        rng = np.random.default_rng(width * height)
        stills[f"noise {width}x{height}"] = rng.integers(0, 256, (height, width, 3), np.uint8)
    result = {}
    for name, rgb in stills.items():
        target = images.smart_resize(*rgb.shape[:2])
        host = images.resize_rgb(rgb, *target)
        device = images.resize_rgb_torch(torch.from_numpy(rgb).to(DEVICE), *target)
        patches = images.device_pixel_values(device).contiguous().cpu().numpy()
        result[name] = {
            "resize_same_bytes": device.cpu().numpy().tobytes() == host.tobytes(),
            "patches_same_bytes": patches.tobytes() == images.normalize_and_pack(host)[0].tobytes(),
        }
    result["all_same"] = all(all(v.values()) for v in result.values())
    log(f"device resize {result}")
    return result


def heads_profile(executor, workloads: dict, name: str = "12 questions", runs: int = 20) -> str:
    """cProfile of the heads and finishing (Executor.respond) of one workload, heads' products
    where the executor runs them: the 25 functions of most own time."""
    import cProfile
    import io
    import pstats

    _, prepared = workloads[name]
    readouts = executor.readouts(prepared)
    executor.respond(prepared, readouts, 0.0)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(runs):
        executor.respond(prepared, readouts, 0.0)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    log(f"heads profile, {name}, {runs} runs:\n{text.getvalue()}")
    return text.getvalue()


def whole_profile(executor, workloads: dict, runs: int = 20) -> dict:
    """cProfile of whole requests (Executor.answer, request JSON to response) of the 12-question
    and 255-option workloads: the 30 functions of most cumulative and of most own time, where
    the host's part of a request goes (waits for the device included)."""
    import cProfile
    import io
    import pstats

    result = {}
    for name in ("12 questions", "255 options"):
        body, _ = workloads[name]
        executor.answer(body)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(runs):
            executor.answer(body)
        profiler.disable()
        text = io.StringIO()
        stats = pstats.Stats(profiler, stream=text)
        stats.sort_stats("cumulative").print_stats(45)
        stats.sort_stats("tottime").print_stats(30)
        result[name] = text.getvalue()
        log(f"whole-request profile, {name}, {runs} runs:\n{text.getvalue()}")
    return result


def heads_sites(executor, workloads: dict, runs: int = 10) -> dict:
    """The heads with their large products on the device (the default on CUDA) and on the
    host: the same answers? and each one's heads time (Executor.stages, median ms)."""
    from tools import bench

    kept = executor.heads.device_mlps
    result: dict = {"device_mlps": kept is not None}
    for name, (body, _) in workloads.items():
        row = {}
        for site, mlps in (("device", kept), ("host", None)):
            if site == "device" and kept is None:
                continue
            executor.heads.device_mlps = mlps
            answers, seconds = None, []
            for _ in range(runs):
                response = executor.answer(body)
                answers = answers or bench.without_latency(response)
                seconds.append(executor.stages["heads"])
            row[site] = {"heads_ms": round(1e3 * statistics.median(seconds), 3), "answers": answers}
        executor.heads.device_mlps = kept
        if "device" in row:
            same = json.dumps(row["device"]["answers"]) == json.dumps(row["host"]["answers"])
            row["same_answers"] = same
            row["largest_difference"] = max(
                (
                    bench.largest_difference(row["device"]["answers"][q], row["host"]["answers"][q])
                    for q in row["host"]["answers"]
                ),
                default=0.0,
            )
        for site in ("device", "host"):
            if site in row:
                row[site].pop("answers")
        result[name] = row
        log(f"heads {name}: {row}")
    return result


def host_waits(executor, workloads: dict, names=("1 question", "12 questions")) -> dict:
    """Where the host waits for the device in one GPU-stage run (torch's sync debug mode warns
    at each wait, from the line that caused it): only the final reads of the readouts should."""
    import warnings

    import torch

    result = {}
    for name in names:
        _, prepared = workloads[name]
        executor.readouts(prepared)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                executor.readouts(prepared)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        result[name] = [f"{Path(w.filename).name}:{w.lineno}" for w in caught]
        log(f"host waits, {name}: {result[name]}")
    return result


def peak_memory(executor, workloads: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        return {}
    body, _ = workloads["255 options"]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    executor.answer(body)
    torch.cuda.synchronize()
    gib = 1 << 30
    free, total = torch.cuda.mem_get_info()
    return {
        "max_allocated_gib": torch.cuda.max_memory_allocated() / gib,
        "max_reserved_gib": torch.cuda.max_memory_reserved() / gib,
        "device_used_gib": (total - free) / gib,
    }


def profile(executor, workloads: dict, names=("1 question", "255 options")) -> dict:
    """CUDA time per kernel over one warm GPU-stage run of each workload (PyTorch profiler)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    tables = {}
    for name in names:
        _, prepared = workloads[name]
        executor.readouts(prepared)
        with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            executor.readouts(prepared)
        averages = prof.key_averages()
        tables[name] = averages.table(
            sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
        )
        kernels = [e for e in averages if e.device_type.name == "CUDA"]
        total = sum(e.device_time_total for e in kernels) / 1e3
        tables[f"{name} cuda_ms"] = round(total, 2)
        log(f"profile {name}: {total:.1f} ms of kernels")
    return tables


class Recorded:
    """The reference's answers computed in another process, looked up by request body."""

    def __init__(self, path: Path):
        self.answers = json.loads(path.read_text())

    def answer(self, body: bytes) -> dict:
        return self.answers[hashlib.sha256(body).hexdigest()]


def reference_answers(path: str) -> None:
    """(run by parity_float32, in a process without fla-core: transformers would otherwise run
    fla's chunked kernel, whose Triton dots round float32 operands to TF32) the float32
    reference's answers to every parity request, by the sha256 of the request body."""
    from reference.mso1 import Reference
    from tools import bench

    reference = Reference(WORK / f"{PRESET}-export", dtype="float32", device=DEVICE)
    answers = {}
    for _, image, mime in bench.parity_images():
        for questions in bench.question_sets().values():
            body = bench.body(image, mime, questions)
            answers[hashlib.sha256(body).hexdigest()] = reference.answer(body)
    Path(path).write_text(json.dumps(answers))


def without_fla() -> dict[str, str]:
    """This environment with fla-core's folder (FLA_PATH) off the module path."""
    fla = os.environ.get("FLA_PATH", "")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and p != fla]
    return {**os.environ, "PYTHONPATH": ":".join(parts)}


def parity_float32() -> dict:
    """Float32 engine (eager modules + CUDA graphs) against the float32 reference (plain PyTorch,
    another process): 80 answers."""
    return parity_against_float32(Run("float32", dtype="float32", compile=False))


def parity_bfloat16() -> dict:
    """The shipped BF16 engine (compiled, CUDA graphs) against the same float32 reference: the
    issue's "BF16 against the float32 reference reported beside it"."""
    return parity_against_float32(Run("bf16"))


def parity_reference_bfloat16() -> dict:
    """The reference itself in BF16 with fla-core (as `reference_latency` runs it) against its
    float32 answers: how far BF16 alone moves this checkpoint's answers, beside our BF16
    engine's figure."""
    import gc

    import torch

    from reference.mso1 import Reference
    from tools import bench

    recorded = float32_reference()
    reference = Reference(WORK / f"{PRESET}-export", dtype="bfloat16", device=DEVICE)
    report = bench.parity(reference, Recorded(recorded), bench.question_sets())
    log("parity reference bfloat16\n" + bench.parity_table(report))
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    return {"summary": report["summary"], "flips": report["flips"], "backend": "reference"}


def float32_reference() -> Path:
    """The float32 reference's answers, made once in a process without fla-core and kept in
    WORK."""
    recorded = WORK / "reference-float32.json"
    if not recorded.exists():
        command = [sys.executable, "-u", __file__, "refanswers", str(recorded), *sys.argv[2:]]
        subprocess.run(command, env=without_fla(), check=True)
    return recorded


def parity_against_float32(run: Run) -> dict:
    """`run`'s engine against the float32 reference's answers (made once, in a process without
    fla-core, and kept in WORK): 80 answers."""
    import gc

    import torch

    from tools import bench

    recorded = float32_reference()
    executor = executor_for(run)
    report = bench.parity(executor, Recorded(recorded), bench.question_sets())
    log(f"parity {run.dtype}\n" + bench.parity_table(report))
    joint = {"joint_passes": executor.joint, "joint_tokens": executor.joint_tokens}
    log(f"parity {run.dtype} ran {joint}")
    del executor
    gc.collect()
    torch.cuda.empty_cache()
    return {"summary": report["summary"], "flips": report["flips"], "backend": run, **joint}


def reference_latency(workloads: dict) -> list[dict]:
    """The PyTorch reference in BF16 with fla-core importable (transformers then takes its
    Gated DeltaNet kernels), request JSON to response."""
    import gc

    import torch

    from reference.mso1 import Reference
    from tools import bench

    reference = Reference(WORK / f"{PRESET}-export", dtype="bfloat16", device="cuda")
    rows = []
    for name, (body, _) in workloads.items():
        times = bench.time_runs(reference.answer, body, REFERENCE_RUNS)
        rows.append(
            {
                "workload": name,
                "median_ms": 1e3 * statistics.median(times),
                "p90_ms": 1e3 * bench.quantile(times, 0.9),
                "runs_ms": [round(1e3 * t, 3) for t in times],  # every run, in order
            }
        )
        log(f"reference {rows[-1]}")
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def cold_start(engines: Path) -> dict:
    """Process start to ready (weights loaded, warm-up requests answered and their shapes
    compiled and captured) in a new process: first with the engine directory's caches emptied,
    then again with the caches the first one left."""
    result = {}
    labels = ["without_caches", "with_caches"]
    if "--only-without" in sys.argv:  # the first of two calls (each call has 10 minutes)
        labels.remove("with_caches")
    if "--only-with" in sys.argv and (engines / "torch").is_dir():  # the second, still warm
        labels.remove("without_caches")
    for label in labels:
        if label == "without_caches":
            shutil.rmtree(engines / "torch", ignore_errors=True)
        started = time.perf_counter()
        log_file = OUT / f"cold-{label}.log"  # written as it goes: kept if the call is cut
        with log_file.open("w") as stderr:
            done = subprocess.run(
                [sys.executable, "-u", __file__, "coldstart", str(engines), *sys.argv[2:]],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                env={**os.environ, **COLD_LOGS},
            )
        text = log_file.read_text()
        tail = text[-COLD_LOG_CHARS:]
        aot_lines = [line[:600] for line in text.splitlines() if "aot:" in line]
        log_file.write_text(done.stdout + "\n" + tail)
        result[label] = {
            "seconds": time.perf_counter() - started,
            "exit": done.returncode,
            "inner": done.stdout.strip().splitlines()[-2:] if done.stdout else [],
            "stderr_tail": tail[-1500:] if done.returncode else "",
            "aot_lines": aot_lines,
        }
        log(f"cold start {label}: {result[label]['seconds']:.1f} s (exit {done.returncode})")
    return same_answers(result)


def same_answers(result: dict) -> dict:
    """The warm-up answers' digests of each start (kept in WORK across the two calls of
    `--only-without` and `--only-with`), and whether the starts answered alike."""
    kept = WORK / "cold-answers.json"
    digests = json.loads(kept.read_text()) if kept.is_file() else {}
    for label, run in result.items():
        for line in run["inner"]:
            if '"compile_steps"' in line:
                digests[label] = [step["answer"] for step in json.loads(line)["compile_steps"]]
    kept.write_text(json.dumps(digests))
    result["answers"] = digests
    if len(digests) == 2:
        result["same_answers"] = digests["without_caches"] == digests["with_caches"]
    return result


def coldstart(engines: str) -> None:
    """One process: the torch artifacts of `engines` (made now when missing), load, warm-up.
    Each warm-up request's compiler work goes to stderr (`compile_steps`), beside the
    recompiles and Triton autotuning that `cold_start` asks the process to log."""
    started = time.perf_counter()
    from build_engines.engines import build_torch_artifacts
    from runtime.executor import Executor
    from tools import bench

    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    warm = [bench.body(image, "image/png", qs) for qs in bench.workloads().values()]
    steps: list[dict] = []
    Executor.answer = compile_steps(Executor.answer, steps)
    record = build_torch_artifacts(WORK / f"{PRESET}-export", engines, "bfloat16", warm)
    print(json.dumps({"ready_s": time.perf_counter() - started, "artifacts": record}))
    print(json.dumps({"compile_steps": steps, "compile_times": compile_times()}))


def compile_steps(answer, steps: list):
    """`Executor.answer` that records, per request, its seconds and what the compilers did
    meanwhile: graphs Dynamo made, FX-graph cache hits and misses, CUDA graphs captured."""
    import torch._dynamo.utils as dynamo_utils

    def counted() -> dict:
        counters = dynamo_utils.counters
        return {
            "graphs": counters["stats"]["unique_graphs"],
            "fx_hits": counters["inductor"]["fxgraph_cache_hit"],
            "fx_misses": counters["inductor"]["fxgraph_cache_miss"],
            "aot_hits": counters["aot_autograd"]["autograd_cache_hit"],
        }

    def wrapped(self, body: bytes) -> dict:
        from tools import bench

        before, at = counted(), time.perf_counter()
        captured = sum(s["captured"] for s in self.backend.stats().values())
        print(f"== warm-up request {len(steps)}", file=sys.stderr, flush=True)
        made = None
        try:
            made = answer(self, body)
            return made
        finally:
            after = counted()
            step = {k: after[k] - before[k] for k in after}
            step["captures"] = sum(s["captured"] for s in self.backend.stats().values()) - captured
            step["seconds"] = round(time.perf_counter() - at, 2)
            # the answer's bytes without its latencies: a start that loads the saved blocks
            # must answer as one that compiled them (cold_start compares the two)
            text = json.dumps(bench.without_latency(made), sort_keys=True) if made else ""
            step["answer"] = hashlib.sha256(text.encode()).hexdigest()[:16]
            steps.append(step)
            print(f"== done {step}", file=sys.stderr, flush=True)

    return wrapped


def compile_times() -> str:
    """Dynamo's per-phase compile seconds of this process, as its table."""
    try:
        import torch._dynamo.utils as dynamo_utils

        return dynamo_utils.compile_times(repr="str", aggregate=True)
    except Exception as error:  # a torch without it: the steps still tell
        return f"unavailable: {error}"


# -- tables ----------------------------------------------------------------------------------


def latency_table(rows: list[dict], reference: list[dict] | None = None) -> str:
    stages = ("vision", "prefix", "questions", "options", "prepare", "heads")
    ref = {r["workload"]: r["median_ms"] for r in reference or []}
    lines = [
        "| workload | median ms | p90 ms | target ms | reference ms | " + " | ".join(stages) + " |",
        "| --- | ---: | ---: | ---: | ---: |" + " ---: |" * len(stages),
    ]
    for r in rows:
        cells = " | ".join(f"{r['stages_ms'].get(s, 0.0):.1f}" for s in stages)
        target = r.get("target_ms", "-")
        theirs = f"{ref[r['workload']]:.1f}" if r["workload"] in ref else "-"
        lines.append(
            f"| {r['workload']} | {r['median_ms']:.1f} | {r['p90_ms']:.1f} | {target} | "
            f"{theirs} | {cells} |"
        )
    for key, what in (  # whole requests' variants (`whole_requests`)
        ("early_heads_off_median_ms", "early heads off"),
        ("early_prefix_on_median_ms", "early prefix on"),
        ("mlps_behind_off_median_ms", "heads' MLPs after the readouts (not behind the passes)"),
        ("one_lane_median_ms", "every joint pass in one lane"),
    ):
        found = [r for r in rows if r.get(key) is not None]
        if found:
            on = ", ".join(f"{r['workload']} {r[key]:.1f}" for r in found)
            lines.append(f"\n{what}, median ms: {on}")
    return "\n".join(lines)


def attempt(report: dict, key: str, step, *args):
    """Runs one step; a failure is recorded and the next steps still run."""
    try:
        report[key] = step(*args)
    except Exception as error:  # one failed step must not cost the call's other results
        report[key] = {"error": repr(error), "trace": traceback.format_exc()[-3000:]}
        log(f"{key} failed: {error!r}")
    save("report.json", report)
    return report[key]


def use_cache_dirs() -> None:
    """Points the compiler caches under WORK (unpacking a carried pack first, if any)."""
    pieces = sorted(CACHE_PACK.glob("caches.tar.xz.*"))
    if pieces and not (WORK / "inductor").exists():
        WORK.mkdir(parents=True, exist_ok=True)
        subprocess.run(f"cat {' '.join(map(str, pieces))} | xz -d | tar x -C {WORK}", shell=True)
        log(f"unpacked {len(pieces)} cache pieces")
    for name, folder in CACHE_DIRS.items():
        os.environ.setdefault(name, str(folder))


def pack_caches() -> dict:
    """The compiler caches into $OUT in pieces of CACHE_PIECE, when four pieces hold them."""
    folders = [f.name for f in CACHE_DIRS.values() if f.exists()]
    packed = WORK / "caches.tar.xz"
    subprocess.run(f"tar c -C {WORK} {' '.join(folders)} | xz -T0 -6 > {packed}", shell=True)
    size = packed.stat().st_size
    if size > 4 * 15 * (1 << 20):
        return {"packed_mib": size / (1 << 20), "returned": False}
    subprocess.run(["split", "-b", CACHE_PIECE, "-d", str(packed), str(OUT / "caches.tar.xz.")])
    return {"packed_mib": size / (1 << 20), "returned": True}


def session(final: bool) -> None:
    import torch

    from server.app import worker_process

    # requests timed in a process set up as the worker's (its GIL switch interval since this
    # round; its PyTorch threads capped alike: 16 made the heads erratic in h200-2026-12-02g)
    worker_process()
    use_cache_dirs()
    report = {"environment": environment(), "started": time.strftime("%H:%M:%S")}
    attempt(report, "build", build)
    if not TINY and "--no-kernels" not in sys.argv:
        attempt(report, "option_rows", option_rows_kernel)
    if not TINY:
        attempt(report, "attention_kernel", attention_kernel_check)
    attempt(report, "device_resize", device_resize)
    run = Run("bf16")
    started = time.perf_counter()
    executor = attempt(report, "load", executor_for, run)
    report["load_s"] = time.perf_counter() - started
    if isinstance(executor, dict):
        return
    report["load_parts"] = {
        **executor.load_seconds,
        "weights": getattr(executor.backend, "weights_seconds", None),
        "floors": getattr(executor.backend, "floor_seconds", None),
    }
    report["backend"] = executor.backend.name
    report["pass_shape"] = executor.pass_shape()
    report["joint_passes"] = executor.joint
    report["compile_modes"] = getattr(executor.backend, "compile_modes", [])
    floors = getattr(executor.backend, "row_floors", {})
    report["row_floors"] = {"x".join(map(str, k)): v for k, v in floors.items()}
    log(f"pass shape {report['pass_shape']}, row floors {report['row_floors']}")
    workloads = prepared_workloads(executor)
    if not TINY:
        attempt(report, "product_rows", product_rows, executor)
    attempt(report, "gpu_stages", gpu_stages, executor, workloads)
    report["lanes"] = getattr(executor.backend, "lanes", 1)
    attempt(report, "one_lane", one_lane, executor, workloads)
    if not TINY and "--no-recurrent" not in sys.argv:
        attempt(report, "recurrent_rows", recurrent_rows, executor, workloads)
    report["warm_stats"] = executor.backend.stats()
    attempt(report, "invariance", invariance, executor)
    if executor.pass_shape()[1] and "--no-fixed" not in sys.argv:
        attempt(report, "fixed_rows", fixed_rows, executor, workloads)
    if executor.joint and "--no-separate" not in sys.argv:
        attempt(report, "separate_passes", separate_passes, executor, workloads)
    if "--quick" not in sys.argv:
        attempt(report, "host_waits", host_waits, executor, workloads)
        attempt(report, "vision_enqueue", vision_enqueue, executor, workloads)
        attempt(report, "heads_profile", heads_profile, executor, workloads)
    attempt(report, "heads_sites", heads_sites, executor, workloads)  # the heads' CUDA graphs
    if "--whole-profile" in sys.argv:
        attempt(report, "whole_profile", whole_profile, executor, workloads)
    if final:
        attempt(report, "requests", whole_requests, executor, workloads)
    attempt(report, "peak_memory", peak_memory, executor, workloads)
    if "--quick" not in sys.argv:
        report["profile"] = attempt(report, "profile", profile, executor, workloads)
    attempt(report, "traces", traces, executor, workloads)
    report["stats"] = executor.backend.stats()
    if not final:
        attempt(report, "option_rows_sweep", option_rows_sweep, executor, workloads)
        attempt(report, "caches", pack_caches)
    if final:
        del executor
        torch.cuda.empty_cache()
        # after the engine's timings: fla tunes its chunked kernel once a process (and saves the
        # choice), keyed by head counts only, so the crossover's short passes run first had the
        # prefix pass run their configuration (h200-2026-12-03b, call 2: kkt_solve 0.44 → 0.81 ms)
        if not TINY and "--no-crossover" not in sys.argv:
            attempt(report, "crossover", crossover)
        if "--no-reference" not in sys.argv:
            attempt(report, "reference_fla", reference_latency, workloads)
        if "--no-parity" not in sys.argv:  # parity alone: `parity` (a call of its own fits)
            attempt(report, "parity_float32", parity_float32)
        if "--host" in sys.argv:  # the host profiles of `serve`, in this lease
            attempt(report, "host_profiles", host_profiles)
    profile_text = report.pop("profile", {})
    save("profile.txt", "\n\n".join(f"## {k}\n{v}" for k, v in profile_text.items()))
    save("report.json", report)
    summarise(report)


def cold_session() -> None:
    """Cold start alone (its two processes need the whole GPU): after `final`, same lease."""
    report = {"environment": environment()}
    attempt(report, "build", build)
    attempt(report, "cold_start", cold_start, WORK / f"engines-{PRESET}-cold")
    save("cold_start.json", report)
    if "--no-parity" not in sys.argv:
        attempt(report, "parity_float32", parity_float32)
        save("cold_start.json", report)
    summarise(report)


def waits_session() -> None:
    """Host waits alone (`--tiny` on the GPU machine: minutes less than the 4b)."""
    report = {"environment": environment()}
    attempt(report, "build", build)
    executor = attempt(report, "load", executor_for, Run("waits", compile=False))
    if not isinstance(executor, dict):
        attempt(report, "host_waits", host_waits, executor, prepared_workloads(executor))
    save("waits.json", report)


def parts_session() -> None:
    """Two-part joint passes (runtime.passes.JOINT_PARTS = 2) alone: invariance, then the GPU
    stages of 1 and 12 questions; `--emulate-casts` compiles with Inductor's
    emulate_precision_casts (every BF16 rounding of eager PyTorch kept, whatever is fused), the
    candidate that would give one-part and two-part graphs a row's same bytes."""
    import torch._inductor.config as inductor

    from runtime import passes

    use_cache_dirs()
    passes.JOINT_PARTS = 2
    report = {"environment": environment(), "started": time.strftime("%H:%M:%S")}
    report["emulate_casts"] = inductor.emulate_precision_casts = "--emulate-casts" in sys.argv
    attempt(report, "build", build)
    executor = attempt(report, "load", executor_for, Run("bf16"))
    if isinstance(executor, dict):
        save("parts.json", report)
        return
    report["joint_tokens"] = executor.joint_tokens
    attempt(report, "invariance", invariance, executor)
    save("parts.json", report)  # kept if the stages below run past the call's limit
    workloads = prepared_workloads(executor)
    chosen = {name: workloads[name] for name in ("1 question", "12 questions")}
    attempt(report, "gpu_stages", gpu_stages, executor, chosen)
    save("parts.json", report)
    summarise(report)


def parity_session() -> None:
    """Float32 parity alone, on a cold machine too (the export is built first when missing),
    then, unless `--no-bf16`, the BF16 engine and the reference in BF16 against the same
    float32 answers."""
    report = {"environment": environment()}
    attempt(report, "build", build)
    attempt(report, "parity_float32", parity_float32)
    save("parity.json", report)
    if "--no-bf16" not in sys.argv:
        attempt(report, "parity_bfloat16", parity_bfloat16)
        save("parity.json", report)
        attempt(report, "parity_reference_bfloat16", parity_reference_bfloat16)
        save("parity.json", report)
    summarise(report)


def server_environment() -> dict:
    """The server's environment: this one's, the compile logs, the prefix cache off unless
    `--prefix-cache` (a previous round ran with it on by mistake: h200-2026-12-02d)."""
    env = {**os.environ, **COLD_LOGS}
    if "--prefix-cache" not in sys.argv:
        env["OMNIJEV_PREFIX_CACHE"] = "0"
    return env


def served(engines: Path, report: dict) -> None:
    """`omnijev serve` on the 4b (default backend, warmed on the bench workloads), then
    tools.loadtest: one client, then LOAD_CLIENTS closed-loop clients on the 12-question
    request; the server's log tail goes into the report. The prefix cache is off (the issue's
    check: every request sends the same image, so a cache would skip vision and the prefix;
    `--prefix-cache` keeps the worker's default)."""
    from tools import bench

    image = bench.encode(bench.screen_image(*bench.BENCH_SIZE, seed=1), "PNG")
    warm = []
    for index, questions in enumerate(bench.workloads().values()):
        path = WORK / f"warm-{index}.json"
        path.write_bytes(bench.body(image, "image/png", questions))
        warm += ["--warm-up", str(path)]
    port = "8011"
    command = [
        sys.executable,
        "-u",
        "-m",
        "runtime.cli",
        "serve",
        "--checkpoint",
        str(WORK / f"{PRESET}-export"),
        "--engines",
        str(engines),
        "--port",
        port,
        *warm,
    ]
    log_path = WORK / "server.log"
    env = server_environment()
    report["prefix_cache"] = env.get("OMNIJEV_PREFIX_CACHE", "default")
    started = time.perf_counter()
    with open(log_path, "wb") as server_log:
        server = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, env=env)
    try:
        report["ready_s"] = wait_ready(f"http://127.0.0.1:{port}/health", server, started)
        log(f"server ready in {report['ready_s']:.1f} s")
        load = subprocess.run(
            [sys.executable, "-m", "tools.loadtest", "--url",
             f"http://127.0.0.1:{port}/v1/systemone", "--workload", "12 questions",
             "--clients", str(LOAD_CLIENTS), "--seconds", "30", "--warm-up", "5", "--single",
             "--out", str(OUT / "load.json")],
            capture_output=True, text=True, timeout=200,
        )  # fmt: skip
        report["loadtest"] = load.stdout[-3000:] + load.stderr[-1500:]
        log(report["loadtest"])
    finally:
        server.terminate()
        server.wait(timeout=60)
        text = log_path.read_text(errors="replace")
        report["server_log_tail"] = text[-3000:]
        (OUT / "server.log").write_text(text[-COLD_LOG_CHARS:])  # its start, recompiles included


def wait_ready(url: str, server: subprocess.Popen, started: float) -> float:
    """Seconds from the server's start to `/health` answering 200."""
    import urllib.error
    import urllib.request

    while time.perf_counter() - started < READY_LIMIT_S:
        if server.poll() is not None:
            raise RuntimeError(f"server exited with {server.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return time.perf_counter() - started
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server not ready after {READY_LIMIT_S} s")


def host_profiles() -> dict:
    """tools.hostprofile on this machine's cores with 4 and 8 PyTorch threads (patches on the
    device): the 12-question PNG's host stages."""
    result = {}
    for threads in HOST_THREADS:
        out = OUT / f"host-threads{threads}.json"
        done = subprocess.run(
            [sys.executable, "-m", "tools.hostprofile", "--runs", "15", "--device", "cuda",
             "--threads", str(threads), "--checkpoint", str(WORK / f"{PRESET}-export"),
             "--device-heads", "--out", str(out)],
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        result[threads] = done.stdout[-4000:] + done.stderr[-1000:]
        log(f"host profile, {threads} threads:\n{result[threads]}")
    return result


def serve_session() -> None:
    """The worker over HTTP under load, then the host profiles: after `final`, same lease."""
    use_cache_dirs()  # the server process compiles into (and reads) the same caches
    report = {"environment": environment()}
    attempt(report, "build", build)
    attempt(report, "serve", served, engine_dir(Run("bf16")), report)
    attempt(report, "host_profiles", host_profiles)
    save("serve.json", report)


def summarise(report: dict) -> None:
    summary = [f"backend {report.get('backend')}, load {report.get('load_s', 0):.1f} s"]
    if isinstance(report.get("gpu_stages"), list):
        summary += ["GPU stages", latency_table(report["gpu_stages"])]
    if isinstance(report.get("one_lane"), list) and report["one_lane"]:
        summary += ["GPU stages, one lane", latency_table(report["one_lane"])]
    if isinstance(report.get("recurrent_rows"), dict) and report["recurrent_rows"]:
        rows = report["recurrent_rows"]
        summary += ["GPU stages, option rows in the recurrent kernel",
                    latency_table(rows["gpu_stages"]), json.dumps(rows["answers"])]  # fmt: skip
    if isinstance(report.get("fixed_rows"), list):
        summary += ["GPU stages, fixed rows", latency_table(report["fixed_rows"])]
    separate = report.get("separate_passes")
    if isinstance(separate, dict) and isinstance(separate.get("gpu_stages"), list):
        summary += ["GPU stages, passes apart", latency_table(separate["gpu_stages"])]
    if isinstance(report.get("requests"), list):
        reference = report.get("reference_fla")
        reference = reference if isinstance(reference, list) else None
        summary += ["whole request", latency_table(report["requests"], reference)]
    keys = ("attention_kernel", "crossover", "invariance", "peak_memory", "cold_start")
    for key in (*keys, "parity_float32", "parity_bfloat16", "parity_reference_bfloat16"):
        if key in report:
            summary.append(f"{key}: {json.dumps(report[key], default=str)[:1500]}")
    save("summary.md", "\n\n".join(summary))
    print("\n\n".join(summary))


if __name__ == "__main__":
    mode = next((a for a in sys.argv[1:] if not a.startswith("--")), "dev")
    apply_flags()
    if mode == "coldstart":
        coldstart(sys.argv[2])
    elif mode == "parity":
        parity_session()
    elif mode == "refanswers":
        reference_answers(sys.argv[2])
    elif mode == "cold":
        cold_session()
    elif mode == "serve":
        serve_session()
    elif mode == "waits":
        waits_session()
    elif mode == "parts":
        parts_session()
    elif mode == "hostprobe":
        host_probe_session()
    elif mode == "probe":
        probe_session()
    elif mode == "attention":
        sys.exit(0 if attention_session() else 1)
    else:
        session(final=mode == "final")
