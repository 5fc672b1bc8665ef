"""The request contract (docs/contract.md §2.2-2.6): a parsed body becomes a `Request` or a 422
refusal.

Follows the native worker's `contract::compile` (`S1@1df4c2d src/models/omnijev/native/src/
contract.rs`) check by check and in its order, with answer keys and option texts as the
reference's `MSO1._options` / `render_option` make them (§4.1).

Messages that §2.5 and §13 call "not known" are the ones that contract.rs itself uses:

    a question must be an object                      question value not an object
    question type must be choice, score, or noul      `type` missing (as for any other type)
    instructions must be a string                     `instructions` missing
    Score supports type, instructions, levels and criteria
    Choice supports type, instructions, options and criteria
    levels must be an array of strings                `levels` present but not an array
    options must be an array                          `options` present but not an array
    too many options                                  more than 1,020 option objects
    an option must be an object                       an `options` entry not an object
    abstain must be a boolean                         `abstain` present and not true/false
    key must be a string, key exceeds 8192 characters     an option's `key`
    text must be a string, text exceeds 8192 characters   an option's `text`
    a level exceeds 8192 characters                   a level, or a Score criteria key
    criteria exceed 8192 characters                   a Choice criterion and its rubric
    a region must be {"box": [x1, y1, x2, y2]}        also an option's `"region": null`

Question-level messages get the `question {id}: ` prefix; the image messages come from
`runtime.images.parse_data_url`.
"""

from __future__ import annotations

import unicodedata

from runtime import images
from runtime.constants import MODEL_ID
from runtime.errors import ContractError
from runtime.types import Question, Request

MODELS = (MODEL_ID, "omnijev", "omnijev-4b-v1.1")  # §2.2: the id and contract.rs' ALIASES
TOP_LEVEL_FIELDS = ("model", "state", "questions")  # §2.2
STATE_FIELDS = ("images", "video")  # §2.2; a video is this runtime's (§2.10)
MAX_QUESTIONS = 64  # §2.2
MAX_ID_CHARS = 256  # §2.2, in code points
MAX_ROWS = 1024  # §2.2: options over all questions
MAX_OPTIONS = 255  # §2.5: options of one question
MAX_OPTION_OBJECTS = 4 * MAX_OPTIONS  # §2.5: 1,020 entries in a Choice `options` list
MAX_TEXT_CHARS = 8192  # §2.4, in code points
OPTION_CHARS = 200  # §4.1: rendered option texts are cut to 200 code points
MAX_COORDINATE = 1e9  # §2.5: |region coordinate| ≤ 1e9
# §2.6, in contract.rs' order: the first of these a text contains is the one named.
RESERVED_TOKENS = (
    "<|opt|>",
    "<|/opt|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|vision_start|>",
    "<|vision_end|>",
)
QUESTION_FIELDS = {  # §2.5: the keys each question type allows
    "noul": ("type", "instructions", "region"),
    "score": ("type", "instructions", "levels", "criteria"),
    "choice": ("type", "instructions", "options", "criteria"),
}
OPTION_FIELDS = ("key", "text", "region", "abstain")  # §2.5, Choice option objects
UNKNOWN_FIELD = {  # §2.5 for Noul; contract.rs' own words for Score and Choice
    "noul": "Noul supports type, instructions and region",
    "score": "Score supports type, instructions, levels and criteria",
    "choice": "Choice supports type, instructions, options and criteria",
}
NOUL_KEY = "yes"  # §4.1: a Noul question's only answer key

REGION_SHAPE = 'a region must be {"box": [x1, y1, x2, y2]}'
# Rust's `{:?}` escapes these with a backslash; other escaped characters become `\u{hex}`.
RUST_BACKSLASH_ESCAPES = {
    "\0": "\\0",
    "\t": "\\t",
    "\r": "\\r",
    "\n": "\\n",
    "\\": "\\\\",
    '"': '\\"',
}
# Rust's `is_printable` is false for these general categories (core/src/unicode/printable.py),
# except for the ASCII space.
RUST_UNPRINTABLE = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs")
# Other_Grapheme_Extend (Unicode 15 PropList.txt): with Mn and Me, the Grapheme_Extend characters
# that `{:?}` always escapes. Python's unicodedata has no such property.
OTHER_GRAPHEME_EXTEND = (
    (0x09BE, 0x09BE),
    (0x09D7, 0x09D7),
    (0x0B3E, 0x0B3E),
    (0x0B57, 0x0B57),
    (0x0BBE, 0x0BBE),
    (0x0BD7, 0x0BD7),
    (0x0CC2, 0x0CC2),
    (0x0CD5, 0x0CD6),
    (0x0D3E, 0x0D3E),
    (0x0D57, 0x0D57),
    (0x0DCF, 0x0DCF),
    (0x0DDF, 0x0DDF),
    (0x1B35, 0x1B35),
    (0x200C, 0x200C),
    (0x302E, 0x302F),
    (0xFF9E, 0xFF9F),
    (0x1133E, 0x1133E),
    (0x11357, 0x11357),
    (0x114B0, 0x114B0),
    (0x114BD, 0x114BD),
    (0x115AF, 0x115AF),
    (0x11930, 0x11930),
    (0x1D165, 0x1D165),
    (0x1D16E, 0x1D172),
    (0xE0020, 0xE007F),
)


def compile_request(obj: dict, image: tuple | None = None) -> Request:
    """Checks a parsed request body (§2.2) and returns its image and compiled questions;
    `image` is `compile_image(obj)` where the caller has it already."""
    image = compile_image(obj) if image is None else image
    questions = obj.get("questions")
    if not isinstance(questions, dict):
        raise ContractError("questions must be an object")
    if not 1 <= len(questions) <= MAX_QUESTIONS:
        raise ContractError(f"questions must contain 1 to {MAX_QUESTIONS} questions")
    compiled = []
    for question_id, value in questions.items():
        if len(question_id) > MAX_ID_CHARS:
            raise ContractError(f"question ids must be at most {MAX_ID_CHARS} characters")
        try:
            compiled.append(compile_question(question_id, value))
        except ContractError as error:
            raise error.within(f"question {question_id}") from None
    if sum(len(question.keys) for question in compiled) > MAX_ROWS:
        raise ContractError(f"request exceeds {MAX_ROWS} options in all")
    if not isinstance(image, tuple):  # a video (runtime.video), prepared by runtime.video_prepare
        return Request(image_mime="", image_bytes=b"", questions=tuple(compiled), video=image)
    mime, data, opened = image
    return Request(image_mime=mime, image_bytes=data, questions=tuple(compiled), opened=opened)


def compile_image(obj: dict) -> tuple[str, bytes, images.OpenedImage] | object:
    """The checks of a parsed request body up to its image, in `compile_request`'s order, and
    the image as `image_of_state` gives it: the decode can start before the questions' checks.
    A state with a video gives `runtime.video.video_of_state`'s video instead."""
    if any(key not in TOP_LEVEL_FIELDS for key in obj):
        raise ContractError("request fields must be model, state and questions")
    model = obj.get("model")
    if model is not None and not (isinstance(model, str) and model in MODELS):
        raise ContractError("requested model is not loaded")
    if "state" not in obj:
        raise ContractError("request requires state")
    return image_of_state(obj["state"])


def image_of_state(state: object) -> tuple[str, bytes, images.OpenedImage] | object:
    """The `state` object's one image as (MIME type, bytes, Pillow's open header), its data URL
    checked (§2.2-2.3)."""
    if not isinstance(state, dict):
        raise ContractError("state must be an object with images")
    if any(key not in STATE_FIELDS for key in state):
        raise ContractError("state supports images and video only")
    if "video" in state:
        from runtime.video import video_of_state

        return video_of_state(state)
    urls = state.get("images")
    if not isinstance(urls, list):
        raise ContractError("state.images must be an array")
    if len(urls) != 1:
        raise ContractError("state.images must contain exactly one image")
    return images.open_data_url(urls[0])


def compile_question(question_id: str, value: object) -> Question:
    """One question's answer keys and option texts (§2.5-2.6, §4.1); messages without prefix."""
    if not isinstance(value, dict):
        raise ContractError("a question must be an object")
    kind = value.get("type")
    if not isinstance(kind, str) or kind not in QUESTION_FIELDS:
        raise ContractError("question type must be choice, score, or noul")
    instructions = text_field(value.get("instructions"), "instructions")
    if any(key not in QUESTION_FIELDS[kind] for key in value):
        raise ContractError(UNKNOWN_FIELD[kind])
    if kind == "noul":
        keys, texts = noul_options(value)
    elif kind == "score":
        keys, texts = score_options(value)
    else:
        keys, texts = choice_options(value)
    if not 1 <= len(texts) <= MAX_OPTIONS:
        raise ContractError(f"a question needs 1 to {MAX_OPTIONS} options")
    check_unique(keys)
    for text in (instructions, *texts):
        check_reserved(text)
    return Question(
        id=question_id,
        type=kind,
        instructions=instructions,
        keys=tuple(keys),
        option_texts=tuple(texts),
    )


def noul_options(question: dict) -> tuple[list[str], list[str]]:
    """`["yes"]` and the region text, or `""` when `region` is falsy by Python's rules."""
    region = question.get("region")
    return [NOUL_KEY], [region_text(region) if region else ""]


def score_options(question: dict) -> tuple[list[str], list[str]]:
    """The levels, from `levels` or from the keys of `criteria`, and their cut texts."""
    if "levels" in question and "criteria" in question:
        raise ContractError("Score takes levels or criteria, not both")
    if "levels" in question:
        levels = question["levels"]
        if not isinstance(levels, list):
            raise ContractError("levels must be an array of strings")
        keys = [text_field(level, "a level") for level in levels]
    else:
        criteria = question.get("criteria")
        if not isinstance(criteria, dict):
            raise ContractError("Score requires levels, or criteria as an object keyed by level")
        keys = list(criteria)
        for key in keys:
            check_length(key, "a level")
    return keys, [cut(key) for key in keys]


def choice_options(question: dict) -> tuple[list[str], list[str]]:
    """Keys and texts from the reference's `options` list or from Jev's `criteria` map."""
    if "options" in question and "criteria" in question:
        raise ContractError("Choice takes options or criteria, not both")
    if "options" in question:
        return option_list(question["options"])
    return criteria_options(question.get("criteria"))


def option_list(options: object) -> tuple[list[str], list[str]]:
    """The `options` form: abstain entries skipped, `option_{i}` counting them (§4.1)."""
    if not isinstance(options, list):
        raise ContractError("options must be an array")
    if len(options) > MAX_OPTION_OBJECTS:
        raise ContractError("too many options")
    keys, texts = [], []
    for i, option in enumerate(options):
        if not isinstance(option, dict):
            raise ContractError("an option must be an object")
        if any(key not in OPTION_FIELDS for key in option):
            raise ContractError("an option supports key, text, region and abstain")
        if "abstain" in option and not isinstance(option["abstain"], bool):
            raise ContractError("abstain must be a boolean")
        if option.get("abstain"):
            continue  # the head has its own abstain probability
        for field in ("key", "text"):
            if field in option:
                text_field(option[field], field)
        keys.append(option.get("key") or option.get("text") or f"option_{i}")
        if "region" in option:
            texts.append(region_text(option["region"]))
        else:
            texts.append(cut(option.get("text", "")))
    return keys, texts


def criteria_options(criteria: object) -> tuple[list[str], list[str]]:
    """The `criteria` form: `key`, or `key: rubric` when the rubric is a non-empty string."""
    if not isinstance(criteria, dict):
        raise ContractError("Choice requires options or criteria")
    texts = []
    for key, rubric in criteria.items():
        if rubric is None:
            rubric = ""
        elif not isinstance(rubric, str):
            raise ContractError("criteria values must be strings or null")
        if len(key) + len(rubric) > MAX_TEXT_CHARS:
            raise ContractError(f"criteria exceed {MAX_TEXT_CHARS} characters")
        texts.append(cut(f"{key}: {rubric}" if rubric else key))
    return list(criteria), texts


def region_text(region: object) -> str:
    """`region [x1,y1,x2,y2]`, each coordinate rounded half-to-even as Python's `round`."""
    box = region.get("box") if isinstance(region, dict) and len(region) == 1 else None
    if not isinstance(box, list) or len(box) != 4:
        raise ContractError(REGION_SHAPE)
    rounded = []
    for coordinate in box:
        if isinstance(coordinate, bool) or not isinstance(coordinate, int | float):
            raise ContractError("region coordinates must be numbers")
        if not abs(coordinate) <= MAX_COORDINATE:  # written so that NaN is refused too
            raise ContractError("region coordinates must be within ±1e9")
        rounded.append(round(coordinate))
    return "region [{},{},{},{}]".format(*rounded)


def text_field(value: object, what: str) -> str:
    """A text field: a string of at most 8,192 code points (§2.4)."""
    if not isinstance(value, str):
        raise ContractError(f"{what} must be a string")
    check_length(value, what)
    return value


def check_length(text: str, what: str) -> None:
    if len(text) > MAX_TEXT_CHARS:
        raise ContractError(f"{what} exceeds {MAX_TEXT_CHARS} characters")


def cut(text: str) -> str:
    """An option text as the reference writes it: the first 200 code points."""
    return text[:OPTION_CHARS]


def check_unique(keys: list[str]) -> None:
    """Refuses the first answer key that repeats an earlier one."""
    seen: set[str] = set()
    for key in keys:
        if key in seen:
            raise ContractError(f"answer key {rust_debug(key)} is repeated")
        seen.add(key)


def check_reserved(text: str) -> None:
    """Refuses marker text that would move the prompt's image or option positions (§2.6)."""
    for token in RESERVED_TOKENS:
        if token in text:
            raise ContractError(f"text must not contain {token}")


def rust_debug(text: str) -> str:
    """A string as Rust's `{:?}` writes it: quoted, with escapes where Rust's `str` Debug puts
    them (`\\0 \\t \\r \\n \\\\ \\"`, then `\\u{hex}` for grapheme extenders and unprintables).

    Character properties come from Python's `unicodedata`, whose Unicode version may trail Rust's.
    """
    return '"' + "".join(_rust_escape(char) for char in text) + '"'


def _rust_escape(char: str) -> str:
    if char in RUST_BACKSLASH_ESCAPES:
        return RUST_BACKSLASH_ESCAPES[char]
    if " " <= char <= "~":
        return char
    category = unicodedata.category(char)
    if category in ("Mn", "Me") or _other_grapheme_extend(char) or category in RUST_UNPRINTABLE:
        return f"\\u{{{ord(char):x}}}"
    return char


def _other_grapheme_extend(char: str) -> bool:
    code = ord(char)
    return any(low <= code <= high for low, high in OTHER_GRAPHEME_EXTEND)
