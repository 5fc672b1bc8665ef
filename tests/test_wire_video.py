"""A clip over HTTP on a real worker (tiny model, uvicorn): answered on the native route (a file
and the reference's mosaic of its frames), on the TypeSafe route (the `system-one` SDK's state,
OneJev's `media` over plain HTTP: the SDK has no `media`), refused on the OpenAI route in its
error shape, refused with the limit and the value where a limit is passed, and listed by
`/v1/models` and the OpenAPI document."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from system_one import SystemOne
from system_one.schemas import ChoiceAnswer, NoulAnswer, ScoreAnswer
from system_one.settings import HTTPConfig

from bench.clips import clip, video_url
from runtime.video import video_file, video_frames
from tests import wire_helpers
from tests.video_clips import mosaic_state
from tests.wire_helpers import CHOICES, IMAGE, LEVELS, MODEL

NATIVE = "/v1/systemone"
TYPESAFE = "/typesafe/v1/systemone"
DATA, MIME = clip(12, 64, 48, "h264", 4, seed=7)
CLIP = video_url(DATA, MIME)


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from wire_helpers.served_tiny(tmp_path_factory)


def native(url: str, state: dict) -> httpx.Response:
    body = {"model": MODEL, "state": state, "questions": wire_helpers.native_questions()}
    return httpx.post(url + NATIVE, json=body, timeout=60)


def answers(response: httpx.Response) -> dict:
    """The answers without their latency fields."""
    assert response.status_code == 200, response.text
    return {
        key: {k: v for k, v in answer.items() if not k.startswith("latency")}
        for key, answer in response.json()["answers"].items()
    }


def typesafe_questions() -> dict:
    return {
        "present": {"type": "noul", "instructions": wire_helpers.INSTRUCTIONS["noul"]},
        "next": {
            "type": "choice",
            "instructions": wire_helpers.INSTRUCTIONS["choice"],
            "criteria": CHOICES,
        },
        "severity": {
            "type": "score",
            "instructions": wire_helpers.INSTRUCTIONS["score"],
            "criteria": LEVELS,
        },
    }


def test_the_native_route_answers_a_file_and_its_mosaic_alike(url: str) -> None:
    as_file = answers(native(url, {"video": CLIP}))
    decoded = video_frames(video_file(CLIP))
    assert len(decoded.frames) == 12 and decoded.duration == 3.0
    state = mosaic_state(list(decoded.frames), decoded.timestamps, decoded.duration, cols=5)
    assert answers(native(url, state)) == as_file
    # the frames are read: the still of the first frame, or another clip, answers otherwise
    other = video_url(*clip(12, 64, 48, "vp9", 4, seed=8))
    assert answers(native(url, {"video": other})) != as_file
    assert answers(native(url, {"images": [IMAGE]})) != as_file


def test_the_typesafe_route_answers_a_clip(url: str) -> None:
    """The SDK carries a state object (`{"video": ...}`); OneJev's `media` form goes over plain
    HTTP. Both give the native route's numbers."""
    expected = answers(native(url, {"video": CLIP}))
    sdk = SystemOne(HTTPConfig(base_url=url + "/typesafe", model=MODEL, max_retries=0))
    output = sdk.ask({"video": CLIP}, typesafe_questions())
    present, choice, score = (output.answers[k] for k in ("present", "next", "severity"))
    assert isinstance(present, NoulAnswer) and present.noul == expected["present"]["noul"]
    assert isinstance(choice, ChoiceAnswer) and choice.choice == expected["next"]["choice"]
    assert isinstance(score, ScoreAnswer)
    assert list(score.probabilities.values()) == list(
        expected["severity"]["probabilities"].values()
    )
    media = {
        "model": MODEL,
        "state": "<video:1>",
        "media": [{"type": "video", "data": CLIP}],
        "questions": typesafe_questions(),
    }
    response = httpx.post(url + TYPESAFE, json=media, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["answers"]["present"]["noul"] == expected["present"]["noul"]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"state": "<video:1>", "media": [{"type": "video", "data": CLIP}] * 2},
            "media: a video is asked about alone, not with 1 more",
        ),
        (
            {"state": "<image:1>", "media": [{"type": "video", "data": CLIP}]},
            "state: with a video in media, the string <video:1>",
        ),
        (
            {"state": "<video:1>", "media": [{"type": "video", "data": "data:video/avi;base64,"}]},
            "only inline MP4/WebM videos are supported",
        ),
    ],
)
def test_the_typesafe_route_refuses_a_clip_it_cannot_take(url: str, body, message) -> None:
    response = httpx.post(url + TYPESAFE, json={"questions": typesafe_questions(), **body})
    assert response.status_code == 422 and message in response.json()["detail"], response.text


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "input_video", "video_url": CLIP}, "input[0].content[0]"),
        ({"type": "input_image", "image_url": CLIP}, "input[0].content[0].image_url"),
        ({"type": "input_file", "file_data": CLIP}, "input[0].content[0].file_data"),
    ],
)
def test_the_openai_route_refuses_a_clip_naming_the_field(url: str, part, param) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    questions = [{"type": "predicate", "instructions": "Did the person fall?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.decisions.create(
            model=MODEL, input=[{"role": "user", "content": [part]}], questions=questions
        )
    error = refused.value
    assert error.status_code == 400 and error.param == param
    assert "video is not supported" in error.message and "/v1/systemone" in error.message


def mosaic(**changes: object) -> dict:
    decoded = video_frames(video_file(CLIP))
    state = mosaic_state(list(decoded.frames[:4]), decoded.timestamps[:4], 1.0, cols=2)
    return {**state, "video": {**state["video"], **changes}}


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (mosaic(n_frames=40), "video must be at most 16 frames, got 40"),
        (mosaic(n_frames=0), "video must have at least 1 frame, got 0"),
        (mosaic(duration=1000), "video duration must be 0 to 300 seconds, got 1000"),
        (mosaic(timestamps=[0, 1]), "state.video.timestamps must be 4 numbers, got 2"),
        (mosaic(tile=[64, 480]), "video mosaic is 128x96, too small for 2 rows of 2 64x480 tiles"),
        (mosaic(cols=17), "state.video.cols must be 1 to 16, got 17"),
        (mosaic(fps=5), "state.video supports n_frames, cols, tile, timestamps and duration"),
        ({"video": CLIP, "images": [IMAGE]}, "state.video as a file takes no state.images"),
        ({"video": "data:video/mp4;base64,AAAA"}, "video format does not match its MIME type"),
        ({"video": 5}, "state.video must be a video data URL or a mosaic description"),
    ],
)
def test_the_native_route_refuses_naming_the_limit(url: str, state: dict, message: str) -> None:
    response = native(url, state)
    assert response.status_code == 422 and response.json()["detail"] == message


def test_models_and_openapi_say_what_is_accepted(url: str) -> None:
    card = httpx.get(url + "/v1/models").json()["data"][0]
    video = card["inputs"]["video"]
    assert video["types"] == {"video/mp4": ["h264"], "video/webm": ["vp8", "vp9"]}
    assert video["max_frames"] == 16 and video["routes"] == [NATIVE, "/typesafe/v1/systemone"]
    assert card["inputs"]["image"] == ["image/png", "image/jpeg"]
    schemas = httpx.get(url + "/openapi.json").json()["components"]["schemas"]
    assert {"VideoFileState", "VideoMosaicState", "TypeSafeVideo"} <= set(schemas)
    assert schemas["VideoMosaic"]["properties"]["n_frames"]["maximum"] == 16
