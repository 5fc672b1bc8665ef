"""The exported ONNX files run in onnxruntime (CPU) and match the export modules on the three pass
kinds, for both Gated DeltaNet variants; checker, ir_version and readout variants."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from build_engines.onnx_export import MANIFEST, MAX_IR_VERSION, export_onnx
from plugins.readout import DOMAIN, OP_TYPE
from runtime.model.vision import vision_inputs
from runtime.model.weights import load_language_pass, load_vision_tower, read_config
from tests.test_modules import (
    GRID,
    TINY_TEXT,
    TINY_VISION,
    build_model,
    empty_state,
    grid_pixels,
    module_runner,
    pass_feeds,
    readouts,
    relative,
    row_batch,
    run_chain,
    write_export,
)

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One tiny export and its ONNX variants: ORT fused GDN and vision attention (all graphs),
    standard ops (vision, lm_state) and the plugin readout (lm_rows, not runnable by
    onnxruntime)."""
    root = tmp_path_factory.mktemp("onnx")
    model = build_model(TINY_TEXT, TINY_VISION)
    export = write_export(model, root / "export")
    variants = {
        "ort": export_onnx(export, root / "ort", gdn="ort"),
        "std": export_onnx(export, root / "std", gdn="std", graphs=("vision", "lm_state")),
        "plugin": export_onnx(
            export, root / "plugin", gdn="std", readout="plugin", graphs=("lm_rows",)
        ),
    }
    return model, export, root, variants


def session(path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def onnx_runner(sess: ort.InferenceSession):
    names = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]

    def run(feeds: dict) -> dict:
        arrays = {name: feeds[name].numpy() for name in names}
        return {
            k: torch.from_numpy(v) for k, v in zip(outputs, sess.run(None, arrays), strict=True)
        }

    return run


def features(model, export):
    tower, pos_embed = load_vision_tower(export)
    inputs = vision_inputs(GRID, pos_embed, read_config(export))
    pixels = grid_pixels(model)
    with torch.no_grad():
        ours = tower(pixels, *(torch.from_numpy(inputs[k]) for k in ("pos_embeds", "cos", "sin")))
    return pixels, inputs, ours


@pytest.mark.parametrize("variant", ["ort", "std"])
def test_vision_onnx_matches_module(exported, variant):
    """Fused MultiHeadAttention (the ORT variant) and standard-op attention alike."""
    model, export, root, described = exported
    pixels, inputs, expected = features(model, export)
    ops = {(n.domain, n.op_type) for n in onnx.load(str(root / variant / "vision.onnx")).graph.node}
    fused = ("com.microsoft", "MultiHeadAttention") in ops
    assert fused == (variant == "ort") == (described[variant]["vision_attention"] == "ort")
    if variant == "std":
        assert not any(domain for domain, _ in ops)  # TensorRT reads this form
    sess = session(root / variant / "vision.onnx")
    (out,) = sess.run(None, {"pixel_values": pixels.numpy(), **inputs})
    assert [i.name for i in sess.get_inputs()] == ["pixel_values", "pos_embeds", "cos", "sin"]
    assert out.shape == tuple(expected.shape)
    assert relative(out, expected) < TOLERANCE


@pytest.mark.parametrize("gdn", ["ort", "std"])
def test_lm_state_matches_module_on_three_passes(exported, gdn):
    model, export, root, _ = exported
    config = read_config(export)
    _, _, image = features(model, export)
    feeds = pass_feeds(model)
    module = load_language_pass(export, return_state=True)
    expected = run_chain(module_runner(module, config), config, image, feeds)
    actual = run_chain(onnx_runner(session(root / gdn / "lm_state.onnx")), config, image, feeds)
    for want, got in zip(expected, actual, strict=True):
        assert set(got) == set(want)
        for name in want:
            assert got[name].shape == want[name].shape, name
            assert relative(got[name], want[name]) < TOLERANCE, name


def test_lm_rows_matches_lm_state(exported):
    """The rows-only graph gives the state graph's readouts on the option pass."""
    model, export, root, _ = exported
    config = read_config(export)
    _, _, image = features(model, export)
    feeds = pass_feeds(model)
    state = run_chain(onnx_runner(session(root / "ort" / "lm_state.onnx")), config, image, feeds)
    rows_sess = session(root / "ort" / "lm_rows.onnx")
    assert [o.name for o in rows_sess.get_outputs()] == ["hidden", "logprobs"]

    def rows_then_state(inputs: dict) -> dict:
        out = onnx_runner(session(root / "ort" / "lm_state.onnx"))(inputs)
        rows = onnx_runner(rows_sess)(inputs)
        assert torch.equal(rows["hidden"], out["hidden"])
        assert torch.equal(rows["logprobs"], out["logprobs"])
        return out

    again = run_chain(rows_then_state, config, image, feeds)
    assert torch.equal(again[2]["hidden"], state[2]["hidden"])


def test_files_are_valid_and_described(exported):
    _, _, root, variants = exported
    for variant, description in variants.items():
        manifest = json.loads((root / variant / MANIFEST).read_text())
        assert manifest["gdn"] == description["gdn"]
        for graph, info in description["graphs"].items():
            path = root / variant / info["file"]
            onnx.checker.check_model(str(path))
            proto = onnx.load(str(path))
            assert proto.ir_version <= MAX_IR_VERSION
            assert info["data"] is None  # tiny: weights inside the file
            if graph.startswith("lm"):
                shapes = [i.dims for i in proto.graph.initializer]
                assert shapes.count([512, 64]) == 1  # one tied table for lookup and readout
    inputs = {i["name"]: i for i in variants["ort"]["graphs"]["lm_state"]["inputs"]}
    assert inputs["input_ids"]["shape"] == ["B", "T"]
    assert inputs["prefix_k.0"]["shape"] == ["I", 2, "P", 32]
    assert inputs["prefix_rows"]["shape"] == ["B"] and inputs["prefix_mask"]["shape"] == ["I", "P"]
    assert inputs["src_rec.2"]["shape"] == ["S", 4, 16, 16]
    assert variants["std"]["max_tokens"] == 64


def test_readout_and_gdn_variants(exported):
    _, _, root, _ = exported
    ops = {}
    for variant, graph in (("ort", "lm_rows"), ("std", "lm_state"), ("plugin", "lm_rows")):
        proto = onnx.load(str(root / variant / f"{graph}.onnx"))
        ops[variant] = {(n.domain, n.op_type) for n in proto.graph.node}
    assert (DOMAIN, OP_TYPE) in ops["plugin"]
    assert not any(domain == DOMAIN for domain, _ in ops["ort"] | ops["std"])
    assert ("com.microsoft", "LinearAttention") in ops["ort"]
    assert not any(domain for domain, _ in ops["std"])  # standard ops only
    assert not any(domain == "com.microsoft" for domain, _ in ops["plugin"])
    node = next(
        n
        for n in onnx.load(str(root / "plugin" / "lm_rows.onnx")).graph.node
        if n.op_type == OP_TYPE
    )
    assert [a.name for a in node.attribute if a.name == "chunk"] == ["chunk"]
    assert len(node.input) == 3


@pytest.mark.parametrize(("gdn", "tokens"), [("std", 64), ("ort", 130)])
def test_long_pass_matches_module(exported, gdn, tokens):
    """The standard-op graph at its 64-token limit; the fused graph over several chunks."""
    model, export, root, _ = exported
    config = read_config(export)
    module = load_language_pass(export, return_state=True)
    rng = np.random.default_rng(5)
    rows = [list(rng.integers(0, 400, tokens)), list(rng.integers(0, 400, 30))]
    positions = [torch.arange(len(r)).expand(3, len(r)) for r in rows]
    feeds = {
        **empty_state(config),
        **row_batch(rows, positions, pad=0),
        **readouts(rows, tokens, 3),
        "src": torch.zeros(2, dtype=torch.long),
        "image_features": torch.zeros(1, 64),
    }
    want = module_runner(module, config)(feeds)
    got = onnx_runner(session(root / gdn / "lm_state.onnx"))(feeds)
    for name in want:
        assert relative(got[name], want[name]) < TOLERANCE, name


def linear_attention_session(heads: int) -> ort.InferenceSession:
    names = ["query", "key", "value", "past_state", "decay", "beta"]
    node = helper.make_node(
        "LinearAttention", names, ["output", "present_state"], domain="com.microsoft",
        q_num_heads=heads, kv_num_heads=heads, update_rule="gated_delta", scale=1.0,
    )  # fmt: skip
    float_value = TensorProto.FLOAT
    graph = helper.make_graph(
        [node],
        "linear_attention",
        [helper.make_tensor_value_info(n, float_value, None) for n in names],
        [helper.make_tensor_value_info(n, float_value, None) for n in node.output],
    )
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
    proto = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def test_ort_linear_attention_is_transformers_recurrence():
    """onnxruntime's gated_delta rule (decay applied to S before the delta term, q already
    L2-normalised and scaled, scale=1) equals transformers' recurrence over 150 tokens."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    torch.manual_seed(3)
    b, t, heads, d = 2, 150, 4, 16
    q, k, v = (torch.randn(b, t, heads, d) for _ in range(3))
    g, beta, state = (
        -2 * torch.rand(b, t, heads),
        torch.rand(b, t, heads),
        torch.randn(b, heads, d, d),
    )
    expected, expected_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    qn = torch.nn.functional.normalize(q, dim=-1) * d**-0.5
    kn = torch.nn.functional.normalize(k, dim=-1)
    inputs = [x.reshape(b, t, heads * d) for x in (qn, kn, v)] + [state, g, beta]
    names = ["query", "key", "value", "past_state", "decay", "beta"]
    out, new_state = linear_attention_session(heads).run(
        None, {n: x.numpy() for n, x in zip(names, inputs, strict=True)}
    )
    assert relative(out, expected.reshape(b, t, heads * d)) < 1e-5
    assert relative(new_state, expected_state) < 1e-5


def test_rows_graph_is_derived_without_state_outputs_and_shares_weights(tmp_path, tmp_path_factory):
    """lm_rows is lm_state pruned to its readouts, reading lm_state's external data in place."""
    import onnx

    import build_engines.onnx_export as ox
    from tests.checkpoint_fixtures import tiny_export

    export = tiny_export(tmp_path_factory)
    saved = ox.EXTERNAL_BYTES
    ox.EXTERNAL_BYTES = 0  # force external data, as the 4b export has
    try:
        description = ox.export_onnx(export, tmp_path / "onnx", graphs=("lm_state", "lm_rows"))
    finally:
        ox.EXTERNAL_BYTES = saved
    rows = description["graphs"]["lm_rows"]
    assert rows["derived_from"] == "lm_state.onnx"
    assert rows["data"] == "lm_state.onnx.data"
    assert [o["name"] for o in rows["outputs"]] == ["hidden", "logprobs"]
    assert not (tmp_path / "onnx" / "lm_rows.onnx.data").exists()
    model = onnx.load(str(tmp_path / "onnx" / "lm_rows.onnx"), load_external_data=False)
    state = onnx.load(str(tmp_path / "onnx" / "lm_state.onnx"), load_external_data=False)
    assert len(model.graph.node) < len(state.graph.node)
