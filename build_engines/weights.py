"""Reads an export directory's weights into the export modules of build_engines/modules.py.

Follows the export layout of docs/design.md: `config.json`, the language model's shard index with
`Qwen3_5TextModel` names (`model.` and `model.language_model.` prefixes accepted) and
`vision.safetensors` with `model.visual.*` names.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from build_engines.export_format import language_name
from build_engines.modules import LanguagePass, VisionTower

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"  # an unsharded language model, as save_pretrained writes it
VISION = "vision.safetensors"
VISION_PREFIX = "model.visual."
POS_EMBED = "pos_embed.weight"  # used on the host (vision_inputs), not inside the tower graph
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def read_config(export_dir: str | Path) -> dict:
    return json.loads((Path(export_dir) / CONFIG).read_text("utf-8"))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118 - not a mapping


def language_shards(export_dir: Path) -> list[Path]:
    """Shard files in index order; a single `model.safetensors` when there is no index."""
    index = export_dir / INDEX
    if not index.is_file():
        return [export_dir / SINGLE]
    shards: list[Path] = []
    for name in json.loads(index.read_text("utf-8"))["weight_map"].values():
        if export_dir / name not in shards:
            shards.append(export_dir / name)
    return shards


def language_state(export_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Language-model tensors named as `Qwen3_5TextModel.state_dict()`, cast to `dtype`."""
    state = {}
    for shard in language_shards(Path(export_dir)):
        for key, tensor in read_tensors(shard).items():
            name = language_name(key)
            if name is not None:
                state[name] = tensor.to(dtype)
    return state


def vision_state(export_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Vision tensors without the `model.visual.` prefix; the position table stays float32."""
    state = {}
    for key, tensor in read_tensors(Path(export_dir) / VISION).items():
        name = key.removeprefix(VISION_PREFIX)
        state[name] = tensor.float() if name == POS_EMBED else tensor.to(dtype)
    return state


def load_language_pass(
    export_dir: str | Path, dtype: torch.dtype = torch.float32, **options
) -> LanguagePass:
    """The export's language model as a `LanguagePass` (options: return_state, gdn, readout)."""
    config = read_config(export_dir)
    state = language_state(export_dir, dtype)
    vocab = state["embed_tokens.weight"].shape[0]
    with torch.device("meta"):  # no random init: every parameter comes from the export
        module = LanguagePass(config, vocab=vocab, **options)
    module.load_state_dict(state, strict=True, assign=True)
    return module.eval()


def load_vision_tower(
    export_dir: str | Path, dtype: torch.dtype = torch.float32
) -> tuple[VisionTower, np.ndarray]:
    """The tower and its float32 position table [num_position_embeddings, C] for vision_inputs."""
    config = read_config(export_dir)
    state = vision_state(export_dir, dtype)
    pos_embed = state.pop(POS_EMBED).numpy()
    with torch.device("meta"):
        tower = VisionTower(config["vision_config"])
    tower.load_state_dict(state, strict=True, assign=True)
    return tower.eval(), pos_embed
