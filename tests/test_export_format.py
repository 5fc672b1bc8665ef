"""Tests of build_engines/export_format.py: each check of docs/contract.md §8.3, the weight
loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from reference.transformers_model import build_transformers_model
from runtime.export_format import (
    MANIFEST,
    REAL_IDENTITY,
    ExportError,
    head_shapes,
    language_name,
    load_export,
    load_heads_state,
    load_language_state,
    load_vision_state,
    sha256_file,
)
from runtime.finish import Calibration
from tests.checkpoint_fixtures import copy_export, rewrite


@pytest.fixture
def copy(export_dir, tmp_path) -> Path:
    return copy_export(export_dir, tmp_path / "export")


def read_manifest(root: Path) -> dict:
    return json.loads((root / MANIFEST).read_text("utf-8"))


HUGE = "__1e999__"  # written as the JSON number 1e999, which Python reads as inf


def write_manifest(root: Path, manifest: dict) -> None:
    text = json.dumps(manifest, indent=1) + "\n"
    rewrite(root / MANIFEST, text.replace(f'"{HUGE}"', "1e999"))


def edit_manifest(root: Path, edit) -> None:
    manifest = read_manifest(root)
    edit(manifest)
    write_manifest(root, manifest)


def replace_output(root: Path, name: str, data: bytes | str) -> None:
    """Rewrites a listed file and records its new hash, so only the content check can fail."""
    rewrite(root / name, data)
    edit_manifest(root, lambda m: m["outputs"].__setitem__(name, sha256_file(root / name)))


def refused(root: Path, message: str, verify: bool = True) -> None:
    with pytest.raises(ExportError, match=message):
        load_export(root, verify=verify)


# -- a good export -------------------------------------------------------------------------


def test_tiny_export_loads(export_dir):
    info = load_export(export_dir)
    assert info.identity == "synthetic"
    assert info.hidden_size == 64
    assert isinstance(info.calibration, Calibration)
    assert info.calibration.temperatures == {"noul": 1.1991, "choice": 1.1199, "score": 1.1909}
    assert info.calibration.noul_bias == 0.05310856608843584
    assert info.config["text_config"]["vocab_size"] == 248079
    assert len(info.shards) == 2  # the 31.8 MB embedding alone, then the rest
    assert set(info.files) == set(read_manifest(export_dir)["outputs"])
    assert info.manifest["lora"] == {"rank": 32, "alpha": 64, "merged": "bfloat16"}


def test_manifest_is_written_as_the_worker_expects(export_dir):
    text = (export_dir / MANIFEST).read_text("utf-8")
    manifest = json.loads(text)
    assert text == json.dumps(manifest, indent=1, allow_nan=False) + "\n"
    assert list(manifest)[:2] == ["format", "model_id"]
    listed = set(manifest["outputs"])
    on_disk = {p.name for p in export_dir.iterdir()} - {MANIFEST}
    assert listed == on_disk
    assert all(k.startswith(("base/", "checkpoint/")) for k in manifest["inputs"])


def test_language_state_names_and_shapes(export_dir):
    info = load_export(export_dir, verify=False)
    state = load_language_state(info, torch.float32)
    assert state["embed_tokens.weight"].shape == (248079, 64)
    assert "norm.weight" in state and "layers.3.self_attn.q_proj.weight" in state
    assert not any(k.startswith(("model.", "lm_head")) for k in state)
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert load_language_state(info)["embed_tokens.weight"].dtype == torch.bfloat16


def test_vision_and_heads_state(export_dir):
    info = load_export(export_dir, verify=False)
    vision = load_vision_state(info)
    assert vision["model.visual.pos_embed.weight"].shape == (2304, 32)
    assert all(k.startswith("model.visual.") for k in vision)
    heads = load_heads_state(info)
    assert {k: tuple(v.shape) for k, v in heads.items()} == head_shapes(64)
    assert head_shapes(2560)["head.opt.0.weight"] == (1024, 2560)  # docs/contract.md §6.1
    assert head_shapes(2560)["ord.cut.0.weight"] == (512, 2560)


@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
def test_three_embedding_prefixes_load_alike(export_dir, tmp_path, prefix):
    root = copy_export(export_dir, tmp_path / "export")
    index = json.loads((root / "model.safetensors.index.json").read_text())
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(root / shard), framework="pt") as f:
            tensors = {prefix + k: f.get_tensor(k) for k in f.keys()}
        (root / shard).unlink()
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    index["weight_map"] = {prefix + k: v for k, v in index["weight_map"].items()}
    (root / "model.safetensors.index.json").unlink()
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    info = load_export(root, verify=False)
    state = load_language_state(info)
    expected = load_language_state(load_export(export_dir, verify=False))
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)


def test_language_name_prefixes():
    assert language_name("model.language_model.embed_tokens.weight") == "embed_tokens.weight"
    assert language_name("model.embed_tokens.weight") == "embed_tokens.weight"
    assert language_name("layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert language_name("lm_head.weight") is None
    assert language_name("mtp.layers.0.mlp.up_proj.weight") is None


def test_build_transformers_model_ties_and_matches_dtype(export_dir):
    info = load_export(export_dir, verify=False)
    model = build_transformers_model(info, torch.float32, "cpu")
    embed = model.model.language_model.embed_tokens.weight
    assert model.lm_head.weight is embed
    assert embed.shape == (248079, 64) and embed.dtype == torch.float32
    assert not model.training
    ids = torch.tensor([[248045, 846, 198, 248077, 248078]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hidden = out.hidden_states[-1][0]
    assert torch.allclose(out.logits[0], hidden @ embed.T, atol=1e-4)
    assert torch.isfinite(out.logits).all()


# -- refusals (docs/contract.md §8.3) -----------------------------------------------------------


def test_refuses_wrong_format(copy):
    edit_manifest(copy, lambda m: m.__setitem__("format", "omnijev-merged/2"))
    refused(copy, r"export manifest format is \"omnijev-merged/2\", expected \"omnijev-merged/1\"")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("vocabulary", 248320),
        ("option_tokens", {"<|opt|>": 248078, "<|/opt|>": 248077}),
        ("max_pixels", 401408),
        ("heads", {"norm": "sigmoid", "lm_features": True, "ordinal": True}),
    ],
)
def test_refuses_pinned_values(copy, key, value):
    edit_manifest(copy, lambda m: m.__setitem__(key, value))
    refused(copy, f"export manifest {key} is")


def test_real_claim_needs_the_real_identity(copy):
    edit_manifest(copy, lambda m: m.pop("synthetic"))
    refused(copy, 'export manifest model_id is "synthetic/omnijev-tiny-seed0", expected tinnel')

    def claim_real(manifest):
        manifest.update(REAL_IDENTITY)
        manifest["checkpoint_revision"] = "0" * 40

    edit_manifest(copy, claim_real)
    refused(copy, "export manifest checkpoint_revision is")


def test_real_identity_is_checked_beyond_the_manifest(copy):
    """A manifest with the real identity passes the pins; the real hidden size is then required."""
    edit_manifest(copy, lambda m: (m.pop("synthetic"), m.update(REAL_IDENTITY)))
    refused(copy, "export hidden size is 64, expected 2560", verify=False)


def test_synthetic_may_not_claim_the_real_model_id(copy):
    edit_manifest(copy, lambda m: m.__setitem__("model_id", REAL_IDENTITY["model_id"]))
    refused(copy, "synthetic export claims model_id tinnel123/OmniJev")


@pytest.mark.parametrize(
    "name",
    [
        "config.json",
        "heads.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "vision.safetensors",
    ],
)
def test_refuses_missing_required_output(copy, name):
    edit_manifest(copy, lambda m: m["outputs"].pop(name))
    refused(copy, f"export manifest does not list {name}")


def test_refuses_hash_mismatch(copy):
    rewrite(copy / "heads.safetensors", (copy / "heads.safetensors").read_bytes()[:-4] + b"\0" * 4)
    refused(copy, "export output heads.safetensors does not match its SHA-256")
    load_export(copy, verify=False)  # verify=False skips only the hashing


def test_refuses_listed_file_that_is_missing(copy):
    (copy / "vision.safetensors").unlink()
    refused(copy, "export output vision.safetensors is missing")


@pytest.mark.parametrize(
    "name",
    ["../tokenizer.json", "sub/tokenizer.json", "sub\\tokenizer.json", "..", MANIFEST, ""],
)
def test_refuses_names_that_are_not_plain(copy, name):
    edit_manifest(copy, lambda m: m["outputs"].__setitem__(name, "0" * 64))
    refused(copy, "export output|export outputs list the manifest")


def test_refuses_unlisted_shard(copy):
    shard = "model-00002-of-00002.safetensors"
    edit_manifest(copy, lambda m: m["outputs"].pop(shard))
    refused(copy, f'export shard "{shard}" is not listed in the manifest')


def test_refuses_unlisted_model_safetensors(copy):
    (copy / "model.safetensors").write_bytes((copy / "vision.safetensors").read_bytes())
    refused(copy, "export holds an unlisted model.safetensors")


def test_refuses_wrong_vocab_size(copy):
    config = json.loads((copy / "config.json").read_text())
    config["text_config"]["vocab_size"] = 248320
    replace_output(copy, "config.json", json.dumps(config))
    refused(copy, "export text_config.vocab_size is 248320, expected 248079")


@pytest.mark.parametrize(
    ("calibration", "message"),
    [
        (
            {"temperatures": {"noul": 1.0, "choice": 1.0}, "noul_bias": 0.0},
            "temperatures are .*, expected noul, choice, score",
        ),
        (
            {
                "temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0, "x": 1.0},
                "noul_bias": 0.0,
            },
            "temperatures are",
        ),
        (
            {"temperatures": {"noul": 1.0, "choice": -1.0, "score": 1.0}, "noul_bias": 0.0},
            "export temperature choice is -1.0, expected positive",
        ),
        (
            {"temperatures": {"noul": 1.0, "choice": 1.0, "score": 0}, "noul_bias": 0.0},
            "export temperature score is 0",
        ),
        (
            {"temperatures": {"noul": HUGE, "choice": 1.0, "score": 1.0}, "noul_bias": 0.0},
            "export temperature noul is inf",
        ),
        (
            {"temperatures": {"noul": 1.0, "choice": "1", "score": 1.0}, "noul_bias": 0.0},
            "export temperature choice is '1'",
        ),
        (
            {"temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0}, "noul_bias": HUGE},
            "export noul_bias is inf, expected a finite number",
        ),
        ({"temperatures": {"noul": 1.0, "choice": 1.0, "score": 1.0}}, "export noul_bias is None"),
    ],
)
def test_refuses_bad_calibration(copy, calibration, message):
    edit_manifest(copy, lambda m: m.__setitem__("calibration", calibration))
    refused(copy, message)


def test_refuses_nan_in_manifest(copy):
    text = (copy / MANIFEST).read_text()
    rewrite(copy / MANIFEST, text.replace('"noul_bias": 0.05310856608843584', '"noul_bias": NaN'))
    refused(copy, "export manifest holds NaN")


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("<|opt|>", "export tokenizer maps <|opt|> to None, expected 248077"),
        ("<|image_pad|>", "export tokenizer maps <|image_pad|> to None, expected 248056"),
    ],
)
def test_refuses_tokenizer_id_mismatch(copy, token, message):
    text = (copy / "tokenizer.json").read_text("utf-8")
    entry = f'"content":"{token}"'
    assert text.count(entry) == 1  # only the added token's entry changes
    renamed = text.replace(entry, entry.replace("|", "!"))
    replace_output(copy, "tokenizer.json", renamed)
    refused(copy, message)


def test_refuses_missing_directory_and_manifest(tmp_path):
    refused(tmp_path / "nowhere", "export directory .* does not exist")
    refused(tmp_path, f"export manifest {MANIFEST} is missing")


def test_the_checked_tokenizer_is_the_one_the_executor_uses(copy):
    """The export check loads tokenizer.json once and hands it on (the executor used to parse
    the file again); an unchanged file is not parsed again, a rewritten one is."""
    info = load_export(copy, verify=False)
    assert info.tokenizer is not None and info.tokenizer.token_to_id("<|opt|>") == 248077
    assert load_export(copy, verify=False).tokenizer is info.tokenizer
    path = copy / "tokenizer.json"
    rewrite(path, path.read_bytes())
    assert load_export(copy, verify=False).tokenizer is not info.tokenizer
