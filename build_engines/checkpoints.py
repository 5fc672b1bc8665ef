"""Writes synthetic OmniJev releases (base model + adapter checkpoint) and merges them to exports.

Follows the published release's layout (docs/contract.md §8.1, docs/model.md §7.2-7.3): a Qwen3.5
base as HF publishes it and a checkpoint holding a PEFT LoRA, `head.pt`/`ord.pt`, `head_meta.json`,
the option rows and the tokenizer; `merge.merge_release` then does what the reference's `export.py`
does.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from build_engines import presets
from build_engines.merge import merge_release
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
from runtime.export_format import head_shapes, sha256_file

# Largest base shard: HF's 5 GB gives the real base's two shards; the tiny one gets two as well
# (the 31.8 MB embedding alone, then the rest) so the shard path is exercised.
SHARD_BYTES = {"tiny": 16_000_000, "4b": 5_000_000_000}
EXPORT_SHARD = {"tiny": "16MB", "4b": "5GB"}  # max_shard_size of the merged language model

# Modules the real adapter covers, inferred from its byte count (docs/model.md §7.3).
LORA_TARGETS = (
    "down_proj",
    "gate_proj",
    "in_proj_qkv",
    "in_proj_z",
    "k_proj",
    "o_proj",
    "out_proj",
    "q_proj",
    "up_proj",
    "v_proj",
)
LORA_B_STD = 0.02  # alpha/r · B·A ≈ 0.23/√fan_in: about a quarter of W, so the merge matters

# Base initialisation: O(1) activations in every layer. Matrices use 1/√fan_in; the projections
# back into the residual stream are further divided by √(2·layers) (GPT-2), so the stream grows
# slowly; the tied embedding uses 1/√D, so logits = hidden·Eᵀ have standard deviation ≈ 1.
RESIDUAL_OUTPUTS = ("o_proj", "out_proj", "down_proj", "attn.proj", "mlp.linear_fc2")
# Norm weights and biases get noise around their init: a runtime that ignores one must fail parity.
NORM_NOISE = 0.1
BIAS_STD = 0.02
POS_EMBED_STD = 0.5  # the vision grid must move patches visibly
A_RANGE = (0.01, 16.0)  # A_log = log(uniform(0.01, 16)), transformers' Qwen3.5 init
# dt_bias = softplus⁻¹(dt), dt log-uniform in DT_RANGE: the Gated DeltaNet authors' form (FLA
# `fla/layers/gated_deltanet.py`, after Mamba2: dt in [1e-3, 0.1]), narrowed to long memories, for
# both presets. transformers' dt_bias = 1 is a placeholder for trained weights: with it the decay
# g = -A·softplus(a + 1) is about -10 a token, so every head forgets at once and outputs one term
# β(q̂·k̂)v/√dk of rms 1e-4…1e-2, around the gated RMSNorm's √eps = 1e-3; the norm turns the chunked
# kernel's float32 rounding (in-chunk cumulative decays reach -600) into relative errors of 1e-4.
# Measured, float32 branch vs plain forward (tests/test_reference.py, tiny, seed 0): 3.2e-4 on
# final-norm hidden states with dt_bias = 1, 5.6e-6 with DT_RANGE (log-probs 1.1e-5 → 3.8e-6;
# seeds 0-5 at most 7.8e-6 and 5.7e-6); FLA's full range still leaves heads decaying several nats
# a token (seed 2: 5.7e-5). One layer at the 4b's shapes (dk 128: single-token outputs of 2e-3),
# prefix then row vs one pass after the gated norm: 5.1e-5 with dt_bias = 1, 6.7e-6 with DT_RANGE.
DT_RANGE = (1e-4, 1e-3)

# Heads: the last Linear of each scorer has weights of std gain/√fan_in, chosen so that over
# prepared requests the choice logits spread over about ±3 and the ordinal cut points straddle z
# (checked in tests/test_checkpoints.py). The ordinal thresholds add up one softplus per level,
# so its gain is lower.
HEAD_GAINS = {"head.score": 3.0, "head.abstain": 3.0, "ord.z.2": 1.5, "ord.cut.2": 1.5}
HEAD_BIAS_STD = 0.1
# LM features reach tens (a long option's dist is about -40; -73.8 in features.json): 0.01 keeps
# their share of h and of the logit comparable to the gated option term's.
FEATURE_STD = 0.01
LOG_TAU = (math.log(1.25), 0.0, math.log(0.8))  # distinct per type: a wrong type_id shows

# head_meta.json of v1.1 (docs/contract.md §7.1).
TEMPERATURES = {"noul": 1.1991, "choice": 1.1199, "score": 1.1909}
NOUL_BIAS = 0.05310856608843584
PROCESSOR_MAX_PIXELS = 401408  # the processor config's own budget; MSO1 overrides it (§4.8)
PROCESSOR_MIN_PIXELS = 65536

# Renders docs/contract.md §4.2: no system prompt is added; a list content renders images as
# vision markup and texts as is; the whole content is trimmed; the generation prompt opens
# thinking with `<think>\n` and no `</think>`.
CHAT_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- else -%}
{%- for item in content -%}
{%- if item.type == 'image' or 'image' in item or 'image_url' in item -%}
<|vision_start|><|image_pad|><|vision_end|>
{%- elif item.type == 'video' or 'video' in item -%}
<|vision_start|><|video_pad|><|vision_end|>
{%- elif 'text' in item -%}
{{- item.text -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\\n' + (render_content(message.content) | trim) -}}
{{- '<|im_end|>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}
{{- '<think>\\n\\n</think>\\n\\n' -}}
{%- else -%}
{{- '<think>\\n' -}}
{%- endif -%}
{%- endif -%}
"""


def tensor_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator for one tensor: the bytes depend only on (seed, name), not on order."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def normal(shape: tuple[int, ...], mean: float, std: float, seed: int, name: str) -> torch.Tensor:
    generator = tensor_generator(seed, name)
    return torch.empty(shape, dtype=torch.float32).normal_(mean, std, generator=generator)


def base_init(name: str, shape: tuple[int, ...], config) -> tuple[float, float]:
    """(mean, std) of one base tensor; see the constants above for the reasons."""
    text, vision = config.text_config, config.vision_config
    leaf = name.rsplit(".", 1)[-1]
    module = name.rsplit(".", 2)[-2]
    if name.endswith("embed_tokens.weight"):
        return 0.0, text.hidden_size**-0.5
    if name.endswith("linear_attn.norm.weight"):
        return 1.0, NORM_NOISE  # the gated RMSNorm is not zero-centred
    if "norm" in module:
        zero_centred = "language_model" in name  # Qwen3_5RMSNorm computes x·(1 + w)
        if leaf == "bias":
            return 0.0, BIAS_STD
        return (0.0 if zero_centred else 1.0), NORM_NOISE
    if leaf == "bias":
        return 0.0, BIAS_STD
    if module == "pos_embed":
        return 0.0, POS_EMBED_STD
    if module == "conv1d":
        return 0.0, shape[-1] ** -0.5  # depthwise: fan-in is the kernel width
    std = math.prod(shape[1:]) ** -0.5
    if any(f"{part}.weight" in name for part in RESIDUAL_OUTPUTS):
        layers = vision.depth if "visual" in name else text.num_hidden_layers
        std /= math.sqrt(2 * layers)
    if "merger.linear_fc2" in name:
        std *= text.hidden_size**-0.5  # image rows at the scale of the token embeddings
    return 0.0, std


def dt_bias(shape: tuple[int, ...], seed: int, name: str) -> torch.Tensor:
    """softplus⁻¹(dt) with dt log-uniform in DT_RANGE (see there), in float32."""
    low, high = (math.log(x) for x in DT_RANGE)
    dt = torch.empty(shape).uniform_(low, high, generator=tensor_generator(seed, name)).exp_()
    return dt + torch.log(-torch.expm1(-dt))


def base_tensor(name: str, shape: tuple[int, ...], config, seed: int) -> torch.Tensor:
    """One base tensor in BF16."""
    if name.endswith("A_log"):
        uniform = torch.empty(shape).uniform_(*A_RANGE, generator=tensor_generator(seed, name))
        return uniform.log_().to(torch.bfloat16)
    if name.endswith("dt_bias"):
        return dt_bias(shape, seed, name).to(torch.bfloat16)
    mean, std = base_init(name, shape, config)
    return normal(shape, mean, std, seed, name).to(torch.bfloat16)


def base_entries(config) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every base tensor as HF publishes it: sorted, without the tied lm_head."""
    state = presets.meta_model(config).state_dict()
    return sorted((k, tuple(v.shape)) for k, v in state.items() if k != "lm_head.weight")


def plan_shards(entries: list, limit: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Greedy shards of at most `limit` BF16 bytes (a larger tensor gets a shard of its own)."""
    shards, current, size = [], [], 0
    for name, shape in entries:
        nbytes = 2 * math.prod(shape)
        if current and size + nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += nbytes
    return [*shards, current] if current else shards


def shard_name(index: int, count: int) -> str:
    """The real base's shard names (docs/contract.md §8.1 step 3)."""
    return f"model.safetensors-{index:05d}-of-{count:05d}.safetensors"


def write_base(config, seed: int, base_dir: Path, shard_bytes: int) -> None:
    """config.json, the index and BF16 shards, generated one shard at a time."""
    base_dir.mkdir(parents=True)
    config.dtype = torch.bfloat16
    (base_dir / "config.json").write_text(config.to_json_string(use_diff=True), "utf-8")
    shards = plan_shards(base_entries(config), shard_bytes)
    weight_map, total = {}, 0
    for index, entries in enumerate(shards, start=1):
        name = shard_name(index, len(shards))
        tensors = {key: base_tensor(key, shape, config, seed) for key, shape in entries}
        save_file(tensors, str(base_dir / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(base_dir / "model.safetensors.index.json", index)


def lora_modules(config) -> list[tuple[str, int, int]]:
    """(module name, in, out) of every Linear the adapter covers: language model only."""
    model = presets.meta_model(config)
    found = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, torch.nn.Linear) and leaf in LORA_TARGETS:
            if "language_model" not in name:
                raise ValueError(f"LoRA target {name} lies outside the language model")
            found.append((name, module.in_features, module.out_features))
    return found


def adapter_config(base_model: str) -> dict:
    """A PEFT LoRA config as `LoraConfig.save_pretrained` writes it, with a stable module order."""
    from peft import LoraConfig

    lora = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        bias="none",
        target_modules=list(LORA_TARGETS),
        base_model_name_or_path=base_model,
        inference_mode=True,
    ).to_dict()
    # LoraConfig keeps target_modules as a set, whose order varies between processes.
    lora["target_modules"] = sorted(lora["target_modules"])
    return dict(sorted(lora.items()))


def write_adapter(config, seed: int, ckpt_dir: Path, base_model: str) -> None:
    """adapter_config.json and adapter_model.safetensors (float32 A and B for every target)."""
    tensors = {}
    for name, fan_in, out in lora_modules(config):
        key = f"base_model.model.{name}"
        a_name, b_name = f"{key}.lora_A.weight", f"{key}.lora_B.weight"
        tensors[a_name] = normal((LORA_RANK, fan_in), 0.0, fan_in**-0.5, seed, a_name)
        tensors[b_name] = normal((out, LORA_RANK), 0.0, LORA_B_STD, seed, b_name)
    save_file(tensors, str(ckpt_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    write_json(ckpt_dir / "adapter_config.json", adapter_config(base_model))


def head_tensor(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """One float32 head tensor; see HEAD_* above."""
    if name == "head.log_tau":
        return torch.tensor(LOG_TAU, dtype=torch.float32)
    if name.endswith(".bias"):
        return normal(shape, 0.0, HEAD_BIAS_STD, seed, name)
    if name.startswith(("head.feat.", "head.feat_lin.")):
        return normal(shape, 0.0, FEATURE_STD, seed, name)
    gain = HEAD_GAINS.get(name.removesuffix(".weight"), 1.0)
    return normal(shape, 0.0, gain * shape[1] ** -0.5, seed, name)


def write_heads(hidden: int, seed: int, ckpt_dir: Path) -> None:
    """head.pt (OptionScorer state dict), ord.pt (OrdinalScoreHead state dict), float32."""
    state = {name: head_tensor(name, shape, seed) for name, shape in head_shapes(hidden).items()}
    for prefix, file_name in (("head.", "head.pt"), ("ord.", "ord.pt")):
        part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        torch.save(part, ckpt_dir / file_name)


def head_meta() -> dict:
    return {
        "norm": "softmax",
        "lm_feats": True,
        "ordinal": True,
        "branch": True,
        "temperatures": dict(TEMPERATURES),
        "biases": {"noul": NOUL_BIAS},
    }


def processor_config() -> dict:
    """Qwen3-VL processor settings: patch 16, merge 2, temporal 2, mean = std = 0.5."""
    image = {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "merge_size": 2,
        "patch_size": 16,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": PROCESSOR_MAX_PIXELS, "shortest_edge": PROCESSOR_MIN_PIXELS},
        "temporal_patch_size": 2,
    }
    return {"image_processor": image, "processor_class": "Qwen3VLProcessor"}


def files_record(directory: Path, names) -> dict[str, dict]:
    return {
        name: {"bytes": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
        for name in sorted(names)
    }


def content_revision(files: dict) -> str:
    """A 40-hex revision derived from the files' hashes: a synthetic release's own identity."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()[:40]


def synthetic_ids(preset: str, seed: int) -> tuple[str, str]:
    return f"synthetic/omnijev-{preset}-seed{seed}", f"synthetic/qwen3.5-{preset}-seed{seed}"


def write_release_manifest(release_dir: Path, preset: str, seed: int) -> None:
    """The checkpoint's manifest: the release's identity and the SHA-256 of every file."""
    base_dir, ckpt_dir = release_dir / BASE_DIR, release_dir / CHECKPOINT_DIR
    files = files_record(ckpt_dir, RELEASE_FILES)
    base_files = files_record(base_dir, [p.name for p in base_dir.iterdir()])
    model_id, base_model = synthetic_ids(preset, seed)
    manifest = {
        "release": RELEASE,
        "synthetic": True,
        "preset": preset,
        "seed": seed,
        "model_id": model_id,
        "checkpoint_revision": content_revision(files),
        "base_model": base_model,
        "base_revision": content_revision(base_files),
        "lora": {"rank": LORA_RANK, "alpha": LORA_ALPHA},
        "files": files,
        "base_files": base_files,
    }
    write_json(ckpt_dir / RELEASE_MANIFEST, manifest)


def make_release(preset: str, seed: int, out_dir: str | Path) -> Path:
    """Writes a synthetic release: `out_dir/base` (Qwen3.5 layout) and `out_dir/checkpoint`."""
    from runtime.tokenizer import write_tokenizer_files

    release_dir = Path(out_dir)
    if release_dir.exists() and any(release_dir.iterdir()):
        raise FileExistsError(f"release directory {release_dir} exists and is not empty")
    config = presets.build_config(preset)
    hidden = config.text_config.hidden_size
    _, base_model = synthetic_ids(preset, seed)
    write_base(config, seed, release_dir / BASE_DIR, SHARD_BYTES[preset])
    ckpt_dir = release_dir / CHECKPOINT_DIR
    ckpt_dir.mkdir()
    write_adapter(config, seed, ckpt_dir, base_model)
    write_heads(hidden, seed, ckpt_dir)
    write_json(ckpt_dir / "head_meta.json", head_meta())
    rows = normal((2, hidden), 0.0, hidden**-0.5, seed, "new_tok_emb")
    torch.save(rows, ckpt_dir / "new_tok_emb.pt")
    write_tokenizer_files(ckpt_dir)
    (ckpt_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, "utf-8")
    write_json(ckpt_dir / "processor_config.json", processor_config())
    write_release_manifest(release_dir, preset, seed)
    return release_dir


def release_path(export_dir: Path) -> Path:
    """Where `make_checkpoint` keeps the release of an export: `<export>.release` beside it."""
    return export_dir.parent / f"{export_dir.name}.release"


def make_checkpoint(preset: str, seed: int, out_dir: str | Path, merge: bool = True) -> Path:
    """A synthetic export at `out_dir` (release beside it), or with merge=False the release."""
    out = Path(out_dir)
    if not merge:
        return make_release(preset, seed, out)
    if out.exists():
        raise FileExistsError(f"output directory {out} exists")
    release_dir = make_release(preset, seed, release_path(out))
    return merge_release(release_dir, out, max_shard_size=EXPORT_SHARD[preset])


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def cli_checkpoint(args) -> int:
    """`omnijev checkpoint --preset tiny|4b --seed N --out DIR [--release-only]`."""
    out = Path(args.out)
    start = time.perf_counter()
    path = make_checkpoint(args.preset, args.seed, out, merge=not args.release_only)
    seconds = time.perf_counter() - start
    if not args.release_only:
        release = release_path(out)
        print(f"release: {release} ({directory_bytes(release) / 1e9:.2f} GB)")
    kind = "release" if args.release_only else "export"
    print(f"{kind}: {path} ({directory_bytes(path) / 1e9:.2f} GB, {seconds:.1f} s)")
    if not args.release_only:
        print(f"use it with --checkpoint {path}")
    return 0
