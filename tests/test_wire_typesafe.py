"""The TypeSafe System One format on /typesafe/v1/systemone, driven by the real `system-one` SDK
against a real worker (tiny model, uvicorn, HTTP): the native route's numbers in the SDK's own
models, several images tiled as docs/model.md §8.2 says, and the format's refusals."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from system_one import SystemOne
from system_one.errors import APIError
from system_one.schemas import ChoiceAnswer, NoulAnswer, ScoreAnswer
from system_one.settings import HTTPConfig
from system_one.utils import choice_confidence, score_confidence

from reference.questions import data_url, pattern_png
from tests import wire_helpers
from tests.wire_helpers import CHOICES, IMAGE, INSTRUCTIONS, LEVELS, MODEL

PATH = "/typesafe/v1/systemone"


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from wire_helpers.served_tiny(tmp_path_factory)


def sdk(url: str) -> SystemOne:
    """The SDK as a user sets it up: only the base URL names this worker."""
    return SystemOne(HTTPConfig(base_url=url + "/typesafe", model=MODEL, max_retries=0))


def questions() -> dict:
    """The native questions as an SDK user writes them (a Choice as labels and descriptions)."""
    return {
        "present": {"type": "noul", "instructions": INSTRUCTIONS["noul"]},
        "next": {"type": "choice", "instructions": INSTRUCTIONS["choice"], "criteria": CHOICES},
        "severity": {"type": "score", "instructions": INSTRUCTIONS["score"], "criteria": LEVELS},
    }


def assert_native_numbers(output, native: dict) -> None:
    """The SDK's answers carry the native route's numbers, as the README documents them."""
    present, choice, score = (output.answers[key] for key in ("present", "next", "severity"))
    assert isinstance(present, NoulAnswer) and present.noul == native["present"]["noul"]
    assert present.confidence == round(choice_confidence([1 - present.noul, present.noul]), 4)
    assert isinstance(choice, ChoiceAnswer) and choice.choice == native["next"]["choice"]
    expected = wire_helpers.renormalised(native["next"]["probabilities"])
    assert list(choice.probabilities) == list(CHOICES)
    assert list(choice.probabilities.values()) == expected
    assert choice.confidence == round(choice_confidence(expected), 4)
    levels = list(native["severity"]["probabilities"].values())
    assert isinstance(score, ScoreAnswer)
    assert score.probabilities == dict(enumerate(levels))
    assert score.legend == dict(enumerate(LEVELS))
    assert score.score == wire_helpers.expected_level(levels)
    assert score.confidence == round(score_confidence(levels), 4)


def test_the_sdk_gets_the_native_numbers(url: str) -> None:
    output = sdk(url).ask({"images": [IMAGE]}, questions())
    assert list(output.answers) == ["present", "next", "severity"]
    assert output.model == MODEL and output.usage.output_tokens == 0
    assert_native_numbers(output, wire_helpers.native_answers(url, [IMAGE]))


def test_several_images_are_one_numbered_panel(url: str) -> None:
    """Two images (the SDK's state, OneJev's media) are answered as the panel of docs/model.md
    §8.2."""
    images = [IMAGE, data_url(pattern_png(40, 80))]
    native = wire_helpers.native_answers(url, images)
    assert_native_numbers(sdk(url).ask({"images": images}, questions()), native)
    media = {
        "model": MODEL,
        "state": "<image:1> <image:2>",
        "media": [{"type": "image", "data": image} for image in images],
        "questions": questions(),
    }
    response = httpx.post(url + PATH, json=media, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["answers"]["present"]["noul"] == native["present"]["noul"]


def test_panels_follow_the_fixture() -> None:
    """tests/fixtures/wire/panels.json (`python -m tests.wire_helpers`), and the rule's
    geometry read from the pixels: background border, numbered strip, thumbnail below it."""
    fixture = json.loads(wire_helpers.FIXTURE.read_text("utf-8"))
    for case in fixture.values():
        sizes = [tuple(size) for size in case["sizes"]]
        assert wire_helpers.panel_record(sizes) == {**case, "sizes": sizes}
    from runtime import panels

    thumbs = [panels.thumbnail(data_url(pattern_png(w, h))) for w, h in [(64, 48), (900, 300)]]
    picture = panels.tile(thumbs)
    assert thumbs[1].size == (448, 149) and picture.size == (
        6 + 448 + 6 + 448 + 6,
        6 + 22 + 149 + 6,
    )
    assert picture.getpixel((0, 0)) == panels.BACKGROUND
    assert picture.getpixel((6, 6 + 22)) == thumbs[0].getpixel((0, 0))
    assert picture.getpixel((6 + 448 + 6, 6 + 22)) == thumbs[1].getpixel((0, 0))
    strip = [picture.getpixel((x, y)) for x in range(6, 26) for y in range(6, 28)]
    assert (255, 255, 255) in strip or any(min(pixel) > 200 for pixel in strip)


def refusal(url: str, body: dict) -> httpx.Response:
    return httpx.post(url + PATH, json=body, timeout=60)


def body(**changes: object) -> dict:
    return {"model": MODEL, "state": {"images": [IMAGE]}, "questions": questions(), **changes}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"questions": {"c": {"type": "choice", "criteria": [f"o{i}" for i in range(256)]}}},
            "question c: a question needs 1 to 255 options",
        ),
        ({"state": "a screenshot of a login form"}, "text in the state is not supported"),
        ({"state": {"images": [IMAGE], "text": "hello"}}, "state.text: unknown field"),
        ({"state": {"images": [IMAGE] * 9}}, "state: at most 8 images, not 9"),
        (
            {"state": "<image:1>", "media": [{"type": "video", "frames": [IMAGE]}]},
            "media[0].frames: unknown field (allowed: type, data)",
        ),
        (
            {"questions": {"s": {"type": "score", "criteria": [{"a": 1}]}}},
            "questions.s.criteria: a level must be a string or a number, not object",
        ),
        (
            {"questions": {"c": {"type": "choice", "criteria": {"a": {"x": 1}}}}},
            "questions.c.criteria.a: a description must be a string, not object",
        ),
        (
            {"questions": {"n": {"type": "noul", "instructions": 3}}},
            "instructions must be a string",
        ),
        ({"questions": {}}, "questions: must be a non-empty object of questions"),
        ({"model": "jev-latest"}, "model: 'jev-latest' is not served here"),
        ({"state": {"images": [IMAGE, "data:image/png;base64,AAAA"]}}, "image 2: "),
    ],
)
def test_refusals_name_the_field(url: str, changes: dict, message: str) -> None:
    response = refusal(url, body(**changes))
    assert response.status_code == 422 and message in response.json()["detail"], response.text


def test_the_sdk_reports_a_refusal(url: str) -> None:
    with pytest.raises(APIError) as raised:
        sdk(url).ask("a screenshot", questions())
    assert raised.value.status == 422 and "text in the state" in raised.value.body


def test_noul_criteria_are_accepted_and_not_read(url: str) -> None:
    """As in the reference, a Noul's true/false descriptions do not enter the prompt."""
    plain = sdk(url).ask({"images": [IMAGE]}, {"n": {"type": "noul", "instructions": "Dark."}})
    described = {"type": "noul", "instructions": "Dark.", "criteria": {"true": "it is night"}}
    criteria = sdk(url).ask({"images": [IMAGE]}, {"n": described})
    assert criteria.answers["n"].noul == plain.answers["n"].noul
