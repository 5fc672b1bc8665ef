"""OpenAI's Decisions API on /v1/decisions, driven by the real `openai` client against a real
worker (tiny model, uvicorn, HTTP): the native route's numbers in the client's own types, and
the format's refusals in OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from openai.types.decision import (
    AnswerAnswerResourceChoice,
    AnswerAnswerResourcePredicate,
    AnswerAnswerResourceScore,
)
from system_one.utils import choice_confidence, score_confidence

from reference.questions import data_url, pattern_png
from tests import wire_helpers
from tests.wire_helpers import CHOICES, IMAGE, INSTRUCTIONS, LEVELS, MODEL

PATH = "/v1/decisions"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from wire_helpers.served_tiny(tmp_path_factory)


def client(url: str) -> openai.OpenAI:
    """The client as a user sets it up: only the base URL names this worker."""
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)


def user(*images: str) -> list[dict]:
    parts = [{"type": "input_image", "image_url": image} for image in images]
    return [{"type": "message", "role": "user", "content": parts}]


def questions() -> list[dict]:
    choices = [
        {"value": value, **({"description": text} if text else {})}
        for value, text in CHOICES.items()
    ]
    return [
        {"type": "predicate", "name": "present", "instructions": INSTRUCTIONS["noul"]},
        {
            "type": "choice",
            "name": "next",
            "instructions": INSTRUCTIONS["choice"],
            "choices": choices,
        },
        {
            "type": "score",
            "instructions": INSTRUCTIONS["score"],
            "levels": [{"label": level} for level in LEVELS],
        },
    ]


def assert_native_numbers(decision, native: dict) -> None:
    predicate, choice, score = decision.answers
    assert isinstance(predicate, AnswerAnswerResourcePredicate) and predicate.name == "present"
    assert predicate.probability == native["present"]["noul"]
    assert isinstance(choice, AnswerAnswerResourceChoice) and choice.name == "next"
    expected = wire_helpers.renormalised(native["next"]["probabilities"])
    assert [(p.value, p.probability) for p in choice.probabilities] == list(
        zip(CHOICES, expected, strict=True)
    )
    assert choice.choice == native["next"]["choice"]
    assert choice.confidence == round(choice_confidence(expected), 4)
    levels = list(native["severity"]["probabilities"].values())
    assert isinstance(score, AnswerAnswerResourceScore) and score.name is None
    assert [(p.value, p.label, p.probability) for p in score.probabilities] == list(
        zip(range(len(LEVELS)), LEVELS, levels, strict=True)
    )
    assert score.score == wire_helpers.expected_level(levels)
    assert score.confidence == round(score_confidence(levels), 4)


def test_the_client_gets_the_native_numbers(url: str) -> None:
    decision = client(url).decisions.create(model=MODEL, input=user(IMAGE), questions=questions())
    assert decision.model == MODEL
    assert decision.usage.total_tokens == decision.usage.input_tokens > 0
    assert_native_numbers(decision, wire_helpers.native_answers(url, [IMAGE]))


def test_several_input_images_are_one_numbered_panel(url: str) -> None:
    images = [IMAGE, data_url(pattern_png(40, 80)), IMAGE]
    native = wire_helpers.native_answers(url, images)
    messages = user(*images[:2]) + user(images[2])  # parts of several user messages, in order
    decision = client(url).decisions.create(model=MODEL, input=messages, questions=questions())
    assert_native_numbers(decision, native)


def test_boolean_choices_keep_their_type(url: str) -> None:
    question = {
        "type": "choice",
        "instructions": "Is a dialog open?",
        "choices": [{"value": True}, {"value": False}, {"value": "unsure"}],
    }
    decision = client(url).decisions.create(model=MODEL, input=user(IMAGE), questions=[question])
    values = [p.value for p in decision.answers[0].probabilities]
    assert values == [True, False, "unsure"] and decision.answers[0].choice in values


def refused(url: str, **changes: object) -> dict:
    body = {"model": MODEL, "input": user(IMAGE), "questions": questions(), **changes}
    response = httpx.post(url + PATH, json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    return {"status": response.status_code, **response.json()["error"]}


def choice_of(count: int) -> list[dict]:
    values = [{"value": f"option {i}"} for i in range(count)]
    return [{"type": "choice", "instructions": "Which?", "choices": values}]


@pytest.mark.parametrize(
    ("changes", "param", "message"),
    [
        ({"questions": choice_of(256)}, "questions[0].choices", "2 to 255 choices, not 256"),
        ({"questions": choice_of(1)}, "questions[0].choices", "2 to 255 choices, not 1"),
        ({"input": "Is the user logged in?"}, "input", "text is not supported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]},
            "input[0].content[0]",
            "'input_text' part is not supported",
        ),
        (
            {"input": user("https://example.com/a.png")},
            "input[0].content[0].image_url",
            "only data URLs are supported",
        ),
        (
            {"input": [{"role": "system", "content": "be strict"}, *user(IMAGE)]},
            "input[0]",
            "'system' input is not supported",
        ),
        (
            {"questions": [{"type": "predicate", "instructions": 7}]},
            "questions[0].instructions",
            "must be a string, not number",
        ),
        ({"questions": [{"type": "multi", "instructions": "x"}]}, "questions[0].type", "predicate"),
        ({"questions": []}, "questions", "1 to 64 questions, not 0"),
        ({"temperature": 0}, "temperature", "unknown field"),
        (
            {"questions": [{"type": "predicate", "instructions": "<|opt|>"}]},
            "questions[0]",
            "text must not contain <|opt|>",
        ),
        ({"input": user("data:image/png;base64,AAAA")}, None, "image format does not match"),
    ],
)
def test_refusals_are_openai_errors_naming_the_field(
    url: str, changes: dict, param: str | None, message: str
) -> None:
    error = refused(url, **changes)
    assert error["status"] == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and message in error["message"], error


def test_the_client_raises_the_api_errors(url: str) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client(url).decisions.create(model="gpt-6-luna", input=user(IMAGE), questions=questions())
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client(url).decisions.create(model=MODEL, input=user(IMAGE), questions=choice_of(256))
    assert bad.value.status_code == 400 and "255 choices" in bad.value.message
    unsupported = httpx.post(url + PATH, content=b"{}", headers={"content-type": "text/plain"})
    assert unsupported.status_code == 415 and unsupported.json()["error"]["message"]


def test_models_lists_the_served_model(url: str) -> None:
    models = client(url).models.list()
    assert [model.id for model in models.data] == [MODEL]
