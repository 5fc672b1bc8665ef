"""OpenAI's Decisions API (`client.decisions.create`, openai-python ≥ 3.26) on `/v1/decisions`.

The request becomes the native one: the user messages' `input_image` parts (data URLs) are the
image, tiled into one where there are several (runtime.panels); `predicate`, `choice` and `score`
questions become noul, choice (`value: description` criteria) and score (the level labels)
questions, asked in their list order. Text in the input, image URLs and JSON parts are refused
(the model reads images only), and so is a video (the format has none; the other routes take
it). Errors carry OpenAI's `{"error": {...}}` body; the native contract's refusals are 400
`invalid_request_error`s.
"""

from __future__ import annotations

import re

from runtime import panels
from runtime.contract import MAX_OPTIONS, MAX_QUESTIONS, MODELS
from server.formats import (
    FormatError,
    Translation,
    Wire,
    check_keys,
    choice_confidence,
    expected_level,
    json_type,
    option_probabilities,
    rounded,
    score_confidence,
)

PATH = "/v1/decisions"
TOP_LEVEL = (
    "model",
    "input",
    "questions",
    "prompt_cache_key",  # accepted and not used: the worker keeps no prompt cache by key
    "prompt_cache_options",
    "safety_identifier",
)
MESSAGE_FIELDS = ("type", "role", "content")
IMAGE_FIELDS = ("type", "image_url", "detail", "prompt_cache_breakpoint")  # detail: not used
QUESTION_FIELDS = {
    "predicate": ("type", "instructions", "name"),
    "choice": ("type", "instructions", "choices", "name"),
    "score": ("type", "instructions", "levels", "name"),
}
CHOICE_FIELDS = ("value", "description")
LEVEL_FIELDS = ("label", "description")
MIN_CHOICES = 2  # the API's own bounds: 2 to 255 unique choices
NATIVE_TYPES = {"predicate": "noul", "choice": "choice", "score": "score"}
ERROR_TYPES = {404: "invalid_request_error", 500: "server_error", 503: "server_error"}
ERROR_CODES = {404: "model_not_found", 413: "request_too_large", 503: "overloaded"}
TEXT_REFUSED = "is not supported: the model reads images only; send input_image parts"
QUESTION_PREFIX = re.compile(r"question (\d+): ")
VIDEO_PARTS = ("input_video", "video_url", "video")  # what a client may try for a clip
VIDEO_REFUSED = (
    "video is not supported: the Decisions API has no video input; "
    "send the clip to /v1/systemone as state.video (or /typesafe/v1/systemone as media)"
)


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    kind = ERROR_TYPES.get(status, "invalid_request_error")
    return {
        "error": {"message": message, "type": kind, "param": param, "code": ERROR_CODES.get(status)}
    }


def native_param(message: str) -> tuple[str, str | None]:
    """A native refusal's message and the question it names (`question 3: ...` -> questions[3])."""
    found = QUESTION_PREFIX.match(message)
    if found is None:
        return message, None
    return message[found.end() :], f"questions[{found.group(1)}]"


def translate(obj: dict) -> Translation:
    """The native request of a Decisions body, and its answers' translation back."""
    check_keys(obj, TOP_LEVEL, "", 400)
    for field in ("model", "input", "questions"):
        if field not in obj:
            raise FormatError(f"missing required parameter: '{field}'", field, 400)
    model = obj["model"]
    if not isinstance(model, str) or model not in MODELS:
        raise FormatError(f"the model {model!r} does not exist (served: {MODELS[0]})", "model", 404)
    urls = input_images(obj["input"])
    questions = obj["questions"]
    if not isinstance(questions, list) or not 1 <= len(questions) <= MAX_QUESTIONS:
        count = len(questions) if isinstance(questions, list) else json_type(questions)
        message = f"questions: must be an array of 1 to {MAX_QUESTIONS} questions, not {count}"
        raise FormatError(message, "questions", 400)
    native, values = {}, []
    for index, question in enumerate(questions):
        native[str(index)], choice_values = native_question(question, f"questions[{index}]")
        values.append(choice_values)
    request = {"model": MODELS[0], "state": {"images": [panels.one_image(urls)]}}
    names = [question.get("name") for question in questions]
    return Translation(
        {**request, "questions": native}, lambda answer: response(answer, questions, names, values)
    )


def input_images(items: object) -> list[str]:
    """The data URLs of the user messages' `input_image` parts, in order."""
    if isinstance(items, str):
        raise FormatError(f"input: text {TEXT_REFUSED}", "input", 400)
    if not isinstance(items, list) or not items:
        raise FormatError("input: must be a non-empty array of user messages", "input", 400)
    urls = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise FormatError(f"{where}: must be a message object", where, 400)
        if item.get("type", "message") != "message" or item.get("role") != "user":
            kind = item.get("role") or item.get("type")
            raise FormatError(f"{where}: {kind!r} input {TEXT_REFUSED}", where, 400)
        check_keys(item, MESSAGE_FIELDS, where, 400)
        urls.extend(message_images(item.get("content"), f"{where}.content"))
    if not 1 <= len(urls) <= panels.MAX_IMAGES:
        message = f"input: needs 1 to {panels.MAX_IMAGES} input_image parts, not {len(urls)}"
        raise FormatError(message, "input", 400)
    return urls


def message_images(content: object, where: str) -> list[str]:
    if isinstance(content, str):
        raise FormatError(f"{where}: text {TEXT_REFUSED}", where, 400)
    if not isinstance(content, list):
        raise FormatError(f"{where}: must be an array of input_image parts", where, 400)
    urls = []
    for index, part in enumerate(content):
        at = f"{where}[{index}]"
        kind = part.get("type") if isinstance(part, dict) else json_type(part)
        video = video_field(part, at)
        if video is not None:
            raise FormatError(f"{video}: {VIDEO_REFUSED}", video, 400)
        if kind != "input_image":
            raise FormatError(f"{at}: {kind!r} part {TEXT_REFUSED}", at, 400)
        check_keys(part, IMAGE_FIELDS, at, 400)
        url = part.get("image_url")
        if not isinstance(url, str) or not url.startswith("data:"):
            message = f"{at}.image_url: only data URLs are supported (the worker fetches nothing)"
            raise FormatError(message, f"{at}.image_url", 400)
        urls.append(url)
    return urls


def video_field(part: object, at: str) -> str | None:
    """Where a content part holds a video (a video part, or a video data URL in any field),
    for the refusal to name; None for any other part."""
    if not isinstance(part, dict):
        return None
    if part.get("type") in VIDEO_PARTS:
        return at
    for key, value in part.items():
        if isinstance(value, str) and value.startswith("data:video/"):
            return f"{at}.{key}"
    return None


def native_question(question: object, where: str) -> tuple[dict, list]:
    """One Decisions question as a native one, with a choice question's typed values."""
    kind = question.get("type") if isinstance(question, dict) else None
    if not isinstance(kind, str) or kind not in QUESTION_FIELDS:
        raise FormatError(f"{where}.type: must be predicate, choice or score", f"{where}.type", 400)
    check_keys(question, QUESTION_FIELDS[kind], where, 400)
    instructions = question.get("instructions")
    if not isinstance(instructions, str):
        message = f"{where}.instructions: must be a string, not {json_type(instructions)}"
        raise FormatError(message, f"{where}.instructions", 400)
    name = question.get("name")
    if name is not None and not isinstance(name, str):
        raise FormatError(f"{where}.name: must be a string", f"{where}.name", 400)
    native = {"type": NATIVE_TYPES[kind], "instructions": instructions}
    if kind == "choice":
        criteria, values = choice_criteria(question.get("choices"), f"{where}.choices")
        return {**native, "criteria": criteria}, values
    if kind == "score":
        return {**native, "levels": level_labels(question.get("levels"), f"{where}.levels")}, []
    return native, []


def choice_criteria(choices: object, where: str) -> tuple[dict, list]:
    """`value: description` criteria (a boolean value written true/false) and the values."""
    if not isinstance(choices, list) or not MIN_CHOICES <= len(choices) <= MAX_OPTIONS:
        count = len(choices) if isinstance(choices, list) else json_type(choices)
        message = (
            f"{where}: must be an array of {MIN_CHOICES} to {MAX_OPTIONS} choices, not {count}"
        )
        raise FormatError(message, where, 400)
    criteria, values = {}, []
    for index, choice in enumerate(choices):
        at = f"{where}[{index}]"
        if not isinstance(choice, dict):
            raise FormatError(f"{at}: must be an object with a value", at, 400)
        check_keys(choice, CHOICE_FIELDS, at, 400)
        value, description = choice.get("value"), choice.get("description")
        if not isinstance(value, str | bool):
            raise FormatError(f"{at}.value: must be a string or a boolean", f"{at}.value", 400)
        if description is not None and not isinstance(description, str):
            raise FormatError(f"{at}.description: must be a string", f"{at}.description", 400)
        key = ("true" if value else "false") if isinstance(value, bool) else value
        if key in criteria:
            raise FormatError(f"{at}.value: each choice must be unique ({key!r})", at, 400)
        criteria[key] = description
        values.append(value)
    return criteria, values


def level_labels(levels: object, where: str) -> list[str]:
    if not isinstance(levels, list) or not 1 <= len(levels) <= MAX_OPTIONS:
        message = f"{where}: must be an array of 1 to {MAX_OPTIONS} levels"
        raise FormatError(message, where, 400)
    labels = []
    for index, level in enumerate(levels):
        at = f"{where}[{index}]"
        if not isinstance(level, dict) or not isinstance(level.get("label"), str):
            raise FormatError(f"{at}: must be an object with a string label", at, 400)
        check_keys(level, LEVEL_FIELDS, at, 400)
        if not isinstance(level.get("description", ""), str | None):
            raise FormatError(f"{at}.description: must be a string", f"{at}.description", 400)
        labels.append(level["label"])
    return labels


def response(native: dict, questions: list, names: list, values: list) -> dict:
    """The native response as a Decision: answers in question order."""
    answers = []
    for index, answer in enumerate(native["answers"].values()):
        name = names[index]
        if "noul" in answer:
            answers.append({"type": "predicate", "name": name, "probability": answer["noul"]})
            continue
        probabilities = option_probabilities(answer)
        if "choice" in answer:
            typed = values[index]
            keys = list(answer["probabilities"])
            answers.append(
                {
                    "type": "choice",
                    "name": name,
                    "choice": typed[keys.index(answer["choice"])],
                    "confidence": rounded(choice_confidence(probabilities)),
                    "probabilities": [
                        {"value": value, "probability": p}
                        for value, p in zip(typed, probabilities, strict=True)
                    ],
                }
            )
            continue
        labels = [level["label"] for level in questions[index]["levels"]]
        answers.append(
            {
                "type": "score",
                "name": name,
                "score": rounded(expected_level(probabilities)),
                "confidence": rounded(score_confidence(probabilities)),
                "probabilities": [
                    {"value": i, "label": label, "probability": p}
                    for i, (label, p) in enumerate(zip(labels, probabilities, strict=True))
                ],
            }
        )
    tokens = native["usage"]["input_tokens"]
    usage = {
        "input_tokens": tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": tokens,
    }
    return {"model": native["model"], "answers": answers, "usage": usage}


WIRE = Wire(PATH, translate, error_body, refusal_status=400, native_param=native_param)
