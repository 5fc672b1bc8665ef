"""The OpenAPI document's models of the three decision routes and `GET /v1/models`: requests as
strict as the contracts where JSON Schema can say it, every status each route answers.

Documentation only: bodies are parsed by runtime.strict_json, translated by server.formats and
checked by runtime.contract. A body can pass its schema and still be refused (an image that does
not decode, repeated option keys, a prompt over the token limits): 422, or 400 on /v1/decisions.
"""

from __future__ import annotations

import base64
import io
from typing import Annotated, Any, Literal

from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from runtime.contract import (
    MAX_COORDINATE,
    MAX_ID_CHARS,
    MAX_OPTION_OBJECTS,
    MAX_OPTIONS,
    MAX_QUESTIONS,
    MAX_TEXT_CHARS,
    MODELS,
)
from runtime.panels import MAX_IMAGES
from runtime.video import MAX_DURATION, MAX_FRAMES
from server.formats import NATIVE_PATH, decisions, typesafe

# docs/contract.md §2.3: strict base64 of at least one quantum with canonical padding
BASE64 = r"([A-Za-z0-9+/]{4})*([A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)"
IMAGE_URL = rf"^data:image/(png|jpeg);base64,{BASE64}$"
MediaReferences = Annotated[str, Field(pattern=r"^((\s*<image:[0-9]+>)*|\s*<video:1>)\s*$")]
VIDEO_URL = rf"^data:video/(mp4|webm);base64,{BASE64}$"
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
ImageURL = Annotated[str, Field(pattern=IMAGE_URL, description="data:image/png or jpeg, base64")]
VideoURL = Annotated[
    str,
    Field(
        pattern=VIDEO_URL,
        description=f"data:video/mp4 (H.264) or webm (VP8, VP9), base64; at most "
        f"{MAX_DURATION} s, {MAX_FRAMES} frames sampled uniformly",
    ),
]


def example_image() -> str:
    """A 32×32 grey PNG as a data URL: the documents' examples answer 200."""
    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), (128, 128, 128)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


EXAMPLE_IMAGE = example_image()


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def strict_with_example(**example: Any) -> ConfigDict:
    """A strict model's settings with one request example (the model's own, then `example`)."""
    body = {"model": MODELS[0], **example}
    return ConfigDict(extra="forbid", json_schema_extra={"examples": [body]})


NOUL_EXAMPLE = {"type": "noul", "instructions": "A person is visible."}


# -- native: POST /v1/systemone (docs/contract.md §2-3)
# ---------------------------------------------

# a falsy region counts as absent (docs/contract.md §2.5)
ABSENT_REGION = [{"enum": [None, False, 0, "", []]}, {"type": "object", "maxProperties": 0}]


class Region(Strict):
    box: list[Annotated[float, Field(ge=-MAX_COORDINATE, le=MAX_COORDINATE)]] = Field(
        min_length=4, max_length=4, description="[x1, y1, x2, y2] in pixels"
    )


class NoulQuestion(Strict):
    type: Literal["noul"]
    instructions: Text
    region: Any = Field(
        None, json_schema_extra={"anyOf": [Region.model_json_schema(), *ABSENT_REGION]}
    )


class ChoiceOption(Strict):
    key: Text = None
    text: Text = None
    region: Region = None
    abstain: bool = Field(None, description="abstain entries are skipped")


ONE_OF = {"oneOf": [{"required": ["options"]}, {"required": ["criteria"]}]}


class ChoiceQuestion(Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=ONE_OF)
    type: Literal["choice"]
    instructions: Text
    options: list[ChoiceOption] = Field(
        None, max_length=MAX_OPTION_OBJECTS, description="reference form"
    )
    criteria: dict[str, str | None] = Field(
        None, min_length=1, max_length=MAX_OPTIONS, description="key -> rubric or null"
    )


class ScoreQuestion(Strict):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"oneOf": [{"required": ["levels"]}, {"required": ["criteria"]}]},
    )
    type: Literal["score"]
    instructions: Text
    levels: list[Text] = Field(None, min_length=1, max_length=MAX_OPTIONS)
    criteria: dict[Text, Any] = Field(
        None, min_length=1, max_length=MAX_OPTIONS, description="keyed by level"
    )


class ImageState(Strict):
    images: list[ImageURL] = Field(min_length=1, max_length=1, description="exactly one image")


class VideoFileState(Strict):
    video: VideoURL


class VideoMosaic(Strict):
    """The reference's form: `images[0]` holds `n_frames` tiles, `cols` a row, row-major."""

    n_frames: int = Field(ge=1, le=MAX_FRAMES)
    cols: int = Field(ge=1, le=MAX_FRAMES)
    tile: int | list[int] = Field(description="a square's side, or [width, height]")
    timestamps: list[Annotated[float, Field(ge=0, le=MAX_DURATION)]] = Field(
        max_length=MAX_FRAMES, description="seconds, one a frame"
    )
    duration: float = Field(ge=0, le=MAX_DURATION, description="seconds")


class VideoMosaicState(Strict):
    images: list[ImageURL] = Field(min_length=1, max_length=1, description="the frame mosaic")
    video: VideoMosaic


Question = Annotated[NoulQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]
QuestionIds = {"propertyNames": {"maxLength": MAX_ID_CHARS}}


class DecisionRequest(Strict):
    """Strict JSON: unknown fields, duplicate keys, NaN and deep nesting are refused."""

    model_config = strict_with_example(
        state={"images": [EXAMPLE_IMAGE]},
        questions={
            "visible": NOUL_EXAMPLE,
            "risk": {
                "type": "score",
                "instructions": "How risky is acting on this screen?",
                "levels": ["safe", "check first", "dangerous"],
            },
        },
    )
    model: Any = Field(None, json_schema_extra={"enum": [*MODELS, None]})
    state: ImageState | VideoFileState | VideoMosaicState
    questions: dict[str, Question] = Field(
        min_length=1,
        max_length=MAX_QUESTIONS,
        description="answered in this order",
        json_schema_extra=QuestionIds,
    )


class NoulAnswer(BaseModel):
    noul: float
    latency_s: float
    latency_total_s: float


class ChoiceAnswer(BaseModel):
    choice: str
    probabilities: dict[str, float]
    abstain: float
    valid: bool
    confidence: float
    latency_s: float
    latency_total_s: float


class ScoreAnswer(BaseModel):
    score: str
    probabilities: dict[str, float]
    confidence: float
    latency_s: float
    latency_total_s: float


class Usage(BaseModel):
    input_tokens: int
    output_tokens: int = 0


class DecisionResponse(BaseModel):
    model: str = MODELS[0]
    answers: dict[str, NoulAnswer | ChoiceAnswer | ScoreAnswer]
    usage: Usage


class ErrorBody(BaseModel):
    detail: str


class HealthBody(BaseModel):
    status: str
    model: str | None = None


# -- TypeSafe: POST /typesafe/v1/systemone (system_one.schemas 0.4.0) ---------------------------


class TypeSafeNoulCriteria(Strict):
    true: Any = None
    false: Any = None


class TypeSafeNoul(Strict):
    type: Literal["noul"]
    instructions: Text | None = None
    criteria: TypeSafeNoulCriteria | None = Field(None, description="not read by the model")


class TypeSafeChoice(Strict):
    type: Literal["choice"]
    instructions: Text | None = None
    criteria: (
        Annotated[dict[str, str | None], Field(min_length=1, max_length=MAX_OPTIONS)]
        | Annotated[list[str], Field(min_length=1)]
    ) = Field(description="label -> description, or labels")


class TypeSafeScore(Strict):
    type: Literal["score"]
    instructions: Text | None = None
    criteria: list[Text | float] = Field(
        min_length=1, max_length=MAX_OPTIONS, description="the levels, lowest first"
    )


class TypeSafeImage(Strict):
    type: Literal["image"]
    data: ImageURL


class TypeSafeVideo(Strict):
    """A clip, referenced alone from the state as `<video:1>`."""

    type: Literal["video"]
    data: VideoURL


TypeSafeMedia = Annotated[TypeSafeImage | TypeSafeVideo, Field(discriminator="type")]


class TypeSafeState(Strict):
    images: list[ImageURL] = Field(min_length=1, max_length=MAX_IMAGES)


TypeSafeQuestion = Annotated[
    TypeSafeNoul | TypeSafeChoice | TypeSafeScore, Field(discriminator="type")
]


class TypeSafeRequest(Strict):
    """The `system-one` SDK's SystemOneInput; `media` is OneJev's (state: `<image:1>`...)."""

    model_config = strict_with_example(
        state={"images": [EXAMPLE_IMAGE]},
        questions={
            "visible": NOUL_EXAMPLE,
            "severity": {
                "type": "score",
                "instructions": "How severe is the issue?",
                "criteria": ["minor", "normal", "major", "critical"],
            },
        },
    )
    model: Any = Field(None, json_schema_extra={"enum": [*MODELS, None]})
    state: TypeSafeState | VideoFileState | MediaReferences
    media: list[TypeSafeMedia] | None = Field(None, min_length=1, max_length=MAX_IMAGES)
    questions: dict[str, TypeSafeQuestion] = Field(
        min_length=1, max_length=MAX_QUESTIONS, json_schema_extra=QuestionIds
    )


class TypeSafeNoulAnswer(BaseModel):
    type: Literal["noul"]
    noul: float = Field(description="P(true)")
    confidence: float


class TypeSafeChoiceAnswer(BaseModel):
    type: Literal["choice"]
    choice: str
    probabilities: dict[str, float] = Field(description="renormalised without abstain")
    confidence: float


class TypeSafeScoreAnswer(BaseModel):
    type: Literal["score"]
    score: float = Field(description="the expected level index Σ i·p_i")
    legend: dict[str, Any]
    probabilities: dict[str, float]
    confidence: float


class TypeSafeResponse(BaseModel):
    model: str
    answers: dict[str, TypeSafeNoulAnswer | TypeSafeChoiceAnswer | TypeSafeScoreAnswer]
    usage: Usage


# -- OpenAI Decisions: POST /v1/decisions (openai 3.60.0 types/decision*.py) --------------------


class InputImage(Strict):
    type: Literal["input_image"]
    image_url: ImageURL
    detail: Any = Field(None, description="not used: the image is read at the model's budget")
    prompt_cache_breakpoint: Any = Field(None, description="not used")


class UserMessage(Strict):
    type: Literal["message"] = "message"
    role: Literal["user"]
    content: list[InputImage] = Field(min_length=1, max_length=MAX_IMAGES)


class DecisionPredicate(Strict):
    type: Literal["predicate"]
    instructions: Text
    name: str | None = None


class ChoiceValue(Strict):
    value: str | bool
    description: str | None = None


class DecisionChoice(Strict):
    type: Literal["choice"]
    instructions: Text
    choices: list[ChoiceValue] = Field(min_length=2, max_length=MAX_OPTIONS)
    name: str | None = None


class Level(Strict):
    label: Text
    description: str | None = None


class DecisionScore(Strict):
    type: Literal["score"]
    instructions: Text
    levels: list[Level] = Field(min_length=1, max_length=MAX_OPTIONS)
    name: str | None = None


DecisionQuestion = Annotated[
    DecisionPredicate | DecisionChoice | DecisionScore, Field(discriminator="type")
]


class OpenAIDecisionRequest(Strict):
    """`client.decisions.create(model=..., input=[user messages], questions=[...])`."""

    model_config = strict_with_example(
        input=[{"role": "user", "content": [{"type": "input_image", "image_url": EXAMPLE_IMAGE}]}],
        questions=[
            {**NOUL_EXAMPLE, "type": "predicate", "name": "visible"},
            {
                "type": "choice",
                "instructions": "What comes next?",
                "choices": [{"value": "click"}, {"value": "wait"}],
            },
        ],
    )
    model: Any = Field(json_schema_extra={"enum": list(MODELS)})
    input: list[UserMessage] = Field(min_length=1, max_length=MAX_IMAGES)
    questions: list[DecisionQuestion] = Field(min_length=1, max_length=MAX_QUESTIONS)
    prompt_cache_key: Any = Field(None, description="accepted, not used")
    prompt_cache_options: Any = Field(None, description="accepted, not used")
    safety_identifier: Any = Field(None, description="accepted, not used")


class PredicateAnswer(BaseModel):
    type: Literal["predicate"]
    name: str | None
    probability: float


class ChoiceProbability(BaseModel):
    value: str | bool
    probability: float


class ChoiceDecision(BaseModel):
    type: Literal["choice"]
    name: str | None
    choice: str | bool
    confidence: float
    probabilities: list[ChoiceProbability] = Field(description="renormalised without abstain")


class ScoreProbability(BaseModel):
    value: int
    label: str
    probability: float


class ScoreDecision(BaseModel):
    type: Literal["score"]
    name: str | None
    score: float
    confidence: float
    probabilities: list[ScoreProbability]


class DecisionUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class OpenAIDecision(BaseModel):
    model: str
    answers: list[PredicateAnswer | ChoiceDecision | ScoreDecision]
    usage: DecisionUsage


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    error: OpenAIErrorDetail


class VideoInput(BaseModel):
    types: dict[str, list[str]] = Field(description="MIME type -> codecs")
    max_frames: int = Field(description="frames sampled uniformly from a file")
    max_seconds: int
    routes: list[str]


class ModelInputs(BaseModel):
    image: list[str] = Field(description="MIME types")
    video: VideoInput


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    inputs: ModelInputs = Field(description="what the decision routes take (this runtime's)")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


# -- the routes ---------------------------------------------------------------------------------

REQUESTS = {
    NATIVE_PATH: DecisionRequest,
    typesafe.PATH: TypeSafeRequest,
    decisions.PATH: OpenAIDecisionRequest,
}
ANSWERS = {NATIVE_PATH: DecisionResponse, typesafe.PATH: TypeSafeResponse}
ANSWERS[decisions.PATH] = OpenAIDecision
STATUSES = {  # what every decision route answers besides 200, and why
    400: "not strict JSON, not an object, or a Host not allowed",
    408: "the body did not arrive within the body-read deadline",
    413: "body over 12 MiB",
    415: "content type not application/json",
    422: "contract or preparation refusal",
    500: "inference failed",
    503: "busy, warming up or shutting down; retry after Retry-After",
}
DECISIONS_STATUSES = {
    **STATUSES,
    400: "invalid request: not strict JSON, a field the format or the contract refuses",
    404: "the model is not served here",
}
del DECISIONS_STATUSES[422]
ROUTE_DOCS = {
    NATIVE_PATH: "Answer the questions about the image "
    "(the native contract, docs/contract.md §2-3).",
    typesafe.PATH: "The TypeSafe System One format: the `system-one` SDK with base_url "
    "`http://host:port/typesafe`. Several images are tiled into one numbered panel.",
    decisions.PATH: "OpenAI's Decisions API: `client.decisions.create` with `input_image` parts. "
    "Choice probabilities are renormalised without the abstain share.",
}
ROUTE_SUMMARIES = {
    NATIVE_PATH: "Decide (native)",
    typesafe.PATH: "Decide (TypeSafe System One)",
    decisions.PATH: "Decide (OpenAI Decisions)",
}


def route_responses(path: str) -> dict[int | str, dict[str, Any]]:
    """Every status the decision route at `path` answers, with its body's model."""
    if path == decisions.PATH:
        errors = {status: (OpenAIError, why) for status, why in DECISIONS_STATUSES.items()}
    else:
        errors = {status: (ErrorBody, why) for status, why in STATUSES.items()}
    responses: dict[int | str, dict[str, Any]] = {
        200: {"model": ANSWERS[path], "description": "answers in question order"}
    }
    for status, (model, why) in errors.items():
        responses[status] = {"model": model, "description": why}
    return responses


def request_body(path: str) -> dict[str, Any]:
    name = REQUESTS[path].__name__
    schema = {"$ref": f"#/components/schemas/{name}"}
    return {"required": True, "content": {"application/json": {"schema": schema}}}


def request_schemas() -> dict[str, Any]:
    """The request models' JSON Schemas (and the models they use) for components.schemas."""
    schemas: dict[str, Any] = {}
    for model in REQUESTS.values():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas
