"""Reads an export directory's weights into the model's modules (`LanguagePass`, `VisionTower`).

Follows the export layout of docs/design.md through `runtime.export_format`: `config.json`, the
language model's shards with `Qwen3_5TextModel` names and `vision.safetensors` (`model.visual.*`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from runtime.export_format import INDEX, VISION, language_name, read_safetensors
from runtime.model.language import LanguagePass
from runtime.model.vision import VisionTower

CONFIG = "config.json"
SINGLE = "model.safetensors"  # an unsharded language model, as save_pretrained writes it
VISION_PREFIX = "model.visual."
POS_EMBED = "pos_embed.weight"  # used on the host (vision_inputs), not inside the tower graph


def read_config(export_dir: str | Path) -> dict:
    return json.loads((Path(export_dir) / CONFIG).read_text("utf-8"))


def language_shards(export_dir: Path) -> list[Path]:
    """Shard files in index order; a single `model.safetensors` when there is no index (a plain
    `save_pretrained` directory: the modules load those too, without an export manifest)."""
    index = export_dir / INDEX
    if not index.is_file():
        return [export_dir / SINGLE]
    names = json.loads(index.read_text("utf-8"))["weight_map"].values()
    return [export_dir / name for name in dict.fromkeys(names)]


def language_state(export_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Language-model tensors named as `Qwen3_5TextModel.state_dict()`, cast to `dtype`."""
    state = {}
    for shard in language_shards(Path(export_dir)):
        for key, tensor in read_safetensors(shard, dtype).items():
            name = language_name(key)
            if name is not None:
                state[name] = tensor
    return state


def vision_state(export_dir: str | Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Vision tensors without the `model.visual.` prefix; the position table stays float32."""
    state = {}
    for key, tensor in read_safetensors(Path(export_dir) / VISION, None).items():
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
