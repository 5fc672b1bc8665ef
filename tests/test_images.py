"""Image data URLs, decoding and preprocessing against the reference's pixel fixtures
(docs/contract.md §2.3, §4.7-4.8, §9.2) and the worker's refusals."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import struct
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from runtime.errors import ContractError
from runtime.images import (
    check_size,
    decode_base64,
    decode_rgb,
    normalize_and_pack,
    parse_data_url,
    prepare_image,
    resize_rgb,
    smart_resize,
)
from tests.spec import FIXTURES

PIXEL_CASES = json.loads((FIXTURES / "pixels.json").read_text())["cases"]
PROCESSING_CASES = json.loads((FIXTURES / "processing.json").read_text())["cases"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def sha256(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def pattern(width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """The fixture pattern's RGB and its rgba case's alpha (fixture README)."""
    x = np.arange(width, dtype=np.int64)[None, :]
    y = np.arange(height, dtype=np.int64)[:, None]
    r, g, b = np.broadcast_arrays((7 * x + 3 * y) % 256, (x * y + 13) % 256, ((x ^ y) * 5) % 256)
    alpha = np.broadcast_to((x + y) % 256, (height, width))
    return np.stack([r, g, b], axis=-1).astype(np.uint8), alpha.astype(np.uint8)


def encode(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    if fmt == "PNG":
        options.setdefault("compress_level", 1)  # lossless either way; faster
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def png(width: int, height: int, colour: tuple[int, int, int] = (0, 0, 0)) -> bytes:
    return encode(Image.new("RGB", (width, height), colour))


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def raw_png(
    width: int,
    height: int,
    depth: int,
    colour_type: int,
    pixels: bytes,
    extra: tuple[tuple[bytes, bytes], ...] = (),
) -> bytes:
    """A PNG written by hand, for what Pillow does not write (16-bit RGB, acTL, bad headers)."""
    row = len(pixels) // height if height else 0
    scanlines = b"".join(b"\0" + pixels[i * row : (i + 1) * row] for i in range(height))
    header = struct.pack(">IIBBBBB", width, height, depth, colour_type, 0, 0, 0)
    chunks = [(b"IHDR", header), *extra, (b"IDAT", zlib.compress(scanlines)), (b"IEND", b"")]
    return PNG_MAGIC + b"".join(png_chunk(kind, body) for kind, body in chunks)


def case_image(case: dict) -> tuple[bytes, str]:
    """The fixture case's file bytes and MIME type: redrawn patterns or the stored bytes."""
    width, height = case["size"]
    if case["kind"] == "stored":
        mime = "image/jpeg" if case["format"] == "jpeg" else "image/png"
        return base64.b64decode(case["bytes"]), mime
    rgb, alpha = pattern(width, height)
    if case["kind"] == "pattern_rgba":
        image = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif case["kind"] == "pattern_gray":
        image = Image.fromarray(np.ascontiguousarray(rgb[:, :, 0]), "L")
    else:
        image = Image.fromarray(rgb, "RGB")
    return encode(image), "image/png"


def refused(call, *args) -> str:
    with pytest.raises(ContractError) as caught:
        call(*args)
    return str(caught.value)


@pytest.mark.parametrize("case", PIXEL_CASES, ids=[c["name"] for c in PIXEL_CASES])
def test_pixel_fixtures(case):
    data, mime = case_image(case)
    assert parse_data_url(data_url(data, mime)) == (mime, data)
    prepared = prepare_image(data, mime)
    assert (prepared.width, prepared.height) == tuple(case["size"])
    assert prepared.rgb.dtype == np.uint8
    assert prepared.rgb.shape == (case["size"][1], case["size"][0], 3)
    assert sha256(prepared.rgb) == case["rgb_sha256"]
    assert list(prepared.grid_thw) == case["image_grid_thw"]
    assert prepared.pixel_values.dtype == np.float32
    assert list(prepared.pixel_values.shape) == case["pixel_values_shape"]
    assert sha256(prepared.pixel_values) == case["pixel_values_sha256"]
    if "rgb" in case:
        assert prepared.rgb.tobytes() == base64.b64decode(case["rgb"])


def test_resize_runs_the_uint8_kernel():
    rgb, _ = pattern(333, 217)
    resized = resize_rgb(rgb, 224, 320)
    assert resized.dtype == np.uint8 and resized.shape == (224, 320, 3)
    # A float resize rounded back to uint8 is not what the fixtures hold.
    source = torch.from_numpy(rgb).permute(2, 0, 1)[None].float()
    as_float = torch.nn.functional.interpolate(
        source, size=(224, 320), mode="bicubic", antialias=True, align_corners=False
    )
    rounded = as_float.round().clamp(0, 255).to(torch.uint8)[0].permute(1, 2, 0).numpy()
    assert not np.array_equal(rounded, resized)


@pytest.mark.parametrize(
    ("height", "width", "expected"),
    [
        (900, 1600, (576, 1024)),  # §4.8 examples
        (48, 64, (224, 320)),
        (720, 1280, (576, 1024)),
        (272, 400, (256, 384)),  # 8.5 and 12.5 round half to even, down
        (1080, 1920, (576, 1024)),
        (20, 2000, (32, 2560)),
        (1200, 800, (928, 608)),
    ],
)
def test_smart_resize(height, width, expected):
    assert smart_resize(height, width) == expected


def test_smart_resize_refuses_the_aspect_the_processor_refuses():
    assert smart_resize(2, 400) == (32, 3648)
    assert refused(smart_resize, 2, 401) == "image aspect ratio must be at most 200"


def test_pack_order_is_block_major():
    rgb = np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)
    values, grid = normalize_and_pack(rgb)
    assert grid == (1, 4, 6) and values.shape == (24, 1536)
    normalized = (rgb.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    blocks_per_row = 96 // 32
    for index in (0, 1, 2, 3, 4, 13, 23):
        block, sub = divmod(index, 4)
        top = (block // blocks_per_row) * 32 + (sub // 2) * 16
        left = (block % blocks_per_row) * 32 + (sub % 2) * 16
        patch = normalized[top : top + 16, left : left + 16].transpose(2, 0, 1)  # channel, row, col
        expected = np.stack([patch, patch], axis=1)  # channel, temporal copy, row, col
        np.testing.assert_array_equal(values[index], expected.reshape(-1))


SOLID_CASES = {tuple(c["image_size"]): c for c in PROCESSING_CASES}


@pytest.mark.parametrize("size", sorted(SOLID_CASES), ids=lambda s: f"{s[0]}x{s[1]}")
def test_solid_colour_processing_fixtures(size):
    case = SOLID_CASES[size]
    colour = tuple(case["image_colour"])
    prepared = prepare_image(png(*size, colour), "image/png")
    assert list(prepared.grid_thw) == case["image_grid_thw"]
    assert list(prepared.pixel_values.shape) == case["pixel_values_shape"]
    assert sha256(prepared.pixel_values) == case["pixel_values_sha256"]
    expected = [(np.float32(c) - np.float32(127.5)) / np.float32(127.5) for c in colour]
    channels = prepared.pixel_values.reshape(-1, 3, 512)
    for channel, value in enumerate(expected):
        assert np.all(channels[:, channel] == value)


def test_single_noul_hash():
    prepared = prepare_image(png(1600, 900, (40, 90, 160)), "image/png")
    digest = "439a2c9ec89d25c0cf7669301bfabd1ebf56e1657790afd2545cad85fac583e3"
    assert sha256(prepared.pixel_values) == digest


PNG_64 = png(64, 48, (1, 2, 3))
PNG_URL = data_url(PNG_64)
ENCODED_PNG = PNG_URL.split(",", 1)[1]
JPEG_8 = encode(Image.new("RGB", (8, 8)), "JPEG")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (123, "an image must be a data URL"),
        (None, "an image must be a data URL"),
        (PNG_URL.encode(), "an image must be a data URL"),
        ("https://example.com/a.png", "invalid image data URL"),
        ("data:image/gif;base64,AAAA", "only inline PNG/JPEG images are supported"),
        ("data:image/PNG;base64," + ENCODED_PNG, "only inline PNG/JPEG images are supported"),
        ("data:image/png," + ENCODED_PNG, "only inline PNG/JPEG images are supported"),
        (PNG_URL[:40] + "\n" + PNG_URL[40:], "invalid base64 image"),
        (PNG_URL[:40] + " " + PNG_URL[40:], "invalid base64 image"),
        (data_url(PNG_MAGIC).rstrip("="), "invalid base64 image"),  # unpadded
        (PNG_URL + "=", "invalid base64 image"),
        ("data:image/png;base64,QR==", "invalid base64 image"),  # nonzero trailing bits
        ("data:image/png;base64," + ENCODED_PNG.replace("+", "-"), "invalid base64 image"),
        ("data:image/png;base64,QQ==", "image format does not match its MIME type"),
        ("data:image/png;base64,", "image format does not match its MIME type"),
        (data_url(PNG_64, "image/jpeg"), "image format does not match its MIME type"),
        (data_url(JPEG_8), "image format does not match its MIME type"),
        (data_url(PNG_MAGIC), "invalid image"),  # the padded text of the unpadded case
        (data_url(png(4097, 64)), "invalid image"),
        (data_url(png(64, 4097)), "invalid image"),
        (data_url(png(401, 2)), "image aspect ratio must be at most 200"),
        (data_url(png(2, 401)), "image aspect ratio must be at most 200"),
        (data_url(PNG_64[:30]), "invalid image"),
        (data_url(raw_png(0, 4, 8, 2, b"")), "invalid image"),
        (data_url(raw_png(30000, 30000, 8, 2, b"")), "invalid image"),  # a decompression bomb
        (data_url(raw_png(64, 48, 8, 9, bytes(64 * 48 * 3))), "invalid image"),  # colour type 9
    ],
)
def test_data_url_refusals(value, message):
    assert refused(parse_data_url, value) == message


def test_data_url_size_limits():
    exactly = PNG_MAGIC + bytes(8 * 1024 * 1024 - len(PNG_MAGIC))
    assert refused(parse_data_url, data_url(exactly)) == "invalid image"  # size passes
    over = exactly + b"\0"
    assert len(data_url(over)) - len("data:image/png;base64,") == 11_184_812  # length passes
    assert refused(parse_data_url, data_url(over)) == "image exceeds 8 MiB"
    too_long = "data:image/png;base64," + "A" * 11_184_816
    assert refused(parse_data_url, too_long) == "image exceeds 8 MiB"


def test_data_url_accepts_the_limits():
    for width, height in ((4096, 64), (400, 2), (2, 400)):
        assert parse_data_url(data_url(png(width, height))) == ("image/png", png(width, height))
    jpeg = encode(Image.new("RGB", (16, 8), (9, 9, 9)), "JPEG")
    assert parse_data_url(data_url(jpeg, "image/jpeg")) == ("image/jpeg", jpeg)


def test_size_messages():
    assert check_size(4096, 4096) is None
    assert refused(check_size, 4097, 64) == "invalid image"
    assert refused(check_size, 0, 64) == "image must be at most 4096 pixels per side"


def test_truncated_pixel_data_is_refused_at_decode():
    data = encode(Image.fromarray(pattern(64, 48)[0]))
    truncated = data[: len(data) // 2]
    assert parse_data_url(data_url(truncated)) == ("image/png", truncated)  # header only
    assert refused(decode_rgb, truncated, "image/png") == "invalid image"
    jpeg = encode(Image.fromarray(pattern(64, 48)[0]), "JPEG")
    assert refused(decode_rgb, jpeg[: len(jpeg) // 2], "image/jpeg") == "invalid image"


def test_animated_png_is_refused():
    frames = [Image.new("RGB", (16, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    apng = encode(frames[0], save_all=True, append_images=frames[1:])
    assert parse_data_url(data_url(apng)) == ("image/png", apng)  # refused at decode time
    assert refused(decode_rgb, apng, "image/png") == "image must be single-frame"


def test_single_frame_apng_is_refused():
    actl = struct.pack(">II", 1, 0)
    fctl = struct.pack(">IIIIIHHBB", 0, 4, 2, 0, 0, 1, 10, 0, 0)
    data = raw_png(4, 2, 8, 2, bytes(24), extra=((b"acTL", actl), (b"fcTL", fctl)))
    assert Image.open(io.BytesIO(data)).n_frames == 1
    assert refused(decode_rgb, data, "image/png") == "image must be single-frame"


def test_mpo_is_refused():
    picture = Image.fromarray(pattern(32, 16)[0])
    mpo = encode(picture, "MPO", save_all=True, append_images=[picture])
    assert Image.open(io.BytesIO(mpo)).format == "MPO"
    assert parse_data_url(data_url(mpo, "image/jpeg"))[0] == "image/jpeg"
    assert refused(decode_rgb, mpo, "image/jpeg").startswith("image must be single-frame")


def test_jpeg_with_an_mpf_segment_is_refused():
    picture = Image.fromarray(pattern(32, 16)[0])
    mpo = encode(picture, "MPO", save_all=True, append_images=[picture])
    # The MP index now lists one picture, so Pillow opens the file as a plain JPEG and would
    # decode the first picture; the worker refuses any MPF segment.
    count_two = b"\x01\xb0\x04\x00\x01\x00\x00\x00\x02\x00\x00\x00"  # tag B001, LONG 2
    assert mpo.count(count_two) == 1
    listed_once = mpo.replace(count_two, count_two[:8] + struct.pack("<I", 1))
    assert Image.open(io.BytesIO(listed_once)).format == "JPEG"
    assert refused(decode_rgb, listed_once, "image/jpeg").startswith("image must be single-frame")
    plain = encode(picture, "JPEG")
    assert decode_rgb(plain, "image/jpeg").shape == (16, 32, 3)


def test_sixteen_bit_pngs_follow_pillow():
    gray = np.array([[0, 200, 255], [256, 1000, 65535]], dtype=">u2")
    clipped = np.minimum(gray.astype(np.int64), 255).astype(np.uint8)
    for extra in ((), ((b"tRNS", struct.pack(">H", 1000)),)):
        rgb = decode_rgb(raw_png(3, 2, 16, 0, gray.tobytes(), extra), "image/png")
        np.testing.assert_array_equal(rgb, np.repeat(clipped[:, :, None], 3, axis=2))
    colour = np.array([[[0x1234, 0xABCD, 0x00FF], [0xFF00, 0x8080, 0x7F7F]]], dtype=">u2")
    shifted = (colour.astype(np.int64) >> 8).astype(np.uint8)
    rgb = decode_rgb(raw_png(2, 1, 16, 2, colour.tobytes()), "image/png")
    np.testing.assert_array_equal(rgb, shifted)
    with_alpha = np.dstack([colour, np.full((1, 2, 1), 0x0101)]).astype(">u2")
    rgb = decode_rgb(raw_png(2, 1, 16, 6, with_alpha.tobytes()), "image/png")
    np.testing.assert_array_equal(rgb, shifted)  # alpha dropped, not composited
    gray_alpha = np.array([[[0x1234, 0], [0xABCD, 0xFFFF]]], dtype=">u2")
    rgb = decode_rgb(raw_png(2, 1, 16, 4, gray_alpha.tobytes()), "image/png")
    np.testing.assert_array_equal(rgb[0, :, 0], [0x12, 0xAB])


def test_decode_rechecks_the_header():
    assert refused(decode_rgb, PNG_64, "image/jpeg") == "image format does not match its MIME type"
    assert refused(decode_rgb, PNG_64, "image/gif") == "only inline PNG/JPEG images are supported"
    assert refused(decode_rgb, png(4097, 64), "image/png") == "invalid image"


# -- the PNG chunk walk (issue 14 §8) and the image opened once ----------------------------------

# issue 14: each bomb refused in under 50 ms past its base64 decode, which any 8 MiB image costs
# (27 ms of the 30 ms refusal of the 8 MiB tEXt bomb on one 2-core machine, and more on a slower
# one: a CI run met 54.5 ms in all)
REFUSAL_SECONDS = 0.05


def bomb(kind: bytes, body: bytes, count: int, after_idat: bool = False) -> bytes:
    """A valid 64×48 PNG with `count` copies of one chunk before (or after) its image data."""
    data = png(64, 48, (1, 2, 3))
    iend = data.rindex(b"IEND") - 4
    cut = iend if after_idat else data.index(b"IDAT") - 4
    return data[:cut] + png_chunk(kind, body) * count + data[cut:]


def zeros_inflating_to(size: int) -> bytes:
    return zlib.compress(bytes(size), 9)


def itxt(text: bytes) -> bytes:
    return b"XML:com.adobe.xmp\0\x01\x00\0\0" + text  # keyword, compressed, method, lang, key


BOMBS = {
    "iCCP": (b"iCCP", b"icc\0\0" + zeros_inflating_to(1 << 20), 8, False),
    # issue 14's: ~8 MiB of 1 MiB profiles, 17.6 s an open before the walk
    "iCCP 8 MiB": (b"iCCP", b"icc\0\0" + zeros_inflating_to(1 << 20), 7_900, False),
    "tEXt 8 MiB": (b"tEXt", b"k\0" + bytes(1000), 8_000, False),
    "zTXt": (b"zTXt", b"Comment\0\0" + zeros_inflating_to(1 << 20), 8, False),
    "iTXt": (b"iTXt", itxt(zeros_inflating_to(1 << 20)), 8, False),
    "zTXt after IDAT": (b"zTXt", b"Comment\0\0" + zeros_inflating_to(1 << 20), 8, True),
    "many small chunks": (b"tEXt", b"k\0v", 300, False),
    "many unknown chunks": (b"prVt", b"", 300, True),
}


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_png_chunk_bombs_are_refused_fast(name):
    kind, body, count, after = BOMBS[name]
    data = bomb(kind, body, count, after)
    assert len(data) <= 8 * 1024 * 1024
    url = data_url(data)
    seconds, decoding = [], []
    for _ in range(3):  # the best of three: a busy 2-core machine stalls one call at times
        started = time.perf_counter()
        message = refused(parse_data_url, url)
        seconds.append(time.perf_counter() - started)
        started = time.perf_counter()
        binascii.a2b_base64(url.partition(",")[2], strict_mode=True)
        decoding.append(time.perf_counter() - started)
    assert min(seconds) - min(decoding) < REFUSAL_SECONDS
    assert message.startswith("image ")
    assert refused(decode_rgb, data, "image/png") == message  # the decode walks the chunks too


def test_png_chunk_limits_name_the_limit():
    assert refused(parse_data_url, data_url(bomb(b"tEXt", b"k\0v", 257))) == (
        "image has more than 256 ancillary PNG chunks"
    )
    iccp = b"icc\0\0" + zeros_inflating_to(1 << 20)
    assert refused(parse_data_url, data_url(bomb(b"iCCP", iccp, 3))) == (
        "image metadata inflates past 2097152 bytes"
    )
    many = bomb(b"IDAT", b"", 16_385)  # empty IDAT chunks: valid to Pillow, but not to the walk
    assert refused(parse_data_url, data_url(many)) == "image has more than 16384 PNG chunks"


def test_png_chunks_within_the_limits_decode_as_before():
    plain = png(64, 48, (1, 2, 3))
    icc = b"icc\0\0" + zeros_inflating_to(1 << 20)  # a 1 MiB profile: Pillow's own limit
    text = bomb(b"tEXt", b"k\0v", 255)
    for data in (bomb(b"iCCP", icc, 1), text, bomb(b"iTXt", itxt(zlib.compress(b"x" * 9)), 3)):
        assert parse_data_url(data_url(data)) == ("image/png", data)
        np.testing.assert_array_equal(decode_rgb(data, "image/png"), decode_rgb(plain, "image/png"))


def test_the_request_image_is_opened_once(monkeypatch):
    import runtime.images as images

    expected = sha256(decode_rgb(PNG_64, "image/png"))
    opens = []
    real_open = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: opens.append(1) or real_open(*a, **k))
    mime, data, opened = images.open_data_url(PNG_URL)
    prepared = prepare_image(data, mime, opened)
    assert len(opens) == 1
    assert sha256(prepared.rgb) == expected
    assert opened.take() is None  # handed over once; a second decode opens the bytes again
    assert sha256(prepare_image(data, mime, opened).pixel_values) == sha256(prepared.pixel_values)
    assert len(opens) == 2


@pytest.mark.parametrize("fast", [True, False])
def test_decode_base64_matches_the_reencoding_rule(fast):
    """`b64decode(validate=True)` plus `b64encode(data) == text`, the rule it replaces: with
    pybase64's decode (`fast_base64`, binascii where it refuses) and with binascii alone."""
    from runtime import images

    if fast:
        pytest.importorskip("pybase64")
        assert images.fast_base64("QUJD") == b"ABC"

    def by_reencoding(text: str) -> bytes | None:
        try:
            data = base64.b64decode(text, validate=True)
        except ValueError:
            return None
        return data if base64.b64encode(data) == text.encode("ascii") else None

    def ours(text: str) -> bytes | None:
        try:
            return decode_base64(text, simd=fast)
        except ContractError:
            return None

    rng = np.random.default_rng(0)
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    texts = ["", "=", "==", "A===", "AA==", "QR==", "QQ=", "QUJD====", "QQ==QQ==", " AAAA"]
    for _ in range(20_000):
        n = int(rng.integers(0, 12))
        chars = rng.choice(list(alphabet + "=-_ \né"), size=n, p=None)
        texts.append("".join(chars))
        encoded = base64.b64encode(rng.bytes(int(rng.integers(0, 7)))).decode()
        texts.append(encoded)
        texts.append(encoded[:-1] + "B" if encoded else "B")
    for text in texts:
        assert ours(text) == by_reencoding(text), repr(text)


@pytest.mark.parametrize("size", [(64, 48), (333, 217), (1600, 900)])
def test_device_pixel_values_equal_the_host_patches(size):
    from runtime.images import device_pixel_values

    rgb = np.random.default_rng(1).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    resized = resize_rgb(rgb, *smart_resize(*rgb.shape[:2]))
    host, _ = normalize_and_pack(resized)
    device = device_pixel_values(torch.from_numpy(resized))
    assert device.dtype == torch.float32 and tuple(device.shape) == host.shape
    assert device.contiguous().numpy().tobytes() == host.tobytes()


# downscales (the bench still, a 1080p frame, a 4:3 photo), upscales past MIN_PIXELS, a size the
# budget keeps, one side kept while the other changes, and the aspect ratio's limit
RESIZE_SIZES = [
    (1600, 900), (1920, 1080), (1024, 768), (2048, 1536), (65, 33), (457, 123), (320, 224),
    (320, 500), (200, 1), (3000, 17), (97, 4000), (3999, 2001), (1366, 768),
]  # fmt: skip


@pytest.mark.parametrize("size", RESIZE_SIZES)
def test_the_torch_resize_is_the_host_resize_byte_for_byte(size):
    """`resize_rgb_torch` (integer arithmetic, any device) against PyTorch's CPU uint8 kernel
    that `resize_rgb` runs, on noise (every weight and rounding in play) and on a ramp."""
    from runtime.images import resize_rgb_torch

    width, height = size
    target = smart_resize(height, width)
    noise = np.random.default_rng(width * height).integers(0, 256, (height, width, 3), np.uint8)
    ramp = (np.indices((height, width)).sum(0)[..., None] * [1, 3, 7] % 256).astype(np.uint8)
    for rgb in (noise, ramp):
        expected = resize_rgb(rgb, *target)
        got = resize_rgb_torch(torch.from_numpy(rgb), *target)
        assert got.dtype == torch.uint8 and got.numpy().tobytes() == expected.tobytes()


def test_the_device_may_resize_the_decoded_image():
    """prepare_image(pack=False, resize=False): no host resize, the grid from the target size, a
    digest of the encoded image; the device's resize and patches are the host's bytes."""
    from runtime.images import PATCH, device_pixel_values, image_digest, resize_rgb_torch

    data = encode(Image.fromarray(pattern(333, 217)[0]))
    packed = prepare_image(data, "image/png")
    left = prepare_image(data, "image/png", pack=False, resize=False)
    assert left.resized is None and left.pixel_values is None
    assert left.grid_thw == packed.grid_thw and left.digest == image_digest(data, "image/png")
    assert left.digest != image_digest(data, "image/jpeg")
    height, width = left.grid_thw[1] * PATCH, left.grid_thw[2] * PATCH
    resized = resize_rgb_torch(torch.from_numpy(left.rgb.copy()), height, width)
    device = device_pixel_values(resized)
    assert device.contiguous().numpy().tobytes() == packed.pixel_values.tobytes()


def test_pack_equals_torchvision_arithmetic():
    rgb = np.random.default_rng(2).integers(0, 256, (96, 64, 3), dtype=np.uint8)
    values, _ = normalize_and_pack(rgb)
    normalized = (rgb.astype(np.float32) - np.float32(127.5)) / np.float32(127.5)
    blocks = normalized.reshape(3, 2, 16, 2, 2, 16, 3).transpose(0, 3, 1, 4, 6, 2, 5)
    expected = np.broadcast_to(blocks[:, :, :, :, :, None], (3, 2, 2, 2, 3, 2, 16, 16))
    assert values.tobytes() == np.ascontiguousarray(expected).reshape(24, 1536).tobytes()


def test_unpacked_image_leaves_the_patches_to_the_device():
    from runtime.images import device_pixel_values

    data = encode(Image.fromarray(pattern(333, 217)[0]))
    packed = prepare_image(data, "image/png")
    unpacked = prepare_image(data, "image/png", pack=False)
    assert unpacked.pixel_values is None and unpacked.grid_thw == packed.grid_thw
    assert unpacked.rgb.tobytes() == packed.rgb.tobytes()
    device = device_pixel_values(torch.from_numpy(unpacked.resized))
    assert device.contiguous().numpy().tobytes() == packed.pixel_values.tobytes()
