"""Merges a release (Qwen3.5 base + OmniJev adapter checkpoint) into an `omnijev-merged/1` export.

Follows the reference export (`LF@ebd572b recipe/omnijev/export.py`, docs/contract.md §8.1 steps
1-8): checks, BF16 base on CPU, resize to 248,079 rows, option rows, PEFT merge, files, manifest
last. A release directory holds `base/` (Qwen/Qwen3.5-4B's files) and `checkpoint/` (the adapter's).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from build_engines.release import (
    BASE_DIR,
    CHECKPOINT_DIR,
    LORA_ALPHA,
    LORA_RANK,
    RELEASE,
    RELEASE_FILES,
    RELEASE_MANIFEST,
    write_json,
)
from runtime.export_format import (
    FORMAT,
    HEADS,
    HEADS_META,
    INDEX,
    LORA,
    MANIFEST,
    MAX_PIXELS,
    OPTION_TOKENS,
    REAL_IDENTITY,
    TEMPERATURE_KEYS,
    VISION,
    VOCABULARY,
    ExportError,
    check_heads,
    check_tokenizer,
    sha256_file,
)

# Pinned base files of Qwen/Qwen3.5-4B at 851bf6e (docs/contract.md §8.1 step 3).
BASE_PINS = {
    "config.json": "ddc63e1c717afa86c865bb5e01313d89d72bb53b97ad4a8a03ba8510c0621670",
    INDEX: "cf3f798ee02ba45f9622aa8892a47369ab667d0afbf154ee7c2212de42e6302d",
    "model.safetensors-00001-of-00002.safetensors": (
        "26a93f066e1916adb13453dae5a0c707c0fbc71299ed98779571a907b8e74c61"
    ),
    "model.safetensors-00002-of-00002.safetensors": (
        "cb544bd9bfae93dc59b0f22b292f5933573854a7f9b97835c67060d7d910e188"
    ),
}
REAL_BASE_MODEL = REAL_IDENTITY["base_model_id"]
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")  # step 8
HEAD_FILES = (("head.", "head.pt"), ("ord.", "ord.pt"))
OPTION_ROWS = slice(OPTION_TOKENS["<|opt|>"], OPTION_TOKENS["<|/opt|>"] + 1)


class ReleaseError(ValueError):
    """A release that the export refuses to merge."""


def read_release_manifest(ckpt_dir: Path) -> dict:
    """The checkpoint's `release_manifest.json`: release v1.1, real or with its own identity."""
    path = ckpt_dir / RELEASE_MANIFEST
    try:
        manifest = json.loads(path.read_text("utf-8"))
    except FileNotFoundError:
        raise ReleaseError(f"release has no {RELEASE_MANIFEST} in {ckpt_dir}") from None
    if not isinstance(manifest, dict):
        raise ReleaseError(f"{RELEASE_MANIFEST} is not a JSON object")
    if manifest.get("release") != RELEASE:
        raise ReleaseError(f"release is {manifest.get('release')!r}, expected {RELEASE!r}")
    synthetic = manifest.get("synthetic", False) is True
    base_model = manifest.get("base_model")
    if not synthetic and base_model != REAL_BASE_MODEL:
        raise ReleaseError(f"release base_model is {base_model!r}, expected {REAL_BASE_MODEL!r}")
    if synthetic:
        for key in ("model_id", "checkpoint_revision", "base_model", "base_revision"):
            if not isinstance(manifest.get(key), str) or not manifest[key]:
                raise ReleaseError(f"synthetic release manifest has no {key}")
        if manifest["model_id"] == REAL_IDENTITY["model_id"]:
            raise ReleaseError(f"synthetic release claims model_id {manifest['model_id']}")
    return manifest


def identity(manifest: dict) -> dict:
    """The export manifest's identity: pinned for the real release, else the release's own."""
    if manifest.get("synthetic") is not True:
        return dict(REAL_IDENTITY)
    return {
        "model_id": manifest["model_id"],
        "checkpoint_revision": manifest["checkpoint_revision"],
        "base_model_id": manifest["base_model"],
        "base_revision": manifest["base_revision"],
        "synthetic": True,
    }


def _recorded_hash(entry: object) -> str | None:
    """A manifest entry is a hex digest or an object with `sha256`."""
    if isinstance(entry, dict):
        entry = entry.get("sha256")
    return entry.lower() if isinstance(entry, str) else None


def check_hashes(directory: Path, expected: dict, prefix: str) -> dict[str, str]:
    """SHA-256 of each named file against its record; returns `{prefix/name: sha}`."""
    checked = {}
    for name, entry in expected.items():
        path = directory / name
        if not path.is_file():
            raise ReleaseError(f"release file {prefix}/{name} is missing")
        digest = sha256_file(path)
        if digest != _recorded_hash(entry):
            raise ReleaseError(f"release file {prefix}/{name} does not match its SHA-256")
        checked[f"{prefix}/{name}"] = digest
    return checked


def check_release_files(release_dir: Path, manifest: dict) -> dict[str, str]:
    """Steps 2-3: the checkpoint files against the manifest, the base against its pins."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ReleaseError(f"{RELEASE_MANIFEST} has no files")
    missing = [name for name in RELEASE_FILES if name not in files]
    if missing:
        raise ReleaseError(f"{RELEASE_MANIFEST} does not list {missing[0]}")
    ckpt_dir, base_dir = release_dir / CHECKPOINT_DIR, release_dir / BASE_DIR
    inputs = check_hashes(ckpt_dir, {name: files[name] for name in RELEASE_FILES}, CHECKPOINT_DIR)
    inputs[f"{CHECKPOINT_DIR}/{RELEASE_MANIFEST}"] = sha256_file(ckpt_dir / RELEASE_MANIFEST)
    if manifest.get("synthetic") is True:
        pins = manifest.get("base_files")
        if not isinstance(pins, dict):
            raise ReleaseError(f"synthetic {RELEASE_MANIFEST} has no base_files")
        index = json.loads((base_dir / INDEX).read_text("utf-8"))
        for name in ("config.json", INDEX, *index["weight_map"].values()):
            if name not in pins:
                raise ReleaseError(f"synthetic {RELEASE_MANIFEST} does not pin base/{name}")
    else:
        pins = BASE_PINS
    inputs.update(check_hashes(base_dir, pins, BASE_DIR))
    return inputs


def _positive_finite(value: object) -> bool:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    return ok and math.isfinite(value) and value > 0


def check_head_meta(path: Path) -> dict:
    """Step 4; returns the export's calibration `{"temperatures": …, "noul_bias": …}`."""
    meta = json.loads(path.read_text("utf-8"))
    if meta.get("norm") != HEADS_META["norm"]:
        raise ReleaseError(f"head_meta norm is {meta.get('norm')!r}, expected 'softmax'")
    for key in ("lm_feats", "ordinal", "branch"):
        if meta.get(key) is not True:
            raise ReleaseError(f"head_meta {key} is {meta.get(key)!r}, expected true")
    temperatures = meta.get("temperatures")
    if not isinstance(temperatures, dict) or sorted(temperatures) != sorted(TEMPERATURE_KEYS):
        raise ReleaseError(
            f"head_meta temperatures are {temperatures!r}, expected noul, choice, score"
        )
    for key, value in temperatures.items():
        if not _positive_finite(value):
            raise ReleaseError(f"head_meta temperature {key} is {value!r}, expected positive")
    biases = meta.get("biases", {})
    if not isinstance(biases, dict) or set(biases) - {"noul"}:
        raise ReleaseError(f"head_meta biases are {biases!r}, only noul is allowed")
    bias = biases.get("noul", 0.0)
    if not isinstance(bias, int | float) or isinstance(bias, bool) or not math.isfinite(bias):
        raise ReleaseError(f"head_meta noul bias is {bias!r}, expected a finite number")
    temps = {key: temperatures[key] for key in TEMPERATURE_KEYS}
    return {"temperatures": temps, "noul_bias": bias}


def load_base(base_dir: Path):
    """Step 6: the base in BF16 on the CPU."""
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(
        str(base_dir), dtype=torch.bfloat16, device_map="cpu", local_files_only=True
    ).eval()


def restore_option_rows(model, rows_path: Path) -> None:
    """Step 6: 248,079 rows, the two option rows from `new_tok_emb.pt`, embeddings tied."""
    model.resize_token_embeddings(VOCABULARY, mean_resizing=False)
    embedding = model.get_input_embeddings().weight
    rows = torch.load(rows_path, map_location="cpu", weights_only=True)
    hidden = embedding.shape[1]
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (2, hidden):
        found = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ReleaseError(f"new_tok_emb.pt is {found}, expected (2, {hidden})")
    if not bool(torch.isfinite(rows).all()):
        raise ReleaseError("new_tok_emb.pt is not finite")
    with torch.no_grad():
        embedding[OPTION_ROWS] = rows.to(embedding.dtype)
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    if not (tied and model.config.get_text_config().tie_word_embeddings):
        raise ReleaseError("base model does not tie its input and output embeddings")
    if model.config.get_text_config().vocab_size != VOCABULARY:
        raise ReleaseError(f"resized vocabulary is not {VOCABULARY}")


def merge_adapter(model, ckpt_dir: Path):
    """Step 7: PEFT LoRA (rank 32, alpha 64) loaded in full and merged in BF16."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict

    peft_model = PeftModel.from_pretrained(model, str(ckpt_dir), is_trainable=False)
    lora = peft_model.peft_config["default"]
    if (lora.r, lora.lora_alpha) != (LORA_RANK, LORA_ALPHA):
        raise ReleaseError(f"adapter is rank {lora.r} alpha {lora.lora_alpha}, expected 32 / 64")
    with safe_open(str(ckpt_dir / "adapter_model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
    # save_embedding_layers=False: "auto" would look the base model up on the Hub.
    loaded = set(get_peft_model_state_dict(peft_model, save_embedding_layers=False))
    if stored != loaded:
        extra = sorted(stored ^ loaded)[0]
        raise ReleaseError(f"adapter tensors do not fit the base: {extra}")
    return peft_model.merge_and_unload(safe_merge=True)


def read_heads(ckpt_dir: Path, hidden: int) -> dict[str, torch.Tensor]:
    """`head.*` from head.pt and `ord.*` from ord.pt as float32, shapes and finiteness checked."""
    state = {}
    for prefix, file_name in HEAD_FILES:
        part = torch.load(ckpt_dir / file_name, map_location="cpu", weights_only=True)
        if not isinstance(part, dict):
            raise ReleaseError(f"{file_name} is not a state dict")
        state.update(
            {prefix + k: v.detach().to(torch.float32).contiguous() for k, v in part.items()}
        )
    try:
        check_heads(state, hidden)
    except ExportError as error:
        raise ReleaseError(str(error)) from None
    return state


def write_language_model(model, out: Path, max_shard_size: str) -> None:
    """The language model as `Qwen3_5TextModel.save_pretrained` writes it, always with an index."""
    model.model.language_model.save_pretrained(str(out), max_shard_size=max_shard_size)
    single = out / "model.safetensors"
    if not (out / INDEX).exists() and single.exists():  # small models come out unsharded
        with safe_open(str(single), framework="pt") as f:
            names = sorted(f.keys())
        total = sum(
            t.numel() * t.element_size() for t in model.model.language_model.state_dict().values()
        )
        index = {"metadata": {"total_size": total}, "weight_map": dict.fromkeys(names, single.name)}
        write_json(out / INDEX, index)
    # config.json: the full model's, with vision_config and the resized vocabulary.
    model.config.dtype = torch.bfloat16
    model.config.text_config.architectures = None  # set by the text model's save_pretrained
    (out / "config.json").write_text(model.config.to_json_string(use_diff=True), "utf-8")


def write_vision(model, out: Path) -> None:
    """`model.visual.*` unchanged (the adapter does not touch the vision tower)."""
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if k.startswith("model.visual.")
    }
    save_file(state, str(out / VISION), metadata={"format": "pt"})


def export_manifest(out: Path, release: dict, calibration: dict, inputs: dict) -> dict:
    """Contract.md §8.2, with the SHA-256 of every file written before it."""
    outputs = {p.name: sha256_file(p) for p in sorted(out.iterdir()) if p.name != MANIFEST}
    return {
        "format": FORMAT,
        **identity(release),
        "lora": dict(LORA),
        "vocabulary": VOCABULARY,
        "option_tokens": dict(OPTION_TOKENS),
        "max_pixels": MAX_PIXELS,
        "heads": dict(HEADS_META),
        "calibration": calibration,
        "inputs": dict(sorted(inputs.items())),
        "outputs": outputs,
    }


def merge_release(
    release_dir: str | Path, out_dir: str | Path, max_shard_size: str = "5GB"
) -> Path:
    """Writes the export of a release into `out_dir` (refused if it exists); returns `out_dir`."""
    release_dir, out = Path(release_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"output directory {out} exists")
    ckpt_dir = release_dir / CHECKPOINT_DIR
    release = read_release_manifest(ckpt_dir)
    inputs = check_release_files(release_dir, release)
    calibration = check_head_meta(ckpt_dir / "head_meta.json")
    try:
        check_tokenizer(ckpt_dir / "tokenizer.json")
    except ExportError as error:
        raise ReleaseError(str(error).replace("export ", "release ", 1)) from None
    model = load_base(release_dir / BASE_DIR)
    restore_option_rows(model, ckpt_dir / "new_tok_emb.pt")
    model = merge_adapter(model, ckpt_dir)
    heads = read_heads(ckpt_dir, model.config.get_text_config().hidden_size)

    partial = out.parent / f".{out.name}.partial"
    if partial.exists():
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    write_language_model(model, partial, max_shard_size)
    write_vision(model, partial)
    save_file(heads, str(partial / HEADS), metadata={"format": "pt"})
    for name in COPIED:
        shutil.copyfile(ckpt_dir / name, partial / name)
    for path in partial.iterdir():
        os.chmod(path, 0o644)  # save_pretrained writes shards readable by their owner only
    manifest = export_manifest(partial, release, calibration, inputs)
    text = json.dumps(manifest, indent=1, allow_nan=False) + "\n"
    (partial / MANIFEST).write_text(text, "utf-8")
    partial.rename(out)
    return out


def cli_merge(args) -> int:
    """`omnijev merge --release DIR --out DIR`."""
    start = time.perf_counter()
    out = merge_release(args.release, args.out)
    print(f"export: {out} ({time.perf_counter() - start:.1f} s)")
    return 0
