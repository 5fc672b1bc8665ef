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
from functools import partial
from importlib import metadata
from pathlib import Path

import torch
import torch.nn.functional as F

from runtime.backends.base import Capabilities
from runtime.backends.graphs import GraphSlots, Slot, builds_of, checked_feeds, signature
from runtime.config import RuntimeConfig, cache_home
from runtime.constants import DTYPES, MAX_PREFIXES, PACKED_GRAPH
from runtime.images import FACTOR, MAX_PIXELS
from runtime.model.language import (
    BLOCKS,
    folded_attention,
    lm_input_names,
    lm_output_names,
    pass_body,
)
from runtime.model.packed import (
    PACKED_BLOCKS,
    ROW_TABLES,
    TOKEN_INPUTS,
    packed_body,
    products_differ,
)
from runtime.packing import PACK_SIZES

log = logging.getLogger("omnijev.torch")

# readout rows per matrix product: every piece has this one shape, so a row's log-probability
# never depends on how many other rows the pass reads (invariance); 128 rows × the 248,079-row
# table is where the product stops being bound by reading the table (1.27 GB in BF16)
READOUT_PIECE = 128
# embedding rows padded to a multiple of this for the readout product: 248,079 rows sent cuBLAS
# to an sm75 kernel on the H200 (docs/engines.md §15); the padded rows are never read
TABLE_ALIGN = 64
GRAPH_SLOTS = 64  # shape signatures kept per graph, each with its buffers and CUDA graph
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
# the image prefix's pass (the ONNX files' `lm_state`), and the packed passes after it
LM_GRAPHS = ("lm_state", PACKED_GRAPH)
VERSIONED = ("torch", "triton", "fla-core")  # what compiled artifacts were made with
# read by the readout, which runs after the captured body: a pass's graph is keyed by the body's
# shapes alone, so readout counts (which vary with the questions asked) add no graph or memory
READOUT_INPUTS = ("read_rows", "target_rows", "target_tokens", "target_slots")
READOUT_OUTPUTS = ("hidden", "logprobs")
# the image prefixes every captured packed pass reads (one graph a packed size, whatever the
# batch): up to four requests' rows share a pass (about 70 MB a prefix on the 4b)
GRAPH_PREFIXES = 4
# the packed pass's feeds of one row an image prefix: a stack of fewer than GRAPH_PREFIXES goes
# into the first rows of the graph's own input buffers, the rest left as they are (no row reads
# them): a stack padded with copies, then copied in, would move 560 MB a pass on the 4b
PREFIX_STACK = ("prefix_k.", "prefix_v.", "prefix_mask", "src_conv.", "src_rec.")


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
    """Runs `vision`, `lm_state` (the image prefix) and the packed passes `lm_packed` with the
    model's modules (runtime.model)."""

    max_pass_tokens = None  # fla's kernels and the eager core take any length
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
        weights = time.perf_counter()
        self.weights_seconds = weights - started  # a cold start's parts, reported
        self.prepare_modules(cuda)
        # merging requests needs products whose rows keep their bytes at every pass size
        self.products_differ = self.check_products()
        # a start's parts (the executor logs the whole backend's)
        log.info(
            "backend: weights %.2f s, modules and products check %.2f s",
            self.weights_seconds,
            time.perf_counter() - weights,
        )
        if self.products_differ:
            shown = ", ".join(self.products_differ[:4])
            log.warning("products move a row's bytes here (%s): requests run alone", shown)
        self.table = padded_table(self.language.embed_tokens.weight.data)
        self.language.embed_tokens.weight.data = self.table[: self.vocab]
        self.functions = self.make_functions()
        # one memory pool for every captured graph: passes run one at a time on one stream, and
        # `run` reads a pass's outputs before the next (graphs.GraphSlots); a pool a graph held
        # every graph's temporaries at once, most of the device memory the worker took
        pool = torch.cuda.graph_pool_handle() if graphs else None
        self.slots = {
            graph: GraphSlots(
                self.device,
                bind=self.bind,
                launch=partial(self.launch, graph),
                size=GRAPH_SLOTS,
                capture=graphs,
                pool=pool,
            )
            for graph in ("vision", *LM_GRAPHS)
        }
        self._dtypes = {graph: self.graph_dtypes(graph) for graph in self.slots}
        # what `checked` lets through: the graphs' inputs, and for the passes the plan's
        # `target_slots`, which the readout reads and no graph takes
        slots = {"target_slots": torch.int64}
        self._fed = {
            graph: {**dtypes, **slots} if graph in LM_GRAPHS else dtypes
            for graph, dtypes in self._dtypes.items()
        }
        self.buffers: dict[tuple, torch.Tensor] = {}  # static inputs, by (name, shape, dtype)
        self.capabilities = Capabilities(
            # a pass asked for no readout outputs reads none: the image prefix's padded readout
            # would be a 128-row piece over the vocabulary
            optional_readouts=True,
            padded_targets=False,  # `readout` pads the targets to its READOUT_PIECE rows itself
            asynchronous=cuda,
            # a packed row reads its own prefix's keys in place, whatever the others' prefixes
            prefixes=GRAPH_PREFIXES if graphs else MAX_PREFIXES,
            # a packed row's bytes never follow its pass (runtime.model.packed) where the
            # machine's products do not: the worker still checks a batch before ready
            # (Executor.check_batches)
            merges=not self.products_differ,
            packed=True,
            # one packed graph a size, not one a size and prefix length besides: a masked key's
            # weight is an exact zero in the packed attention
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

    def check_products(self) -> list[str]:
        """This machine's products that give a row other bytes at another pass size (none: a
        pass may merge several requests' rows)."""
        return products_differ(self.language, PACK_SIZES)

    def make_functions(self) -> dict:
        """The graphs' bodies and the readout piece. On CUDA compiled by region: the vision
        tower whole, the language-model passes one decoder layer at a time (one compilation per
        layer kind and shape family serves all 32 layers: a whole pass compiled as one graph
        took over 7 minutes on the H200's host), dynamic shapes (one compilation serves every
        size; each size still gets its own CUDA graph)."""
        functions = {
            "vision": self.vision,
            "lm_state": partial(pass_body, self.language, return_state=True),
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
        packed = {name: torch.compile(f, dynamic=True) for name, f in PACKED_BLOCKS.items()}
        return {
            "vision": torch.compile(self.vision, dynamic=True),
            "lm_state": partial(pass_body, self.language, return_state=True, blocks=blocks),
            PACKED_GRAPH: partial(packed_body, self.language, blocks=packed),
            "readout": torch.compile(functions["readout"], dynamic=False),
            "pick": torch.compile(picked_logprobs, dynamic=True),
        }

    def graph_dtypes(self, graph: str) -> dict[str, torch.dtype]:
        if graph == "vision":
            return dict.fromkeys(VISION_INPUTS, torch.float32)
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
        if graph == "vision":
            return ["image_features"]
        if graph == PACKED_GRAPH:
            return list(READOUT_OUTPUTS)
        return lm_output_names(self.config, return_state=True)

    def run(
        self,
        graph: str,
        feeds: dict[str, torch.Tensor],
        outputs: dict[str, torch.Tensor],
    ) -> None:
        """One pass: on CUDA its shape's captured graph, elsewhere the eager body."""
        feeds = self.checked(graph, feeds)
        if graph == "vision":
            if self.device.type == "cuda":
                self.run_vision(feeds, outputs["image_features"])
            else:
                outputs["image_features"].copy_(self.compute(graph, feeds)["image_features"])
            return
        body = graph_body(feeds)
        if graph == PACKED_GRAPH and self.device.type == "cuda":
            body = self.stacked_in_place(body)
        states = {n: t for n, t in outputs.items() if n not in READOUT_OUTPUTS}
        if self.device.type != "cuda":
            results = self.compute(graph, body)
            for name, out in states.items():
                out.copy_(results[name])
        else:
            results = self.slots[graph].run(signature(graph, body), body, states).outputs
        if any(name in READOUT_OUTPUTS for name in outputs):
            self.read(results["flat"], feeds, outputs)

    def stacked_in_place(self, body: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A packed pass's feeds with its image prefixes in the first rows of the input buffers
        of the graph that reads GRAPH_PREFIXES of them, where that graph is built (a clip's
        pass, of one prefix at a clip's keys, has no such graph and runs as given)."""
        count = body["prefix_mask"].shape[0]
        if count >= GRAPH_PREFIXES:
            return body
        wide = {
            name: (GRAPH_PREFIXES, *t.shape[1:]) if name.startswith(PREFIX_STACK) else t.shape
            for name, t in body.items()
        }
        key = (PACKED_GRAPH, *((name, tuple(wide[name]), t.dtype) for name, t in body.items()))
        if self.slots[PACKED_GRAPH].get(key) is None:
            return body
        placed = dict(body)
        for name, tensor in body.items():
            if name.startswith(PREFIX_STACK):
                buffer = self.state_buffer(name, wide[name], tensor.dtype)
                buffer[:count].copy_(tensor, non_blocking=True)
                placed[name] = buffer
        return placed

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

    def read(self, flat: torch.Tensor, feeds: dict, outputs: dict) -> None:
        """The readouts of a pass from `flat`: the hidden states at `read_rows`, and the
        log-probabilities from one `readout` (each row once, where the plan gave
        `target_slots`)."""
        outputs["hidden"].copy_(flat[feeds["read_rows"]])
        rows, tokens = feeds["target_rows"], feeds["target_tokens"]
        slots = feeds.get("target_slots")
        outputs["logprobs"].copy_(self.readout(flat, rows, tokens, slots))

    def prepare(self, signatures: list[tuple]) -> int:
        """Compiles and captures each pass signature ahead of its first request, on stand-in
        feeds (zeros, every row one token long): a graph's work depends on shapes alone."""
        new = 0
        for given in signatures:
            graph, *specs = given
            feeds = graph_body(
                {name: stand_in(name, shape, dtype, self.device) for name, shape, dtype in specs}
            )
            key, slots = signature(graph, feeds), self.slots[graph]
            slot = slots.get(key)
            if slot is not None and slot.built:
                continue
            while slot is None or not slot.built:  # eager launches, then the capture
                slot = slots.run(key, feeds, {})
            new += 1
        return new

    def settle(self) -> int:
        return 0  # nothing builds in the background: compilation happens in prepare or run

    def stats(self) -> dict:
        graphs = {graph: slots.stats() for graph, slots in self.slots.items()}
        return {**graphs, **builds_of(self.slots.values())}

    # -- passes -----------------------------------------------------------------------------

    def checked(self, graph: str, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The graph's feeds, and the plan's `target_slots` (not a graph input: the readout's)."""
        return checked_feeds(graph, feeds, self._fed[graph], self.device)

    def bind(self, key: tuple, feeds: dict[str, torch.Tensor], outputs: dict) -> Slot:
        """A slot's static inputs, shared by every slot with an input of that name and shape
        (passes run one at a time and each copies its feeds in just before its replay: one
        prefix-state buffer serves every packed size); its outputs are whatever the launch
        returned last (during a capture: tensors of the graphs' one pool, good until the next
        replay of any graph, so `run` reads them at once)."""
        inputs = {
            name: self.state_buffer(name, tuple(tensor.shape), tensor.dtype)
            for name, tensor in feeds.items()
        }
        return Slot(inputs=inputs, outputs={})

    def state_buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The static input buffer a pass reads the input `name` of this shape from."""
        key = (name, tuple(shape), dtype)
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
        return self.functions[graph](feeds)

    def readout(
        self,
        flat: torch.Tensor,
        target_rows: torch.Tensor,
        tokens: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Log-probabilities of `tokens`, target i at row `target_rows[slots[i]]` of `flat`
        (`slots` None: target i at `target_rows[i]`), READOUT_PIECE rows at a time, each row
        once; every target reads the piece its row is in."""
        if slots is None:
            slots = torch.arange(target_rows.shape[0], device=target_rows.device)
        piece = READOUT_PIECE
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


def graph_body(feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The feeds a pass's graph takes, its readout's aside: what its slots are keyed by."""
    return {n: t for n, t in feeds.items() if n not in READOUT_INPUTS}


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


def stand_in(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A feed for warm-up: zeros, except one valid token per row."""
    if name == "lengths":
        return torch.ones(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)
