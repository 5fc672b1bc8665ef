"""The release layout both the synthetic checkpoints and the merge read: folder and file names,
the adapter's rank (docs/contract.md §8.1-§8.2).
"""

from __future__ import annotations

import json
from pathlib import Path

RELEASE = "v1.1"
BASE_DIR = "base"
CHECKPOINT_DIR = "checkpoint"
RELEASE_MANIFEST = "release_manifest.json"
# The files the export checks against the release manifest (docs/contract.md §8.1 step 2).
RELEASE_FILES = (
    "adapter_config.json",
    "adapter_model.safetensors",
    "chat_template.jinja",
    "head.pt",
    "head_meta.json",
    "new_tok_emb.pt",
    "ord.pt",
    "processor_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
)
LORA_RANK = 32  # docs/contract.md §8.2
LORA_ALPHA = 64


def write_json(path: Path, value: dict, indent: int = 2) -> None:
    text = json.dumps(value, indent=indent, ensure_ascii=False, allow_nan=False)
    path.write_text(text + "\n", "utf-8")
