"""The bench's requests: the stills (screen, photo, pattern) and the question sets of
`omnijev bench` and `omnijev parity` (docs/contract.md §10.1, §10.2, §12.2)."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image, ImageDraw

BENCH_SIZE = (1600, 900)  # the latency still of docs/contract.md §12.2
# the sizes of parity's further stills: common screens and photos, landscape and portrait
MORE_SIZES = ((1920, 1080), (1280, 720), (800, 1200), (1024, 768), (2560, 1440), (720, 1280))
OPTIONS_255 = 255  # the largest Choice the contract allows
HOST_WORKLOADS = ("1 question", "12 questions", "255 options")  # the host profile's requests
HOST_FORMATS = (("PNG", "image/png"), ("JPEG", "image/jpeg"))


def quantile(values: list[float], f: float) -> float:
    """validate.py's q(f) = sorted[min(n − 1, int(f·n))]."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(f * len(ordered)))]


def encode(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def pattern_image(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width].astype(np.int64)
    rgb = np.stack([(7 * x + 3 * y) % 256, (x * y + 13) % 256, ((x ^ y) * 5) % 256], axis=-1)
    return Image.fromarray(rgb.astype(np.uint8), "RGB")


def screen_image(width: int, height: int, seed: int) -> Image.Image:
    """A screenshot-like still: windows, buttons and text lines drawn deterministically."""
    rng = np.random.default_rng(seed)
    image = Image.new("RGB", (width, height), (235, 238, 242))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = int(rng.integers(0, width - 200)), int(rng.integers(0, height - 120))
        x1, y1 = x0 + int(rng.integers(120, 600)), y0 + int(rng.integers(60, 400))
        colour = tuple(int(c) for c in rng.integers(40, 250, size=3))
        draw.rectangle([x0, y0, x1, y1], fill=colour, outline=(20, 20, 20), width=2)
        for line in range(3):
            draw.text(
                (x0 + 10, y0 + 10 + 16 * line), f"item {seed}.{line} OK Cancel", fill=(0, 0, 0)
            )
    return image


def photo_image(width: int, height: int, seed: int) -> Image.Image:
    """A photo-like still: smooth gradients with noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / 97 + seed),
            128 + 90 * np.cos(y / 71),
            128 + 80 * np.sin((x + y) / 53),
        ],
        axis=-1,
    )
    noisy = base + rng.normal(0, 12, size=base.shape)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def parity_images(more: int = 0) -> list[tuple[str, bytes, str]]:
    """Four different stills, PNG and JPEG: (name, bytes, mime); `more` seeded ones after them,
    screens as PNG and photos as JPEG in turn, at the sizes of MORE_SIZES in turn."""
    w, h = BENCH_SIZE
    images = [
        ("screen.png", encode(screen_image(w, h, 1), "PNG"), "image/png"),
        ("screen.jpg", encode(screen_image(w, h, 1), "JPEG"), "image/jpeg"),
        ("photo.jpg", encode(photo_image(1280, 720, 2), "JPEG"), "image/jpeg"),
        ("pattern.png", encode(pattern_image(640, 480), "PNG"), "image/png"),
    ]
    for index in range(more):
        size, seed = MORE_SIZES[index % len(MORE_SIZES)], 10 + index
        if index % 2:
            images.append(
                (f"photo-{seed}.jpg", encode(photo_image(*size, seed), "JPEG"), "image/jpeg")
            )
        else:
            images.append(
                (f"screen-{seed}.png", encode(screen_image(*size, seed), "PNG"), "image/png")
            )
    return images


def choice_with(options: int) -> dict[str, dict]:
    words = [f"option {i}" for i in range(options)]
    return {
        "wide": {
            "type": "choice",
            "instructions": "Which label fits the image best?",
            "options": [{"key": w, "text": w} for w in words] + [{"abstain": True}],
        }
    }


def workloads() -> dict[str, dict[str, dict]]:
    """`omnijev bench`'s workloads by name: the speed bench's first 1, 3, 6 and 12 questions,
    the gate's 32 options and a Choice of 255."""
    from reference.questions import gate_questions, speed_bench_questions

    loads = {f"{n} question{'s' * (n > 1)}": speed_bench_questions(n) for n in (1, 3, 6, 12)}
    loads["32 options"] = {"choice32": gate_questions()["choice32"]}
    loads["255 options"] = choice_with(OPTIONS_255)
    return loads


def question_sets() -> dict[str, dict[str, dict]]:
    """`omnijev parity`'s question sets: the speed bench's 12 and the gate's 8."""
    from reference.questions import gate_questions, speed_bench_questions

    return {"speed_bench": speed_bench_questions(12), "gate": gate_questions()}


def body(image: bytes, mime: str, questions: dict[str, dict]) -> bytes:
    from reference.questions import request_body

    return request_body(image, questions, mime)


def bench_still() -> bytes:
    """The latency still as PNG: every workload's image."""
    return encode(screen_image(*BENCH_SIZE, seed=1), "PNG")


def bench_body(workload: str) -> bytes:
    """`omnijev bench`'s request for a workload: the screen still as PNG (docs/contract.md
    §12.2)."""
    loads = workloads()
    if workload not in loads:
        raise ValueError(f"unknown workload {workload!r}; one of {sorted(loads)}")
    return body(bench_still(), "image/png", loads[workload])


def bench_bodies(only: list[str] | None = None) -> dict[str, bytes]:
    """Every workload's request on the latency still (those named in `only`, if given)."""
    loads = workloads()
    unknown = sorted(set(only or ()) - set(loads))
    if unknown:
        raise ValueError(f"unknown workload {unknown[0]!r}; one of {sorted(loads)}")
    still = bench_still()
    chosen = [name for name in loads if not only or name in only]
    return {name: body(still, "image/png", loads[name]) for name in chosen}


def host_requests() -> dict[str, bytes]:
    """The host profile's requests: the 1600×900 screen still as PNG and JPEG, each workload."""
    loads = workloads()
    still = screen_image(*BENCH_SIZE, seed=1)
    out = {}
    for fmt, mime in HOST_FORMATS:
        data = encode(still, fmt)
        for name in HOST_WORKLOADS:
            out[f"{fmt} {name}"] = body(data, mime, loads[name])
    return out
