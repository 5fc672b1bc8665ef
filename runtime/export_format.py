"""Reads an `omnijev-merged/1` export directory with every check of the worker's `export::load`.

Follows docs/contract.md §8.2-8.3 (`S1@fc27b75 .../export.rs`): the manifest, the listed files and
their SHA-256, the shard index, the vocabulary, the calibration and the tokenizer ids; then loads
the weights into plain state dicts (the reference builds transformers' model from them).
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from runtime.constants import IMAGE_PAD_ID, MODEL_ID, OPTION_TOKENS, SPECIAL_IDS, VOCABULARY
from runtime.types import TYPE_IDS, Calibration

FORMAT = "omnijev-merged/1"
MANIFEST = "omnijev_export.json"
INDEX = "model.safetensors.index.json"
VISION = "vision.safetensors"
HEADS = "heads.safetensors"
TOKENIZERS_KEPT = 2  # checked tokenizers kept by file (a Qwen tokenizer is tens of MB)
HASH_BLOCK = 4 * 1024 * 1024  # the worker hashes in 4 MiB blocks (docs/contract.md §8.3)
# files hashed at once: hashlib lets go of the GIL while it hashes a block, so the shards hash
# side by side (one file at a time, the 4b export's check was most of its load)
HASH_THREADS = 8

# Identity of the published release (docs/contract.md §0.2, §8.2); pinned only for a real export.
REAL_IDENTITY = {
    "model_id": MODEL_ID,
    "checkpoint_revision": "ffe5f436eaf22e20e2f041f8e74e121fd057a6cb",
    "base_model_id": "Qwen/Qwen3.5-4B",
    "base_revision": "851bf6e806efd8d0a36b00ddf55e13ccb7b8cd0a",
}
IDENTITY_CHECKED = ("model_id", "checkpoint_revision", "base_revision")  # the worker's list
MAX_PIXELS = 602112  # 768·28·28, MSO1's budget (docs/contract.md §4.8)
HEADS_META = {"norm": "softmax", "lm_features": True, "ordinal": True}
LORA = {"rank": 32, "alpha": 64, "merged": "bfloat16"}  # docs/contract.md §8.2
# Values every export must carry, synthetic or real: the runtime depends on them.
PINNED = {
    "format": FORMAT,
    "vocabulary": VOCABULARY,
    "option_tokens": OPTION_TOKENS,
    "max_pixels": MAX_PIXELS,
    "heads": HEADS_META,
}
REQUIRED_OUTPUTS = ("config.json", HEADS, INDEX, "tokenizer.json", VISION)
TEMPERATURE_KEYS = ("noul", "choice", "score")
TOKENIZER_IDS = SPECIAL_IDS  # the processor's check
IMAGE_TOKEN_ID = IMAGE_PAD_ID  # the executor's check of config.json
REAL_HIDDEN = 2560  # the executor's check; synthetic exports may be narrower
# Accepted names of the language model's tensors (docs/contract.md §8.3), longest prefix first.
LANGUAGE_PREFIXES = ("model.language_model.", "model.")
IGNORED_LANGUAGE = ("lm_head.", "mtp.")  # tied output projection; multi-token prediction

# heads.safetensors: every tensor's shape as a function of the hidden size D (contract §6.1-6.2)
N_FEATS = 6  # LM features per option (contract §6.2)
OPTION_WIDTH_CAP = 1024  # OptionScorer d_hidden: min(1024, 2·D) (contract §6.1)
ORDINAL_WIDTH_CAP = 512  # OrdinalScoreHead d_hidden: min(512, D) (contract §6.1)


def option_width(hidden: int) -> int:
    """OptionScorer's inner width for hidden size D."""
    return min(OPTION_WIDTH_CAP, 2 * hidden)


def ordinal_width(hidden: int) -> int:
    """OrdinalScoreHead's inner width for hidden size D."""
    return min(ORDINAL_WIDTH_CAP, hidden)


def _linear(name: str, out: Callable[[int], int], inp: Callable[[int], int]) -> dict:
    return {
        f"{name}.weight": lambda d: (out(d), inp(d)),
        f"{name}.bias": lambda d: (out(d),),
    }


def _hidden(d: int) -> int:
    return d


def _one(d: int) -> int:
    return 1


def _feats(d: int) -> int:
    return N_FEATS


# Tensor name -> shape as a function of the hidden size D (PyTorch Linear layout [out, in]).
HEAD_SHAPES: dict[str, Callable[[int], tuple[int, ...]]] = {
    **_linear("head.opt.0", option_width, _hidden),
    **_linear("head.opt.2", option_width, option_width),
    **_linear("head.que.0", option_width, _hidden),
    **_linear("head.que.2", option_width, option_width),
    **_linear("head.score", _one, option_width),
    "head.log_tau": lambda d: (len(TYPE_IDS),),
    **_linear("head.abstain", _one, option_width),
    **_linear("head.feat", option_width, _feats),
    **_linear("head.feat_lin", _one, _feats),
    **_linear("ord.z.0", ordinal_width, _hidden),
    **_linear("ord.z.2", _one, ordinal_width),
    **_linear("ord.cut.0", ordinal_width, _hidden),
    **_linear("ord.cut.2", _one, ordinal_width),
}


def head_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """Every tensor of `heads.safetensors` and its shape for hidden size D."""
    return {name: shape(hidden) for name, shape in HEAD_SHAPES.items()}


class ExportError(ValueError):
    """An export directory that the worker would refuse to load."""


@dataclass(frozen=True)
class ExportInfo:
    """A checked export: where its files are and what its manifest and config say."""

    dir: Path
    manifest: dict
    config: dict
    calibration: Calibration
    identity: str  # "real" or "synthetic"
    files: dict[str, Path]  # every listed output
    shards: tuple[Path, ...]  # language-model shards, in index order
    # the checked tokenizer.json, loaded once (its repr is the whole vocabulary: not shown)
    tokenizer: Tokenizer = field(compare=False, repr=False)

    @property
    def hidden_size(self) -> int:
        return int(self.config["text_config"]["hidden_size"])

    @property
    def vision_path(self) -> Path:
        return self.files[VISION]

    @property
    def heads_path(self) -> Path:
        return self.files[HEADS]

    @property
    def tokenizer_path(self) -> Path:
        return self.files["tokenizer.json"]


def sha256_file(path: Path) -> str:
    """SHA-256 hex digest of a file, read in 4 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _refuse_constant(name: str) -> float:
    raise ExportError(f"export manifest holds {name}")


def read_json(path: Path, what: str) -> dict:
    """A JSON object from a file; NaN and Infinity are refused, as the worker's parser does."""
    try:
        value = json.loads(path.read_text("utf-8"), parse_constant=_refuse_constant)
    except FileNotFoundError:
        raise ExportError(f"{what} {path.name} is missing") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ExportError(f"{what} {path.name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ExportError(f"{what} {path.name} is not a JSON object")
    return value


def _shown(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def check_pinned(manifest: dict) -> str:
    """Pinned values; returns the identity. A real export must name the published release."""
    for key, expected in PINNED.items():
        if manifest.get(key) != expected:
            found = _shown(manifest.get(key))
            raise ExportError(f"export manifest {key} is {found}, expected {_shown(expected)}")
    synthetic = manifest.get("synthetic", False)
    if not isinstance(synthetic, bool):
        raise ExportError(f"export manifest synthetic is {_shown(synthetic)}, expected a boolean")
    for key in IDENTITY_CHECKED:
        value = manifest.get(key)
        if synthetic:
            if not isinstance(value, str) or not value:
                raise ExportError(f"export manifest {key} is {_shown(value)}, expected a string")
            if key == "model_id" and value == REAL_IDENTITY[key]:
                raise ExportError(f"synthetic export claims model_id {value}")
        elif value != REAL_IDENTITY[key]:
            expected = REAL_IDENTITY[key]
            raise ExportError(f"export manifest {key} is {_shown(value)}, expected {expected}")
    return "synthetic" if synthetic else "real"


def check_file_name(name: object) -> str:
    """A listed output must be a plain file name inside the export directory."""
    if not isinstance(name, str) or not name or name in (".", ".."):
        raise ExportError(f"export output name {_shown(name)} is not a file name")
    if "/" in name or "\\" in name or ".." in name or "\0" in name:
        raise ExportError(f"export output name {name} is not a plain file name")
    if name == MANIFEST:
        raise ExportError(f"export outputs list the manifest {MANIFEST}")
    return name


def check_outputs(root: Path, manifest: dict, verify: bool) -> dict[str, Path]:
    """Names, presence and (with `verify`) SHA-256 of every listed output."""
    outputs = manifest.get("outputs")
    if not isinstance(outputs, dict):
        raise ExportError("export manifest outputs is not an object")
    for name in REQUIRED_OUTPUTS:
        if name not in outputs:
            raise ExportError(f"export manifest does not list {name}")
    files = {}
    for name, expected in outputs.items():
        path = root / check_file_name(name)
        if not isinstance(expected, str) or len(expected) != 64:
            raise ExportError(f"export output {name} has no SHA-256")
        if not path.is_file():
            raise ExportError(f"export output {name} is missing")
        if not path.resolve().is_relative_to(root.resolve()):  # a symbolic link out of it
            raise ExportError(f"export output {name} resolves outside the export directory")
        files[name] = path
    if verify:
        verify_outputs(files, outputs)
    return files


def verify_outputs(files: dict[str, Path], outputs: dict[str, str]) -> None:
    """Every listed output's SHA-256 against the manifest's (`check_outputs`' hashing)."""
    with ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="omnijev-hash") as pool:
        digests = dict(zip(files, pool.map(sha256_file, files.values()), strict=True))
    for name, expected in outputs.items():  # the manifest's order: the first mismatch
        if digests[name] != expected.lower():
            raise ExportError(f"export output {name} does not match its SHA-256")


def start_verify(info: ExportInfo) -> Future:
    """`verify_outputs` of a `load_export(verify=False)` on a thread of its own: the caller
    loads meanwhile and takes `.result()` (the export's refusal, if any) before it answers."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="omnijev-verify")
    try:
        return pool.submit(verify_outputs, info.files, info.manifest["outputs"])
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


def check_shards(root: Path, files: dict[str, Path]) -> tuple[Path, ...]:
    """Every shard of the index is a listed output; a stray `model.safetensors` is refused."""
    index = read_json(files[INDEX], "export index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ExportError(f"export index {INDEX} has no weight_map")
    shards = []
    for shard in weight_map.values():
        # a listed output has a plain name (check_file_name), so this also confines the shard
        if not isinstance(shard, str) or shard not in files:
            raise ExportError(f"export shard {_shown(shard)} is not listed in the manifest")
        if files[shard] not in shards:
            shards.append(files[shard])
    if (root / "model.safetensors").exists() and "model.safetensors" not in files:
        raise ExportError("export holds an unlisted model.safetensors")
    return tuple(shards)


def check_config(config: dict, identity: str) -> None:
    """The executor's checks of `config.json`: vocabulary, image token and (real) hidden size."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ExportError("export config.json has no text_config")
    if text.get("vocab_size") != VOCABULARY:
        found = _shown(text.get("vocab_size"))
        raise ExportError(f"export text_config.vocab_size is {found}, expected {VOCABULARY}")
    if config.get("image_token_id") != IMAGE_TOKEN_ID:
        found = _shown(config.get("image_token_id"))
        raise ExportError(f"export image_token_id is {found}, expected {IMAGE_TOKEN_ID}")
    if identity == "real" and text.get("hidden_size") != REAL_HIDDEN:
        found = _shown(text.get("hidden_size"))
        raise ExportError(f"export hidden size is {found}, expected {REAL_HIDDEN}")


def _finite_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_calibration(value: object) -> Calibration:
    """Exactly three positive finite temperatures and a finite Noul bias (docs/contract.md §7.7)."""
    if not isinstance(value, dict):
        raise ExportError("export calibration is not an object")
    temperatures = value.get("temperatures")
    if not isinstance(temperatures, dict) or sorted(temperatures) != sorted(TEMPERATURE_KEYS):
        found = _shown(sorted(temperatures) if isinstance(temperatures, dict) else temperatures)
        expected = ", ".join(TEMPERATURE_KEYS)
        raise ExportError(f"export calibration temperatures are {found}, expected {expected}")
    for key, temperature in temperatures.items():
        if not _finite_number(temperature) or temperature <= 0:
            raise ExportError(f"export temperature {key} is {temperature!r}, expected positive")
    bias = value.get("noul_bias")
    if not _finite_number(bias):
        raise ExportError(f"export noul_bias is {bias!r}, expected a finite number")
    temps = {key: float(temperatures[key]) for key in TEMPERATURE_KEYS}
    return Calibration(temperatures=temps, noul_bias=float(bias))


def check_tokenizer(path: Path) -> Tokenizer:
    """The processor's check: image and option tokens at their ids, 248,079 tokens in all; the
    tokenizer it loaded, for the caller to use (shared: never change its padding or
    truncation)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    tokenizer, problem = _checked_tokenizer(*key)
    if problem:
        raise ExportError(problem)
    return tokenizer


@functools.lru_cache(maxsize=TOKENIZERS_KEPT)
def _checked_tokenizer(path: str, size: int, mtime_ns: int, inode: int) -> tuple:
    """(tokenizer, None) or (None, the problem). Loading takes about a second (the executor
    used to load the file again after this check), so a file unchanged since its last check
    is not reloaded."""
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        return None, f"export tokenizer.json does not load: {error}"
    count = tokenizer.get_vocab_size(with_added_tokens=True)
    if count != VOCABULARY:
        return None, f"export tokenizer has {count} tokens, expected {VOCABULARY}"
    for token, expected in TOKENIZER_IDS.items():
        found = tokenizer.token_to_id(token)
        if found != expected:
            return None, f"export tokenizer maps {token} to {found}, expected {expected}"
    return tokenizer, None


def load_export(path: str | Path, verify: bool = True) -> ExportInfo:
    """Checks an export directory (docs/contract.md §8.3); `verify=False` skips only the hashing."""
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"export directory {root} does not exist")
    manifest = read_json(root / MANIFEST, "export manifest")
    identity = check_pinned(manifest)
    files = check_outputs(root, manifest, verify)
    shards = check_shards(root, files)
    config = read_json(files["config.json"], "export config")
    check_config(config, identity)
    calibration = check_calibration(manifest.get("calibration"))
    tokenizer = check_tokenizer(files["tokenizer.json"])
    return ExportInfo(root, manifest, config, calibration, identity, files, shards, tokenizer)


def language_name(name: str) -> str | None:
    """`Qwen3_5TextModel` name of a language-model tensor; None for tensors the model ties."""
    for prefix in LANGUAGE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return None if name.startswith(IGNORED_LANGUAGE) else name


def read_safetensors(path: Path, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            tensor = f.get_tensor(key)
            tensors[key] = tensor if dtype is None else tensor.to(dtype)
    return tensors


def load_language_state(
    info: ExportInfo, dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """Language-model tensors named as `Qwen3_5TextModel.state_dict()` (`embed_tokens.weight`)."""
    state = {}
    for shard in info.shards:
        for key, tensor in read_safetensors(shard, dtype).items():
            name = language_name(key)
            if name is None:
                continue
            if name in state:
                raise ExportError(f"export language model holds {name} twice")
            state[name] = tensor
    rows = state.get("embed_tokens.weight")
    if rows is None or rows.shape[0] != VOCABULARY:
        found = None if rows is None else tuple(rows.shape)
        raise ExportError(f"export embedding is {found}, expected {VOCABULARY} rows")
    return state


def load_vision_state(info: ExportInfo, dtype: torch.dtype | None = None) -> dict:
    """Vision-tower tensors, named `model.visual.*` as in the full model."""
    state = read_safetensors(info.vision_path, dtype)
    stray = [key for key in state if not key.startswith("model.visual.")]
    if stray:
        raise ExportError(f"export {VISION} holds {stray[0]}, expected model.visual.* only")
    return state


def check_heads(state: dict[str, torch.Tensor], hidden: int) -> None:
    """Exactly the tensors of `head_shapes`, float32 and finite."""
    expected = head_shapes(hidden)
    for key in sorted(set(expected) | set(state)):
        if key not in state:
            raise ExportError(f"head tensor {key} is missing")
        tensor = state[key]
        if key not in expected:
            raise ExportError(f"head tensor {key} is not one of the heads' tensors")
        if tuple(tensor.shape) != expected[key]:
            found = tuple(tensor.shape)
            raise ExportError(f"head tensor {key} has shape {found}, expected {expected[key]}")
        if tensor.dtype != torch.float32:
            raise ExportError(f"head tensor {key} is {tensor.dtype}, expected float32")
        if not bool(torch.isfinite(tensor).all()):
            raise ExportError(f"head tensor {key} is not finite")


def load_heads_state(info: ExportInfo) -> dict[str, torch.Tensor]:
    """Head tensors `head.*` and `ord.*`, float32 (docs/contract.md §6.1), checked."""
    state = read_safetensors(info.heads_path, None)
    check_heads(state, info.hidden_size)
    return state
