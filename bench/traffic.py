"""The traffic suite: a seeded stream of requests unlike any one bench request. Screenshot-like
images of ten sizes (phones to 4K, a wide 3:1) as PNG and JPEG, each drawn anew so that no prefix
cache can hit, and 1 to 16 questions drawn from a pool of 62 templates of the three types:
Choices of 2 to 255 options whose texts share no lead, Scores of 2 to 10 levels, regions."""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from bench.workloads import body, encode
from reference.questions import MODEL_ID

# (width, height): phone portraits, desktop and laptop screens, 1440p, 4K, a wide 3:1 and a
# tablet portrait; every block of len(SIZES) requests holds each once, in a seeded order
SIZES = (
    (1170, 2532),
    (390, 844),
    (800, 600),
    (1366, 768),
    (1920, 1080),
    (2560, 1440),
    (3840, 2160),
    (3000, 1000),
    (1280, 800),
    (1024, 1366),
)
FORMATS = ("PNG", "JPEG")
MIMES = {"PNG": "image/png", "JPEG": "image/jpeg"}
MAX_QUESTIONS = 16
STREAMS = {"suite": 0, "held-out": 1, "warm-up": 2}  # independent streams of one seed
SCREENSHOT_DRAWS = 11  # seeds the draws of `request(images=K)`'s screenshots, apart
# option counts of a Choice: mostly a handful, sometimes dozens, now and then up to the limit;
# at most one question of a request above LARGE_CHOICE (the contract's 1,024 rows in all)
CHOICE_SPANS = (((2, 6), 0.7), ((7, 32), 0.2), ((33, 128), 0.07), ((129, 255), 0.03))
LARGE_CHOICE = 32
SCORE_LEVELS = (2, 10)
REGION_SHARE = 0.3  # Nouls asked about a region
FORM_SHARE = 0.2  # Choices and Scores sent in the `criteria` form
MAX_TAIL_WORDS = 8  # an option text's words after its lead: rows of different lengths
CLIP_FPS = 2  # a clip's frames a second: 16 frames are 8 s, a decision about motion
# distinct clips a run cycles through: encoding is the driver's slowest step (about 1 s for 16
# frames of 1280x720), so serve with the prefix cache off to run every clip's frames
CLIP_VARIANTS = 4

NOULS = (
    "A dialog box is open.",
    "The screen shows an error message.",
    "A text field has keyboard focus.",
    "The page is still loading.",
    "A login form is visible.",
    "The window is maximised.",
    "There is a notification in the corner.",
    "The user has unsaved changes.",
    "A progress bar is visible.",
    "The current page is a search result list.",
    "A checkbox on this screen is ticked.",
    "The interface uses a dark theme.",
    "A menu is expanded.",
    "The screen asks for a payment.",
    "A video is playing.",
    "The browser shows a security warning.",
    "This is a settings page.",
    "A file is being downloaded.",
    "The task described by the title bar is complete.",
    "Two windows overlap.",
    "A chat conversation is shown.",
    "The cursor hovers over a button.",
    "A table of numbers fills most of the screen.",
    "The screen contains a map.",
)
# (instructions, option leads): leads start with distinct words; more options take invented words
CHOICES = (
    ("Which control should be clicked next?", ("submit", "cancel", "back", "help", "close")),
    ("What kind of application is in front?", ("browser", "editor", "terminal", "mail", "chat")),
    ("Which menu holds the next step?", ("file", "edit", "view", "tools", "window")),
    ("What is the user most likely doing?", ("writing", "reading", "shopping", "gaming")),
    ("Which colour dominates the screen?", ("white", "black", "blue", "green", "grey")),
    ("What should the agent do now?", ("continue", "stop", "ask", "retry", "wait")),
    ("Which part of the screen changed last?", ("header", "sidebar", "footer", "centre")),
    ("Which document type is open?", ("spreadsheet", "slides", "letter", "invoice", "form")),
    ("What does the highlighted icon mean?", ("warning", "success", "information", "error")),
    ("Which tab is active?", ("overview", "details", "history", "settings", "billing")),
    ("What language is the interface in?", ("english", "german", "french", "spanish")),
    ("Which device does this layout suit?", ("phone", "tablet", "laptop", "television")),
    ("What is the primary call to action?", ("buy", "subscribe", "download", "register")),
    ("Which keyboard shortcut fits the next step?", ("copy", "paste", "undo", "save", "find")),
    ("What state is the form in?", ("empty", "partial", "complete", "invalid", "sent")),
    ("Which label names the selected item?", ("alpha", "bravo", "charlie", "delta", "echo")),
    ("Where should the pointer move?", ("up", "down", "left", "right", "nowhere")),
    ("Which file should be opened?", ("report", "notes", "budget", "photo", "archive")),
    ("What kind of chart is shown?", ("bar", "line", "pie", "scatter", "none")),
    ("Which account is signed in?", ("personal", "work", "guest", "admin", "unknown")),
    ("What is the loading state?", ("idle", "busy", "stalled", "finished")),
)
REGION_CHOICE = "Which region holds the element to act on?"  # options are boxes, not texts
SCALES = (
    ("none", "trace", "low", "mild", "moderate", "notable", "high", "severe", "extreme", "total"),
    ("empty", "sparse", "light", "some", "average", "full", "busy", "crowded", "packed", "chaos"),
    ("safe", "benign", "minor", "careful", "risky", "hazardous", "dangerous", "critical",
     "grave", "fatal"),
    ("trivial", "easy", "simple", "plain", "fair", "involved", "hard", "tough", "brutal",
     "impossible"),
)  # fmt: skip
SCORES = (
    ("How urgent is the next action?", 0),
    ("How cluttered is the screen?", 1),
    ("How risky is clicking the main button?", 2),
    ("How hard is the task on this screen?", 3),
    ("How much text is visible?", 1),
    ("How irreversible is the pending change?", 2),
    ("How confident is the layout that a step is done?", 0),
    ("How many windows compete for attention?", 1),
    ("How likely is data loss here?", 2),
    ("How complex is the form?", 3),
    ("How bright is the interface?", 0),
    ("How much of the page is advertising?", 1),
    ("How sensitive is the information shown?", 2),
    ("How long will the next step take?", 3),
    ("How visible is the error?", 0),
    ("How much scrolling is needed to finish?", 3),
)
TEMPLATES = len(NOULS) + len(CHOICES) + 1 + len(SCORES)
SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
TAILS = ("near", "the", "top", "left", "panel", "button", "again", "now", "first", "item")


@dataclass(frozen=True)
class TrafficRequest:
    """One generated request and what it is made of."""

    index: int
    size: tuple[int, int]
    format: str
    questions: int
    options: int  # answer rows in all
    body: bytes


def rng_for(seed: int, stream: str, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, STREAMS[stream], index])


def screenshot_rng(seed: int, stream: str, index: int) -> np.random.Generator:
    """The draws of screenshot `index` that several requests ask about (`request(images=K)`)."""
    return np.random.default_rng([seed, STREAMS[stream], index, SCREENSHOT_DRAWS])


def size_of(seed: int, stream: str, index: int) -> tuple[int, int]:
    """Each block of len(SIZES) requests holds every size once, in a seeded order."""
    block, place = divmod(index, len(SIZES))
    order = np.random.default_rng([seed, STREAMS[stream], block, 7]).permutation(len(SIZES))
    return SIZES[int(order[place])]


def screenshot(width: int, height: int, rng: np.random.Generator, label: str) -> Image.Image:
    """A screenshot-like image: a desktop, a task bar and windows with title bars, text lines
    and buttons, their places and colours drawn from `rng` and `label` written on each."""
    background = tuple(int(c) for c in rng.integers(30, 230, size=3))
    image = Image.new("RGB", (width, height), background)
    draw = ImageDraw.Draw(image)
    bar = max(24, height // 30)
    draw.rectangle([0, height - bar, width, height], fill=(32, 34, 40))
    for i in range(int(rng.integers(3, 9))):
        w = int(rng.integers(width // 4, width * 9 // 10))
        h = int(rng.integers(height // 5, height * 8 // 10))
        x0, y0 = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - bar - h + 1))
        fill = tuple(int(c) for c in rng.integers(200, 256, size=3))
        draw.rectangle([x0, y0, x0 + w, y0 + h], fill=fill, outline=(60, 60, 60), width=2)
        draw.rectangle(
            [x0, y0, x0 + w, y0 + 22], fill=tuple(int(c) for c in rng.integers(0, 160, 3))
        )
        draw.text((x0 + 8, y0 + 5), f"{label} window {i}", fill=(255, 255, 255))
        for line in range(min(int(rng.integers(2, 30)), (h - 60) // 16)):
            words = " ".join(invented_word(rng) for _ in range(int(rng.integers(3, 12))))
            draw.text((x0 + 12, y0 + 32 + 16 * line), words, fill=(20, 20, 20))
        for b in range(int(rng.integers(1, 4))):
            bx, by = x0 + w - 90 * (b + 1), y0 + h - 34
            if bx > x0:
                draw.rounded_rectangle([bx, by, bx + 80, by + 24], 6, fill=(40, 110, 220))
                draw.text((bx + 10, by + 6), ("OK", "Cancel", "Apply")[b], fill=(255, 255, 255))
    return image


def invented_word(rng: np.random.Generator) -> str:
    return "".join(rng.choice(SYLLABLES, size=int(rng.integers(2, 4))))


def option_texts(rng: np.random.Generator, leads: tuple[str, ...], count: int) -> list[str]:
    """`count` option texts, each led by a word no other one starts with, of varied lengths."""
    firsts = list(leads[:count])
    while len(firsts) < count:
        word = invented_word(rng)
        if word not in firsts:
            firsts.append(word)
    rng.shuffle(firsts)
    tails = rng.integers(0, MAX_TAIL_WORDS + 1, size=count) * (rng.random(count) < 0.5)
    pairs = zip(firsts, tails, strict=True)
    return [" ".join([first, *rng.choice(TAILS, size=int(t))]) for first, t in pairs]


def choice_count(rng: np.random.Generator, large_left: bool) -> int:
    spans = [span for span, _ in CHOICE_SPANS]
    weights = np.array([w for _, w in CHOICE_SPANS])
    low, high = spans[int(rng.choice(len(spans), p=weights / weights.sum()))]
    count = int(rng.integers(low, high + 1))
    return count if large_left or count <= LARGE_CHOICE else int(rng.integers(2, 7))


def region(rng: np.random.Generator, size: tuple[int, int]) -> dict:
    width, height = size
    x1, y1 = int(rng.integers(0, width - 40)), int(rng.integers(0, height - 40))
    x2, y2 = int(rng.integers(x1 + 20, width)), int(rng.integers(y1 + 20, height))
    return {"box": [x1, y1, x2, y2]}


def choice_question(rng: np.random.Generator, large_left: bool, size: tuple[int, int]) -> dict:
    pick = int(rng.integers(0, len(CHOICES) + 1))
    if pick == len(CHOICES):  # the region Choice: 2 to 8 boxes
        boxes = [{"key": f"r{k}", "region": region(rng, size)} for k in range(rng.integers(2, 9))]
        return {"type": "choice", "instructions": REGION_CHOICE, "options": boxes}
    instructions, leads = CHOICES[pick]
    texts = option_texts(rng, leads, choice_count(rng, large_left))
    if rng.random() < FORM_SHARE:
        criteria = {text: (f"pick {text} when it fits" if k % 2 else None)
                    for k, text in enumerate(texts)}  # fmt: skip
        return {"type": "choice", "instructions": instructions, "criteria": criteria}
    options: list[dict] = [{"key": f"o{k}", "text": text} for k, text in enumerate(texts)]
    if rng.random() < 0.5:
        options.append({"abstain": True})
    return {"type": "choice", "instructions": instructions, "options": options}


def score_question(rng: np.random.Generator) -> dict:
    instructions, scale = SCORES[int(rng.integers(0, len(SCORES)))]
    count = int(rng.integers(SCORE_LEVELS[0], SCORE_LEVELS[1] + 1))
    ladder = SCALES[scale]
    levels = [ladder[int(k)] for k in np.linspace(0, len(ladder) - 1, count).round()]
    if rng.random() < FORM_SHARE:
        criteria = {level: f"the screen looks {level}" for level in levels}
        return {"type": "score", "instructions": instructions, "criteria": criteria}
    return {"type": "score", "instructions": instructions, "levels": levels}


def noul_question(rng: np.random.Generator, size: tuple[int, int]) -> dict:
    question = {"type": "noul", "instructions": NOULS[int(rng.integers(0, len(NOULS)))]}
    if rng.random() < REGION_SHARE:
        question["region"] = region(rng, size)
    return question


def questions_for(rng: np.random.Generator, count: int, size: tuple[int, int]) -> dict[str, dict]:
    """`count` questions of random types from the templates, under varied ids."""
    questions: dict[str, dict] = {}
    large_left = True
    for k in range(count):
        kind = rng.choice(("noul", "choice", "score"))
        if kind == "noul":
            question = noul_question(rng, size)
        elif kind == "score":
            question = score_question(rng)
        else:
            question = choice_question(rng, large_left, size)
            large_left = large_left and len(question.get("options", ())) <= LARGE_CHOICE + 1
        questions[f"{kind[0]}{k}-{invented_word(rng)}"] = question
    return questions


def answer_rows(question: dict) -> int:
    if question["type"] == "noul":
        return 1
    if "criteria" in question:
        return len(question["criteria"])
    entries = question.get("levels") or question["options"]
    return sum(not (isinstance(e, dict) and e.get("abstain")) for e in entries)


def request(
    seed: int,
    index: int,
    stream: str = "suite",
    questions: int | None = None,
    size: tuple[int, int] | None = None,
    fmt: str | None = None,
    images: int | None = None,
    clip: int | None = None,
) -> TrafficRequest:
    """Request `index` of a seed's stream; `questions`, `size` and `fmt` fix what they name;
    with `images`, the requests ask about that many screenshots in turn (request i about
    screenshot i mod `images`), as clients that ask several sets of questions about one screen;
    with `clip`, the same questions about a clip of that many frames at the size (H.264 in MP4,
    CLIP_FPS frames a second) in place of the still."""
    rng = rng_for(seed, stream, index)
    shown = index % images if images else index
    # with `images`, a screenshot's draws come from a stream of their own, the same for every
    # request about it; without, the request's draws are as they always were
    image_rng = screenshot_rng(seed, stream, shown) if images else rng
    size = size or size_of(seed, stream, shown)
    fmt = fmt or FORMATS[int(image_rng.integers(0, len(FORMATS)))]
    count = questions or int(rng.integers(1, MAX_QUESTIONS + 1))
    label = f"{stream} {seed}.{shown}"
    still = screenshot(*size, image_rng, label)  # drawn for a clip too: the same questions follow
    chosen = questions_for(rng, count, size)
    rows = sum(answer_rows(q) for q in chosen.values())
    if clip:
        return TrafficRequest(index, size, "MP4", count, rows, clip_body(clip, size, shown, chosen))
    payload = body(encode(still, fmt), MIMES[fmt], chosen)
    return TrafficRequest(index, size, fmt, count, rows, payload)


def clip_body(frames: int, size: tuple[int, int], index: int, questions: dict[str, dict]) -> bytes:
    """A native request about a clip of `frames` moving-shape frames (`bench.clips`)."""
    state = {"video": clip_url(frames, size, index % CLIP_VARIANTS)}
    return json.dumps({"model": MODEL_ID, "state": state, "questions": questions}).encode()


@functools.lru_cache(maxsize=64)
def clip_url(frames: int, size: tuple[int, int], seed: int) -> str:
    from bench.clips import clip, video_url

    return video_url(*clip(frames, *size, fps=CLIP_FPS, seed=seed))


def stream(seed: int, count: int, held_out: bool = False, **fixed) -> Iterator[TrafficRequest]:
    """The first `count` requests of the suite's stream of `seed` (or of its held-out one)."""
    name = "held-out" if held_out else "suite"
    for index in range(count):
        yield request(seed, index, name, **fixed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--held-out", action="store_true", help="the seed's held-out stream")
    parser.add_argument("--out", required=True, help="a folder for the request bodies")
    args = parser.parse_args(argv)
    from pathlib import Path

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for made in stream(args.seed, args.requests, args.held_out):
        (out / f"request-{made.index:04d}.json").write_bytes(made.body)
        described = {k: v for k, v in made.__dict__.items() if k != "body"}
        print(json.dumps(described))
    return 0


if __name__ == "__main__":
    sys.exit(main())
