"""Image data URLs, decoding and preprocessing (docs/contract.md §2.3, §4.7-4.8), bit-exact with the
reference's `Image.open(...).convert("RGB")` and its Qwen2-VL image processor under MSO1's budget.

A PNG's chunks are walked and bounded before Pillow reads them, and a request's image is opened
by Pillow once: the contract's header check hands its open image to the decode (`OpenedImage`).
An 8-bit RGB, RGBA or gray PNG that Pillow has opened is decoded by libdeflate and libspng
instead of Pillow (`fast_png`, issue 13): the same bytes, a quarter of the time, and without the
GIL; a YCbCr or gray JPEG by libjpeg-turbo through simplejpeg straight into RGB (`fast_jpeg`),
the library and settings Pillow decodes it with; anything else, and anything they refuse or warn
about, goes through Pillow as before.
"""

from __future__ import annotations

import binascii
import ctypes
import functools
import hashlib
import io
import math
import os
import re
import struct
import threading
import warnings
import zlib
from collections.abc import Callable

import numpy as np
from PIL import Image

try:  # SIMD base64 (`fast_base64`); binascii alone without it
    import pybase64
except ImportError:
    pybase64 = None

from runtime.errors import ContractError
from runtime.pools import process_pool
from runtime.types import PreparedImage

DATA_URL_MIMES = {  # the only data-URL prefixes the worker's contract::image accepts
    "data:image/png;base64": "image/png",
    "data:image/jpeg;base64": "image/jpeg",
}
MAGIC = {  # the signatures the image crate's guess_format (and Pillow's _accept) sniff
    "image/png": b"\x89PNG\r\n\x1a\n",
    "image/jpeg": b"\xff\xd8\xff",
}
PILLOW_FORMATS = {"image/png": "PNG", "image/jpeg": "JPEG"}
# where a decode may write its uint8 [H, W, 3] array (`decode_rgb(allocate=...)`): given the shape
Allocate = Callable[[tuple[int, ...]], np.ndarray]

MAX_IMAGE_BYTES = 8 * 1024 * 1024  # §2.3: decoded image size, 8 MiB
MAX_ENCODED_CHARS = 4 * math.ceil(MAX_IMAGE_BYTES / 3)  # 11,184,812: the base64 length of 8 MiB
MAX_SIDE = 4096  # §2.3: the decoder's per-side limit (the worker's image::Limits)
MAX_ASPECT = 200  # §2.3; the processor's smart_resize refuses more as well
MAX_DECODE_BYTES = 4096 * 4096 * 8  # §2.3: the worker's decoder allocation cap, 16-bit RGBA
# Pillow holds any PNG/JPEG mode in at most 4 bytes a pixel and convert("RGB") adds 4 more
# (RGB rows are padded to 32 bits), so a decode peaks at 8 bytes a pixel.
PILLOW_PEAK_BYTES_PER_PIXEL = 8

PATCH = 16  # §4.8: vision patch side
MERGE = 2  # §4.8: 2×2 patches merge into one image token
TEMPORAL = 2  # §4.8: a still is repeated to fill the temporal patch
FACTOR = PATCH * MERGE  # 32: resized sides are multiples of this
MIN_PIXELS = 65_536  # §4.8: the processor's min_pixels
MAX_PIXELS = 768 * 28 * 28  # 602,112: MSO1's budget, overriding the processor config's 401,408
# A clip file's frames (runtime.video) share this many image tokens, each frame's resize keeping
# at most its share (as Qwen's video processors bound a clip's pixels as a whole): half a
# question's 8,192, leaving the rest to its text and options.
CLIP_TOKENS = 4096
# A clip's image prefix at most: CLIP_TOKENS of frames and 512 of text and times (a file's need
# under 200); a mosaic's tiles keep an image's budget, and past this it is refused. Where a
# backend fixes prefix keys, every clip's are this many (runtime.passes).
CLIP_PREFIX = 4608
# mean 0.5 and std 0.5 times 255: transformers' torchvision backend fuses the 1/255 rescale
CUBIC_A = -0.5  # PyTorch's antialiased bicubic (as PIL's), not the -0.75 of its plain bicubic
CUBIC_TAPS = 4  # HelperInterpCubic::interp_size
NORM_MEAN = np.float32(127.5)
NORM_STD = np.float32(127.5)

# The PNG chunk walk (issue 14 §8): Pillow inflates every iCCP, zTXt and compressed iTXt chunk
# (up to 1 MiB each) and counts only text toward its limits, so ~8,000 iCCP chunks in 8 MiB cost
# ~18 s. Real PNGs carry a handful of ancillary chunks (iCCP, pHYs, sRGB, gAMA, cHRM, an XMP
# iTXt, eXIf) and ICC profiles of a few KiB (rarely ~1 MiB); libpng writes 8 KiB IDAT chunks, so
# an 8 MiB image needs ~1,000 chunks. On the 2-core CI machine the walk costs ~0.5 µs a chunk
# and inflating ~4 ms a MiB.
MAX_PNG_CHUNKS = 16_384  # every chunk, IDAT included: an 8 MiB file of ≥ 512-byte chunks
MAX_ANCILLARY_CHUNKS = 256  # chunks other than IHDR, PLTE, IDAT, IEND
# iCCP + zTXt + compressed iTXt, inflated, in all: one profile of Pillow's largest (1 MiB,
# MAX_TEXT_CHUNK) and as much text again; inflating it costs ~8 ms on the 2-core CI machine
MAX_INFLATED_BYTES = 2 * 1024 * 1024
COMPRESSED_CHUNKS = (b"iCCP", b"zTXt", b"iTXt")
ANIMATION_CHUNKS = (b"acTL", b"fcTL", b"fdAT")  # APNG frames: refused at decode, not counted
CRITICAL_CHUNKS = (b"IHDR", b"PLTE", b"IDAT", b"IEND")
CHUNK_HEAD = struct.Struct(">I4s")  # length, type; the CRC follows the data
CHUNK_TYPE = re.compile(rb"\w{4}")  # Pillow's `is_cid`: it stops at any other chunk type

# torchvision's normalize, subtract then divide in float32, has one value per uint8 level: the
# device-side patches are gathered from this table (the same float32 arithmetic, so the same
# bytes on any device, whatever its division rounds like).
NORMALIZED = (np.arange(256, dtype=np.float32) - NORM_MEAN) / NORM_STD

# The decoded RGB is a read-only view of Pillow's bytes; the resize only reads it, but PyTorch
# warns about any read-only array it wraps.
warnings.filterwarnings(
    "ignore", "The given NumPy array is not writable", UserWarning, r"runtime\.images"
)

# standard base64's alphabet: a character's 6-bit value, for the canonical-padding check
# The PNG fast path (`fast_png`). Pillow opens the file as ever (chunks before the image data,
# their CRCs, the mode); then libdeflate inflates the image data (0.2 against 8 ms for zlib on
# the bench still) and libspng unfilters it, fed a PNG of stored deflate blocks: 4-5 ms against
# Pillow's 12 on the 2-core CI machine. Pillow's tile raw mode names what it would decode:
# `(mode, raw mode)` -> (PNG colour type, channels of the image data, libspng format). 16-bit,
# sub-byte and palette images, and interlaced ones, stay with Pillow.
FAST_PNG_MODES = {
    ("RGB", "RGB"): (2, 3, "RGB8"),
    ("RGBA", "RGBA"): (6, 4, "RGB8"),  # libspng drops alpha as convert("RGB") does
    ("L", "L"): (0, 1, "G8"),  # convert("RGB") repeats the gray level
}
# Pillow's modes of the JPEGs libjpeg-turbo itself turns into RGB (`fast_jpeg`): the same
# conversion in Pillow and simplejpeg; Pillow converts CMYK and YCCK with its own arithmetic
JPEG_FAST_MODES = ("RGB", "L")
PNG_FILTERS = 4  # filter types 0-4 (PNG §9.2); Pillow refuses any other, so falls back
STORED_BLOCK = 65_535  # the largest stored deflate block (RFC 1951 §3.2.4)
ZLIB_HEADER = 0x78  # deflate with a 32 KiB window (RFC 1950): zlib's limits are libdeflate's
# libspng's constants (spng.h, 0.7.4, the version pyspng 0.1.4 bundles)
SPNG_CTX_IGNORE_ADLER32 = 1  # the stored stream carries no checksum; libdeflate checked the real
SPNG_CRC_USE = 2  # nor do its chunks carry CRCs
SPNG_FORMATS = {"RGB8": 4, "G8": 64}
# A decode thread keeps its stored-stream buffer for the next image up to this size (the bench
# still needs 4.3 MB); a larger image takes a buffer of its own.
SCRATCH_BYTES = 16 * 1024 * 1024
# libspng's unfiltering is the fast path's cost, and Paeth is most of it: a row of filter type
# 0-4 costs this many ns a byte (2-core CI machine, the bench still's rows all set to one type:
# 0.25 / 1.33 / 0.31 / 2.97 / 10.3 ms for 4.3 MB). A row filtered with None or Sub reads no row
# above it, so the rows from one such row to the next decode on their own, with the bytes of one
# decode: `png_pieces` cuts the image there into pieces of about equal cost, and `fast_png`
# decodes them on DECODE_THREADS threads (the bench still has 26 Sub rows among 900). An image
# filtered by Up, Avg and Paeth alone stays one piece.
FILTER_NS_PER_BYTE = np.array([0.06, 0.31, 0.07, 0.69, 2.4])
# more threads than four decoded the bench still no faster on a 16-core host, and two were the
# best on the 2-core CI machine (docs/performance.md)
DECODE_THREADS = min(4, len(os.sched_getaffinity(0)))
PIECE_MIN_NS = 250_000  # a thread hop costs ~20-50 µs: no piece is made for less than this

BASE64_VALUES = {
    c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")
}

INVALID_IMAGE = "invalid image"
SINGLE_FRAME = "image must be single-frame"
# §2.3 calls the MPO message not known; this is the worker's own text (S1@fc27b75
# image_decode.rs `ensure_single_jpeg`), which starts with SINGLE_FRAME.
MPO_REFUSED = "image must be single-frame; MPF/MPO containers are unsupported"


def parse_data_url(value: object) -> tuple[str, bytes]:
    """The MIME type and bytes of a request's image data URL, checked as contract::image does.

    Only the header is read (Pillow's `Image.open` decodes no pixels).
    """
    mime, data, opened = open_data_url(value)
    opened.close()
    return mime, data


def open_data_url(value: object) -> tuple[str, bytes, OpenedImage]:
    """`parse_data_url`, keeping Pillow's open image for the decode (`decode_rgb(..., opened)`)."""
    if not isinstance(value, str):
        raise ContractError("an image must be a data URL")
    prefix, comma, encoded = value.partition(",")
    if not comma:
        raise ContractError("invalid image data URL")
    mime = DATA_URL_MIMES.get(prefix)
    if mime is None:
        raise ContractError("only inline PNG/JPEG images are supported")
    # §2.3 calls this message not known; the worker's contract.rs (S1@1df4c2d) uses this one.
    if len(encoded) > MAX_ENCODED_CHARS:
        raise ContractError("image exceeds 8 MiB")
    data = decode_base64(encoded)
    if len(data) > MAX_IMAGE_BYTES:
        raise ContractError("image exceeds 8 MiB")
    return mime, data, OpenedImage(open_header(data, mime))


def decode_base64(encoded: str, *, simd: bool = True) -> bytes:
    """Strict standard base64 with canonical padding, as Rust's base64 `STANDARD` engine.

    `simd`: try pybase64 first (`fast_base64`); without it, binascii alone decides (the same
    texts and bytes either way)."""
    data = fast_base64(encoded) if simd else None
    if data is None:
        try:
            data = binascii.a2b_base64(encoded, strict_mode=True)
        except (ValueError, TypeError):  # binascii.Error, or a non-ASCII character
            raise ContractError("invalid base64 image") from None
    # Strict mode still accepts padding after a whole quantum ("QUJD====") and nonzero trailing
    # bits ("QR=="); a canonical text has whole quanta and zero bits there, which its last data
    # character (before any "=") alone decides. This is b64encode(data) == encoded, uncopied.
    if len(encoded) % 4 or not canonical_tail(encoded):
        raise ContractError("invalid base64 image")
    return data


def fast_base64(encoded: str) -> bytes | None:
    """pybase64's SIMD decode with validation (a 3.2 MB image: 0.26 ms, binascii 10 ms on the
    2-core CI machine), or None where it is missing or refuses the text. It refuses more than
    binascii's strict mode (padding before a text's end, "QUJD="), never less: binascii then
    decides, so the texts accepted are exactly its (tests/test_images.py)."""
    if pybase64 is None:
        return None
    try:
        return pybase64.b64decode(encoded, validate=True)
    except (ValueError, TypeError):
        return None


def canonical_tail(encoded: str) -> bool:
    """Whether a strictly decoded text has at most two "=" and zero bits where they drop some
    (4 before "==", 2 before "=")."""
    if encoded.endswith("==="):
        return False
    if encoded.endswith("=="):
        return BASE64_VALUES[encoded[-3]] & 0b1111 == 0
    if encoded.endswith("="):
        return BASE64_VALUES[encoded[-2]] & 0b11 == 0
    return True


class OpenedImage:
    """Pillow's lazily opened image of one request, handed once from the header check to the
    decode, so that a request's image is opened (and its PNG chunks walked) once."""

    def __init__(self, image: Image.Image):
        self.size: tuple[int, int] = image.size
        self._image: Image.Image | None = image
        self._lock = threading.Lock()

    def take(self) -> Image.Image | None:
        """The open image the first time; None after (the caller then opens the bytes again)."""
        with self._lock:
            image, self._image = self._image, None
        return image

    def close(self) -> None:
        image = self.take()
        if image is not None:
            image.close()


def open_header(data: bytes, mime: str) -> Image.Image:
    """Pillow's lazily opened image, after the format, size and aspect checks of §2.3."""
    if mime not in PILLOW_FORMATS:
        raise ContractError("only inline PNG/JPEG images are supported")
    if not data.startswith(MAGIC[mime]):
        raise ContractError("image format does not match its MIME type")
    if mime == "image/png":
        walk_png(data)
    # Pillow raises many exception types for a bad header, and refuses a zero side. Its bomb
    # check raises above 2 * MAX_IMAGE_PIXELS and only warns below; check_size refuses both
    # before any pixel is decoded.
    try:
        image = Image.open(io.BytesIO(data), formats=[PILLOW_FORMATS[mime]])
    except Exception:
        raise ContractError(INVALID_IMAGE) from None
    try:
        check_size(*image.size)
    except ContractError:
        image.close()
        raise
    return image


def walk_png(data: bytes) -> None:
    """Bounds a PNG's chunks before Pillow reads them: how many, how many ancillary, and how
    many bytes their compressed metadata inflates to. A malformed or truncated chunk ends the
    walk: what to say about it is Pillow's (and so the worker's) `invalid image`."""
    position, chunks, ancillary, inflated = len(MAGIC["image/png"]), 0, 0, 0
    while position + CHUNK_HEAD.size <= len(data):
        length, kind = CHUNK_HEAD.unpack_from(data, position)
        start, end = position + CHUNK_HEAD.size, position + CHUNK_HEAD.size + length
        if end + 4 > len(data) or kind == b"IEND" or not CHUNK_TYPE.fullmatch(kind):
            return
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise ContractError(f"image has more than {MAX_PNG_CHUNKS} PNG chunks")
        if kind not in CRITICAL_CHUNKS and kind not in ANIMATION_CHUNKS:
            ancillary += 1
            if ancillary > MAX_ANCILLARY_CHUNKS:
                raise ContractError(
                    f"image has more than {MAX_ANCILLARY_CHUNKS} ancillary PNG chunks"
                )
        if kind in COMPRESSED_CHUNKS:
            inflated += inflated_size(kind, data[start:end], MAX_INFLATED_BYTES - inflated)
            if inflated > MAX_INFLATED_BYTES:
                raise ContractError(f"image metadata inflates past {MAX_INFLATED_BYTES} bytes")
        position = end + 4  # the CRC, which Pillow checks


def inflated_size(kind: bytes, body: bytes, budget: int) -> int:
    """Bytes the chunk's compressed field inflates to, counted up to `budget` + 1 (0 for an
    uncompressed iTXt or a malformed chunk, which Pillow judges)."""
    keyword_end = body.find(b"\0")
    if keyword_end < 0:
        return 0
    if kind == b"iTXt":
        # keyword \0 flag method language \0 translated keyword \0 text
        if body[keyword_end + 1 : keyword_end + 2] != b"\x01":
            return 0
        fields = body[keyword_end + 3 :].split(b"\0", 2)
        if len(fields) < 3:
            return 0
        stream = fields[2]
    else:  # iCCP, zTXt: keyword \0 method stream
        stream = body[keyword_end + 2 :]
    inflater = zlib.decompressobj()
    try:
        return len(inflater.decompress(stream, max(budget, 0) + 1))
    except zlib.error:
        return 0


def check_size(width: int, height: int) -> None:
    """The header checks of §2.3, in the worker's order.

    A side over 4096 is `invalid image`: the worker reads the dimensions through a decoder
    limited to 4096×4096, which fails (`invalid image`) before its own per-side check; its
    contract tests expect `invalid image` for a 4097×64 PNG. That leaves the per-side message
    to a zero side, which Pillow already refuses at open (`invalid image`), so for PNG and JPEG
    input the message is unreachable here; the check stays where the worker has it.
    """
    if width > MAX_SIDE or height > MAX_SIDE:
        raise ContractError(INVALID_IMAGE)
    if width <= 0 or height <= 0:
        raise ContractError("image must be at most 4096 pixels per side")
    if max(width, height) > MAX_ASPECT * min(width, height):
        raise ContractError("image aspect ratio must be at most 200")


def decode_rgb(
    data: bytes,
    mime: str,
    opened: OpenedImage | None = None,
    allocate: Allocate | None = None,
    *,
    fast: bool = True,
) -> np.ndarray:
    """Pillow's `Image.open(...).convert("RGB")` as uint8 [H, W, 3], refusing animations.

    `opened` is the contract's open image of these bytes, used if not taken yet. The array is a
    read-only view of Pillow's pixel bytes: `convert("RGB")` of an RGB image would only copy.
    `allocate(shape)` gives the uint8 array a PNG that libspng decodes, or a JPEG that
    libjpeg-turbo does, is written into (pinned memory, for an upload without a copy); Pillow's
    decodes keep their own. `fast`: a PNG tries `fast_png` first, a JPEG `fast_jpeg`; without
    it, Pillow alone decodes (the same pixels or refusal).
    """
    image = opened.take() if opened is not None else None
    if image is None:
        image = open_header(data, mime)
    with image:
        check_single_frame(image)
        width, height = image.size
        if width * height * PILLOW_PEAK_BYTES_PER_PIXEL > MAX_DECODE_BYTES:
            raise ContractError(INVALID_IMAGE)
        rgb = None
        if fast:
            rgb = (fast_png if mime == "image/png" else fast_jpeg)(data, image, allocate)
        if rgb is not None:
            return rgb
        try:
            image.load()
            if image.mode == "RGB":
                return np.asarray(image)
            with image.convert("RGB") as rgb:
                return np.asarray(rgb)
        except Exception:  # truncated or corrupt pixel data
            raise ContractError(INVALID_IMAGE) from None


class Libspng:
    """libspng's decoder through ctypes: pyspng's extension exports its C API, and a ctypes call
    releases the GIL (pyspng's own `load` holds it and copies the input)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        pointer, size = ctypes.c_void_p, ctypes.c_size_t
        lib.spng_ctx_new.restype = pointer
        lib.spng_ctx_new.argtypes = [ctypes.c_int]
        lib.spng_ctx_free.argtypes = [pointer]
        lib.spng_set_crc_action.argtypes = [pointer, ctypes.c_int, ctypes.c_int]
        lib.spng_set_png_buffer.argtypes = [pointer, pointer, size]
        lib.spng_decode_image.argtypes = [pointer, pointer, size, ctypes.c_int, ctypes.c_int]
        self.lib = lib

    def decode(self, png: np.ndarray, out: np.ndarray, fmt: int) -> bool:
        """Decodes the PNG in `png` into `out` (its exact size); False where libspng refuses."""
        lib = self.lib
        ctx = lib.spng_ctx_new(SPNG_CTX_IGNORE_ADLER32)
        if not ctx:
            return False
        try:
            lib.spng_set_crc_action(ctx, SPNG_CRC_USE, SPNG_CRC_USE)
            if lib.spng_set_png_buffer(ctx, png.ctypes.data, png.nbytes):
                return False
            return lib.spng_decode_image(ctx, out.ctypes.data, out.nbytes, fmt, 0) == 0
        finally:
            lib.spng_ctx_free(ctx)


def fast_jpeg(
    data: bytes, image: Image.Image, allocate: Allocate | None = None
) -> np.ndarray | None:
    """`convert("RGB")` of an opened, unloaded YCbCr or gray JPEG by libjpeg-turbo through
    simplejpeg, decoded straight into RGB (into `allocate`'s array where given), or None where
    Pillow must decode it: other colour spaces (CMYK, YCCK: Pillow converts those itself), or a
    stream libjpeg-turbo warns about (truncated or corrupt data: Pillow's outcome decides).

    Byte for byte Pillow's: Pillow decodes a JPEG with libjpeg-turbo too, with its defaults, the
    accurate integer DCT and fancy upsampling, which simplejpeg is told to keep; gray comes out
    replicated into three channels, as `convert("RGB")` does.
    """
    if image.mode not in JPEG_FAST_MODES:
        return None
    try:
        import simplejpeg
    except ImportError:  # a deployment without it: Pillow
        return None
    width, height = image.size
    out = allocate((height, width, 3)) if allocate is not None else None
    try:
        return simplejpeg.decode_jpeg(
            data, colorspace="RGB", fastdct=False, fastupsample=False, strict=True, buffer=out
        )
    except ValueError:
        return None


@functools.cache
def fast_png_codecs() -> tuple[Callable[[bytes, int], bytes], Libspng] | None:
    """libdeflate's zlib inflate and libspng, or None where either is missing (Pillow then)."""
    try:
        import deflate
        from pyspng import _pyspng_c
    except ImportError:
        return None

    def inflate(stream: bytes, size: int) -> bytes:
        try:
            return deflate.zlib_decompress(stream, size)
        except deflate.DeflateError:
            return b""

    try:
        return inflate, Libspng(_pyspng_c.__file__)
    except (OSError, AttributeError):
        return None


def fast_png(
    data: bytes,
    image: Image.Image,
    allocate: Allocate | None = None,
    *,
    threads: int = DECODE_THREADS,
    piece_ns: int = PIECE_MIN_NS,
) -> np.ndarray | None:
    """`convert("RGB")` of an opened, unloaded 8-bit RGB, RGBA or gray PNG by libdeflate and
    libspng, or None where Pillow must decode it (other modes, interlace, image data that is not
    one run of IDAT chunks then IEND, a stream either library refuses).

    Byte for byte Pillow's: Pillow has read every chunk before the image data; the run of IDAT
    chunks ends in IEND, so Pillow's `load_end` reads nothing more; libdeflate takes only a
    complete zlib stream of a 32 KiB window with its checksum, inflating to exactly the rows
    (Pillow reads those bytes and stops); the filter types are checked; libspng unfilters them,
    in at most `threads` pieces of at least `piece_ns` each (`png_pieces`).
    """
    codecs = fast_png_codecs()
    if codecs is None or len(image.tile) != 1 or image.info.get("interlace"):
        return None
    # (codec, extents, offset, raw mode): a plain tuple before Pillow 11's `ImageFile._Tile`
    codec, extents, offset, rawmode = tuple(image.tile[0])
    width, height = image.size
    fast = FAST_PNG_MODES.get((image.mode, rawmode if isinstance(rawmode, str) else None))
    if fast is None or codec != "zip" or tuple(extents) != (0, 0, width, height):
        return None
    colour_type, channels, spng_format = fast
    stream = idat_stream(data, offset - CHUNK_HEAD.size)
    if stream is None or len(stream) < 2 or stream[0] != ZLIB_HEADER:
        return None
    stride = 1 + width * channels
    inflate, libspng = codecs
    raw = inflate(stream, height * stride)
    if len(raw) != height * stride:
        return None
    filters = np.frombuffer(raw, np.uint8)[::stride]
    if filters.max() > PNG_FILTERS:
        return None
    gray = spng_format == "G8"
    shape = (height, width) if gray else (height, width, 3)
    out = allocate(shape) if allocate is not None and not gray else np.empty(shape, np.uint8)
    pieces = png_pieces(filters, stride, threads, piece_ns)
    if not unfilter_pieces(libspng, raw, pieces, out, stride, colour_type, spng_format):
        return None
    return np.repeat(out[:, :, None], 3, axis=2) if gray else out


def png_pieces(
    filters: np.ndarray, stride: int, count: int, piece_ns: int = PIECE_MIN_NS
) -> list[tuple[int, int]]:
    """Row ranges [start, stop) that cover the image, each starting at row 0 or at a row
    filtered with None or Sub, cut where the estimated unfiltering cost (FILTER_NS_PER_BYTE)
    crosses each 1/n of the whole, n at most `count` and no piece meant to cost less than
    `piece_ns`."""
    height = filters.size
    cost = np.cumsum(FILTER_NS_PER_BYTE[filters] * stride)
    wanted = min(count, int(cost[-1] // piece_ns))
    starts = np.flatnonzero(filters[1:] <= 1) + 1  # rows that read no row above them
    if wanted < 2 or starts.size == 0:
        return [(0, height)]
    before = cost[starts - 1]  # the cost of the rows above each possible start
    targets = cost[-1] * np.arange(1, wanted) / wanted
    chosen = np.unique(starts[np.minimum(np.searchsorted(before, targets), starts.size - 1)])
    bounds = [0, *chosen.tolist(), height]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def unfilter_pieces(
    libspng: Libspng,
    raw: bytes,
    pieces: list[tuple[int, int]],
    out: np.ndarray,
    stride: int,
    colour_type: int,
    spng_format: str,
) -> bool:
    """libspng's decode of each piece of the filtered rows `raw` into its rows of `out`: the
    first piece on this thread, the others on the decode pool; whether every piece decoded."""
    view = memoryview(raw)
    width = out.shape[1]

    def piece(start: int, stop: int) -> bool:
        png = stored_png(view[start * stride : stop * stride], width, stop - start, colour_type)
        return libspng.decode(png, out[start:stop], SPNG_FORMATS[spng_format])

    if len(pieces) == 1:
        return piece(*pieces[0])
    pool = process_pool("png", DECODE_THREADS)
    others = [pool.submit(piece, *bounds) for bounds in pieces[1:]]
    first = piece(*pieces[0])
    return all([first, *(future.result() for future in others)])


def idat_stream(data: bytes, position: int) -> bytes | None:
    """The image data of the run of IDAT chunks at `position`, if IEND's header follows it."""
    view, pieces = memoryview(data), []
    while position + CHUNK_HEAD.size <= len(data):
        length, kind = CHUNK_HEAD.unpack_from(data, position)
        if kind != b"IDAT":
            return b"".join(pieces) if kind == b"IEND" and pieces else None
        start = position + CHUNK_HEAD.size
        if start + length + 4 > len(data):
            return None
        pieces.append(view[start : start + length])
        position = start + length + 4
    return None


_scratch = threading.local()


def stored_png(raw: bytes, width: int, height: int, colour_type: int) -> np.ndarray:
    """A PNG of `raw` (filtered scanlines) in stored deflate blocks: signature, IHDR, one IDAT,
    IEND. Neither the zlib checksum nor the IDAT CRC is written (libspng is told to skip them)."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    size, blocks = len(raw), max(1, -(-len(raw) // STORED_BLOCK))
    body = 2 + 5 * blocks + size + 4
    head = b"".join(
        [
            MAGIC["image/png"],
            CHUNK_HEAD.pack(len(ihdr), b"IHDR"),
            ihdr,
            struct.pack(">I", zlib.crc32(b"IHDR" + ihdr)),
            CHUNK_HEAD.pack(body, b"IDAT"),
            bytes([ZLIB_HEADER, 0x01]),
        ]
    )
    tail = bytes(8) + CHUNK_HEAD.pack(0, b"IEND") + struct.pack(">I", zlib.crc32(b"IEND"))
    total = len(head) + 5 * blocks + size + len(tail)
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.size < total:
        buffer = np.empty(total, np.uint8)
        if total <= SCRATCH_BYTES:
            _scratch.buffer = buffer
    png = buffer[:total]
    png[: len(head)] = np.frombuffer(head, np.uint8)
    source = np.frombuffer(raw, np.uint8)
    full = size // STORED_BLOCK
    at = len(head)
    if full:
        whole = png[at : at + full * (STORED_BLOCK + 5)].reshape(full, STORED_BLOCK + 5)
        whole[:, 5:] = source[: full * STORED_BLOCK].reshape(full, STORED_BLOCK)
        whole[:, :5] = np.frombuffer(stored_header(STORED_BLOCK, False), np.uint8)
        at += full * (STORED_BLOCK + 5)
    rest = size - full * STORED_BLOCK
    if rest or not full:
        png[at : at + 5] = np.frombuffer(stored_header(rest, True), np.uint8)
        png[at + 5 : at + 5 + rest] = source[full * STORED_BLOCK :]
        at += 5 + rest
    else:
        png[at - (STORED_BLOCK + 5)] = 1  # BFINAL on the last whole block
    png[at:] = np.frombuffer(tail, np.uint8)
    return png


def stored_header(length: int, final: bool) -> bytes:
    """A stored deflate block's header: BFINAL/BTYPE byte, LEN and NLEN (RFC 1951 §3.2.4)."""
    return struct.pack("<BHH", int(final), length, length ^ 0xFFFF)


def check_single_frame(image: Image.Image) -> None:
    """Refuses an APNG and an MPO container rather than decoding their first picture."""
    # Any MPF APP2 segment before the scan makes an MPO container for the worker; Pillow calls
    # it MPO only when it lists more than one picture.
    segments = getattr(image, "applist", [])
    if any(name == "APP2" and body.startswith(b"MPF\0") for name, body in segments):
        raise ContractError(MPO_REFUSED)
    # Any acTL chunk makes an APNG for the worker (`is_apng`), even one with a single frame.
    if getattr(image, "is_animated", False) or image.get_format_mimetype() == "image/apng":
        raise ContractError(SINGLE_FRAME)


def smart_resize(height: int, width: int, most: int = MAX_PIXELS) -> tuple[int, int]:
    """The processor's `smart_resize` with factor 32 and MSO1's budget (§4.8), or a clip's frame
    budget `most` (runtime.video.clip_pixels); Python `round`."""
    if height <= 0 or width <= 0:
        raise ContractError(INVALID_IMAGE)
    if max(height, width) > MAX_ASPECT * min(height, width):
        raise ContractError("image aspect ratio must be at most 200")
    h_bar = round(height / FACTOR) * FACTOR
    w_bar = round(width / FACTOR) * FACTOR
    if h_bar * w_bar > most:
        beta = math.sqrt(height * width / most)
        h_bar = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w_bar = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif h_bar * w_bar < MIN_PIXELS:
        beta = math.sqrt(MIN_PIXELS / (height * width))
        h_bar = math.ceil(height * beta / FACTOR) * FACTOR
        w_bar = math.ceil(width * beta / FACTOR) * FACTOR
    return h_bar, w_bar


def resize_rgb(rgb: np.ndarray, height: int, width: int) -> np.ndarray:
    """PyTorch's CPU uint8 bicubic antialias resize of uint8 [H, W, 3], as torchvision runs it."""
    # Imported here so that the contract's data-URL checks do not pay for importing torch.
    import torch

    # Read-only input (the decode's view of Pillow's bytes) is only read here.
    source = torch.from_numpy(np.require(rgb, np.uint8, ["C"])).permute(2, 0, 1)[None]
    # uint8 input keeps PyTorch on its integer kernel (int16 fixed-point weights, rounding after
    # each pass), which the reference uses; a float resize rounds differently.
    resized = torch.nn.functional.interpolate(
        source, size=(height, width), mode="bicubic", antialias=True, align_corners=False
    )
    return resized[0].permute(1, 2, 0).contiguous().numpy()


def cubic_aa(x: np.ndarray) -> np.ndarray:
    """PyTorch's antialiased bicubic filter (HelperInterpCubic::aa_filter, Keys a = -0.5, as
    PIL), in its expression order, on float64 arrays."""
    a = CUBIC_A
    x = np.abs(x)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=64)
def resize_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One axis of `resize_rgb`'s integer resize: source index [out, taps] (int64), int16-range
    weight [out, taps] (int32; 0 past an output's own taps) and the weights' precision in bits.

    PyTorch's HelperInterpBase::_compute_indices_min_size_weights_aa and
    _compute_index_ranges_int16_weights (aten/src/ATen/native/cpu/UpSampleKernel.cpp): PIL's
    centre and support in float64, weights normalised by their sum, rescaled at the largest
    precision that keeps the axis's largest weight under 2^15, rounded half away from zero.
    Every output at once, each float64 operation in the C++ order (a new image size's first
    request pays this on the host)."""
    scale = in_size / out_size
    support = (CUBIC_TAPS * 0.5) * scale if scale >= 1.0 else CUBIC_TAPS * 0.5
    taps = math.ceil(support) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    end = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size)
    xsize = np.minimum(np.maximum(end - xmin, 0), taps)
    j = np.arange(taps, dtype=np.int64)
    own = j[None, :] < xsize[:, None]
    source = xmin[:, None] + j[None, :]
    row = np.where(own, cubic_aa(((source - center[:, None]) + 0.5) * invscale), 0.0)
    total = np.zeros(out_size, dtype=np.float64)
    for column in range(taps):  # in order, as C++ adds
        total = total + row[:, column]
    summed = total != 0.0
    # in place; a row whose weights sum to 0 keeps them raw, as the C++ does
    weights = np.divide(row, total[:, None], out=row, where=summed[:, None])
    largest = float(weights[summed].max(initial=0.0))
    index = np.where(own, source, xmin[:, None])
    precision = 0
    while precision < 22 and int(0.5 + largest * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    scaled = weights * (1 << precision)
    rounded = np.where(scaled < 0, np.trunc(scaled - 0.5), np.trunc(scaled + 0.5))
    return index, rounded.astype(np.int32), precision


@functools.lru_cache(maxsize=64)
def device_taps(in_size: int, out_size: int, device) -> tuple:
    """`resize_taps` on a device (weights as float64), made once per size pair: an upload from
    pageable memory would make the host wait for the device."""
    import torch

    index, weights, precision = resize_taps(in_size, out_size)
    weights = torch.from_numpy(weights.astype(np.float64))
    return torch.from_numpy(index).to(device), weights.to(device), precision


def resize_matrix(index, weights, in_size: int):
    """The taps as a dense float64 [in, out] matrix (column j: output j's integer weights at its
    source pixels), made per request on the taps' device: one is up to tens of MB. Padded taps
    repeat the first source pixel with weight 0, so adding them changes nothing."""
    import torch

    matrix = torch.zeros(in_size, index.shape[0], dtype=torch.float64, device=index.device)
    return matrix.scatter_add_(0, index.t(), weights.t())


def resize_axis(x, index, weights, precision: int):
    """One integer pass of `resize_rgb` along the last dimension of a float64 torch image of
    integers: Σ pixel × weight as one float64 product, plus half an LSB, divided by 2^precision
    and floored (the kernel's shift), clamped to 0-255. Exact whatever the product's order of
    sums: a term is an integer below 2^23 (255 × a weight under 2^15), and every partial sum of
    an output's taps is an integer far below 2^53, which a float64 holds exactly."""
    total = x @ resize_matrix(index, weights, x.shape[-1])
    return total.add_(1 << (precision - 1)).mul_(2.0**-precision).floor_().clamp_(0, 255)


def resize_rgb_torch(rgb, height: int, width: int):
    """`resize_rgb` on a uint8 [H, W, 3] torch tensor on any device, byte for byte (integer
    arithmetic in float64 products: width first, the intermediate rounded to uint8, then
    height, as PyTorch's CPU kernel). About 16 kernels, not three per tap and axis."""
    import torch

    x = rgb.to(torch.float64).permute(2, 0, 1)  # [3, H, W]: each pass runs on the last axis
    if width != rgb.shape[1]:
        x = resize_axis(x, *device_taps(rgb.shape[1], width, rgb.device))
    if height != rgb.shape[0]:
        x = x.transpose(1, 2)
        x = resize_axis(x, *device_taps(rgb.shape[0], height, rgb.device))
        x = x.transpose(1, 2)
    return x.permute(1, 2, 0).to(torch.uint8)


def check_grid(height: int, width: int, channels: int) -> tuple[int, int]:
    """The patch grid (H/16, W/16) of a resized image, whose sides are multiples of 32."""
    if channels != 3 or height % FACTOR or width % FACTOR:
        raise ValueError("expected RGB with sides that are multiples of 32")
    return height // PATCH, width // PATCH


def resized_grid(size: tuple[int, int]) -> tuple[int, int, int]:
    """The patch grid (1, H/16, W/16) of an image resized to `size` (height, width)."""
    return (1, *check_grid(*size, 3))


def normalize_and_pack(rgb: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalized float32 patches [patches, 1536] of a resized uint8 [H, W, 3], and the grid.

    Block-major order (§4.8): 32×32 blocks row-major, their 2×2 patches row-major, each patch
    laid out channel, temporal copy, 16 rows, 16 columns.
    """
    grid_h, grid_w = check_grid(*rgb.shape)
    # torchvision's normalize: subtract, then divide, in float32. (Measured: this beats putting
    # the uint8 pixels in order first and gathering from NORMALIZED, 2.9 against 4.5 ms.)
    values = (rgb.astype(np.float32) - NORM_MEAN) / NORM_STD
    blocks = values.reshape(grid_h // MERGE, MERGE, PATCH, grid_w // MERGE, MERGE, PATCH, 3)
    # -> block row, block column, patch row, patch column, channel, pixel row, pixel column
    blocks = blocks.transpose(0, 3, 1, 4, 6, 2, 5)[:, :, :, :, :, None]
    shape = (grid_h // MERGE, grid_w // MERGE, MERGE, MERGE, 3, TEMPORAL, PATCH, PATCH)
    patches = np.broadcast_to(blocks, shape).reshape(grid_h * grid_w, 3 * TEMPORAL * PATCH**2)
    return patches, (1, grid_h, grid_w)


def device_pixel_values(resized, table=None):
    """`normalize_and_pack`'s patches from a uint8 [H, W, 3] torch tensor on any device, as a
    float32 [patches, 1536] tensor there, byte for byte the host's (the same table lookup).

    The executor can upload `PreparedImage.resized` (1.7 MB for the bench still) instead of the
    float32 patches (14 MB); `table` is `NORMALIZED` already on that device, if kept.
    """
    import torch

    grid_h, grid_w = check_grid(*resized.shape)
    if table is None:
        table = torch.from_numpy(NORMALIZED).to(resized.device)
    blocks = resized.reshape(grid_h // MERGE, MERGE, PATCH, grid_w // MERGE, MERGE, PATCH, 3)
    ordered = blocks.permute(0, 3, 1, 4, 6, 2, 5).reshape(grid_h * grid_w, 3, 1, PATCH * PATCH)
    values = table[ordered.long()]
    shape = (grid_h * grid_w, 3, TEMPORAL, PATCH * PATCH)
    return values.expand(shape).reshape(grid_h * grid_w, 3 * TEMPORAL * PATCH**2)


def device_image_patches(image: PreparedImage, upload: Callable, table=None):
    """`device_pixel_values` of a prepared image on the device: from its resized image, or from
    the decoded one resized there first (`prepare_image(pack=False, resize=False)`); `upload`
    puts a uint8 array on the device."""
    if image.resized is not None:
        return device_pixel_values(upload(image.resized), table)
    height, width = image.grid_thw[1] * PATCH, image.grid_thw[2] * PATCH
    return device_pixel_values(resize_rgb_torch(upload(image.rgb), height, width), table)


def prepare_image(
    data: bytes,
    mime: str,
    opened: OpenedImage | None = None,
    pack: bool = True,
    resize: bool = True,
    allocate: Allocate | None = None,
) -> PreparedImage:
    """Decodes, resizes, normalizes and packs an image for the vision tower.

    With `pack` False the patches are left to the device (`device_pixel_values(resized)`):
    `pixel_values` is then None and the host skips its largest array (14 MB for the bench still).
    With `resize` False as well, the resize is left to the device too (`resize_rgb_torch(rgb)`):
    `resized` is None and `digest` names the image for the prefix cache.
    """
    rgb = decode_rgb(data, mime, opened, allocate)
    digest = None if pack or resize else image_digest(data, mime)
    return image_of_rgb(rgb, pack, resize, MAX_PIXELS, digest)


def image_of_rgb(
    rgb: np.ndarray, pack: bool, resize: bool, most: int, digest: bytes | None
) -> PreparedImage:
    """A decoded image (or a clip's frame) prepared as `prepare_image` says, its resize keeping
    at most `most` pixels; `digest` names it where the resize is the device's (None elsewhere)."""
    height, width = rgb.shape[:2]
    size = smart_resize(height, width, most)
    resized = resize_rgb(rgb, *size) if pack or resize else None
    if pack:
        pixel_values, grid_thw = normalize_and_pack(resized)
    else:
        pixel_values, grid_thw = None, resized_grid(size)
    return PreparedImage(
        width=width,
        height=height,
        rgb=rgb,
        pixel_values=pixel_values,
        grid_thw=grid_thw,
        resized=resized,
        digest=digest,
    )


def image_digest(data: bytes, mime: str) -> bytes:
    """sha256 of an encoded image and its type: what the prefix cache keys an image by when the
    device resizes it (the decode is a function of the two; the encoded bytes are fewer to hash
    than the decoded ones, 4.3 MB for the bench still)."""
    digest = hashlib.sha256(mime.encode())
    digest.update(b"\0")
    digest.update(data)
    return digest.digest()
