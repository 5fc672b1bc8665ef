"""Preparation reproduces the reference's prompts, ids, layout and positions (processing.json)."""

from __future__ import annotations

import base64
import hashlib
import importlib
import io
import json

import numpy as np
import pytest

from runtime.errors import ContractError
from runtime.processing import (
    IMAGE_PAD_ID,
    MARKER_ERROR,
    MAX_PROCESSED,
    MAX_SEQUENCE,
    MAX_TARGETS,
    PLACEHOLDER_ERROR,
    encode_question,
    find_image_run,
    layout,
    mrope_positions,
    option_marks,
    prepare,
    render_prompt,
)
from runtime.tokenizer import load_tokenizer
from runtime.types import PreparedImage, Question, Request
from tests.spec import FIXTURES, rows_as_json


def load_cases() -> list[dict]:
    path = FIXTURES / "processing.json"
    if not path.exists():
        return []
    return json.loads(path.read_text("utf-8"))["cases"]


CASES = load_cases()
needs_fixtures = pytest.mark.skipif(not CASES, reason=f"reference fixtures not found at {FIXTURES}")
case_params = pytest.mark.parametrize("case", CASES, ids=[case["name"] for case in CASES])


def optional(module: str):
    """A module being written in parallel; its tests skip until it can be imported."""
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.skip(f"{module} is not importable yet")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def fake_image(grid_thw: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> PreparedImage:
    """An already prepared image: only its grid matters to tokens, layout and positions."""
    return PreparedImage(
        width=size[0],
        height=size[1],
        rgb=np.zeros((1, 1, 3), dtype=np.uint8),
        pixel_values=np.zeros((1, 1536), dtype=np.float32),
        grid_thw=grid_thw,
    )


def fixture_questions(case: dict) -> tuple[Question, ...]:
    """Question objects from the fixture's own keys and option texts (contract not needed)."""
    requested = case["request"]["questions"]
    return tuple(
        Question(
            id=q["id"],
            type=q["type"],
            instructions=requested[q["id"]]["instructions"],
            keys=tuple(q["keys"]),
            option_texts=tuple(q["option_text"]),
        )
        for q in case["questions"]
    )


def solid_png(case: dict) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", tuple(case["image_size"]), tuple(case["image_colour"])).save(buffer, "PNG")
    return buffer.getvalue()


def expand(token_ids: list[int]) -> list[int]:
    """The fixture's ids with the collapsed image run (−N) written out."""
    out: list[int] = []
    for token in token_ids:
        out += [IMAGE_PAD_ID] * -token if token < 0 else [token]
    return out


def positions_sha256(positions: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(positions, dtype="<i8").tobytes()).hexdigest()


def assert_matches_fixture(prepared, case: dict) -> None:
    assert prepared.prefix_length == case["prefix_length"]
    assert prepared.input_tokens == case["input_tokens"]
    assert len(prepared.layouts) == len(case["questions"])
    for got, want in zip(prepared.layouts, case["questions"], strict=True):
        assert got.question.id == want["id"]
        assert got.prompt == want["prompt"]
        assert list(got.token_ids) == expand(want["token_ids"])
        assert list(got.opens) == want["opens"]
        assert list(got.closes) == want["closes"]
        assert got.positions.shape == (3, len(got.token_ids))
        assert got.positions.dtype == np.int64
        assert positions_sha256(got.positions) == want["positions_sha256"]
        assert rows_as_json(got.rows) == want["rows"]


@needs_fixtures
def test_fixture_has_the_seven_cases():
    assert [case["name"] for case in CASES] == [
        "single_noul",
        "mixed_speed_bench",
        "jev_forms",
        "shared_instruction_start",
        "options_list_forms",
        "unicode_and_special_text",
        "whitespace",
    ]


@needs_fixtures
@case_params
def test_prepare_matches_the_fixture(case, tok):
    image = fake_image(tuple(case["image_grid_thw"]), tuple(case["image_size"]))
    request = Request(image_mime="image/png", image_bytes=b"", questions=fixture_questions(case))
    prepared = prepare(request, tok, image=image)
    assert_matches_fixture(prepared, case)
    assert prepared.image is image
    assert 0 < prepared.prepare_seconds < 5


@needs_fixtures
@case_params
def test_render_and_encode_each_question(case, tok):
    n_image = int(np.prod(case["image_grid_thw"])) // 4
    for question, want in zip(fixture_questions(case), case["questions"], strict=True):
        prompt = render_prompt(question)
        assert prompt == want["prompt"]
        assert encode_question(prompt, tok, n_image) == expand(want["token_ids"])


@needs_fixtures
@case_params
def test_layout_of_the_fixture_ids(case):
    ids = [expand(q["token_ids"]) for q in case["questions"]]
    prefix, rows, opens, closes = layout(ids)
    assert prefix == case["prefix_length"]
    assert opens == [q["opens"] for q in case["questions"]]
    assert closes == [q["closes"] for q in case["questions"]]
    assert [rows_as_json(r) for r in rows] == [q["rows"] for q in case["questions"]]
    assert prefix + sum(len(row.tokens) for r in rows for row in r) == case["input_tokens"]


@needs_fixtures
@case_params
def test_through_the_contract_and_the_image(case, tok):
    """The fixture's request, with a real solid-colour PNG, through compile_request and images."""
    contract = optional("runtime.contract")
    optional("runtime.images")
    body = json.loads(json.dumps(case["request"]))
    url = "data:image/png;base64," + base64.b64encode(solid_png(case)).decode()
    body["state"]["images"] = [url]
    request = contract.compile_request(body)
    assert [q.keys for q in request.questions] == [tuple(q["keys"]) for q in case["questions"]]
    prepared = prepare(request, tok)
    assert_matches_fixture(prepared, case)
    image = prepared.image
    assert [image.width, image.height] == case["image_size"]
    assert list(image.grid_thw) == case["image_grid_thw"]
    assert list(image.pixel_values.shape) == case["pixel_values_shape"]
    pixels = np.ascontiguousarray(image.pixel_values, dtype="<f4").tobytes()
    assert hashlib.sha256(pixels).hexdigest() == case["pixel_values_sha256"]


def test_prompt_trims_trailing_whitespace_only():
    question = Question("q", "noul", " \tLook.\u3000\x1c\n", ("yes",), ("",))
    assert "<|vision_end|> \tLook.<|im_end|>" in render_prompt(question)


def test_mrope_positions_follow_the_rule():
    # 3 text tokens, a 2x3 merged image (grid 4x6), then 4 text tokens.
    start, rows, cols, after = 3, 2, 3, 4
    ids = [1, 2, 3] + [IMAGE_PAD_ID] * (rows * cols) + [5] * after
    got = mrope_positions(ids, start, (1, 2 * rows, 2 * cols))
    want = [[p, p, p] for p in range(start)]
    want += [[start, start + y, start + x] for y in range(rows) for x in range(cols)]
    want += [[start + max(rows, cols) + i] * 3 for i in range(after)]
    assert got.dtype == np.int64
    assert got.T.tolist() == want


def test_image_run_must_be_one_contiguous_span():
    assert find_image_run([7, IMAGE_PAD_ID, IMAGE_PAD_ID, 8], 2) == 1
    for ids, n in [
        ([7, IMAGE_PAD_ID, 8, IMAGE_PAD_ID], 2),  # split
        ([7, IMAGE_PAD_ID, IMAGE_PAD_ID, 8], 3),  # wrong count
        ([7, 8], 0),  # none
    ]:
        with pytest.raises(ContractError, match=PLACEHOLDER_ERROR):
            find_image_run(ids, n)


def test_prompt_needs_exactly_one_image_placeholder(tok):
    with pytest.raises(ContractError, match=PLACEHOLDER_ERROR):
        encode_question("no image here", tok, 4)
    with pytest.raises(ContractError, match=PLACEHOLDER_ERROR):
        encode_question("<|image_pad|><|image_pad|>", tok, 4)


@pytest.mark.parametrize(
    "ids",
    [
        [1, 2, 3],  # no option
        [1, 2, 248077, 5, 248078, 248077],  # unclosed
        [1, 2, 248078, 5, 248077],  # close before open
        [1, 2, 248077, 248077, 248078, 248078],  # not alternating
        [1, 248077, 248078],  # first <|opt|> at 1: no zq token after a prefix of 1
    ],
)
def test_option_markers_must_pair_in_order(ids):
    with pytest.raises(ContractError, match=MARKER_ERROR):
        option_marks(ids)


def test_prefix_stops_before_every_first_option():
    # Identical questions share everything; L is cut to one token before <|opt|>.
    ids = [10, 11, 12, 248077, 20, 248078]
    prefix, rows, _, _ = layout([ids, ids])
    assert prefix == 2
    assert rows[0][0].tokens == (12, 248077, 20, 248078)
    assert (rows[0][0].zq, rows[0][0].u, rows[0][0].first) == (0, 3, 20)
    assert rows[0][0].targets == ((1, 20),)


def digits_question(qid: str, digits: int, qtype: str = "noul", options=("",)) -> Question:
    """Instructions of single digits: the pre-tokenizer splits digits, one token each."""
    keys = tuple(f"k{i}" for i in range(len(options)))
    return Question(qid, qtype, str(qid[-1]) + "7" * (digits - 1), keys, tuple(options))


def test_question_limit_is_inclusive(tok):
    grid = (1, 16, 16)
    overhead = len(encode_question(render_prompt(digits_question("q0", 1)), tok, 64)) - 1
    fits = digits_question("q0", MAX_SEQUENCE - overhead)
    over = digits_question("q1", MAX_SEQUENCE - overhead + 1)
    prepared = prepare(Request("image/png", b"", (fits,)), tok, image=fake_image(grid))
    assert len(prepared.layouts[0].token_ids) == MAX_SEQUENCE
    with pytest.raises(ContractError) as refused:
        prepare(Request("image/png", b"", (fits, over)), tok, image=fake_image(grid))
    assert str(refused.value) == f"question q1: {MAX_SEQUENCE + 1} tokens exceeds 8192"


def test_request_token_limit(tok):
    questions = tuple(digits_question(f"q{i}", 7800) for i in range(9))
    lengths = [len(encode_question(render_prompt(q), tok, 64)) for q in questions]
    prefix = 4 + 64 + 1  # through <|vision_end|>: the questions differ at their first digit
    need = prefix + sum(n - prefix for n in lengths)  # one row per question: the rest of it
    assert need > MAX_PROCESSED
    with pytest.raises(ContractError) as refused:
        prepare(Request("image/png", b"", questions), tok, image=fake_image((1, 16, 16)))
    assert str(refused.value) == f"request needs {need} tokens, above 65536"


def test_option_text_token_limit_skips_score(tok):
    options = tuple(str(i % 10) * 200 for i in range(30))  # 200 digit tokens each
    choices = tuple(digits_question(f"q{i}", 1, "choice", options) for i in range(3))
    reads = 3 * 30 * (200 + 1)  # every text token, plus the first token read at zq
    assert reads > MAX_TARGETS
    with pytest.raises(ContractError) as refused:
        prepare(Request("image/png", b"", choices), tok, image=fake_image((1, 16, 16)))
    assert str(refused.value) == f"request reads {reads} option-text tokens, above 16384"
    scores = tuple(digits_question(f"q{i}", 1, "score", options) for i in range(3))
    prepared = prepare(Request("image/png", b"", scores), tok, image=fake_image((1, 16, 16)))
    assert sum(len(row.targets) for lay in prepared.layouts for row in lay.rows) == 3 * 30 * 200


# -- the template's ids once per tokenizer, the image beside the tokenizer (issue 13) -----------

SPLIT_TEXT = list("ab c\n\t  .,!?éü日本語🙂\u0301\u00a0\u3000<|>/") + [
    "<|im_end|>",
    "<|im_start|>",
    "<think>",
    "</think>",
    "<|endoftext|>",
    " ",
    "\n\n",
    "'s",
    "123",
    "<|",
]


def test_split_ids_equal_the_whole_prompts(tok):
    from runtime.processing import encode_prompts, split_ids, splittable, template

    made = template(tok)
    assert made is not None  # the built-in tokenizer splits at its added tokens
    rng = np.random.default_rng(0)

    def text(n: int) -> str:
        return "".join(rng.choice(SPLIT_TEXT, size=int(rng.integers(0, n))))

    for _ in range(300):
        count = int(rng.integers(1, 4))
        questions = [
            Question(f"q{i}", "choice", text(30), ("a", "b", "c"), (text(10), text(10), ""))
            for i in range(count)
        ]
        if splittable(questions):
            whole = encode_prompts([render_prompt(q) for q in questions], tok, 5)
            assert split_ids(questions, tok, made, 5) == whole


class Counting:
    """A tokenizer that records the texts of each batch it encodes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, []

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def encode_batch(self, texts, **options):
        self.encoded.append(list(texts))
        return self.tokenizer.encode_batch(texts, **options)


def test_texts_seen_before_are_not_encoded_again(tok):
    """The template keeps each text's ids (TEXT_IDS of them): a request asked again encodes
    nothing, one with a new option text encodes only that text, and the ids are the whole
    prompts' either way."""
    from runtime.processing import KEPT_TEXT_CHARS, encode_prompts, encode_questions, template

    counting = Counting(tok)
    assert template(counting) is not None  # made once for this tokenizer, its probe encoded
    encoded = counting.encoded
    first = [Question("q", "choice", "Which one?", ("a", "b"), ("a red car", "a street"))]
    again = [Question("r", "choice", "Which one?", ("a", "b"), ("a street", "a robot"))]
    for questions, new in ((first, ["Which one?", "a red car", "a street"]), (first, []),
                           (again, ["a robot"])):  # fmt: skip
        encoded.clear()
        ids = encode_questions(questions, counting, 5)
        assert [text for batch in encoded for text in batch] == new
        assert ids == encode_prompts([render_prompt(q) for q in questions], tok, 5)
    long = "x" * (KEPT_TEXT_CHARS + 1)  # long texts are encoded every time
    for _ in range(2):
        encoded.clear()
        encode_questions([Question("s", "noul", long, ("yes",), ("",))], counting, 5)
        assert [text for batch in encoded for text in batch] == [long]


def test_template_is_refused_where_a_token_could_cross_a_split(tok):
    from tokenizers import AddedToken, Tokenizer

    from runtime.processing import make_template

    crossing = Tokenizer.from_str(tok.to_str())
    crossing.add_special_tokens([AddedToken("!<|opt|>", special=True, normalized=False)])
    assert make_template(crossing) is None
    stripping = Tokenizer.from_str(tok.to_str())
    stripping.add_special_tokens([AddedToken("<x>", special=True, lstrip=True)])
    assert make_template(stripping) is None


def test_reserved_marker_text_takes_the_whole_prompt_path(tok):
    from runtime.processing import encode_questions, splittable

    question = Question("q", "noul", "see <|image_pad|>", ("yes",), ("",))
    assert not splittable([question])
    with pytest.raises(ContractError, match=PLACEHOLDER_ERROR):
        encode_questions([question], tok, 4)


def test_an_image_refusal_comes_before_a_text_refusal(tok):
    """The decode runs beside the tokenizer; its refusal is still the one the client gets."""
    from PIL import Image

    from runtime.contract import compile_request

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(buffer, "PNG")
    truncated = buffer.getvalue()[:-30]  # the header opens; the pixels do not decode
    url = "data:image/png;base64," + base64.b64encode(truncated).decode()
    long = {"type": "noul", "instructions": "7" * 8190}  # over 8192 tokens with the image
    body = {"state": {"images": [url]}, "questions": {"q": long}}
    with pytest.raises(ContractError) as refused:
        prepare(compile_request(body), tok)
    assert str(refused.value) == "invalid image"
    body["state"]["images"] = [
        "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    ]
    with pytest.raises(ContractError) as refused:
        prepare(compile_request(body), tok)
    assert str(refused.value).startswith("question q: ")


def test_a_forked_child_prepares_with_its_own_image_threads(tok):
    """The image pool's threads do not survive a fork; the child makes a pool of its own."""
    import multiprocessing

    from PIL import Image

    from runtime.contract import compile_request

    buffer = io.BytesIO()
    Image.new("RGB", (64, 48), (1, 2, 3)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"state": {"images": [url]}, "questions": {"q": {"type": "noul", "instructions": "?"}}}
    parent = prepare(compile_request(body), tok)  # the parent's pool now exists
    context = multiprocessing.get_context("fork")
    with context.Pool(1) as pool:
        tokens = pool.apply_async(child_input_tokens, (body,)).get(timeout=60)
    assert tokens == parent.input_tokens


def child_input_tokens(body: dict) -> int:
    from runtime.contract import compile_request

    return prepare(compile_request(body), load_tokenizer(None)).input_tokens


@pytest.mark.parametrize("size", [(1600, 900), (65, 33), (3000, 17), (97, 4000), (33, 33)])
def test_the_header_grid_is_the_decoded_image_grid(size):
    """Positions and the plan are made from the header's size while the image decodes: the
    grid it gives is the one the decoded image gets, on both image paths."""
    from PIL import Image

    from runtime.contract import compile_request
    from runtime.images import prepare_image
    from runtime.processing import header_grid

    buffer = io.BytesIO()
    Image.new("RGB", size, (9, 8, 7)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    body = {"state": {"images": [url]}, "questions": {"q": {"type": "noul", "instructions": "?"}}}
    request = compile_request(body)
    for pack in (True, False):
        decoded = prepare_image(buffer.getvalue(), "image/png", None, pack, pack)
        assert header_grid(request) == tuple(decoded.grid_thw)


def test_a_planner_plans_before_the_image_and_its_refusal_comes_after_the_image(tok):
    """`prepare(planner=...)` hands the planner the request without its image (still decoding)
    and keeps what it returns; the layouts are those of a prepare without it; a planner's
    error is raised only after the image's own refusal."""
    from PIL import Image

    from runtime.contract import compile_request

    buffer = io.BytesIO()
    Image.new("RGB", (640, 480), (1, 2, 3)).save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    options = [{"text": "a"}, {"text": "bb"}]
    questions = {"q": {"type": "choice", "instructions": "Which?", "options": options}}
    body = {"state": {"images": [url]}, "questions": questions}
    seen = []

    def planner(draft):
        seen.append(draft)
        return "planned"

    plain = prepare(compile_request(body), tok)
    prepared = prepare(compile_request(body), tok, planner=planner)
    assert prepared.planned == "planned" and plain.planned is None
    assert len(seen) == 1 and seen[0].layouts == prepared.layouts
    assert prepared.input_tokens == plain.input_tokens
    for mine, theirs in zip(prepared.layouts, plain.layouts, strict=True):
        assert np.array_equal(mine.positions, theirs.positions)
        assert mine.rows == theirs.rows

    def failing(draft):
        raise RuntimeError("planner failed")

    with pytest.raises(RuntimeError, match="planner failed"):
        prepare(compile_request(body), tok, planner=failing)
    body["state"]["images"] = [
        "data:image/png;base64," + base64.b64encode(buffer.getvalue()[:-30]).decode()
    ]
    with pytest.raises(ContractError, match="invalid image"):
        prepare(compile_request(body), tok, planner=failing)
