"""The TypeSafe System One format (the `system-one` SDK, OneJev's `qev.Client`) on
`/typesafe/v1/systemone`: a client sets its base URL to `http://host:port/typesafe`.

Its request becomes the native one: `state.images` (or OneJev's `media` list referenced from the
state as `<image:N>`) tiled into one image where there are several (runtime.panels), a clip
(`state.video`, or a `media` video referenced as `<video:1>`) the native `state.video`; a Choice's
`criteria` map (or list of labels) is the native criteria form; a Score's `criteria` list is the
native `levels`; a Noul's `criteria` are accepted and, as in the reference, not read by the model.
Answers carry `type`; Score answers the expected level index with level-index probabilities and a
`legend`; Choice probabilities are renormalised without the native abstain share.
"""

from __future__ import annotations

import re

from runtime import panels
from runtime.contract import MODELS
from server.formats import (
    FormatError,
    Translation,
    Wire,
    check_keys,
    choice_confidence,
    detail_body,
    expected_level,
    json_type,
    option_probabilities,
    rounded,
    score_confidence,
)

PATH = "/typesafe/v1/systemone"  # the SDK posts to base_url + "/v1/systemone"
PREFIX = "/typesafe"
TOP_LEVEL = ("model", "state", "questions", "media")
QUESTION_FIELDS = ("type", "instructions", "criteria")
MEDIA_FIELDS = ("type", "data")
NOUL_CRITERIA = ("true", "false")
PLACEHOLDER = re.compile(r"<image:(\d+)>")  # OneJev's media references (qev.media)
TEXT_REFUSED = "text in the state is not supported: the model reads images and video only"


def translate(obj: dict) -> Translation:
    """The native request of a TypeSafe body, and its answers' translation back."""
    check_keys(obj, TOP_LEVEL, "")
    model = obj.get("model")
    if model is not None and not (isinstance(model, str) and model in MODELS):
        raise FormatError(f"model: {model!r} is not served here (served: {MODELS[0]})", "model")
    if "state" not in obj:
        raise FormatError("state: required (an object with images)", "state")
    state = native_state(obj["state"], obj.get("media"))
    questions = obj.get("questions")
    if not isinstance(questions, dict) or not questions:
        raise FormatError("questions: must be a non-empty object of questions", "questions")
    native = {name: native_question(name, value) for name, value in questions.items()}
    request = {"model": MODELS[0], "state": state}
    legends = {name: value["criteria"] for name, value in questions.items() if is_score(value)}
    return Translation({**request, "questions": native}, lambda answer: response(answer, legends))


def is_score(value: object) -> bool:
    return isinstance(value, dict) and value.get("type") == "score"


def native_state(state: object, media: object) -> dict:
    """The native state: a clip as `state.video`, else the images tiled into one."""
    video = video_url(state, media)
    if video is not None:
        return {"video": video}
    return {"images": [panels.one_image(image_urls(state, media))]}


def video_url(state: object, media: object) -> object | None:
    """A clip's data URL: OneJev's `media` item of type video, referenced as `<video:1>`, or
    the state object's `video` (which the SDK carries); None without a video. The native
    contract checks the URL itself."""
    if media is None:
        if not (isinstance(state, dict) and "video" in state):
            return None
        check_keys(state, ("video",), "state")
        return state["video"]
    items = media if isinstance(media, list) else []
    if not any(isinstance(item, dict) and item.get("type") == "video" for item in items):
        return None
    if len(items) != 1:
        raise FormatError(
            f"media: a video is asked about alone, not with {len(items) - 1} more", "media"
        )
    check_keys(items[0], MEDIA_FIELDS, "media[0]")
    if not isinstance(state, str) or state.strip() != "<video:1>":
        raise FormatError("state: with a video in media, the string <video:1>", "state")
    return items[0].get("data")


def image_urls(state: object, media: object) -> list[str]:
    """The request's image data URLs, 1 to panels.MAX_IMAGES of them."""
    if media is not None:
        urls = media_urls(state, media)
    elif isinstance(state, dict):
        check_keys(state, ("images",), "state")
        urls = state.get("images")
        if not isinstance(urls, list) or not urls:
            raise FormatError("state.images: must be a non-empty array of data URLs", "state")
    elif isinstance(state, str):
        raise FormatError(f"state: {TEXT_REFUSED}; send state.images", "state")
    else:
        raise FormatError("state: must be an object with images", "state")
    if len(urls) > panels.MAX_IMAGES:
        raise FormatError(f"state: at most {panels.MAX_IMAGES} images, not {len(urls)}", "state")
    return urls


def media_urls(state: object, media: object) -> list[str]:
    """OneJev's form: the state a string of `<image:1>`, `<image:2>`... in order, nothing else."""
    if not isinstance(media, list) or not media:
        raise FormatError("media: must be a non-empty array of images", "media")
    urls = []
    for index, item in enumerate(media):
        where = f"media[{index}]"
        if not isinstance(item, dict) or item.get("type") != "image":
            raise FormatError(
                f"{where}: only {{type: image or video, data: <data URL>}} is supported", where
            )
        check_keys(item, MEDIA_FIELDS, where)
        urls.append(item.get("data"))
    if not isinstance(state, str):
        raise FormatError("state: with media, a string of <image:N> references", "state")
    references = [int(n) for n in PLACEHOLDER.findall(state)]
    if PLACEHOLDER.sub("", state).strip():
        raise FormatError(f"state: {TEXT_REFUSED}", "state")
    if references != list(range(1, len(urls) + 1)):
        raise FormatError("state: must reference every media item once, in order", "state")
    return urls


def native_question(name: str, value: object) -> dict:
    """One TypeSafe question as the native contract's (which then checks it as ever)."""
    where = f"questions.{name}"
    if not isinstance(value, dict):
        raise FormatError(f"{where}: a question must be an object", where)
    kind = value.get("type")
    if kind not in ("noul", "choice", "score"):
        raise FormatError(f"{where}.type: must be noul, choice or score", f"{where}.type")
    check_keys(value, QUESTION_FIELDS, where)
    instructions = value.get("instructions")
    native = {"type": kind, "instructions": "" if instructions is None else instructions}
    criteria = value.get("criteria")
    if kind == "noul":
        if criteria is not None:
            if not isinstance(criteria, dict):
                raise FormatError(f"{where}.criteria: must be an object", f"{where}.criteria")
            check_keys(criteria, NOUL_CRITERIA, f"{where}.criteria")
        return native
    if kind == "choice":
        return {**native, "criteria": choice_criteria(criteria, f"{where}.criteria")}
    return {**native, "levels": score_levels(criteria, f"{where}.criteria")}


def choice_criteria(criteria: object, where: str) -> dict:
    """A label -> description map; a list of labels stands for labels without descriptions."""
    if isinstance(criteria, list) and all(isinstance(label, str) for label in criteria):
        criteria = dict.fromkeys(criteria)
    if not isinstance(criteria, dict) or not criteria:
        raise FormatError(f"{where}: must be a non-empty object of label -> description", where)
    for label, description in criteria.items():
        if description is not None and not isinstance(description, str):
            kind = json_type(description)
            raise FormatError(f"{where}.{label}: a description must be a string, not {kind}", where)
    return criteria


def score_levels(criteria: object, where: str) -> list[str]:
    """The levels, in order: strings, or numbers written as the reference's `str(level)`."""
    if not isinstance(criteria, list) or not criteria:
        raise FormatError(f"{where}: must be a non-empty array of levels", where)
    levels = []
    for level in criteria:
        if isinstance(level, bool) or not isinstance(level, str | int | float):
            kind = json_type(level)
            raise FormatError(f"{where}: a level must be a string or a number, not {kind}", where)
        levels.append(level if isinstance(level, str) else str(level))
    return levels


def response(native: dict, legends: dict[str, list]) -> dict:
    """The native response in TypeSafe's shape, answers in the same order."""
    answers = {}
    for name, answer in native["answers"].items():
        if "noul" in answer:
            p = answer["noul"]
            answers[name] = {"type": "noul", "noul": p, "confidence": confidence([1 - p, p])}
        elif "choice" in answer:
            probabilities = option_probabilities(answer)
            answers[name] = {
                "type": "choice",
                "choice": answer["choice"],
                "probabilities": dict(zip(answer["probabilities"], probabilities, strict=True)),
                "confidence": confidence(probabilities),
            }
        else:
            probabilities = option_probabilities(answer)
            answers[name] = {
                "type": "score",
                "score": rounded(expected_level(probabilities)),
                "legend": {str(i): level for i, level in enumerate(legends[name])},
                "probabilities": {str(i): p for i, p in enumerate(probabilities)},
                "confidence": rounded(score_confidence(probabilities)),
            }
    return {"model": native["model"], "answers": answers, "usage": native["usage"]}


def confidence(probabilities: list[float]) -> float:
    return rounded(choice_confidence(probabilities))


WIRE = Wire(PATH, translate, detail_body)
