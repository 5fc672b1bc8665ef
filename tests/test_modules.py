"""The export modules match transformers' Qwen3.5: vision tower, and the three pass kinds (image
prefix, question text, batched right-padded options) against one plain forward per row."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from build_engines.onnx_export import lm_args, lm_output_names
from plugins.readout import token_logprobs_reference, token_logprobs_std
from runtime.model.gdn import (
    GDN_CHUNK,
    block_inverse_unit_lower,
    chunk_step,
    gated_delta_eager,
    solve_unit_lower,
)
from runtime.model.vision import vision_inputs
from runtime.model.weights import load_language_pass, load_vision_tower

# docs/model.md §10.1
TINY_TEXT = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
    max_position_embeddings=4096, tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)  # fmt: skip
TINY_VISION = dict(
    depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=16,
    spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=64,
)  # fmt: skip
TOKEN_IDS = dict(
    image_token_id=500, video_token_id=501, vision_start_token_id=502, vision_end_token_id=503
)
# Qwen3.5-4B widths (docs/model.md §2.1, §6.1) cut to one Gated DeltaNet and one attention layer
# (the MLP narrowed to keep the test fast: it is the same SwiGLU at any width).
CUT_TEXT = dict(
    TINY_TEXT, hidden_size=2560, intermediate_size=1024, num_hidden_layers=2,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    layer_types=["linear_attention", "full_attention"],
    rope_parameters=dict(TINY_TEXT["rope_parameters"], mrope_section=[11, 11, 10]),
)  # fmt: skip
CUT_VISION = dict(
    TINY_VISION,
    depth=1,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    out_hidden_size=2560,
    num_position_embeddings=2304,
)
GRID = (1, 4, 6)  # non-square, so the block-major order and the interpolation are exercised
PREFIX = [7, 9, 502, *[500] * 6, 503]
QUESTIONS = [[11, 12, 13, 14, 15], [21, 22, 23]]
OPTIONS = [(0, [30, 31, 32, 33]), (0, [40, 41]), (1, [50, 51, 52, 53, 54, 55])]  # (question, ids)
TOLERANCE = 1e-4


def build_model(text: dict, vision: dict, seed: int = 0) -> Qwen3_5ForConditionalGeneration:
    """A random model whose weights are BF16 values (the export's dtype), kept in float32."""
    config = Qwen3_5Config(
        text_config=text, vision_config=vision, tie_word_embeddings=True, **TOKEN_IDS
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(1, 16).log())
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            elif "embed" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p[0].numel()))
            p.copy_(p.bfloat16().float())
    return model


def write_export(model: Qwen3_5ForConditionalGeneration, out: Path) -> Path:
    """The export layout of docs/design.md: two BF16 shards (one with the `model.language_model.`
    prefix, which the loader must accept) and `vision.safetensors`."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.to_json_file(out / "config.json")
    language = model.model.language_model.state_dict()
    state = {k: v.bfloat16().contiguous() for k, v in language.items()}
    names = sorted(state)
    shards = {
        "model-00001-of-00002.safetensors": {k: state[k] for k in names[::2]},
        "model-00002-of-00002.safetensors": {
            f"model.language_model.{k}": state[k] for k in names[1::2]
        },
    }
    weight_map = {}
    for shard, tensors in shards.items():
        save_file(tensors, str(out / shard))
        weight_map.update(dict.fromkeys(tensors, shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    vision = {
        f"model.visual.{k}": v.bfloat16().contiguous()
        for k, v in model.model.visual.state_dict().items()
    }
    save_file(vision, str(out / "vision.safetensors"))
    return out


def grid_pixels(model, grid=GRID, seed: int = 1) -> torch.Tensor:
    vc = model.config.vision_config
    width = vc.in_channels * vc.temporal_patch_size * vc.patch_size**2
    return torch.randn(math.prod(grid), width, generator=torch.Generator().manual_seed(seed))


def full_positions(model, ids: list[int], grid=GRID) -> torch.Tensor:
    """[3, L] M-RoPE positions of one whole sequence, from transformers' get_rope_index."""
    tensor = torch.tensor([ids])
    types = (tensor == model.config.image_token_id).int()
    positions, _ = model.model.get_rope_index(tensor, types, torch.tensor([grid]))
    return positions[:, 0]


def reference_forward(model, ids: list[int], pixels: torch.Tensor, grid=GRID):
    """Final-norm hidden states [L, D] and float32 log-softmax [L, V] of one plain forward."""
    tensor = torch.tensor([ids])
    with torch.no_grad():
        out = model(
            input_ids=tensor,
            pixel_values=pixels,
            image_grid_thw=torch.tensor([grid]),
            mm_token_type_ids=(tensor == model.config.image_token_id).int(),
            output_hidden_states=True,
        )
    return out.hidden_states[-1][0], torch.log_softmax(out.logits[0].float(), dim=-1)


# -- pass inputs -------------------------------------------------------------------------


def empty_state(config: dict, dtype=torch.float32) -> dict:
    """A pass with no past: P = Q = S = 1, masks all false, zero states."""
    tc = config["text_config"]
    kv, hd = tc["num_key_value_heads"], tc["head_dim"]
    channels = 2 * tc["linear_num_key_heads"] * tc["linear_key_head_dim"] + (
        tc["linear_num_value_heads"] * tc["linear_value_head_dim"]
    )
    state = {
        "prefix_mask": torch.zeros(1, 1, dtype=torch.bool),
        "src_mask": torch.zeros(1, 1, dtype=torch.bool),
    }
    types = tc["layer_types"]
    for i in range(types.count("full_attention")):
        for kind in "kv":
            state[f"prefix_{kind}.{i}"] = torch.zeros(1, kv, 1, hd, dtype=dtype)
            state[f"src_{kind}.{i}"] = torch.zeros(1, kv, 1, hd, dtype=dtype)
    for j in range(types.count("linear_attention")):
        state[f"src_conv.{j}"] = torch.zeros(
            1, channels, tc["linear_conv_kernel_dim"] - 1, dtype=dtype
        )
        state[f"src_rec.{j}"] = torch.zeros(
            1, tc["linear_num_value_heads"], tc["linear_key_head_dim"], tc["linear_value_head_dim"]
        )
    return state


def row_batch(rows: list[list[int]], positions: list[torch.Tensor], pad: int = 1) -> dict:
    """Right-padded ids, positions (pads keep counting) and lengths; T = longest + pad; every
    row after the one image prefix."""
    t = max(len(r) for r in rows) + pad
    ids = torch.zeros(len(rows), t, dtype=torch.long)
    pos = torch.zeros(3, len(rows), t, dtype=torch.long)
    for b, (row, p) in enumerate(zip(rows, positions, strict=True)):
        ids[b, : len(row)] = torch.tensor(row)
        pos[:, b, : len(row)] = p
        pos[:, b, len(row) :] = p[:, -1:] + torch.arange(1, t - len(row) + 1)
    lengths = torch.tensor([len(r) for r in rows])
    prefixes = torch.zeros(len(rows), dtype=torch.long)
    return {"input_ids": ids, "positions": pos, "lengths": lengths, "prefix_rows": prefixes}


def readouts(rows: list[list[int]], t: int, extra_token: int) -> dict:
    """Read every valid row; targets: each next token plus one fixed token per row."""
    read, target_rows, tokens = [], [], []
    for b, row in enumerate(rows):
        read += [b * t + i for i in range(len(row))]
        for i in range(len(row) - 1):
            target_rows.append(b * t + i)
            tokens.append(row[i + 1])
        target_rows.append(b * t + len(row) - 1)
        tokens.append(extra_token)
    return {
        "read_rows": torch.tensor(read),
        "target_rows": torch.tensor(target_rows),
        "target_tokens": torch.tensor(tokens),
    }


def carry(out: dict, lengths: torch.Tensor, config: dict, as_prefix: bool) -> dict:
    """Inputs of the next pass from a state pass's outputs: its K/V become the prefix (image
    prefix) or the per-source past (question text); conv and recurrent states always src."""
    t = out["out_k.0"].shape[2]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    types = config["text_config"]["layer_types"]
    state = {}
    for i in range(types.count("full_attention")):
        for kind in "kv":
            state[f"{'prefix' if as_prefix else 'src'}_{kind}.{i}"] = out[f"out_{kind}.{i}"]
    state["prefix_mask" if as_prefix else "src_mask"] = mask
    for j in range(types.count("linear_attention")):
        state[f"src_conv.{j}"] = out[f"out_conv.{j}"]
        state[f"src_rec.{j}"] = out[f"out_rec.{j}"]
    return state


def pass_feeds(model) -> list[dict]:
    """Feeds of the three passes before states are known (states filled by `run_chain`)."""
    full = [PREFIX + QUESTIONS[q] + opt for q, opt in OPTIONS]
    positions = [full_positions(model, ids) for ids in full]
    n, first = len(PREFIX), {q: i for i, (q, _) in reversed(list(enumerate(OPTIONS)))}
    prefix = row_batch([PREFIX], [positions[0][:, :n]], pad=2)
    question = row_batch(
        QUESTIONS,
        [positions[first[q]][:, n : n + len(QUESTIONS[q])] for q in range(len(QUESTIONS))],
    )
    option = row_batch(
        [opt for _, opt in OPTIONS],
        [positions[i][:, n + len(QUESTIONS[q]) :] for i, (q, _) in enumerate(OPTIONS)],
    )
    feeds = []
    for rows, batch in (
        (([PREFIX]), prefix),
        (QUESTIONS, question),
        ([opt for _, opt in OPTIONS], option),
    ):
        feeds.append({**batch, **readouts(rows, batch["input_ids"].shape[1], 3)})
    feeds[1]["src"] = torch.zeros(len(QUESTIONS), dtype=torch.long)
    feeds[2]["src"] = torch.tensor([q for q, _ in OPTIONS])
    feeds[0]["src"] = torch.zeros(1, dtype=torch.long)
    return feeds


def run_chain(run, config: dict, features: torch.Tensor, feeds: list[dict]) -> list[dict]:
    """Prefix → question text → options, each continuing the previous states; `run(feeds)`
    returns outputs keyed by name (`hidden`, `logprobs`, states)."""
    outs = []
    state = empty_state(config, features.dtype)
    prefix = run({**state, **feeds[0], "image_features": features})
    outs.append(prefix)
    after_prefix = carry(prefix, feeds[0]["lengths"], config, as_prefix=True)
    no_image = torch.zeros(1, features.shape[1], dtype=features.dtype)
    question = run({**state, **after_prefix, **feeds[1], "image_features": no_image})
    outs.append(question)
    after_question = carry(question, feeds[1]["lengths"], config, as_prefix=False)
    outs.append(
        run({**state, **after_prefix, **after_question, **feeds[2], "image_features": no_image})
    )
    return outs


def module_runner(module, config: dict):
    names = lm_output_names(config, module.return_state)

    def run(feeds: dict) -> dict:
        with torch.no_grad():
            return dict(zip(names, module(*lm_args(feeds, config)), strict=True))

    return run


def expected_rows(model, pixels) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reference (hidden, logprobs) of the prefix, question and option passes, in the order
    their rows are read (`readouts`)."""
    full = {
        i: reference_forward(model, PREFIX + QUESTIONS[q] + opt, pixels)
        for i, (q, opt) in enumerate(OPTIONS)
    }
    n = len(PREFIX)
    spans = [
        [(0, 0, n, PREFIX)],
        [
            (next(i for i, (q, _) in enumerate(OPTIONS) if q == qi), n, n + len(ids), ids)
            for qi, ids in enumerate(QUESTIONS)
        ],
        [
            (i, n + len(QUESTIONS[q]), n + len(QUESTIONS[q]) + len(opt), opt)
            for i, (q, opt) in enumerate(OPTIONS)
        ],
    ]
    result = []
    for rows in spans:
        hidden, logprobs = [], []
        for i, start, end, ids in rows:
            h, lp = full[i]
            hidden.append(h[start:end])
            targets = [*ids[1:], 3]
            logprobs.append(lp[torch.arange(start, end), torch.tensor(targets)])
        result.append((torch.cat(hidden), torch.cat(logprobs)))
    return result


def relative(actual, expected) -> float:
    actual, expected = torch.as_tensor(actual).double(), torch.as_tensor(expected).double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp(min=1.0)).item()


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = build_model(TINY_TEXT, TINY_VISION)
    return model, write_export(model, tmp_path_factory.mktemp("tiny_export"))


# -- tests ---------------------------------------------------------------------------------


def test_vision_tower_matches_transformers(tiny):
    model, export = tiny
    tower, pos_embed = load_vision_tower(export)
    pixels = grid_pixels(model)
    inputs = {
        k: torch.from_numpy(v)
        for k, v in vision_inputs(
            GRID, pos_embed, json.loads((export / "config.json").read_text())
        ).items()
    }
    with torch.no_grad():
        ours = tower(pixels, inputs["pos_embeds"], inputs["cos"], inputs["sin"])
        expected = model.model.visual(pixels, grid_thw=torch.tensor([GRID])).pooler_output
    assert ours.shape == (math.prod(GRID) // 4, 64)
    assert relative(ours, expected) < TOLERANCE


def test_padding_patches_leave_the_image_rows_in_both_attentions(tiny):
    """An image padded with patches (the torch backend's patch buckets): its rows within 1e-5 of
    the unpadded tower's, with the masked product (the CPU) and with torch's fused attention
    given padding columns and no mask (CUDA), whose rows keep their bytes whatever the padding
    holds."""
    model, export = tiny
    tower, pos_embed = load_vision_tower(export)
    pixels = grid_pixels(model)
    config = json.loads((export / "config.json").read_text())
    inputs = vision_inputs(GRID, pos_embed, config)
    feeds = [pixels, *(torch.from_numpy(inputs[n]) for n in ("pos_embeds", "cos", "sin"))]
    count, extra = pixels.shape[0], 12
    patches = torch.tensor([count])
    with torch.no_grad():
        plain = tower(*feeds)
        rows = count // 4
        for sdpa in (False, True):
            for block in tower.blocks:
                block.sdpa = sdpa
            padded = [torch.cat([f, torch.randn(extra, f.shape[1])]) for f in feeds]
            first = tower(*padded, patches)[:rows]
            assert float((first - plain).abs().max()) < 1e-5, sdpa
            padded = [torch.cat([f, torch.randn(extra, f.shape[1]) * 50]) for f in feeds]
            assert torch.equal(tower(*padded, patches)[:rows], first), sdpa


def test_passes_match_one_plain_forward_per_row(tiny):
    model, export = tiny
    config = json.loads((export / "config.json").read_text())
    module = load_language_pass(export, return_state=True)
    tower, pos_embed = load_vision_tower(export)
    pixels = grid_pixels(model)
    inputs = {k: torch.from_numpy(v) for k, v in vision_inputs(GRID, pos_embed, config).items()}
    with torch.no_grad():
        features = tower(pixels, inputs["pos_embeds"], inputs["cos"], inputs["sin"])
    outs = run_chain(module_runner(module, config), config, features, pass_feeds(model))
    for out, (hidden, logprobs) in zip(outs, expected_rows(model, pixels), strict=True):
        assert out["hidden"].shape == hidden.shape
        assert relative(out["hidden"], hidden) < TOLERANCE
        assert relative(out["logprobs"], logprobs) < TOLERANCE
        assert out["logprobs"].dtype == torch.float32 and (out["logprobs"] < 0).all()


def test_padding_leaves_states_untouched(tiny):
    """A row padded by 5 more tokens gives the same states as the same row unpadded."""
    model, export = tiny
    config = json.loads((export / "config.json").read_text())
    run = module_runner(load_language_pass(export, return_state=True), config)
    row = [5, 6, 7, 8]
    positions = torch.arange(4).expand(3, 4)
    feeds = [
        {
            **empty_state(config),
            **row_batch([row], [positions], pad=pad),
            **readouts([row], 4 + pad, 3),
            "src": torch.zeros(1, dtype=torch.long),
            "image_features": torch.zeros(1, 64),
        }
        for pad in (0, 5)
    ]
    short, long = run(feeds[0]), run(feeds[1])
    for name in short:
        if name.startswith(("out_conv", "out_rec")):
            assert torch.allclose(short[name], long[name], atol=1e-6), name
    assert torch.allclose(short["hidden"], long["hidden"], atol=1e-5)


def test_fused_projections_match_and_share_the_weights(tiny):
    """The torch backend's fused input projections (`fuse()`): the pass outputs of the separate
    Linears, and each Linear's weight a view of the fused one (one copy of the weights)."""
    model, export = tiny
    config = json.loads((export / "config.json").read_text())
    module = load_language_pass(export, return_state=True)
    tower, pos_embed = load_vision_tower(export)
    inputs = {k: torch.from_numpy(v) for k, v in vision_inputs(GRID, pos_embed, config).items()}
    with torch.no_grad():
        features = tower(grid_pixels(model), inputs["pos_embeds"], inputs["cos"], inputs["sin"])
    feeds = pass_feeds(model)
    separate = run_chain(module_runner(module, config), config, features, feeds)
    for layer in module.layers:
        (layer.self_attn if layer.kind == "full_attention" else layer.linear_attn).fuse()
        layer.mlp.fuse()
    fused = run_chain(module_runner(module, config), config, features, feeds)
    for a, b in zip(separate, fused, strict=True):
        for name in a:
            assert relative(b[name], a[name]) < 1e-5, name  # float32: the sums' order may move
    attn = next(layer.self_attn for layer in module.layers if layer.kind == "full_attention")
    delta = next(layer.linear_attn for layer in module.layers if layer.kind != "full_attention")
    mlp = module.layers[0].mlp
    for weight, linears in (
        (attn.qkv, (attn.q_proj, attn.k_proj, attn.v_proj)),
        (delta.in_proj, delta.input_linears()),
        (mlp.gate_up, (mlp.gate_proj, mlp.up_proj)),
    ):
        assert weight is not None
        for linear in linears:
            assert linear.weight.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert not any(k.endswith(("qkv", "in_proj", "gate_up")) for k in module.state_dict())


def test_full_vocabulary_readout():
    """248,079 embedding rows: the pass's log-probabilities match transformers'."""
    text = dict(TINY_TEXT, vocab_size=248079)
    ids = [248000, 17, 248078, 248077, 5, 9]
    model = build_model(text, TINY_VISION, seed=3)
    state = {k: v for k, v in model.model.language_model.state_dict().items()}
    config = model.config.to_dict()
    from runtime.model.language import LanguagePass

    module = LanguagePass(config, return_state=False).eval()
    module.load_state_dict(state, strict=True)
    feeds = {
        **empty_state(config),
        **row_batch([ids], [torch.arange(6).expand(3, 6)], pad=0),
        **readouts([ids], 6, 248078),
        "src": torch.zeros(1, dtype=torch.long),
        "image_features": torch.zeros(1, 64),
    }
    out = module_runner(module, config)(feeds)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    expected = torch.log_softmax(logits.float(), -1)[
        torch.arange(6), torch.tensor(ids[1:] + [248078])
    ]
    assert relative(out["logprobs"], expected) < TOLERANCE


def test_readout_reference_matches_torch():
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((5, 16)).astype(np.float32)
    embedding = (3 * rng.standard_normal((300, 16))).astype(np.float32)
    tokens = rng.integers(0, 300, 5)
    reference = token_logprobs_reference(hidden, embedding, tokens)
    torch_value = token_logprobs_std(*(torch.from_numpy(x) for x in (hidden, embedding, tokens)))
    log_softmax = torch.log_softmax(torch.from_numpy(hidden @ embedding.T), -1)
    assert np.abs(reference - torch_value.numpy()).max() < 1e-5
    assert np.abs(reference - log_softmax[np.arange(5), tokens].numpy()).max() < 1e-4
    assert reference.dtype == np.float32


def test_std_chunk_inverse_matches_solver():
    """The loop-free block inverse equals the triangular solver, also on correlated keys, where
    a Neumann-series product would lose every digit."""
    torch.manual_seed(0)
    base = torch.randn(2, 3, 1, 32)
    keys = torch.nn.functional.normalize(base + 0.05 * torch.randn(2, 3, GDN_CHUNK, 32), dim=-1)
    beta = torch.rand(2, 3, GDN_CHUNK) * 0.5 + 0.5
    decay = torch.ones(GDN_CHUNK, GDN_CHUNK)
    system = (keys * beta[..., None]) @ keys.transpose(-1, -2) * decay
    rhs = torch.randn(2, 3, GDN_CHUNK, 8)
    (solved,) = solve_unit_lower(system, rhs)
    (blocked,) = block_inverse_unit_lower(system, rhs)
    assert relative(blocked, solved) < 1e-4


def test_gated_delta_matches_transformers_and_chunks():
    """The eager core equals transformers' recurrence over 150 tokens (3 chunks), and the std
    chunk step equals it for one chunk."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    torch.manual_seed(1)
    b, t, h, d = 2, 150, 3, 16
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, h, d), torch.randn(b, t, h, d)
    g, beta, state = -torch.rand(b, t, h), torch.rand(b, t, h), torch.randn(b, h, d, d)
    expected, expected_state = torch_recurrent_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    qn = torch.nn.functional.normalize(q, dim=-1, eps=0) * d**-0.5
    kn = torch.nn.functional.normalize(k, dim=-1, eps=0)
    out, new_state = gated_delta_eager(qn, kn, v, g, beta, state)
    assert relative(out, expected) < TOLERANCE and relative(new_state, expected_state) < TOLERANCE
    n = 40
    out, new_state = chunk_step(
        *(x[:, :n].transpose(1, 2) for x in (qn, kn, v)),
        g[:, :n].transpose(1, 2),
        beta[:, :n].transpose(1, 2),
        state,
        block_inverse_unit_lower,
    )
    short, short_state = torch_recurrent_gated_delta_rule(
        q[:, :n],
        k[:, :n],
        v[:, :n],
        g[:, :n],
        beta[:, :n],
        initial_state=state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    assert relative(out.transpose(1, 2), short) < TOLERANCE
    assert relative(new_state, short_state) < TOLERANCE


def test_cut_of_4b_shapes(tmp_path):
    """Qwen3.5-4B widths, one layer of each kind and one vision block: one pass each."""
    model = build_model(dict(CUT_TEXT, vocab_size=600), CUT_VISION, seed=2)
    export = write_export(model, tmp_path / "cut")
    config = json.loads((export / "config.json").read_text())
    tower, pos_embed = load_vision_tower(export)
    grid = (1, 4, 4)
    pixels = grid_pixels(model, grid)
    inputs = {k: torch.from_numpy(v) for k, v in vision_inputs(grid, pos_embed, config).items()}
    with torch.no_grad():
        features = tower(pixels, inputs["pos_embeds"], inputs["cos"], inputs["sin"])
        expected_features = model.model.visual(pixels, grid_thw=torch.tensor([grid])).pooler_output
    assert relative(features, expected_features) < TOLERANCE
    ids = [7, 9, 502, 500, 500, 500, 500, 503, 11, 12]
    module = load_language_pass(export, return_state=False)
    positions = full_positions(model, ids, grid)
    feeds = {
        **empty_state(config),
        **row_batch([ids], [positions], pad=3),
        **readouts([ids], len(ids) + 3, 3),
        "src": torch.zeros(1, dtype=torch.long),
        "image_features": features,
    }
    out = module_runner(module, config)(feeds)
    hidden, logprobs = reference_forward(model, ids, pixels, grid)
    assert relative(out["hidden"], hidden) < TOLERANCE
    expected = logprobs[torch.arange(len(ids)), torch.tensor(ids[1:] + [3])]
    assert relative(out["logprobs"], expected) < TOLERANCE
