"""Tests of the presets, the synthetic release and its merge (build_engines/checkpoints, merge)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file

from build_engines import presets
from build_engines.checkpoints import (
    CHAT_TEMPLATE,
    LORA_TARGETS,
    RELEASE_FILES,
    RELEASE_MANIFEST,
    make_checkpoint,
    make_release,
)
from build_engines.merge import (
    ReleaseError,
    load_base,
    merge_release,
    restore_option_rows,
)
from reference.transformers_model import build_transformers_model
from runtime.cli import main
from runtime.export_format import (
    head_shapes,
    load_export,
    load_heads_state,
    load_language_state,
    load_vision_state,
    sha256_file,
)
from tests.checkpoint_fixtures import copy_export, rewrite
from tests.spec import FIXTURES

IMAGE_PAD, OPT, CLOSE = 248056, 248077, 248078


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path))


def base_state(release: Path) -> dict[str, torch.Tensor]:
    base = release / "base"
    index = json.loads((base / "model.safetensors.index.json").read_text())
    state = {}
    for shard in sorted(set(index["weight_map"].values())):
        state.update(tensors(base / shard))
    return state


def release_model(release: Path):
    """The release as the reference loads it: float32 base, resized, option rows, PEFT adapter."""
    from peft import PeftModel

    base = load_base(release / "base").float()
    restore_option_rows(base, release / "checkpoint" / "new_tok_emb.pt")
    return PeftModel.from_pretrained(base, str(release / "checkpoint")).eval()


# -- presets -------------------------------------------------------------------------------


def test_4b_preset_has_the_real_shapes():
    model = presets.meta_model("4b")
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    text = model.config.text_config
    assert text.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 8
    assert text.rope_parameters["mrope_section"] == [11, 11, 10]
    assert text.rope_parameters["rope_theta"] == 1e7
    lm = "model.language_model."
    assert shapes[lm + "embed_tokens.weight"] == (248320, 2560)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    # docs/model.md §2.2
    gdn, attn = lm + "layers.0.linear_attn.", lm + "layers.3.self_attn."
    assert shapes[gdn + "in_proj_qkv.weight"] == (8192, 2560)
    assert shapes[gdn + "in_proj_z.weight"] == (4096, 2560)
    assert shapes[gdn + "in_proj_b.weight"] == (32, 2560)
    assert shapes[gdn + "conv1d.weight"] == (8192, 1, 4)
    assert shapes[gdn + "norm.weight"] == (128,)
    assert shapes[gdn + "out_proj.weight"] == (2560, 4096)
    assert shapes[attn + "q_proj.weight"] == (8192, 2560)
    assert shapes[attn + "k_proj.weight"] == (1024, 2560)
    assert shapes[attn + "o_proj.weight"] == (2560, 4096)
    assert shapes[lm + "layers.31.mlp.down_proj.weight"] == (2560, 9216)
    # docs/model.md §6.1-6.3
    assert shapes["model.visual.patch_embed.proj.weight"] == (1024, 3, 2, 16, 16)
    assert shapes["model.visual.pos_embed.weight"] == (2304, 1024)
    assert shapes["model.visual.merger.linear_fc1.weight"] == (4096, 4096)
    assert shapes["model.visual.merger.linear_fc2.weight"] == (2560, 4096)
    assert "model.visual.blocks.23.attn.qkv.weight" in shapes
    assert "model.visual.blocks.24.attn.qkv.weight" not in shapes
    assert 4.5e9 < sum(p.numel() for p in model.parameters()) < 4.6e9


def test_tiny_preset_keeps_the_real_ids_and_geometry():
    config = presets.build_config("tiny")
    assert config.text_config.vocab_size == 248320
    assert (config.image_token_id, config.video_token_id) == (248056, 248057)
    assert (config.vision_start_token_id, config.vision_end_token_id) == (248053, 248054)
    vision = config.vision_config
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (16, 2, 2)
    assert vision.out_hidden_size == config.text_config.hidden_size == 64
    assert config.text_config.layer_types.count("full_attention") == 1
    with pytest.raises(ValueError, match="preset must be one of tiny, 4b"):
        presets.build_config("7b")


# -- release -------------------------------------------------------------------------------


def test_release_has_the_real_layout(release_dir):
    base, ckpt = release_dir / "base", release_dir / "checkpoint"
    index = json.loads((base / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert shards == [f"model.safetensors-0000{i}-of-00002.safetensors" for i in (1, 2)]
    state = base_state(release_dir)
    assert set(state) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    assert all(k.startswith(("model.language_model.", "model.visual.")) for k in state)
    assert "lm_head.weight" not in state
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert state["model.language_model.embed_tokens.weight"].shape == (248320, 64)
    config = json.loads((base / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert config["text_config"]["vocab_size"] == 248320 and config["tie_word_embeddings"]
    assert {p.name for p in ckpt.iterdir()} == {*RELEASE_FILES, RELEASE_MANIFEST}


def test_release_manifest_records_every_file(release_dir):
    ckpt = release_dir / "checkpoint"
    manifest = json.loads((ckpt / RELEASE_MANIFEST).read_text())
    assert manifest["release"] == "v1.1" and manifest["synthetic"] is True
    assert manifest["model_id"] == "synthetic/omnijev-tiny-seed0"
    for name in RELEASE_FILES:
        assert manifest["files"][name]["sha256"] == sha256_file(ckpt / name)
    for name, entry in manifest["base_files"].items():
        assert entry["sha256"] == sha256_file(release_dir / "base" / name)
    assert len(manifest["checkpoint_revision"]) == 40


def test_adapter_is_a_peft_lora_on_the_documented_targets(release_dir):
    ckpt = release_dir / "checkpoint"
    config = json.loads((ckpt / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (32, 64, "LORA")
    assert config["target_modules"] == sorted(LORA_TARGETS)
    adapter = tensors(ckpt / "adapter_model.safetensors")
    # 3 GDN + 4 attention + 3 MLP projections per layer type: 3·(3+3) + 1·(4+3) = 25 modules
    assert len(adapter) == 2 * 25
    for key, tensor in adapter.items():
        assert key.startswith("base_model.model.model.language_model.layers.")
        assert tensor.dtype == torch.float32 and tensor.abs().mean() > 1e-3  # B is not zero
    qkv = "base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv"
    a, b = adapter[f"{qkv}.lora_A.weight"], adapter[f"{qkv}.lora_B.weight"]
    assert a.shape == (32, 64) and b.shape == (128, 32)


def test_heads_and_option_rows(release_dir):
    ckpt = release_dir / "checkpoint"
    head = torch.load(ckpt / "head.pt", weights_only=True)
    ordinal = torch.load(ckpt / "ord.pt", weights_only=True)
    shapes = head_shapes(64)
    assert {f"head.{k}": tuple(v.shape) for k, v in head.items()} == {
        k: v for k, v in shapes.items() if k.startswith("head.")
    }
    assert {f"ord.{k}": tuple(v.shape) for k, v in ordinal.items()} == {
        k: v for k, v in shapes.items() if k.startswith("ord.")
    }
    assert len(set(head["log_tau"].tolist())) == 3  # distinct: a wrong type index shows
    meta = json.loads((ckpt / "head_meta.json").read_text())
    assert meta == {
        "norm": "softmax",
        "lm_feats": True,
        "ordinal": True,
        "branch": True,
        "temperatures": {"noul": 1.1991, "choice": 1.1199, "score": 1.1909},
        "biases": {"noul": 0.05310856608843584},
    }
    rows = torch.load(ckpt / "new_tok_emb.pt", weights_only=True)
    assert rows.shape == (2, 64) and rows.dtype == torch.float32


def render_prompt(instructions: str) -> str:
    """The chat template as transformers renders it for MSO1 (docs/contract.md §4.2)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    content = [{"type": "image"}, {"type": "text", "text": instructions}]
    rendered, _ = render_jinja_template(
        [[{"role": "user", "content": content}]],
        chat_template=CHAT_TEMPLATE,
        add_generation_prompt=True,
    )
    return rendered[0]


def test_chat_template_renders_every_fixture_prompt(release_dir):
    assert (release_dir / "checkpoint" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    if not (FIXTURES / "processing.json").is_file():
        pytest.skip(f"reference fixtures not found at {FIXTURES}")
    cases = json.loads((FIXTURES / "processing.json").read_text("utf-8"))["cases"]
    checked = 0
    for case in cases:
        questions = case["request"]["questions"]
        for question in case["questions"]:
            instructions = questions[question["id"]].get("instructions", "")
            options = "".join(f"<|opt|>{t}<|/opt|>" for t in question["option_text"])
            assert render_prompt(instructions) + options == question["prompt"], question["id"]
            checked += 1
    assert checked == 26
    assert render_prompt("  Is it dark?  \n\x1f ").endswith(
        "  Is it dark?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


# -- determinism ---------------------------------------------------------------------------


def tree_bytes(root: Path) -> dict[str, bytes]:
    files = sorted(p for p in root.rglob("*") if p.is_file())
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


def test_same_seed_gives_identical_bytes(export_dir, release_dir, tmp_path, capsys):
    """The command line writes seed 0 again: the same bytes as the fixture, release and export."""
    out = tmp_path / "export"
    assert main(["checkpoint", "--preset", "tiny", "--seed", "0", "--out", str(out)]) == 0
    assert f"--checkpoint {out}" in capsys.readouterr().out
    assert tree_bytes(out) == tree_bytes(export_dir)
    assert tree_bytes(tmp_path / "export.release") == tree_bytes(release_dir)
    other = make_release("tiny", 1, tmp_path / "seed1")
    assert sha256_file(other / "checkpoint" / "head.pt") != sha256_file(
        release_dir / "checkpoint" / "head.pt"
    )
    shard = "base/model.safetensors-00002-of-00002.safetensors"
    assert sha256_file(other / shard) != sha256_file(release_dir / shard)


# -- merge ---------------------------------------------------------------------------------


def test_merged_weights_follow_pefts_bf16_merge(export_dir, release_dir):
    """Every export tensor is the base's, merged exactly as PEFT does it in BF16 on the CPU."""
    base = base_state(release_dir)
    adapter = tensors(release_dir / "checkpoint" / "adapter_model.safetensors")
    info = load_export(export_dir)
    merged = load_language_state(info)
    lm = "model.language_model."
    changed = 0
    for name, tensor in merged.items():
        if name == "embed_tokens.weight":
            continue
        expected = base[lm + name]
        module = name.removesuffix(".weight")
        lora_a = adapter.get(f"base_model.model.{lm}{module}.lora_A.weight")
        if lora_a is not None:
            lora_b = adapter[f"base_model.model.{lm}{module}.lora_B.weight"]
            delta = (lora_b @ lora_a) * (64 / 32)  # alpha / r, in float32 as PEFT on the CPU
            expected = expected + delta.to(torch.bfloat16)
            changed += 1
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, expected), name
    assert changed == 25
    embed = merged["embed_tokens.weight"]
    rows = torch.load(release_dir / "checkpoint" / "new_tok_emb.pt", weights_only=True)
    assert torch.equal(embed[:OPT], base[lm + "embed_tokens.weight"][:OPT])
    assert torch.equal(embed[OPT:], rows.to(torch.bfloat16))
    vision = load_vision_state(info)
    assert vision.keys() == {k for k in base if k.startswith("model.visual.")}
    assert all(torch.equal(vision[k], base[k]) for k in vision)
    heads = load_heads_state(info)
    head = torch.load(release_dir / "checkpoint" / "head.pt", weights_only=True)
    assert all(torch.equal(heads[f"head.{k}"], v) for k, v in head.items())


def test_release_and_export_give_the_same_lm_outputs(export_dir, release_dir):
    """Float32 forward of the release (unmerged adapter) and of the export.

    They differ only by the export's BF16 rounding of the merged weights; without the adapter
    the outputs move about forty times as far, so the tolerance still sees a missing merge.
    """
    exported = build_transformers_model(load_export(export_dir), torch.float32, "cpu")
    released = release_model(release_dir)
    ids = torch.randint(0, 248079, (1, 16), generator=torch.Generator().manual_seed(0))
    ids[0, -2:] = torch.tensor([OPT, CLOSE])
    with torch.no_grad():
        ours = exported(input_ids=ids, output_hidden_states=True)
        theirs = released(input_ids=ids, output_hidden_states=True)
        with released.disable_adapter():
            plain = released(input_ids=ids, output_hidden_states=True)
    hidden, expected = ours.hidden_states[-1], theirs.hidden_states[-1]
    assert (hidden - expected).abs().max() < 0.25
    assert (hidden - expected).abs().mean() < 0.03
    assert (ours.logits - theirs.logits).abs().max() < 0.5
    assert (plain.hidden_states[-1] - expected).abs().max() > 1.0
    assert ours.logits.shape[-1] == theirs.logits.shape[-1] == 248079


def prepared_input(tokenizer, instructions: str, options: list[str], grid=(1, 8, 8)):
    """One question's sequence as docs/contract.md §4.2-4.4 lays it out, with random pixels."""

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False).ids

    after = f"<|vision_end|>{instructions}<|im_end|>\n<|im_start|>assistant\n<think>\n"
    after += "".join(f"<|opt|>{o}<|/opt|>" for o in options)
    count = grid[1] * grid[2] // 4
    ids = encode("<|im_start|>user\n<|vision_start|>") + [IMAGE_PAD] * count + encode(after)
    ids = torch.tensor([ids])
    generator = torch.Generator().manual_seed(1)
    return {
        "input_ids": ids,
        "pixel_values": torch.rand(grid[1] * grid[2], 1536, generator=generator) * 2 - 1,
        "image_grid_thw": torch.tensor([grid]),
        "mm_token_type_ids": (ids == IMAGE_PAD).int(),
    }


def test_heads_give_spread_logits_on_a_prepared_request(export_dir):
    """The synthetic heads are neither uniform nor saturated (docs/contract.md §6.2-6.4
    arithmetic)."""
    from tokenizers import Tokenizer

    info = load_export(export_dir, verify=False)
    model = build_transformers_model(info, torch.float32, "cpu")
    heads = load_heads_state(info)
    inputs = prepared_input(
        Tokenizer.from_file(str(info.tokenizer_path)),
        "Which animal is shown?",
        ["a cat", "a dog", "a bird on a branch"],
    )
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True)
    hidden, logprobs = out.hidden_states[-1][0], out.logits[0].log_softmax(-1)
    ids = inputs["input_ids"][0]
    opens, closes = (ids == OPT).nonzero()[:, 0], (ids == CLOSE).nonzero()[:, 0]
    zq, u = hidden[opens[0] - 1], hidden[closes]

    def mlp(name, x):
        x = F.gelu(F.linear(x, heads[f"{name}.0.weight"], heads[f"{name}.0.bias"]))
        return F.linear(x, heads[f"{name}.2.weight"], heads[f"{name}.2.bias"])

    sums = torch.stack(
        [
            logprobs[torch.arange(o, c - 1), ids[o + 1 : c]].sum()
            for o, c in zip(opens.tolist(), closes.tolist(), strict=True)
        ]
    )
    counts = (closes - opens - 1).float()
    firsts = logprobs[opens, ids[opens + 1]]
    feats = torch.stack(
        [
            sums / 10,
            sums / counts,
            counts / 10,
            sums - sums.logsumexp(0),
            firsts,
            torch.ones_like(sums),
        ],
        dim=1,
    )
    gate = torch.tanh(mlp("head.que", zq))
    film = F.linear(feats, heads["head.feat.weight"], heads["head.feat.bias"])
    h = mlp("head.opt", u) * gate + film
    tau = heads["head.log_tau"][1].exp()
    score = F.linear(h, heads["head.score.weight"], heads["head.score.bias"])[:, 0]
    lin = F.linear(feats, heads["head.feat_lin.weight"], heads["head.feat_lin.bias"])[:, 0]
    logits = (score + lin) / tau
    abstain = F.linear(gate, heads["head.abstain.weight"], heads["head.abstain.bias"]) / tau
    mu = torch.cat([logits, abstain]).softmax(0)
    print("choice logits", logits.tolist(), "abstain", abstain.item())
    assert logits.abs().max() < 5 and logits.std() > 0.3
    assert mu.max() < 0.95 and mu.min() > 0.01
    cut = mlp("ord.cut", u)[:, 0]
    theta = cut[0] + torch.cat([torch.zeros(1), F.softplus(cut[1:]).cumsum(0)])
    cdf = torch.sigmoid(theta - mlp("ord.z", zq)[0])
    print("ordinal cdf", cdf.tolist())
    assert 0.02 < cdf[0] and cdf[-1] < 0.98


def test_merge_removes_a_leftover_partial_and_refuses_an_existing_output(release_dir, tmp_path):
    out = tmp_path / "merged"
    partial = tmp_path / ".merged.partial"
    partial.mkdir()
    (partial / "junk").write_text("left over")
    merge_release(release_dir, out, max_shard_size="16MB")
    assert not partial.exists() and not (out / "junk").exists()
    with pytest.raises(FileExistsError, match="output directory .* exists"):
        merge_release(release_dir, out)


@pytest.fixture
def release_copy(release_dir, tmp_path) -> Path:
    return copy_export(release_dir, tmp_path / "release")


def refuse_merge(release: Path, message: str, tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match=message):
        merge_release(release, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def edit_json(path: Path, edit) -> None:
    value = json.loads(path.read_text())
    edit(value)
    rewrite(path, json.dumps(value))


def reseal(release: Path) -> None:
    """Records the checkpoint files' current hashes, as if the release had been published so."""
    ckpt = release / "checkpoint"

    def update(manifest):
        for name in RELEASE_FILES:
            manifest["files"][name]["sha256"] = sha256_file(ckpt / name)

    edit_json(ckpt / RELEASE_MANIFEST, update)


def test_merge_refuses_a_tampered_checkpoint_file(release_copy, tmp_path):
    rewrite(release_copy / "checkpoint" / "head_meta.json", "{}")
    refuse_merge(release_copy, "release file checkpoint/head_meta.json does not match", tmp_path)


def test_merge_refuses_a_tampered_base_file(release_copy, tmp_path):
    shard = release_copy / "base" / "model.safetensors-00002-of-00002.safetensors"
    rewrite(shard, shard.read_bytes()[:-2] + b"\0\0")
    refuse_merge(release_copy, "release file base/model.safetensors-00002", tmp_path)


def test_merge_pins_the_real_base(release_copy, tmp_path):
    edit_json(
        release_copy / "checkpoint" / RELEASE_MANIFEST,
        lambda m: (m.pop("synthetic"), m.__setitem__("base_model", "Qwen/Qwen3.5-4B")),
    )
    refuse_merge(release_copy, "release file base/config.json does not match its SHA-256", tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.__setitem__("release", "v1.0"), "release is 'v1.0', expected 'v1.1'"),
        (
            lambda m: (m.pop("synthetic"), m.__setitem__("base_model", "x/y")),
            "release base_model is 'x/y', expected 'Qwen/Qwen3.5-4B'",
        ),
        (lambda m: m["files"].pop("ord.pt"), "does not list ord.pt"),
        (lambda m: m.__setitem__("model_id", "tinnel123/OmniJev"), "synthetic release claims"),
    ],
)
def test_merge_refuses_bad_release_manifests(release_copy, tmp_path, edit, message):
    edit_json(release_copy / "checkpoint" / RELEASE_MANIFEST, edit)
    refuse_merge(release_copy, message, tmp_path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m.__setitem__("norm", "sigmoid"), "head_meta norm is 'sigmoid'"),
        (lambda m: m.__setitem__("branch", False), "head_meta branch is False, expected true"),
        (lambda m: m["biases"].__setitem__("choice", 0.1), "only noul is allowed"),
        (lambda m: m["temperatures"].pop("score"), "head_meta temperatures are"),
        (lambda m: m["temperatures"].__setitem__("noul", 0.0), "temperature noul is 0.0"),
    ],
)
def test_merge_refuses_bad_head_meta(release_copy, tmp_path, edit, message):
    edit_json(release_copy / "checkpoint" / "head_meta.json", edit)
    reseal(release_copy)
    refuse_merge(release_copy, message, tmp_path)


def test_merge_refuses_a_tokenizer_without_option_ids(release_copy, tmp_path):
    path = release_copy / "checkpoint" / "tokenizer.json"
    rewrite(path, path.read_text("utf-8").replace('"content":"<|/opt|>"', '"content":"<|x|>"'))
    reseal(release_copy)
    refuse_merge(release_copy, "release tokenizer maps <|/opt|> to None, expected 248078", tmp_path)


def test_merge_refuses_wrong_option_rows_and_heads(release_copy, tmp_path):
    ckpt = release_copy / "checkpoint"
    (ckpt / "new_tok_emb.pt").unlink()
    torch.save(torch.zeros(3, 64), ckpt / "new_tok_emb.pt")
    reseal(release_copy)
    refuse_merge(release_copy, r"new_tok_emb.pt is \(3, 64\), expected \(2, 64\)", tmp_path)
    (ckpt / "new_tok_emb.pt").unlink()
    torch.save(torch.zeros(2, 64), ckpt / "new_tok_emb.pt")
    head = torch.load(ckpt / "ord.pt", weights_only=True)
    head["z.2.bias"] = torch.tensor([float("nan")])
    (ckpt / "ord.pt").unlink()
    torch.save(head, ckpt / "ord.pt")
    reseal(release_copy)
    refuse_merge(release_copy, "head tensor ord.z.2.bias is not finite", tmp_path)


def test_cli_release_then_merge(export_dir, tmp_path, capsys):
    release = tmp_path / "release"
    assert (
        main(
            [
                "checkpoint",
                "--preset",
                "tiny",
                "--seed",
                "0",
                "--out",
                str(release),
                "--release-only",
            ]
        )
        == 0
    )
    assert main(["merge", "--release", str(release), "--out", str(tmp_path / "export")]) == 0
    printed = capsys.readouterr().out
    assert f"export: {tmp_path / 'export'}" in printed
    info = load_export(tmp_path / "export")
    ours, expected = load_language_state(info), load_language_state(load_export(export_dir))
    assert ours.keys() == expected.keys()  # one 5 GB shard here, two 16 MB shards there
    assert all(torch.equal(ours[k], expected[k]) for k in ours)


@pytest.mark.slow
def test_4b_checkpoint_writes_and_loads(tmp_path):
    """Full-size synthetic export: about 9 GB of BF16 in the release and again in the export."""
    start = time.perf_counter()
    out = make_checkpoint("4b", 0, tmp_path / "export")
    seconds = time.perf_counter() - start
    info = load_export(out)
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"4b export: {size / 1e9:.2f} GB in {seconds:.0f} s (release + merge)")
    assert info.hidden_size == 2560 and len(info.shards) == 2
    with safe_open(str(info.shards[0]), framework="pt") as f:
        assert "embed_tokens.weight" in f.keys()
        assert f.get_slice("embed_tokens.weight").get_shape() == [248079, 2560]
    assert 8.5e9 < size < 9.5e9
