"""Writes `vision.onnx`, `lm_state.onnx` and `lm_rows.onnx` from an export directory, with the
inputs and outputs of docs/design.md, and `onnx_export.json` describing them.

Uses the dynamo exporter (`torch.onnx.export(dynamo=True, dynamic_shapes=...)`); ir_version is
capped at 13 for onnxruntime 1.31 (docs/engines.md §0.5, §8).
"""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path

import onnx
import onnx_ir as ir
import torch
from torch.export import Dim

from plugins.readout import DOMAIN, GEMM_OPSET
from runtime.constants import DTYPES, GRAPHS, MODEL_DTYPES
from runtime.model.gdn import GDN_VARIANTS, STD_MAX_TOKENS
from runtime.model.language import (  # noqa: F401 (the graph names, re-exported)
    READOUT_VARIANTS,
    LanguagePass,
    layer_counts,
    lm_args,
    lm_input_names,
    lm_output_names,
)
from runtime.model.vision import ATTENTION_VARIANTS
from runtime.model.weights import load_language_pass, load_vision_tower, read_config

MANIFEST = "onnx_export.json"
FORMAT = "omnijev-onnx/2"  # 2: prefix_rows, several image prefixes a pass
OPSET = GEMM_OPSET  # 18: LayerNormalization and RMSNorm are written out, nothing newer needed
MAX_IR_VERSION = 13  # the newest onnxruntime 1.31 reads (docs/engines.md §8)
EXTERNAL_BYTES = 1 << 30  # weights above this go to `<graph>.onnx.data` (protobuf caps at 2 GiB)
# Example sizes for tracing: distinct and > 1, so no dynamic axis is specialised or unified
# (I: the image prefixes a pass reads, `prefix_rows` picking each row's).
EXAMPLE = {"B": 5, "T": 7, "N": 6, "P": 9, "Q": 10, "S": 11, "R": 12, "M": 13, "I": 3}
MERGED_EXAMPLE = 6  # merged vision rows while tracing (patches = 4 × this)


def example_lm_feeds(config: dict, dtype: torch.dtype, sizes: dict = EXAMPLE) -> dict:
    """Valid inputs of the given sizes, for tracing."""
    tc = config["text_config"]
    b, t, n, p, q, s, r, m, i_ = (sizes[k] for k in "BTNPQSRMI")
    kv, hd, hidden = tc["num_key_value_heads"], tc["head_dim"], tc["hidden_size"]
    hv, dv = tc["linear_num_value_heads"], tc["linear_value_head_dim"]
    dk = tc["linear_key_head_dim"]
    channels = 2 * tc["linear_num_key_heads"] * dk + hv * dv
    kernel = tc["linear_conv_kernel_dim"]
    attn, gdn = layer_counts(config)
    feeds = {
        "input_ids": torch.randint(0, 100, (b, t)),
        "image_features": torch.zeros(n, hidden, dtype=dtype),
        "positions": torch.arange(t).expand(3, b, t).contiguous(),
        "lengths": torch.full((b,), t),
        "prefix_mask": torch.ones(i_, p, dtype=torch.bool),
        "prefix_rows": torch.arange(b) % i_,
        "src": torch.arange(b) % s,
        "src_mask": torch.ones(s, q, dtype=torch.bool),
        "read_rows": torch.arange(r) % (b * t),
        "target_rows": torch.arange(m) % (b * t),
        "target_tokens": torch.arange(m),
    }
    for i in range(attn):
        for kind in "kv":
            feeds[f"prefix_{kind}.{i}"] = torch.zeros(i_, kv, p, hd, dtype=dtype)
            feeds[f"src_{kind}.{i}"] = torch.zeros(s, kv, q, hd, dtype=dtype)
    for j in range(gdn):
        feeds[f"src_conv.{j}"] = torch.zeros(s, channels, kernel - 1, dtype=dtype)
        feeds[f"src_rec.{j}"] = torch.zeros(s, hv, dk, dv)
    return feeds


def lm_dynamic_shapes(config: dict, gdn: str) -> tuple:
    """`dynamic_shapes` mirroring `lm_args`; T is capped at 64 for the standard-op GDN graph."""
    b, n, p, q, s, r, m, i_ = (Dim(name) for name in "BNPQSRMI")
    t = Dim("T", max=STD_MAX_TOKENS) if gdn == "std" else Dim("T")
    shapes = {
        "input_ids": {0: b, 1: t}, "image_features": {0: n}, "positions": {1: b, 2: t},
        "lengths": {0: b}, "prefix_mask": {0: i_, 1: p}, "prefix_rows": {0: b}, "src": {0: b},
        "src_mask": {0: s, 1: q},
        "read_rows": {0: r}, "target_rows": {0: m}, "target_tokens": {0: m},
    }  # fmt: skip
    attn, gdn_layers = layer_counts(config)
    for i in range(attn):
        shapes[f"prefix_k.{i}"] = shapes[f"prefix_v.{i}"] = {0: i_, 2: p}
        shapes[f"src_k.{i}"] = shapes[f"src_v.{i}"] = {0: s, 2: q}
    for j in range(gdn_layers):
        shapes[f"src_conv.{j}"] = shapes[f"src_rec.{j}"] = {0: s}
    return lm_args(shapes, config)


def vision_example(config: dict, dtype: torch.dtype) -> tuple:
    vc = config["vision_config"]
    patches = 4 * MERGED_EXAMPLE
    width = vc["in_channels"] * vc["temporal_patch_size"] * vc["patch_size"] ** 2
    head_dim = vc["hidden_size"] // vc["num_heads"]
    return (
        torch.randn(patches, width),
        torch.zeros(patches, vc["hidden_size"]),
        torch.ones(patches, head_dim),
        torch.zeros(patches, head_dim),
    )


def value_info(values) -> list[dict]:
    """Name, element type and shape (ints or axis names) of ONNX graph inputs or outputs."""
    described = []
    for value in values:
        tensor = value.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tensor.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        described.append({"name": value.name, "dtype": str(dtype), "shape": shape})
    return described


def name_axes(values, axes: dict[str, dict[int, str]]) -> None:
    """Gives graph inputs/outputs readable axis names where the exporter made up its own."""
    for value in values:
        for axis, name in axes.get(value.name, {}).items():
            dims = list(value.shape)
            dims[axis] = ir.SymbolicDim(name)
            value.shape = ir.Shape(dims)


ROWS_OUTPUTS = ("hidden", "logprobs")  # what the readout-only graph returns


def write_graph(
    module,
    args: tuple,
    dynamic_shapes: tuple,
    inputs: list[str],
    outputs: list[str],
    path: Path,
    axes: dict | None = None,
) -> dict:
    """Exports one graph, caps its ir_version, saves (external data when large), checks it."""
    started = time.perf_counter()
    with torch.no_grad(), warnings.catch_warnings():
        # the exporter's notes on axes it merged and on its own deprecated pytree calls
        warnings.filterwarnings("ignore", message=".*(will not be used|LeafSpec)")
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=inputs, output_names=outputs,
            dynamic_shapes=dynamic_shapes, opset_version=OPSET, verbose=False,
        )  # fmt: skip
    program.model.ir_version = min(program.model.ir_version, MAX_IR_VERSION)
    name_axes([*program.model.graph.inputs, *program.model.graph.outputs], axes or {})
    weight_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    path.parent.mkdir(parents=True, exist_ok=True)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    program.save(str(path), external_data=weight_bytes > EXTERNAL_BYTES)
    onnx.checker.check_model(str(path))
    proto = onnx.load(str(path), load_external_data=False)
    return {
        "file": path.name,
        "data": data.name if data.exists() else None,
        "inputs": value_info(proto.graph.input),
        "outputs": value_info(proto.graph.output),
        "custom_domains": sorted({n.domain for n in proto.graph.node if n.domain}),
        "ir_version": proto.ir_version,
        "seconds": round(time.perf_counter() - started, 2),
    }


def derive_rows_graph(state_path: Path, rows_path: Path) -> dict:
    """`lm_rows` from `lm_state`: the same graph without the state outputs and the nodes only
    they need. It reads the state graph's external data file in place, so the weights are
    written once (a 4b export of the language model took four minutes per graph)."""
    started = time.perf_counter()
    model = onnx.load(str(state_path), load_external_data=False)
    keep = [o for o in model.graph.output if o.name in ROWS_OUTPUTS]
    needed = {o.name for o in keep}
    nodes = []
    for node in reversed(model.graph.node):
        if any(name in needed for name in node.output):
            nodes.append(node)
            needed.update(name for name in node.input if name)
    nodes.reverse()
    del model.graph.output[:]
    model.graph.output.extend(keep)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    initializers = [i for i in model.graph.initializer if i.name in needed]
    del model.graph.initializer[:]
    model.graph.initializer.extend(initializers)
    values = [v for v in model.graph.value_info if v.name in needed]
    del model.graph.value_info[:]
    model.graph.value_info.extend(values)
    onnx.save(model, str(rows_path))
    onnx.checker.check_model(str(rows_path))
    data = {e.value for i in initializers for e in i.external_data if e.key == "location"}
    return {
        "file": rows_path.name,
        "data": sorted(data)[0] if data else None,
        "inputs": value_info(model.graph.input),
        "outputs": value_info(model.graph.output),
        "custom_domains": sorted({n.domain for n in model.graph.node if n.domain}),
        "ir_version": model.ir_version,
        "seconds": round(time.perf_counter() - started, 2),
        "derived_from": state_path.name,
    }


def export_vision(
    export_dir: Path, out_dir: Path, dtype: torch.dtype, attention: str = "std"
) -> dict:
    config = read_config(export_dir)
    tower, _ = load_vision_tower(export_dir, dtype)
    tower.set_attention(attention)
    merged = Dim("merged")
    shapes = tuple({0: 4 * merged} for _ in range(4))
    names = ["pixel_values", "pos_embeds", "cos", "sin"]
    axes = {name: {0: "patches"} for name in names} | {"image_features": {0: "N"}}
    return write_graph(
        tower,
        vision_example(config, dtype),
        shapes,
        names,
        ["image_features"],
        out_dir / "vision.onnx",
        axes,
    )


def export_language(
    export_dir: Path,
    out_dir: Path,
    dtype: torch.dtype,
    gdn: str,
    readout: str,
    return_state: bool,
    module: LanguagePass | None = None,
) -> dict:
    config = read_config(export_dir)
    if module is None:
        module = load_language_pass(
            export_dir, dtype, return_state=return_state, gdn=gdn, readout=readout
        )
    module.return_state, module.readout = return_state, readout
    for layer in module.layers:
        if layer.kind == "linear_attention":
            layer.linear_attn.gdn = gdn
    args = lm_args(example_lm_feeds(config, dtype), config)
    name = "lm_state" if return_state else "lm_rows"
    return write_graph(
        module,
        args,
        lm_dynamic_shapes(config, gdn),
        lm_input_names(config),
        lm_output_names(config, return_state),
        out_dir / f"{name}.onnx",
    )


def export_onnx(
    export_dir: str | Path,
    out_dir: str | Path,
    dtype: str = "float32",
    gdn: str = "ort",
    readout: str = "std",
    graphs: tuple[str, ...] = GRAPHS,
    attention: str | None = None,
) -> dict:
    """Writes the ONNX files of one variant and `onnx_export.json`; returns the description.

    gdn="ort" uses onnxruntime's fused LinearAttention; gdn="std" standard ops only (passes of at
    most 64 tokens). attention="ort" writes the vision tower's attention as onnxruntime's fused
    MultiHeadAttention (the default with gdn="ort"). readout="plugin" emits the
    `omnijev::TokenLogProbs` node for TensorRT."""
    attention = attention or ("ort" if gdn == "ort" else "std")
    if dtype not in MODEL_DTYPES or gdn not in GDN_VARIANTS or readout not in READOUT_VARIANTS:
        raise ValueError(f"dtype {dtype!r}, gdn {gdn!r} or readout {readout!r} is not known")
    if attention not in ATTENTION_VARIANTS:
        raise ValueError(f"attention {attention!r} is not known")
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = read_config(export_dir)
    torch_dtype = DTYPES[dtype]
    files = {}
    if "vision" in graphs:
        files["vision"] = export_vision(export_dir, out_dir, torch_dtype, attention)
    lm_graphs = [g for g in ("lm_state", "lm_rows") if g in graphs]
    module = (
        load_language_pass(export_dir, torch_dtype, gdn=gdn, readout=readout) if lm_graphs else None
    )
    for graph in lm_graphs:
        if graph == "lm_rows" and "lm_state" in files:
            files[graph] = derive_rows_graph(out_dir / "lm_state.onnx", out_dir / "lm_rows.onnx")
            continue
        files[graph] = export_language(
            export_dir, out_dir, torch_dtype, gdn, readout, graph == "lm_state", module
        )
    types = config["text_config"]["layer_types"]
    description = {
        "format": FORMAT,
        "dtype": dtype,
        "gdn": gdn,
        "readout": readout,
        "vision_attention": attention,
        "readout_domain": DOMAIN if readout == "plugin" else None,
        "max_tokens": STD_MAX_TOKENS if gdn == "std" else None,
        "opset": OPSET,
        "image_token_id": config["image_token_id"],
        "attention_layers": [n for n, kind in enumerate(types) if kind == "full_attention"],
        "delta_layers": [n for n, kind in enumerate(types) if kind == "linear_attention"],
        "graphs": files,
    }
    manifest = out_dir / MANIFEST
    previous = json.loads(manifest.read_text("utf-8")) if manifest.is_file() else {}
    same = ("dtype", "gdn", "readout", "vision_attention")
    if {k: previous.get(k) for k in same} == {k: description[k] for k in same}:
        description["graphs"] = {**previous.get("graphs", {}), **files}
    manifest.write_text(json.dumps(description, indent=1) + "\n", "utf-8")
    return description


def cli_export(args) -> int:
    """`omnijev export --checkpoint DIR --out DIR [--dtype]`."""
    gdn, readout = getattr(args, "gdn", "ort"), getattr(args, "readout", "std")
    attention = getattr(args, "attention", None)
    description = export_onnx(
        args.checkpoint, args.out, args.dtype, gdn, readout, attention=attention
    )
    for graph, info in description["graphs"].items():
        print(f"{graph}: {info['file']} ({info['seconds']} s)")
    return 0
