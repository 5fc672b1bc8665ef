"""The JPEG fast path (libjpeg-turbo through simplejpeg, `runtime.images.fast_jpeg`) gives
Pillow's `convert("RGB")` byte for byte, and every JPEG it does not take, or takes and warns
about, ends as Pillow alone ends it: the same pixels or the same refusal."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from runtime import images
from runtime.errors import ContractError

SIZES = [(1, 1), (7, 3), (17, 9), (64, 64), (333, 5), (390, 844), (1023, 767)]


def photo(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Gradients and noise, photo-like: every DCT coefficient and the chroma carry work."""
    width, height = size
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), (x + y) % 256])
    noise = rng.integers(0, 48, (height, width, 3))
    return Image.fromarray(np.clip(base.transpose(1, 2, 0) + noise, 0, 255).astype(np.uint8))


def jpeg(image: Image.Image, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, "JPEG", **options)
    return out.getvalue()


def pillow_rgb(data: bytes) -> np.ndarray:
    """The reference's decode: `Image.open(...).convert("RGB")`."""
    with Image.open(io.BytesIO(data)) as image:
        return np.asarray(image.convert("RGB"))


def fast(data: bytes, allocate=None) -> np.ndarray | None:
    with images.open_header(data, "image/jpeg") as image:
        return images.fast_jpeg(data, image, allocate)


def outcome(data: bytes, fast: bool = True) -> tuple:
    """decode_rgb's pixels or refusal; without `fast`, the runtime's Pillow path alone."""
    try:
        rgb = images.decode_rgb(data, "image/jpeg", fast=fast)
        return "pixels", rgb.shape, rgb.tobytes()
    except ContractError as error:
        return "refused", str(error)


def test_simplejpeg_is_installed():
    import simplejpeg  # noqa: F401  (else every JPEG goes through Pillow)


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
@pytest.mark.parametrize(
    "options",
    [
        {"quality": 90, "subsampling": 0},  # 4:4:4
        {"quality": 90, "subsampling": 1},  # 4:2:2
        {"quality": 75, "subsampling": 2},  # 4:2:0, Pillow's default
        {"quality": 95, "progressive": True},
        {"quality": 50, "optimize": True},
    ],
    ids=["444", "422", "420", "progressive", "optimized"],
)
def test_colour_jpegs_give_pillows_bytes(size, options):
    data = jpeg(photo(np.random.default_rng(sum(size)), size), **options)
    got = fast(data)
    assert got is not None
    assert got.shape == (size[1], size[0], 3) and got.tobytes() == pillow_rgb(data).tobytes()


@pytest.mark.parametrize("size", [(1, 1), (31, 17), (640, 480)])
def test_gray_jpegs_come_out_as_pillows_rgb(size):
    data = jpeg(photo(np.random.default_rng(1), size).convert("L"), quality=85)
    got = fast(data)
    assert got is not None and got.tobytes() == pillow_rgb(data).tobytes()


def test_cmyk_stays_with_pillow():
    """Pillow converts CMYK to RGB with its own arithmetic: the fast path declines it."""
    data = jpeg(photo(np.random.default_rng(2), (40, 30)).convert("CMYK"))
    assert fast(data) is None
    assert outcome(data) == outcome(data, fast=False) and outcome(data)[0] == "pixels"


def test_a_decode_writes_into_the_array_it_is_given():
    given: list[np.ndarray] = []

    def allocate(shape: tuple[int, ...]) -> np.ndarray:
        given.append(np.full(shape, 7, np.uint8))
        return given[-1]

    data = jpeg(photo(np.random.default_rng(3), (61, 23)))
    got = images.decode_rgb(data, "image/jpeg", allocate=allocate)
    assert np.shares_memory(got, given[-1]) and got.tobytes() == pillow_rgb(data).tobytes()


def corruptions(data: bytes, rng: np.random.Generator):
    """Cut short at several places, flipped bytes in the entropy-coded data, extra bytes after
    the end: streams libjpeg-turbo warns about, refuses, or decodes."""
    for cut in (len(data) // 3, len(data) // 2, len(data) - 40, len(data) - 2):
        yield f"cut at {cut}", data[:cut]
    for _ in range(30):
        damaged = bytearray(data)
        at = int(rng.integers(len(data) // 4, len(data) - 2))
        damaged[at] ^= int(rng.integers(1, 256))
        yield f"flipped byte {at}", bytes(damaged)
    yield "bytes after the end", data + b"\x00" * 64


def test_damaged_jpegs_end_as_pillow_ends_them():
    rng = np.random.default_rng(11)
    data = jpeg(photo(rng, (96, 64)), quality=90)
    seen = set()
    for name, variant in corruptions(data, rng):
        try:
            expected = outcome(variant, fast=False)
        except Exception as error:  # the header itself refused: decode_rgb is never reached
            expected = ("raised", type(error))
        try:
            got = outcome(variant)
        except Exception as error:
            got = ("raised", type(error))
        assert got == expected, name
        seen.add(expected[0])
    assert {"pixels", "refused"} <= seen  # both kinds of ending were exercised
