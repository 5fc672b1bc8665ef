"""Model shapes of the synthetic checkpoints: `tiny` for tests and `4b` with Qwen3.5-4B's shapes.

Each preset is the keyword arguments of `transformers.Qwen3_5Config`; the 4b values are
docs/model.md §2.1 and §6.1, the tiny ones shrink the widths but keep the layer pattern, the vision
geometry, the real vocabulary and the real special-token ids (docs/model.md §10).
"""

from __future__ import annotations

import copy

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

PRESETS = ("tiny", "4b")
BASE_VOCAB = 248320  # Qwen3.5's padded embedding rows (docs/model.md §2.1)
# len(tokenizer) after the option tokens; the export resizes to it (docs/model.md §7.1)
VOCAB = 248079
LAYER_PATTERN = ["linear_attention"] * 3 + ["full_attention"]  # full attention every 4th layer

# Token ids of docs/model.md §2.1 / docs/contract.md §4.3, identical in both presets.
TOKEN_IDS = {
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
}
TEXT_EOS = 248044  # <|endoftext|>: text_config eos and pad (docs/model.md §2.1)
TOP_EOS = 248046  # <|im_end|>: the top-level eos

# Keys that Qwen3.5's published config.json carries beside the shapes (docs/model.md §2.1).
TEXT_COMMON = {
    "vocab_size": BASE_VOCAB,
    "hidden_act": "silu",
    "attention_bias": False,
    "attn_output_gate": True,
    "rms_norm_eps": 1e-6,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
    "tie_word_embeddings": True,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "eos_token_id": TEXT_EOS,
    "pad_token_id": TEXT_EOS,
}
VISION_COMMON = {
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "in_channels": 3,
    "hidden_act": "gelu_pytorch_tanh",
    "num_position_embeddings": 2304,  # a 48×48 learned grid, as the real tower (docs/model.md §6.1)
    "deepstack_visual_indexes": [],
}


def rope_parameters(mrope_section: list[int]) -> dict:
    """Qwen3.5's rope: theta 1e7, a quarter of each head rotated, interleaved M-RoPE."""
    return {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": mrope_section,
        "mrope_interleaved": True,
    }


TINY_TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    # sum(mrope_section) == head_dim · partial_rotary_factor / 2 = 32 · 0.25 / 2 = 4
    "rope_parameters": rope_parameters([2, 1, 1]),
}
TINY_VISION = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,  # head 16: divisible by 4 for the 2-D rotary
    "out_hidden_size": 64,  # = text hidden
}

REAL_TEXT = {
    "hidden_size": 2560,
    "intermediate_size": 9216,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    # 11 + 11 + 10 = 256 · 0.25 / 2
    "rope_parameters": rope_parameters([11, 11, 10]),
}
REAL_VISION = {
    "depth": 24,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_heads": 16,
    "out_hidden_size": 2560,
}

SHAPES = {"tiny": (TINY_TEXT, TINY_VISION), "4b": (REAL_TEXT, REAL_VISION)}


def config_kwargs(preset: str) -> dict:
    """`Qwen3_5Config` keyword arguments of a preset (a fresh copy each call)."""
    if preset not in SHAPES:
        raise ValueError(f"preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    text, vision = SHAPES[preset]
    num_layers = text["num_hidden_layers"]
    if num_layers % len(LAYER_PATTERN):
        raise ValueError(f"num_hidden_layers must be a multiple of 4, got {num_layers}")
    text_config = {**TEXT_COMMON, **text, "layer_types": LAYER_PATTERN * (num_layers // 4)}
    return copy.deepcopy(
        {
            "text_config": text_config,
            "vision_config": {**VISION_COMMON, **vision},
            **TOKEN_IDS,
            "eos_token_id": TOP_EOS,
            "tie_word_embeddings": True,
            "architectures": ["Qwen3_5ForConditionalGeneration"],
        }
    )


def build_config(preset: str) -> Qwen3_5Config:
    """The preset as a `Qwen3_5Config`, checked against the constraints of docs/model.md §10.2."""
    config = Qwen3_5Config(**config_kwargs(preset))
    check_config(config)
    return config


def check_config(config: Qwen3_5Config) -> None:
    """Refuses shapes that transformers would accept but Qwen3.5's kernels or ids would not."""
    text, vision = config.text_config, config.vision_config
    rope = text.rope_parameters
    rotary_half = int(text.head_dim * rope["partial_rotary_factor"]) // 2
    if sum(rope["mrope_section"]) != rotary_half:
        raise ValueError(f"mrope_section must sum to {rotary_half}, got {rope['mrope_section']}")
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"vision out_hidden_size must be {text.hidden_size}, got {vision.out_hidden_size}"
        )
    if (vision.hidden_size // vision.num_heads) % 4:
        raise ValueError(f"vision head width must divide by 4, got {vision.hidden_size}")
    side = round(vision.num_position_embeddings**0.5)
    if side * side != vision.num_position_embeddings:
        raise ValueError(
            f"num_position_embeddings must be a square, got {vision.num_position_embeddings}"
        )
    for name in TOKEN_IDS:
        if not 0 <= getattr(config, name) < VOCAB:
            raise ValueError(f"{name} must lie below {VOCAB}, got {getattr(config, name)}")


def meta_model(preset_or_config: str | Qwen3_5Config) -> Qwen3_5ForConditionalGeneration:
    """The model on the meta device: every parameter name and shape, no memory."""
    config = preset_or_config
    if isinstance(config, str):
        config = build_config(config)
    with torch.device("meta"):
        return Qwen3_5ForConditionalGeneration(config)
