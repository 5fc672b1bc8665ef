"""The torch backend: the model's own modules (`runtime.model`) on the export's weights, behind the
same graphs, feeds and outputs as the ONNX files. On CUDA: the Gated DeltaNet and attention
kernels of `runtime.model` (fla-core's and our own Triton), `torch.compile` and one CUDA graph per
shape (`runtime.backends.graphs`); on the CPU: eager PyTorch with the eager chunked core and the
folded attention, no graphs.

Follows docs/design.md "Language-model passes" and docs/engines.md §15 (the compiled engine measured
on the H200); module names deliberately avoid `torch.py`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.backends.base import Capabilities
from runtime.backends.graphs import GraphSlots, Slot, builds_of, checked_feeds, signature
from runtime.config import RuntimeConfig, cache_home
from runtime.constants import (
    DTYPES,
    FIT_TOKENS,
    IMAGE_GRAPH,
    JOINT,
    JOINT_GRAPH,
    MAX_PREFIXES,
    PACKED_GRAPH,
    QUESTION_TOKENS,
    SMALL_OPTION_TOKENS,
)
from runtime.images import (
    FACTOR,
    MAX_PIXELS,
    NORMALIZED,
    device_pixel_values,
    resize_rgb_torch,
    smart_resize,
)
from runtime.model.attention_kernels import CHUNK_MAX_ROWS
from runtime.model.language import (
    BLOCKS,
    JOINT_BLOCKS,
    folded_attention,
    joint_body,
    lm_input_names,
    lm_output_names,
    pass_body,
)
from runtime.model.layers import product
from runtime.model.packed import PACKED_BLOCKS, ROW_TABLES, TOKEN_INPUTS, packed_body

log = logging.getLogger("omnijev.torch")

# readout rows per matrix product: every piece has this one shape, so a row's log-probability
# never depends on how many other rows the pass reads (invariance); 128 rows × the 248,079-row
# table is where the product stops being bound by reading the table (1.27 GB in BF16)
READOUT_PIECE = 128
# A pass with more option rows than the passes questions share hold (CHUNK_MAX_ROWS, which the
# attention's chunks follow for the same reason) holds one question alone, so its piece may
# follow its own size: 256 rows, where the product is no longer bound by reading the table
# (a 128-row piece takes about as long as reading the table alone)
WIDE_READOUT_PIECE = 256
# embedding rows padded to a multiple of this for the readout product: 248,079 rows sent cuBLAS
# to an sm75 kernel on the H200 (docs/engines.md §15); the padded rows are never read
TABLE_ALIGN = 64
GRAPH_SLOTS = 64  # shape signatures kept per graph, each with its buffers and CUDA graph
# the image graph's slots are keyed by the decoded image's size, of which a deployment may send
# many more than patch grids: its last sizes keep a graph (each holds the tower's activations and
# the resize's float64 image), an older size runs eagerly and is captured again. The traffic
# suite's 10 screen sizes missed 79 of 160 requests with 8 slots, 10 with 16 (bench.gpu plans)
IMAGE_SLOTS = 16
RECOMPILE_LIMIT = 256  # dynamo's per-function cache (default 8): one entry per shape family
TORCH_DIR = "torch"  # in an engine directory: the compiler caches `omnijev engines` prepared
INDUCTOR_CACHE = "inductor"
TRITON_CACHE = "triton"
ENGINES_MANIFEST = "engines.json"
ONNX_MANIFEST = "onnx_ort/onnx_export.json"
VISION_INPUTS = ("pixel_values", "pos_embeds", "cos", "sin")  # float32 host tables and pixels
# the vision tower's graphs on CUDA: one for each multiple of this many patches, an image's
# patches padded to the next (masked out of its attention): 10 graphs cover every image the
# contract admits (MAX_PATCHES), all built before the worker is ready, in place of a graph for
# every patch grid (or, before, every decoded size) that traffic brought
PATCH_STEP = 256
MAX_PATCHES = MAX_PIXELS // FACTOR**2 * 4  # the resize keeps an image within MAX_PIXELS
# the image graph's: the decoded image as uint8 [H, W, 3], then the vision tower's tables; the
# resize target is smart_resize of the image's size, so the feeds' shapes fix the whole graph,
# in place of launching the upload, the device resize and the patches op by op before it
IMAGE_INPUTS = ("rgb", *VISION_INPUTS[1:])
LM_GRAPHS = ("lm_state", "lm_rows", JOINT_GRAPH, PACKED_GRAPH)
VISION_GRAPHS = ("vision", IMAGE_GRAPH)  # the tower from packed pixels, or from the image
VERSIONED = ("torch", "triton", "fla-core")  # what compiled artifacts were made with
# read by the readout, which runs after the captured body: a pass's graph is keyed by the body's
# shapes alone, so readout counts (which vary with the questions asked) add no graph or memory
READOUT_INPUTS = ("read_rows", "target_rows", "target_tokens", "target_slots")
READOUT_OUTPUTS = ("hidden", "logprobs")
# a joint pass's option rows have these inputs (JOINT + the name) besides the question rows'
# whole set
ROW_INPUTS = ("input_ids", "positions", "lengths", "src", "prefix_rows", *READOUT_INPUTS)
# Fitted passes (runtime.passes.fitted_rows) need a row's bytes not to depend on the pass's row
# count. The products are checked at load, on this machine, for every row count a pass can
# give them (multiples of ROW_STEP up to FIT_TOKENS), against the product of that many rows; one
# that differs is padded to the first of FLOOR_CANDIDATES under which none does (on the GPU,
# cuBLAS in BF16, the narrow products need a floor of a few hundred rows, the wide ones none)
FLOOR_CANDIDATES = (0, 64, 128, 256, 384, 512)
# the row floors are measured up to this many rows (a question part and two option passes of
# the small family that joins), else up to FIT_TOKENS: every joint pass of that family (a
# question part and one option pass) is within either, and the floors found decide the bytes of
# every fitted pass, so the bound stays the one they were measured with
JOINT_TOKENS = QUESTION_TOKENS + 2 * SMALL_OPTION_TOKENS
ROW_STEP = 8  # passes.OPTION_STEP: every fitted pass's rows × tokens is a multiple of it
FLOOR_SEED = 0  # the check's random rows (values do not pick kernels; shapes do)
# Joint passes in two lanes, each a CUDA stream of its own, run at once where the executor puts
# them in both (runtime.run_passes.lane_of): a joint pass of a few microseconds' kernels leaves
# most of the GPU idle, and the next one need not wait for it. A lane has its own graphs,
# captured on its own stream, and its own static inputs: torch keeps a cuBLAS workspace per
# (handle, stream) and a graph replays with the workspace of the stream it was captured on, so
# graphs captured on one stream must not replay at once (pytorch/pytorch#193402), nor two lanes
# copy into one buffer
LANES = 2


def versions() -> dict[str, str | None]:
    """Installed versions of what the compiler caches depend on (None: not installed)."""
    found = {}
    for name in VERSIONED:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["torch"] = torch.__version__  # the build tag (+cu130) matters, metadata drops none
    return found


def unavailable_reason(config: RuntimeConfig) -> str | None:
    """Why `auto` should not pick this backend: it is the default only on CUDA with fla-core
    and Triton importable."""
    if config.device == "cpu":
        return "device cpu asked for"
    if not torch.cuda.is_available():
        return "no cuda device"
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        import triton  # noqa: F401
    except ImportError as error:
        return f"fla-core or triton missing: {error}"
    return None


def fla_importable() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def attention_kernel(wanted: bool) -> Callable | None:
    """The attention kernel's op where it is wanted (CUDA, half precision) and Triton imports;
    else None (the folded products). The kernel holds one row's queries a program, so a row's
    bytes need no fixed-row padding, in place of folded_attention's four padded products."""
    if not wanted:
        return None
    from runtime.model import attention_kernels

    return attention_kernels.rows_attention if attention_kernels.triton is not None else None


def packed_forms(cuda: bool) -> tuple[Callable, Callable]:
    """The packed pass's attention and Gated DeltaNet recurrence: on CUDA the Triton kernels,
    which read each row's offsets in place (no host wait: they are captured in the pass's
    graph); elsewhere the eager forms, a row at a time."""
    from runtime.model import packed

    if cuda:
        from runtime.model import packed_kernels

        if packed_kernels.triton is not None:
            return packed_kernels.packed_attention, packed_kernels.packed_gated_delta
    return packed.packed_attention_eager, packed.packed_delta_eager


def engine_dtype(engines_dir: Path, cuda: bool) -> torch.dtype:
    """The engine directory's dtype (engines.json, else the ONNX variant's description); BF16 on
    CUDA and float32 on the CPU when neither names one."""
    for name in (ENGINES_MANIFEST, ONNX_MANIFEST):
        path = engines_dir / name
        if path.is_file():
            dtype = json.loads(path.read_text("utf-8")).get("dtype")
            if dtype:
                return DTYPES[dtype]
    return torch.bfloat16 if cuda else torch.float32


def check_artifacts(engines_dir: Path) -> Path | None:
    """The engine directory's compiler caches when they were made with the versions installed
    now; None when it has none; an error naming the mismatch otherwise."""
    manifest = engines_dir / ENGINES_MANIFEST
    if not manifest.is_file():
        return None
    recorded = json.loads(manifest.read_text("utf-8")).get("torch")
    if not recorded:
        return None
    installed = versions()
    for name, made_with in recorded["versions"].items():
        if installed.get(name) != made_with:
            raise RuntimeError(
                f"torch engine artifacts were made with {name} {made_with}, "
                f"this process has {installed.get(name)}: rebuild them with `omnijev engines`"
            )
    return private_caches(engines_dir / recorded["dir"], recorded["sha256"])


def private_caches(folder: Path, digest: str) -> Path:
    """A copy of the engine directory's verified caches that this process's compilations may
    add to: the engine directory stays as built, so `verify_engine_dir` accepts it next time.
    Kept per tree digest under the user's cache folder; copied once."""
    target = cache_home() / "torch-caches" / digest[:32]
    if not target.is_dir():
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        shutil.copytree(folder, partial, dirs_exist_ok=True)
        try:
            partial.rename(target)
        except OSError:  # a concurrent start won: its copy is the same
            shutil.rmtree(partial, ignore_errors=True)
    return target


def use_caches(folder: Path) -> None:
    """Points Inductor's and Triton's caches (fla's kernels included) at `folder`; they read the
    variables when they first compile, which is after this."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder / INDUCTOR_CACHE)
    os.environ["TRITON_CACHE_DIR"] = str(folder / TRITON_CACHE)


def padded_table(embedding: torch.Tensor) -> torch.Tensor:
    """The tied embedding with zero rows appended up to TABLE_ALIGN; the module keeps a view of
    its first rows, so the weights stay one copy."""
    rows = -(-embedding.shape[0] // TABLE_ALIGN) * TABLE_ALIGN
    table = torch.zeros(rows, embedding.shape[1], dtype=embedding.dtype, device=embedding.device)
    table[: embedding.shape[0]] = embedding
    return table


def piece_norms(
    rows: torch.Tensor, table: torch.Tensor, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """plugins.readout's arithmetic for READOUT_PIECE rows, up to the tokens: the logits in the
    model's dtype over the padded table, each row's maximum (float32, padding cut before it) and
    the log of its sum of exponentials (float64)."""
    scores = rows @ table.transpose(0, 1)
    upcast = scores[:, :vocab].float()
    peak = upcast.amax(dim=-1)
    total = (upcast - peak[:, None]).exp().double().sum(dim=-1)
    return scores, peak, total.log()


def picked_logprobs(
    scores: torch.Tensor,
    peak: torch.Tensor,
    log_total: torch.Tensor,
    local: torch.Tensor,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """The float32 log-probabilities of `tokens` at the piece rows `local` (piece_norms' rows):
    the logit upcast, less the row maximum, in float64 less the log of the sum."""
    shifted = scores[local, tokens].float() - peak[local]
    return (shifted.double() - log_total[local]).float()


def logprob_piece(
    rows: torch.Tensor, table: torch.Tensor, tokens: torch.Tensor, vocab: int
) -> torch.Tensor:
    """plugins.readout's arithmetic for READOUT_PIECE rows, a token each: `piece_norms`, then
    `picked_logprobs`."""
    scores, peak, log_total = piece_norms(rows, table, vocab)
    local = torch.arange(rows.shape[0], device=rows.device)
    return picked_logprobs(scores, peak, log_total, local, tokens)


class TorchBackend:
    """Runs `vision`, `lm_state`, `lm_rows` and the joint pass `lm_joint` with the model's
    modules (runtime.model)."""

    max_pass_tokens = None  # fla's kernels and the eager core take any length
    floor_seconds = 0.0  # fit_rows: how long measuring the floors took (part of a cold start)
    compile_modes: list[str] = []  # invariant_compilation's settings, where compiled

    def __init__(
        self,
        checkpoint: Path,
        engines_dir: Path,
        config: RuntimeConfig | None = None,
        dtype: torch.dtype | None = None,
        compile: bool | None = None,
    ):
        from runtime.model.weights import load_language_pass, load_vision_tower, read_config

        config = config or RuntimeConfig.from_env()
        cuda = torch.cuda.is_available() and config.device != "cpu"
        self.device = torch.device(config.device or ("cuda" if cuda else "cpu"))
        cuda = self.device.type == "cuda"
        if cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = dtype or engine_dtype(Path(engines_dir), cuda)
        self.artifacts = check_artifacts(Path(engines_dir))
        if self.artifacts is not None:
            use_caches(self.artifacts)
        self.fla = cuda and fla_importable()
        if cuda and self.dtype == torch.float32:
            torch.set_float32_matmul_precision("highest")  # no TF32: float32 parity needs it
        self.compiled = cuda if compile is None else compile
        graphs = cuda  # every pass replays a CUDA graph where there are any
        self.config = read_config(checkpoint)
        started = time.perf_counter()
        self.language = load_language_pass(checkpoint, self.dtype).to(self.device)
        self.vision, _ = load_vision_tower(checkpoint, self.dtype)
        self.vision = self.vision.to(self.device)
        self.weights_seconds = time.perf_counter() - started  # a cold start's parts, reported
        self.prepare_modules(cuda)
        self.rows_fit = self.fit_rows()
        self.table = padded_table(self.language.embed_tokens.weight.data)
        self.language.embed_tokens.weight.data = self.table[: self.vocab]
        self.functions = self.make_functions()
        self.lanes = LANES if graphs else 1
        # lane 0 is the caller's stream, its graphs captured on one stream of their own; each
        # other lane runs and captures on its own stream (distinct streams of torch's pool)
        self.streams = lane_streams(self.device, self.lanes) if self.lanes > 1 else [None]
        self.slots = {
            graph: GraphSlots(
                self.device,
                bind=self.bind,
                launch=partial(self.launch, graph),
                size=IMAGE_SLOTS if graph == IMAGE_GRAPH else GRAPH_SLOTS,
                capture=graphs,
                stream=self.streams[0],
            )
            for graph in (*VISION_GRAPHS, *LM_GRAPHS)
        }
        self.lane_slots = [
            GraphSlots(
                self.device,
                bind=partial(self.bind, lane=lane),
                launch=partial(self.launch, JOINT_GRAPH),
                size=GRAPH_SLOTS,
                capture=graphs,
                stream=self.streams[lane],
            )
            for lane in range(1, self.lanes)
        ]
        self._dtypes = {graph: self.graph_dtypes(graph) for graph in self.slots}
        # what `checked` lets through: the graphs' inputs, and for the passes the plan's
        # `target_slots` (each part's), which the readout reads and no graph takes
        slots = dict.fromkeys(("target_slots", JOINT + "target_slots"), torch.int64)
        self._fed = {
            graph: {**dtypes, **slots} if graph in LM_GRAPHS else dtypes
            for graph, dtypes in self._dtypes.items()
        }
        self.pixel_table = torch.from_numpy(NORMALIZED).to(self.device)  # the patches' lookup
        self.buffers: dict[tuple, torch.Tensor] = {}  # static inputs, by (name, shape, dtype)
        # pass shapes to build when the worker is idle (`build_later`), by signature: lane
        self.pending: dict[tuple, int] = {}
        self.capabilities = Capabilities(
            rows_fit=self.rows_fit,
            joint=self.rows_fit,  # lm_joint keeps a row's bytes where the floors hold
            image_graph=False,
            # a pass asked for no readout outputs reads none: the image prefix's padded readout
            # would be a 128-row piece over the vocabulary
            optional_readouts=True,
            padded_targets=False,  # `readout` pads the targets to its READOUT_PIECE rows itself
            lanes=self.lanes,
            asynchronous=cuda,
            # the attention kernel reads each row's prefix in place; folded_attention runs a
            # prefix's products for each prefix a pass reads (its rows' bytes as with one), so
            # many prefixes cost the CPU and float32 paths a product each
            prefixes=MAX_PREFIXES,
            merges=not cuda,
            packed=True,
            # the suite's 160 requests gave 129 joint-pass shapes with the prefix's own length,
            # 41 with the longest (bench.gpu plans), each captured inside the requests that met
            # it first; the attention kernel adds a masked key's weight as an exact zero
            fixed_prefix_keys=graphs,
        )

    # -- set-up -----------------------------------------------------------------------------

    @property
    def vocab(self) -> int:
        return self.language.embed_tokens.num_embeddings

    @property
    def name(self) -> str:
        parts = ["torch", self.device.type, str(self.dtype).removeprefix("torch.")]
        if self.fla:
            parts.append("fla")
        if self.compiled:
            parts.append("compiled")
        if self.slots["lm_state"].capture:
            parts.append("graphs")
        return "-".join(parts[:2]) + "".join(f"+{p}" for p in parts[2:])

    def prepare_modules(self, cuda: bool) -> None:
        """The runtime forms of attention and Gated DeltaNet and the fused input projections (the
        export keeps its own)."""
        half = self.dtype in (torch.bfloat16, torch.float16)
        kernel = attention_kernel(cuda and half)
        packed_attend, packed_core = packed_forms(cuda)
        for layer in self.language.layers:
            if layer.kind == "full_attention":
                layer.self_attn.attend = kernel or folded_attention
                layer.self_attn.packed_attend = packed_attend
                layer.self_attn.fuse()
            else:
                layer.linear_attn.core = "fla" if self.fla else "eager"
                layer.linear_attn.packed_core = packed_core
                layer.linear_attn.fuse()
            layer.mlp.fuse()  # 4 products a layer in place of 7 or 8
        # fused attention only in half precision: its float32 kernels are not the reference's
        # float32 arithmetic (float32 answers moved by up to 0.028 on the H200, tensor-core
        # rounding suspected; the explicit products run at "highest" precision)
        for block in self.vision.blocks:
            block.sdpa = cuda and half
        for module in (self.language, self.vision):
            module.requires_grad_(False)

    def fit_rows(self) -> bool:
        """Whether passes may be fitted to the request: each product gets the row floor under
        which its rows' bytes do not follow the row count (row_floor), the folded attention
        one shape per length (folded_attention's min_tokens), fla's one cumsum kernel that
        its autotuner keys by batch size one configuration. False, and nothing changed, when
        some product has no such floor. The floors are measured up to JOINT_TOKENS rows, else
        FIT_TOKENS."""
        started = time.perf_counter()
        for tokens in (JOINT_TOKENS, FIT_TOKENS):
            floors = row_floors(self.language, tokens)
            if floors is not None:
                break
        self.floor_seconds = time.perf_counter() - started
        if floors is None:
            log.warning("a product has no row floor: passes keep fixed rows")
            return False
        log.info("row floors %s up to %d rows (%.1f s)", floors, tokens, self.floor_seconds)
        self.row_floors = floors
        for layer in self.language.layers:
            block = layer.self_attn if layer.kind == "full_attention" else layer.linear_attn
            block.row_floors = layer.mlp.row_floors = floors
            # the attention kernel needs no fixed rows: a program holds one row's queries
            if layer.kind == "full_attention" and block.attend is folded_attention:
                block.attend = partial(folded_attention, min_tokens=FIT_TOKENS)
        if self.fla:
            pin_fla_cumsum()
        return True

    def make_functions(self) -> dict:
        """The three graphs' bodies and the readout piece. On CUDA compiled by region: the
        vision tower whole, the language-model passes one decoder layer at a time (one
        compilation per layer kind and shape family serves all 32 layers: a whole pass compiled
        as one graph took over 7 minutes on the H200's host), dynamic shapes (one compilation
        serves every bucket of a family; each shape still gets its own CUDA graph)."""
        functions = {
            "vision": self.vision,
            "lm_state": partial(pass_body, self.language, return_state=True),
            "lm_rows": partial(pass_body, self.language, return_state=False),
            JOINT_GRAPH: partial(joint_body, self.language),
            PACKED_GRAPH: partial(packed_body, self.language),
            "readout": partial(piece_norms, vocab=self.vocab),
            "pick": picked_logprobs,
        }
        if not self.compiled:
            return functions
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = RECOMPILE_LIMIT
        if hasattr(torch._dynamo.config, "recompile_limit"):
            torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
        self.compile_modes = invariant_compilation()
        blocks = {name: torch.compile(f, dynamic=True) for name, f in BLOCKS.items()}
        joint = {name: torch.compile(f, dynamic=True) for name, f in JOINT_BLOCKS.items()}
        packed = {name: torch.compile(f, dynamic=True) for name, f in PACKED_BLOCKS.items()}
        return {
            "vision": torch.compile(self.vision, dynamic=True),
            "lm_state": partial(pass_body, self.language, return_state=True, blocks=blocks),
            "lm_rows": partial(pass_body, self.language, return_state=False, blocks=blocks),
            JOINT_GRAPH: partial(joint_body, self.language, blocks=joint),
            PACKED_GRAPH: partial(packed_body, self.language, blocks=packed),
            "readout": torch.compile(functions["readout"], dynamic=False),
            "pick": torch.compile(picked_logprobs, dynamic=True),
        }

    def graph_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        if graph == "vision":
            return dict.fromkeys(VISION_INPUTS, torch.float32)
        if graph == IMAGE_GRAPH:
            return {"rgb": torch.uint8, **dict.fromkeys(IMAGE_INPUTS[1:], torch.float32)}
        if graph == PACKED_GRAPH:
            return self.packed_dtypes()
        dtypes = {}
        for name in lm_input_names(self.config):
            if name in ("prefix_mask", "src_mask"):
                dtypes[name] = torch.bool
            elif name == "prefix_rows":
                dtypes[name] = torch.int64
            elif name.startswith("src_rec."):
                dtypes[name] = torch.float32
            elif name == "image_features" or name.startswith(("prefix_", "src_k", "src_v")):
                dtypes[name] = self.dtype
            elif name.startswith("src_conv."):
                dtypes[name] = self.dtype
            else:
                dtypes[name] = torch.int64
        if graph == JOINT_GRAPH:
            dtypes.update({JOINT + name: torch.int64 for name in ROW_INPUTS})
        return dtypes

    def packed_dtypes(self) -> dict[str, torch.dtype]:
        """`lm_packed`'s inputs: the tokens and row tables, the image prefixes' keys and values,
        and their after-prefix states."""
        readouts = ("read_rows", "target_rows", "target_tokens")
        dtypes = dict.fromkeys((*TOKEN_INPUTS, *ROW_TABLES, *readouts), torch.int64)
        dtypes["image_features"] = self.dtype
        for name in lm_input_names(self.config):
            if name.startswith(("prefix_k.", "prefix_v.", "src_conv.")):
                dtypes[name] = self.dtype
            elif name.startswith("src_rec."):
                dtypes[name] = torch.float32
        dtypes["prefix_mask"] = torch.bool
        return dtypes

    # -- the contract -----------------------------------------------------------------------

    def has_graph(self, graph: str) -> bool:
        return graph in self._dtypes

    def input_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        return self._dtypes[graph]

    def output_names(self, graph: str) -> list[str]:
        if graph in VISION_GRAPHS:
            return ["image_features"]
        if graph == JOINT_GRAPH:
            return [*READOUT_OUTPUTS, *(JOINT + name for name in READOUT_OUTPUTS)]
        return lm_output_names(self.config, graph == "lm_state")

    def lane_stream(self, lane: int) -> torch.cuda.Stream | None:
        """The stream a lane's joint passes run on; None for lane 0 (the caller's stream)."""
        return self.streams[lane] if 0 < lane < self.lanes else None

    def run(
        self,
        graph: str,
        feeds: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
        lane: int = 0,
    ) -> None:
        """One pass; a joint pass in `lane` > 0 replays that lane's graph, reading that lane's
        static inputs (the caller has made the lane's stream current)."""
        if lane and (graph != JOINT_GRAPH or lane >= self.lanes):
            raise ValueError(f"{graph} has no lane {lane} (lanes: {self.lanes})")
        feeds = self.checked(graph, feeds)
        if graph == "vision" and self.device.type == "cuda":
            self.run_vision(feeds, outputs["image_features"])
            return
        if graph in VISION_GRAPHS:
            if self.device.type != "cuda":
                outputs["image_features"].copy_(self.compute(graph, feeds)["image_features"])
            else:
                self.slots[graph].run(signature(graph, feeds), feeds, outputs)
            return
        body = graph_body(feeds)
        states = {n: t for n, t in outputs.items() if unprefixed(n) not in READOUT_OUTPUTS}
        if self.device.type != "cuda":
            results = self.compute(graph, body)
            for name, out in states.items():
                out.copy_(results[name])
        else:
            slots = self.graph_slots(graph, lane)
            results = slots.run(signature(graph, body), body, states).outputs
        if any(unprefixed(name) in READOUT_OUTPUTS for name in outputs):
            self.read(results["flat"], feeds, outputs, joint=graph == JOINT_GRAPH)

    def run_vision(self, feeds: dict[str, torch.Tensor], out: torch.Tensor) -> None:
        """The vision tower on CUDA, its patches padded to the next PATCH_STEP (`padded_patches`):
        one graph for every grid of a bucket; the image's rows are the first of its output."""
        padded = padded_patches(feeds)
        merged = padded["pixel_values"].shape[0] // self.vision.merge**2
        full = out.new_empty(merged, out.shape[1])
        self.slots["vision"].run(signature("vision", padded), padded, {"image_features": full})
        out.copy_(full[: out.shape[0]])

    def vision_shapes(self) -> list[tuple]:
        """The vision tower's signatures on CUDA, one a patch bucket (`prepare` builds them)."""
        widths = {"pixel_values": self.vision.patch_width, "pos_embeds": self.vision.width}
        widths["cos"] = widths["sin"] = self.vision.head_dim
        shapes = []
        for size in range(PATCH_STEP, patch_bucket(MAX_PATCHES) + 1, PATCH_STEP):
            specs = [(n, (size, widths[n]), torch.float32) for n in VISION_INPUTS]
            shapes.append(("vision", *specs, ("patches", (1,), torch.int64)))
        return shapes

    def graph_slots(self, graph: str, lane: int) -> GraphSlots:
        """The slots a pass of `graph` in `lane` replays."""
        return self.lane_slots[lane - 1] if lane else self.slots[graph]

    def read(self, flat: torch.Tensor, feeds: dict, outputs: dict, joint: bool) -> None:
        """The readouts of a pass from `flat`; a joint pass's option tokens follow its question
        rows' there, and both parts' log-probabilities come from one `readout` (each row once,
        where the plan gave `target_slots`: Pass.arrays(pad=False))."""
        parts = [("", 0)]
        if joint:
            parts.append((JOINT, feeds["input_ids"].numel()))
        for prefix, offset in parts:
            outputs[prefix + "hidden"].copy_(flat[feeds[prefix + "read_rows"] + offset])
        rows, slots, tokens, at = [], [], [], 0
        for prefix, offset in parts:
            mine = feeds[prefix + "target_rows"]
            slot = feeds.get(prefix + "target_slots")
            if slot is None:
                slot = torch.arange(mine.shape[0], device=mine.device)
            rows.append(mine + offset)
            slots.append(slot + at)
            tokens.append(feeds[prefix + "target_tokens"])
            at += mine.shape[0]
        wide = any(feeds[p + "input_ids"].shape[0] > CHUNK_MAX_ROWS for p, _ in parts[1:])
        piece = WIDE_READOUT_PIECE if wide else READOUT_PIECE
        logprobs = self.readout(flat, torch.cat(rows), torch.cat(tokens), torch.cat(slots), piece)
        at = 0
        for prefix, _ in parts:
            count = outputs[prefix + "logprobs"].shape[0]
            outputs[prefix + "logprobs"].copy_(logprobs[at : at + count])
            at += count

    def prepare(self, signatures: list[tuple], lane: int = 0) -> int:
        """Compiles and captures each pass signature ahead of its first request, on stand-in
        feeds (zeros, every row one token long): a graph's work depends on shapes alone. A
        joint pass's in `lane` (its stream current)."""
        new = 0
        for given in signatures:
            graph, *specs = given
            feeds = graph_body(
                {name: stand_in(name, shape, dtype, self.device) for name, shape, dtype in specs}
            )
            key, slots = signature(graph, feeds), self.graph_slots(graph, lane)
            slot = slots.get(key)
            if slot is not None and slot.built:
                continue
            while slot is None or not slot.built:  # eager launches, then the capture
                slot = slots.run(key, feeds, {})
            new += 1
        return new

    def settle(self) -> int:
        return 0  # nothing builds in the background: compilation happens in prepare or run

    def built(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> bool:
        if self.device.type != "cuda":
            return True  # nothing is captured: every shape runs as it comes
        key = signature(graph, graph_body(self.checked(graph, feeds)))
        slot = self.graph_slots(graph, lane).get(key)
        return slot is not None and slot.built

    def build_later(self, graph: str, feeds: dict[str, torch.Tensor], lane: int = 0) -> None:
        body = graph_body(self.checked(graph, feeds))
        specs = tuple((name, tuple(t.shape), t.dtype) for name, t in body.items())
        self.pending[(graph, *specs)] = lane

    def build_pending(self) -> bool:
        """Builds the oldest noted shape on stand-in feeds (`prepare`), in its lane's stream."""
        if not self.pending:
            return False
        given = next(iter(self.pending))
        lane = self.pending.pop(given)
        stream = self.lane_stream(lane)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            self.prepare([given], lane)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return bool(self.pending)

    def stats(self) -> dict:
        lanes = {f"{JOINT_GRAPH}@{k + 1}": s.stats() for k, s in enumerate(self.lane_slots)}
        every = [*self.slots.values(), *self.lane_slots]
        graphs = {graph: slots.stats() for graph, slots in self.slots.items()}
        return {**graphs, **lanes, **builds_of(every)}

    # -- passes -----------------------------------------------------------------------------

    def checked(self, graph: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The graph's feeds, and the plan's `target_slots` (not a graph input: the readout's)."""
        return checked_feeds(graph, feeds, self._fed[graph], self.device)

    def bind(
        self, key: tuple, feeds: dict[str, torch.Tensor], outputs: dict, lane: int = 0
    ) -> Slot:
        """A slot's static inputs, shared by every slot with an input of that name and shape
        (passes run one at a time and each copies its feeds in just before its replay: one
        0.8 GB recurrent-state buffer serves every option-pass shape of the 4b); its outputs are
        whatever the launch returned last (during a capture: tensors of the graph's own pool,
        rewritten by every replay). A lane's slots share the lane's buffers only."""
        inputs = {
            name: self.state_buffer(name, tuple(tensor.shape), tensor.dtype, lane)
            for name, tensor in feeds.items()
        }
        return Slot(inputs=inputs, outputs={})

    def state_buffer(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, lane: int = 0
    ) -> torch.Tensor:
        """The static input buffer a pass reads the input `name` of this shape from (`bind`
        makes every slot's inputs here): a question pass writes its states there, and the option
        passes after it read them without a copy in (0.8 GB of recurrent state per 16-row
        question pass of the 4b). The CPU lends too, so that the tests run the same order of
        writes and reads."""
        key = (name, tuple(shape), dtype) if not lane else (lane, name, tuple(shape), dtype)
        if key not in self.buffers:
            self.buffers[key] = torch.empty(shape, dtype=dtype, device=self.device)
        return self.buffers[key]

    def launch(self, graph: str, slot: Slot) -> None:
        slot.outputs.update(self.compute(graph, slot.inputs))

    def compute(self, graph: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """One graph's body: the vision rows, or a pass's states and `flat` (every position
        after the final norm, which the readouts read)."""
        if graph == "vision":
            tower = self.functions["vision"]
            inputs = (feeds[n] for n in VISION_INPUTS)
            return {"image_features": tower(*inputs, feeds.get("patches"))}
        if graph == IMAGE_GRAPH:
            pixels = self.image_pixels(feeds["rgb"])
            tables = (feeds[n] for n in IMAGE_INPUTS[1:])
            return {"image_features": self.functions["vision"](pixels, *tables)}
        return self.functions[graph](feeds)

    def image_pixels(self, rgb: torch.Tensor) -> torch.Tensor:
        """The vision tower's float32 patches of a decoded uint8 image: `resize_rgb_torch` to
        `smart_resize` of its size, then `device_pixel_values`, the host's bytes (executor's
        `pixel_values` on the same image)."""
        height, width = smart_resize(rgb.shape[0], rgb.shape[1])
        resized = resize_rgb_torch(rgb, height, width)
        return device_pixel_values(resized, self.pixel_table).contiguous()

    def readout(
        self,
        flat: torch.Tensor,
        target_rows: torch.Tensor,
        tokens: torch.Tensor,
        slots: torch.Tensor | None = None,
        piece: int | None = None,
    ) -> torch.Tensor:
        """Log-probabilities of `tokens`, target i at row `target_rows[slots[i]]` of `flat`
        (`slots` None: target i at `target_rows[i]`), `piece` rows at a time (READOUT_PIECE
        where None), each row once; every target reads the piece its row is in."""
        if slots is None:
            slots = torch.arange(target_rows.shape[0], device=target_rows.device)
        piece = piece or READOUT_PIECE
        count = target_rows.shape[0]
        pad = (-count) % piece
        rows = flat[F.pad(target_rows, (0, pad))]
        norms, pick = self.functions["readout"], self.functions["pick"]
        result = None
        for at in range(0, count + pad, piece):
            scores, peak, log_total = norms(rows[at : at + piece], self.table)
            local = slots - at
            value = pick(scores, peak, log_total, local.clamp(0, piece - 1), tokens)
            inside = (local >= 0) & (local < piece)
            result = value if result is None else torch.where(inside, value, result)
        return result


def patch_bucket(patches: int) -> int:
    """The patch count of the vision graph an image of `patches` patches runs in."""
    return max(PATCH_STEP, -(-patches // PATCH_STEP) * PATCH_STEP)


def padded_patches(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The vision tower's feeds with zero patches up to `patch_bucket`, and `patches`, how many
    are the image's (int64 [1], made on the device: no host wait)."""
    count = feeds["pixel_values"].shape[0]
    extra = patch_bucket(count) - count
    padded = {name: F.pad(feeds[name], (0, 0, 0, extra)) for name in VISION_INPUTS}
    device = feeds["pixel_values"].device
    padded["patches"] = torch.full((1,), count, dtype=torch.int64, device=device)
    return padded


def lane_streams(device: torch.device, lanes: int) -> list[torch.cuda.Stream]:
    """`lanes` distinct streams: lane 0's capture stream, then each other lane's. torch hands
    out its pooled streams in turn, so consecutive ones differ; the check says so."""
    streams = [torch.cuda.Stream(device) for _ in range(lanes)]
    if len({s.cuda_stream for s in streams}) != lanes:
        raise RuntimeError(f"lanes need {lanes} distinct CUDA streams")
    return streams


def graph_body(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The feeds a pass's graph takes, its readout's aside: what its slots are keyed by."""
    return {n: t for n, t in feeds.items() if unprefixed(n) not in READOUT_INPUTS}


def unprefixed(name: str) -> str:
    """A feed's or output's name without its joint part's prefix."""
    return name.removeprefix(JOINT)


def product_weights(language) -> list[torch.Tensor]:
    """One weight of each shape the passes multiply by, as they run it (fused where fused)."""
    found: dict[tuple, torch.Tensor] = {}
    for layer in language.layers:
        if layer.kind == "full_attention":
            attn = layer.self_attn
            weights = [attn.qkv, attn.o_proj.weight]
        else:
            delta = layer.linear_attn
            weights = [delta.in_proj, delta.out_proj.weight]
        weights += [layer.mlp.gate_up, layer.mlp.down_proj.weight]
        for weight in weights:
            if weight is not None:
                found.setdefault(tuple(weight.shape), weight)
    return list(found.values())


def row_floors(language, tokens: int) -> dict[tuple, int] | None:
    """Each product's `row_floor` up to `tokens` rows, by weight shape; None if one has none."""
    floors = {}
    for weight in product_weights(language):
        floor = row_floor(weight, tokens)
        if floor is None:
            log.info("product %s: no row floor up to %d rows", tuple(weight.shape), tokens)
            return None
        floors[tuple(weight.shape)] = floor
    return floors


def row_floor(weight: torch.Tensor, tokens: int) -> int | None:
    """The first of FLOOR_CANDIDATES under which every multiple of ROW_STEP rows below `tokens`
    gives each row the bytes it has in a product of `tokens` rows; None if none does."""
    generator = torch.Generator(device=weight.device).manual_seed(FLOOR_SEED)
    x = torch.randn(
        tokens, weight.shape[1], generator=generator, device=weight.device, dtype=weight.dtype
    )
    full = product(x, weight)
    rows = range(ROW_STEP, tokens, ROW_STEP)
    for floor in FLOOR_CANDIDATES:
        floors = {tuple(weight.shape): floor}
        if all(torch.equal(product(x[:m], weight, floors), full[:m]) for m in rows):
            return floor
    return None


def invariant_compilation() -> list[str]:
    """Compiler settings that keep a row's bytes whatever the shape it runs in; the ones this
    torch has. Without them a pass's bytes followed which compiled graph ran it (on the GPU a
    question asked alone moved in joint passes):
    - no duck sizing: sizes that happen to be equal when a block is traced (a joint pass's
      question and option rows, say) are not made one symbol, which made a new graph, with
      kernels of its own, each time they later differed;
    - Inductor's batch-invariant or deterministic mode: a reduction's configuration (how
      many threads sum a row, which sets the order of its sums) is not picked by timing, so
      two graphs, or two processes, do not sum a norm's row differently."""
    import torch._inductor.config as inductor
    import torch.fx.experimental._config as shapes

    modes = []
    if hasattr(shapes, "use_duck_shape"):
        shapes.use_duck_shape = False
        modes.append("no duck shapes")
    for name in ("batch_invariant", "deterministic"):
        if hasattr(inductor, name):
            setattr(inductor, name, True)
            modes.append(name)
            break
    log.info("compiled with %s", ", ".join(modes) or "no invariance settings")
    return modes


def pin_fla_cumsum() -> None:
    """fla's chunk-local cumsum is autotuned over warp counts keyed by batch size, and a scan's
    sum order follows its warps: with fitted passes a question's gates could be summed
    differently as its pass's rows change. One configuration (one warp: a chunk is 64 values)
    takes the autotuner out of it."""
    from fla.ops.utils import cumsum

    pinned = 0
    for name in dir(cumsum):
        tuner = getattr(cumsum, name)
        while tuner is not None and not hasattr(tuner, "configs"):
            tuner = getattr(tuner, "fn", None)  # under triton.heuristics
        if tuner is not None and "B" in getattr(tuner, "keys", ()):
            tuner.configs = tuner.configs[:1]
            pinned += 1
    if not pinned:
        log.warning("no fla cumsum autotuner keyed by batch size found to pin")


def stand_in(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A feed for warm-up: zeros, except one valid token per row (a joint pass's parts too)."""
    if unprefixed(name) == "lengths":
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
