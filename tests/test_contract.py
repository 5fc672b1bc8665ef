"""The request contract: every rule of docs/contract.md §2.2-2.6 accepts and refuses, with its
message, and keys and option texts match the reference's own output (processing.json)."""

from __future__ import annotations

import base64
import functools
import io
import json

import pytest
from PIL import Image

from runtime.contract import MAX_TEXT_CHARS, compile_request, rust_debug
from runtime.contract import RESERVED_TOKENS as RESERVED
from runtime.errors import ContractError
from runtime.strict_json import parse_body
from tests.spec import FIXTURES

FIXTURE = FIXTURES / "processing.json"
LONG = "x" * (MAX_TEXT_CHARS + 1)
# long messages, named once so the tables below stay readable
FIELDS = "request fields must be model, state and questions"
PNG_JPEG = "only inline PNG/JPEG images are supported"
MIME = "image format does not match its MIME type"
ASPECT = "image aspect ratio must be at most 200"
QUESTIONS_64 = "questions must contain 1 to 64 questions"
REGION_SHAPE = 'a region must be {"box": [x1, y1, x2, y2]}'
WITHIN = "region coordinates must be within ±1e9"
NUMBERS = "region coordinates must be numbers"
SCORE_FIELDS = "Score supports type, instructions, levels and criteria"
SCORE_NEEDS = "Score requires levels, or criteria as an object keyed by level"
CHOICE_FIELDS = "Choice supports type, instructions, options and criteria"
OPTION_FIELDS = "an option supports key, text, region and abstain"
COUNT = "a question needs 1 to 255 options"


@functools.cache
def image_bytes(width: int, height: int, fmt: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (40, 90, 160)).save(buffer, fmt)
    return buffer.getvalue()


def data_url(width: int, height: int, fmt: str = "PNG", mime: str | None = None) -> str:
    encoded = base64.b64encode(image_bytes(width, height, fmt)).decode("ascii")
    return f"data:{mime or 'image/' + fmt.lower()};base64,{encoded}"


PNG = data_url(64, 48)


def q(kind: str, **fields: object) -> dict:
    return {"type": kind, "instructions": "x", **fields}


NOUL = q("noul")


def body(questions: object = None, **top: object) -> dict:
    obj = {"model": "tinnel123/OmniJev", "state": {"images": [PNG]}, "questions": {"q": NOUL}}
    if questions is not None:
        obj["questions"] = questions
    obj.update(top)
    return obj


def without(obj: dict, key: str) -> dict:
    return {k: v for k, v in obj.items() if k != key}


def refusal(obj: dict) -> str:
    with pytest.raises(ContractError) as caught:
        compile_request(obj)
    assert caught.value.status == 422
    return str(caught.value)


def criteria(n: int, prefix: str = "o") -> dict:
    return {f"{prefix}{i}": None for i in range(n)}


def options(n: int) -> list[dict]:
    return [{"text": f"o{i}"} for i in range(n)]


# -- top level, state and image (§2.2-2.3) -----------------------------------------------------

TOP_REFUSALS = [
    (body(extra=1), FIELDS),
    ({"model": "other", "state": 1, "questions": 1, "x": 1}, FIELDS),
    (body(model="other"), "requested model is not loaded"),
    (body(model="OmniJev"), "requested model is not loaded"),
    (body(model=3), "requested model is not loaded"),
    (body(model=True), "requested model is not loaded"),
    (body(model=["omnijev"]), "requested model is not loaded"),
    (without(body(model="other"), "state"), "requested model is not loaded"),
    (without(body(), "state"), "request requires state"),
    (without(body(questions=3), "state"), "request requires state"),
    (body(state=None), "state must be an object with images"),
    (body(state="a screen"), "state must be an object with images"),
    (body(state=[PNG]), "state must be an object with images"),
    (body(state={"images": [PNG], "video": {}}), "state.video.n_frames must be an integer"),
    (body(state={"text": "x"}), "state supports images and video only"),
    (body(state={}), "state.images must be an array"),
    (body(state={"images": PNG}), "state.images must be an array"),
    (body(state={"images": None}), "state.images must be an array"),
    (body(state={"images": []}), "state.images must contain exactly one image"),
    (body(state={"images": [PNG, PNG]}), "state.images must contain exactly one image"),
    (body(state={"images": [3]}), "an image must be a data URL"),
    (body(state={"images": [None]}), "an image must be a data URL"),
    (body(state={"images": ["https://example.com/a.png"]}), "invalid image data URL"),
    (body(state={"images": ["data:image/gif;base64,AAAA"]}), PNG_JPEG),
    (body(state={"images": [data_url(64, 48, mime="image/jpeg")]}), MIME),
    (body(state={"images": ["data:image/png;base64,iVBO\nRw0K"]}), "invalid base64 image"),
    (body(state={"images": [data_url(4097, 64)]}), "invalid image"),
    (body(state={"images": [data_url(401, 2)]}), ASPECT),
    # the state and image come before the questions
    (body(questions=[], state=None), "state must be an object with images"),
    (body(questions=[], state={"images": [data_url(401, 2)]}), ASPECT),
    (without(body(), "questions"), "questions must be an object"),
    (body(questions=[NOUL]), "questions must be an object"),
    (body(questions="q"), "questions must be an object"),
    (body(questions={}), QUESTIONS_64),
    (body(questions={f"q{i}": NOUL for i in range(65)}), QUESTIONS_64),
    (body(questions={"q" * 257: NOUL}), "question ids must be at most 256 characters"),
    (body(questions={"a": 3, "q" * 257: NOUL}), "question a: a question must be an object"),
    (body(questions={"q" * 257: NOUL, "a": 3}), "question ids must be at most 256 characters"),
    (
        body(questions={f"q{i}": q("choice", criteria=criteria(255)) for i in range(5)}),
        "request exceeds 1024 options in all",
    ),
    (  # the total comes after every question
        body(
            questions={**{f"q{i}": q("choice", criteria=criteria(255)) for i in range(5)}, "z": 3}
        ),
        "question z: a question must be an object",
    ),
]


@pytest.mark.parametrize(("obj", "message"), TOP_REFUSALS)
def test_top_level_refusals(obj: dict, message: str) -> None:
    assert refusal(obj) == message


@pytest.mark.parametrize(
    "obj",
    [
        body(),
        body(model=None),
        body(model="omnijev"),
        body(model="omnijev-4b-v1.1"),
        without(body(), "model"),
        body(state={"images": [data_url(400, 2)]}),
        body(state={"images": [data_url(4096, 64)]}),
        body(questions={"q" * 256: NOUL}),
        body(questions={"😀" * 256: NOUL}),  # 256 code points, 512 UTF-16 units
        body(questions={f"q{i}": NOUL for i in range(64)}),
        body(
            questions={
                **{f"c{i}": q("choice", criteria=criteria(255)) for i in range(4)},
                **{f"n{i}": NOUL for i in range(4)},
            }
        ),  # exactly 1024 options
    ],
)
def test_top_level_accepted(obj: dict) -> None:
    request = compile_request(obj)
    assert list(request.questions) and request.image_mime == "image/png"


def test_request_carries_the_image_and_question_order() -> None:
    order = ["zeta", "alpha", "mid"]
    request = compile_request(body(questions={qid: NOUL for qid in order}))
    assert request.image_mime == "image/png"
    assert request.image_bytes == image_bytes(64, 48)
    assert [question.id for question in request.questions] == order
    jpeg = compile_request(body(state={"images": [data_url(32, 24, "JPEG")]}))
    assert (jpeg.image_mime, jpeg.image_bytes) == ("image/jpeg", image_bytes(32, 24, "JPEG"))


# -- questions (§2.4-2.6) -------------------------------------------------------------------------

QUESTION_REFUSALS = [
    # common
    (3, "a question must be an object"),
    (None, "a question must be an object"),
    (["noul"], "a question must be an object"),
    ({"instructions": "x"}, "question type must be choice, score, or noul"),
    (q("generation"), "question type must be choice, score, or noul"),
    (q("Noul"), "question type must be choice, score, or noul"),
    (q(3), "question type must be choice, score, or noul"),
    ({"type": "bad", "instructions": 3}, "question type must be choice, score, or noul"),
    ({"type": "noul"}, "instructions must be a string"),
    (q("noul", instructions=3), "instructions must be a string"),
    (q("noul", instructions=None), "instructions must be a string"),
    (q("noul", instructions=LONG), "instructions exceeds 8192 characters"),
    (q("noul", instructions=3, criteria={}), "instructions must be a string"),
    # Noul
    (q("noul", criteria={"true": "a"}), "Noul supports type, instructions and region"),
    (q("noul", options=[]), "Noul supports type, instructions and region"),
    (q("noul", region={"box": [1, 2, 3]}), REGION_SHAPE),
    (q("noul", region={"box": [1, 2, 3, 4, 5]}), REGION_SHAPE),
    (q("noul", region={"box": [1, 2, 3, 4], "x": 1}), REGION_SHAPE),
    (q("noul", region={"Box": [1, 2, 3, 4]}), REGION_SHAPE),
    (q("noul", region={"box": "1,2,3,4"}), REGION_SHAPE),
    (q("noul", region=[1, 2, 3, 4]), REGION_SHAPE),
    (q("noul", region="1,2,3,4"), REGION_SHAPE),
    (q("noul", region=True), REGION_SHAPE),
    (q("noul", region=1), REGION_SHAPE),
    (q("noul", region={"box": [1, "2", 3, 4]}), NUMBERS),
    (q("noul", region={"box": [True, 0, 0, 0]}), NUMBERS),
    (q("noul", region={"box": [None, 0, 0, 0]}), NUMBERS),
    (q("noul", region={"box": [[1], 0, 0, 0]}), NUMBERS),
    (q("noul", region={"box": [1e9 + 1, 0, 0, 0]}), WITHIN),
    (q("noul", region={"box": [0, 0, 0, -2e9]}), WITHIN),
    (q("noul", region={"box": [10**9 + 1, 0, 0, 0]}), WITHIN),
    (q("noul", region={"box": [float("nan"), 0, 0, 0]}), WITHIN),
    (q("noul", region={"box": [2e9, "x", 0, 0]}), WITHIN),
    (q("noul", region={"box": ["x", 2e9, 0, 0]}), NUMBERS),
    # Score
    (q("score", levels=["a"], options=[]), SCORE_FIELDS),
    (q("score", levels=["a"], region=None), SCORE_FIELDS),
    (q("score", levels=["a"], criteria={"a": None}), "Score takes levels or criteria, not both"),
    (q("score"), SCORE_NEEDS),
    (q("score", criteria=["low", "high"]), SCORE_NEEDS),
    (q("score", criteria=None), SCORE_NEEDS),
    (q("score", levels="low"), "levels must be an array of strings"),
    (q("score", levels=None), "levels must be an array of strings"),
    (q("score", levels={"low": 1}), "levels must be an array of strings"),
    (q("score", levels=[1, 2]), "a level must be a string"),
    (q("score", levels=["a", None]), "a level must be a string"),
    (q("score", levels=[True]), "a level must be a string"),
    (q("score", levels=["a", LONG]), "a level exceeds 8192 characters"),
    (q("score", criteria={LONG: None}), "a level exceeds 8192 characters"),
    (q("score", levels=[]), COUNT),
    (q("score", criteria={}), COUNT),
    (q("score", levels=[f"l{i}" for i in range(256)]), COUNT),
    (q("score", levels=["a", "b", "a"]), 'answer key "a" is repeated'),
    # Choice
    (q("choice", criteria={"a": None}, levels=[]), CHOICE_FIELDS),
    (q("choice", options=[{}], region=None), CHOICE_FIELDS),
    (q("choice", options=[], criteria={}), "Choice takes options or criteria, not both"),
    (q("choice"), "Choice requires options or criteria"),
    (q("choice", criteria=None), "Choice requires options or criteria"),
    (q("choice", criteria=["a"]), "Choice requires options or criteria"),
    (q("choice", criteria={"a": 4}), "criteria values must be strings or null"),
    (q("choice", criteria={"a": True}), "criteria values must be strings or null"),
    (q("choice", criteria={"a": False}), "criteria values must be strings or null"),
    (q("choice", criteria={"a": 0}), "criteria values must be strings or null"),
    (q("choice", criteria={"a": ["r"]}), "criteria values must be strings or null"),
    (q("choice", criteria={"x" * 8000: "y" * 193}), "criteria exceed 8192 characters"),
    (q("choice", criteria={LONG: None}), "criteria exceed 8192 characters"),
    (q("choice", criteria={}), COUNT),
    (q("choice", criteria=criteria(256)), COUNT),
    (q("choice", options="a"), "options must be an array"),
    (q("choice", options=None), "options must be an array"),
    (q("choice", options={"key": "a"}), "options must be an array"),
    (q("choice", options=[{}] * 1021), "too many options"),
    (q("choice", options=[{"abstain": True}] * 1021), "too many options"),
    (q("choice", options=[3]), "an option must be an object"),
    (q("choice", options=[{}, None]), "an option must be an object"),
    (q("choice", options=[{"weight": 2}]), OPTION_FIELDS),
    (q("choice", options=[{"abstain": "yes"}]), "abstain must be a boolean"),
    (q("choice", options=[{"abstain": 1}]), "abstain must be a boolean"),
    (q("choice", options=[{"abstain": None}]), "abstain must be a boolean"),
    (q("choice", options=[{"key": 3}]), "key must be a string"),
    (q("choice", options=[{"key": None, "text": "a"}]), "key must be a string"),
    (q("choice", options=[{"text": 3}]), "text must be a string"),
    (q("choice", options=[{"key": "a", "text": None}]), "text must be a string"),
    (q("choice", options=[{"key": LONG}]), "key exceeds 8192 characters"),
    (q("choice", options=[{"text": LONG}]), "text exceeds 8192 characters"),
    (q("choice", options=[{"key": "a", "region": None}]), REGION_SHAPE),
    (q("choice", options=[{"region": {"box": [0, 0, "1", 0]}}]), NUMBERS),
    (q("choice", options=[{"region": {"box": [0, 0, 1e10, 0]}}]), WITHIN),
    (q("choice", options=[]), COUNT),
    (q("choice", options=[{"abstain": True}]), COUNT),
    (q("choice", options=options(256)), COUNT),
    (q("choice", options=[{"text": "a"}, {"key": "a"}]), 'answer key "a" is repeated'),
    (q("choice", options=[{}, {"key": "option_0"}]), 'answer key "option_0" is repeated'),
    (q("choice", options=[{"key": 'say "hi"\n'}] * 2), 'answer key "say \\"hi\\"\\n" is repeated'),
    (q("choice", options=[{"key": "e\u0301\x01"}] * 2), 'answer key "e\\u{301}\\u{1}" is repeated'),
    # the option count comes before repeats, and repeats before reserved text
    (q("choice", options=[{"key": "a"}] * 256), COUNT),
    (q("choice", options=[{"text": "<|opt|>"}] * 2), 'answer key "<|opt|>" is repeated'),
    # reserved text (§2.6)
    *[(q("noul", instructions=f"pick {t} now"), f"text must not contain {t}") for t in RESERVED],
    *[(q("choice", options=[{"text": f"a{t}"}]), f"text must not contain {t}") for t in RESERVED],
    (q("noul", instructions="<|vision_end|><|opt|>"), "text must not contain <|opt|>"),
    (
        q("choice", instructions="<|vision_end|>", options=[{"text": "<|opt|>"}]),
        "text must not contain <|vision_end|>",
    ),
    (q("score", levels=["fine", "<|image_pad|>"]), "text must not contain <|image_pad|>"),
    (q("score", criteria={"<|video_pad|>": None}), "text must not contain <|video_pad|>"),
    (q("choice", criteria={"<|image_pad|>": None}), "text must not contain <|image_pad|>"),
    (q("choice", criteria={"a": "<|/opt|>"}), "text must not contain <|/opt|>"),
]


@pytest.mark.parametrize(("question", "message"), QUESTION_REFUSALS)
def test_question_refusals(question: object, message: str) -> None:
    assert refusal(body({"q": question})) == f"question q: {message}"


def test_question_messages_name_their_question() -> None:
    questions = {"fine": NOUL, "bad one": q("choice", options=[])}
    assert refusal(body(questions)) == "question bad one: a question needs 1 to 255 options"


REGION = {"box": [0.5, 1.5, 2.5, -0.5]}
MIXED_OPTIONS = [
    {"key": "top", "region": {"box": [0, 0, 1000, 120.4]}},
    {"text": "t"},
    {},
    {"abstain": True},
    {"key": "", "text": "u"},
    {"key": "k", "text": ""},
    {"region": {"box": [1, 1, 1, 1]}, "text": "r"},
    {"abstain": False, "key": "f"},
]

LEVELS_255 = [f"l{i}" for i in range(255)]
OPTIONS_255 = [f"o{i}" for i in range(255)]

QUESTION_ACCEPTED = [
    (NOUL, ["yes"], [""]),
    *[(q("noul", region=falsy), ["yes"], [""]) for falsy in (None, False, 0, 0.0, "", [], {})],
    (q("noul", region=REGION), ["yes"], ["region [0,2,2,0]"]),
    (
        q("noul", region={"box": [1e9, -1e9, 3.49, -3.51]}),
        ["yes"],
        ["region [1000000000,-1000000000,3,-4]"],
    ),
    (q("noul", region={"box": [10**9, 2, 3, 4]}), ["yes"], ["region [1000000000,2,3,4]"]),
    (
        q("noul", region={"box": [-0.4, 1e-300, 0.49999999999999994, 3.5]}),
        ["yes"],
        ["region [0,0,0,4]"],
    ),
    (q("score", levels=["low", "high"]), ["low", "high"], ["low", "high"]),
    (q("score", criteria={"safe": "nothing", "risky": 3}), ["safe", "risky"], ["safe", "risky"]),
    (q("score", levels=["x" * 8192]), ["x" * 8192], ["x" * 200]),
    (q("score", levels=["y" * 200 + "<|opt|>"]), ["y" * 200 + "<|opt|>"], ["y" * 200]),
    (q("score", levels=LEVELS_255), LEVELS_255, LEVELS_255),
    (
        q("choice", criteria={"click": None, "type": "Enter text", "scroll": ""}),
        ["click", "type", "scroll"],
        ["click", "type: Enter text", "scroll"],
    ),
    (q("choice", criteria={"x" * 8000: "y" * 192}), ["x" * 8000], ["x" * 200]),
    (q("choice", criteria={"k": "😀" * 300}), ["k"], ["k: " + "😀" * 197]),
    (
        q("choice", options=MIXED_OPTIONS),
        ["top", "t", "option_2", "u", "k", "r", "f"],
        ["region [0,0,1000,120]", "t", "", "u", "", "region [1,1,1,1]", ""],
    ),
    (q("choice", options=[{"abstain": True}, {}]), ["option_1"], [""]),
    (
        q("choice", options=[{"abstain": True, "key": 3, "region": None}, {"text": "a"}]),
        ["a"],
        ["a"],
    ),
    (q("choice", options=[{"key": "<|opt|>", "text": "fine"}]), ["<|opt|>"], ["fine"]),
    (
        q("choice", options=[{"text": "x" * 197 + "<|opt|>"}]),
        ["x" * 197 + "<|opt|>"],
        ["x" * 197 + "<|o"],
    ),
    (q("choice", options=[{"text": "😀" * 250}]), ["😀" * 250], ["😀" * 200]),
    (
        q("choice", options=[{"key": "a", "text": "same"}, {"key": "b", "text": "same"}]),
        ["a", "b"],
        ["same"] * 2,
    ),
    (q("choice", options=options(255)), OPTIONS_255, OPTIONS_255),
    (
        q("choice", options=[{"abstain": True}] * 765 + options(255)),
        OPTIONS_255,
        OPTIONS_255,
    ),
    (q("noul", instructions="x" * 8192), ["yes"], [""]),
    (q("noul", instructions="😀" * 8192), ["yes"], [""]),
    (q("noul", instructions="ends <|im_end|> here"), ["yes"], [""]),
]


@pytest.mark.parametrize(("question", "keys", "texts"), QUESTION_ACCEPTED)
def test_question_keys_and_option_texts(question: dict, keys: list, texts: list) -> None:
    (compiled,) = compile_request(body({"q": question})).questions
    assert compiled.id == "q"
    assert compiled.type == question["type"]
    assert compiled.instructions == question["instructions"]
    assert list(compiled.keys) == keys
    assert list(compiled.option_texts) == texts


def test_instructions_are_kept_untrimmed() -> None:
    (compiled,) = compile_request(body({"q": q("noul", instructions="  a  \n\x1f ")})).questions
    assert compiled.instructions == "  a  \n\x1f "


# -- the reference's own keys and option texts ---------------------------------------------------


def fixture_cases() -> list[dict]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]


@pytest.mark.parametrize("case", fixture_cases(), ids=lambda case: case["name"])
def test_matches_the_reference_fixture(case: dict) -> None:
    raw = json.dumps(case["request"], ensure_ascii=False).replace("<solid PNG of image_size>", PNG)
    request = compile_request(parse_body(raw.encode("utf-8")))
    expected = case["questions"]
    assert len(request.questions) == len(expected)
    for question, want in zip(request.questions, expected, strict=True):
        assert question.id == want["id"]
        assert question.type == want["type"]
        assert list(question.keys) == want["keys"]
        assert list(question.option_texts) == want["option_text"]
        assert question.instructions == case["request"]["questions"][question.id]["instructions"]


# -- Rust's `{:?}` ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "debug"),
    [
        ("a", '"a"'),
        ('say "hi"', '"say \\"hi\\""'),
        ("back\\slash", '"back\\\\slash"'),
        ("\n\t\r\0", '"\\n\\t\\r\\0"'),
        ("\x01\x1f\x7f\x85", '"\\u{1}\\u{1f}\\u{7f}\\u{85}"'),
        ("\u00a0\u3000\u200b\u2028\ufeff", '"\\u{a0}\\u{3000}\\u{200b}\\u{2028}\\u{feff}"'),
        ("e\u0301", '"e\\u{301}"'),
        ("\u09be\ue000\U000e0041", '"\\u{9be}\\u{e000}\\u{e0041}"'),
        ("é 😀中'~", '"é 😀中\'~"'),
    ],
)
def test_rust_debug(text: str, debug: str) -> None:
    assert rust_debug(text) == debug
