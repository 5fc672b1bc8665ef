"""A request's video: `state.video` checked (a file's data URL, or the reference's frame mosaic),
its frames decoded with PyAV, sampled uniformly and cut out, each frame an RGB image.

The reference reads a clip as up to 16 frames, each its own image input (docs/model.md §8.2);
every limit below is checked before the pixels it guards are decoded (docs/contract.md §2.10).
"""

from __future__ import annotations

import io
import json
import math
import mmap
import os
import pickle
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime import images
from runtime.errors import ContractError
from runtime.types import VideoFrames
from runtime.video_tracks import mp4_tracks, webm_tracks

# The reference's mosaic holds at most 16 frames, and a file is sampled to as many.
MAX_FRAMES = 16
MAX_DURATION = 300  # seconds: decision questions are about short clips
VIDEO_MIMES = {  # data-URL prefix -> (MIME type, PyAV demuxer)
    "data:video/mp4;base64": ("video/mp4", "mp4"),
    "data:video/webm;base64": ("video/webm", "webm"),
}
CODECS = {"video/mp4": ("h264",), "video/webm": ("vp8", "vp9")}  # a container's video codecs
MAX_VIDEO_BYTES = images.MAX_IMAGE_BYTES  # 8 MiB decoded, as an image (the body's 12 MiB holds it)
MAX_ENCODED_CHARS = images.MAX_ENCODED_CHARS
# A container's streams (video, audio, subtitles) before any is read: a clip has a few; thousands
# of empty ones only cost the demuxer time.
MAX_STREAMS = 8
# Frames a file's video stream may hold (demuxed packets): 30 frames a second for MAX_DURATION.
MAX_STREAM_FRAMES = 30 * MAX_DURATION
# A frame's pixels: 4K UHD. Every frame of the stream is decoded (later frames need earlier
# ones), so the pixels of all of them are bounded too, ~15 s of one core at 1080p.
MAX_FRAME_PIXELS = 3840 * 2160
MAX_DECODED_PIXELS = 1_000_000_000
DECODE_SECONDS = 10.0  # the whole decode, checked between frames
# a file decodes in a Python process of its own (`decoder_main`, ~0.2 s to start, so the next
# one is started while a request decodes): a fork of the worker would copy its threads' locks,
# and a forkserver that imported the worker's main module (torch) takes ~1 s a fork
# processes started ahead, one a request that prepares at once (the worker's preparation slots):
# with one, the second of two clips at once waited for a process to start (the slower of two
# 342-421 ms against 245-322 with two, on this project's 2-core CPU machine)
DECODER_SPARES = 2
DECODER_SLACK = 2.0  # the process's start and the frames' way back, past DECODE_SECONDS
# the decoder's address space: 16 frames of 4096×2048 RGB, FFmpeg's reference frames at the
# frame limit, and Python, NumPy and PyAV themselves, with room to spare
DECODER_MEMORY = 4 * 1024**3
ROOT = Path(__file__).resolve().parents[1]  # where `runtime` is imported from in the decoder
DECODER_THREADS = 1  # a request decodes on its preparation thread, beside another request's
# A fresh process's decode of a 16-frame 1280x720 clip took 47-64 ms on this project's CPU
# machine, 23 ms in one that had decoded before: its frames land on pages the kernel faults in
# and zeroes one by one (the round trip with them faulted in ahead: 64-81 ms, not 109-136). A spare
# touches DECODER_WARM bytes of heap while it waits, and glibc's malloc is told to serve blocks
# up to its largest mmap threshold from the heap and to keep freed heap: the frames' arrays and
# FFmpeg's buffers then reuse those pages
DECODER_WARM = 128 * 1024**2
WARM_PIECE = 16 * 1024**2  # below the threshold: from the heap
DECODER_HEAP = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024**2),  # glibc's largest on 64-bit
    "MALLOC_TRIM_THRESHOLD_": str(2 * DECODER_WARM),
}
# the frames come back through a file in memory, not the pipe: 16 frames of 1280x720 are 44 MB,
# pickled through a pipe ~100 ms a clip on this project's CPU machine, written ~20 ms and mapped;
# where /dev/shm cannot hold the largest clip's frames (a container's default is 64 MB), the
# temporary directory takes them
SHARED_MEMORY = Path("/dev/shm")
# a mapped file's frames hold their pages until the request is done with them, and two requests
# prepare at once (the worker's preparation slots): room for two of the largest clips' frames
LARGEST_FRAMES = 2 * MAX_FRAMES * MAX_FRAME_PIXELS * 3
# The decoder answers in one line of JSON, never a pickle: a container that took over FFmpeg
# must not reach the worker through its answer. The line is read as soon as it is complete,
# not at the process's exit (its address space torn down, ~5 ms a clip on this project's CPU
# machine): 16 frames' shapes and timestamps, or a refusal, are far below this
ANSWER_BYTES = 64 * 1024
MOSAIC_FIELDS = ("n_frames", "cols", "tile", "timestamps", "duration")
MP4_MAGIC_AT, MP4_MAGIC = 4, b"ftyp"  # ISO BMFF's first box
WEBM_MAGIC = b"\x1a\x45\xdf\xa3"  # EBML header
INVALID_VIDEO = "invalid video"
NO_DECODER = "video is not supported here: PyAV is not installed"
# MP4 and WebM name every stream's codec and size in their headers: the demuxer's probe of the
# packets is kept to its least, which opens a thousand streams in 0.1 s rather than 0.6
DEMUX_OPTIONS = {"probesize": "32", "analyzeduration": "0", "fpsprobesize": "0"}


class VideoSource:
    """A request's video as the contract leaves it; `prepare` makes the request's `Prepared`
    (`runtime.processing.prepare` hands a video request here, which imports nothing of this)."""

    def prepare(self, request, tokenizer, planner=None, pack: bool = True, resize: bool = True):
        from runtime.video_prepare import prepare_video

        started = time.perf_counter()
        frames = video_frames(self)
        # where the device resizes, the frames are named by their source's bytes for the
        # prefix cache (hashing 16 decoded 1280x720 frames would take ~30 ms)
        source = None if pack or resize else images.image_digest(self.data, self.mime)
        return prepare_video(request, tokenizer, frames, planner, started, pack, resize, source)


@dataclass(frozen=True)
class VideoFile(VideoSource):
    """A `state.video` data URL: its MIME type and bytes, magic bytes checked."""

    mime: str
    data: bytes


@dataclass(frozen=True)
class VideoMosaic(VideoSource):
    """The reference's form: `images[0]` a mosaic of `n_frames` tiles, `cols` a row, row-major."""

    mime: str  # the mosaic image's
    data: bytes
    opened: object  # runtime.images.OpenedImage
    n_frames: int
    cols: int
    tile: tuple[int, int]  # (width, height)
    timestamps: tuple[int | float, ...]
    duration: int | float


# -- the contract ------------------------------------------------------------------------------


def video_of_state(state: dict) -> VideoFile | VideoMosaic:
    """`state.video` as the contract takes it: a data URL (then no images), or the mosaic's
    description beside exactly one image, the mosaic."""
    video = state["video"]
    if isinstance(video, str):
        if "images" in state:
            raise ContractError("state.video as a file takes no state.images")
        return video_file(video)
    if not isinstance(video, dict):
        raise ContractError("state.video must be a video data URL or a mosaic description")
    urls = state.get("images")
    if not isinstance(urls, list) or len(urls) != 1:
        raise ContractError("state.video as a mosaic needs state.images of exactly one image")
    return mosaic_of(video, urls[0])


def video_file(url: str) -> VideoFile:
    """A video data URL's MIME type and bytes, size and magic bytes checked."""
    prefix, comma, encoded = url.partition(",")
    if not comma:
        raise ContractError("invalid video data URL")
    if prefix not in VIDEO_MIMES:
        raise ContractError("only inline MP4/WebM videos are supported")
    if len(encoded) > MAX_ENCODED_CHARS:
        raise ContractError(f"video must be at most 8 MiB, got {len(encoded) * 3 // 4} bytes")
    try:
        data = images.decode_base64(encoded)
    except ContractError:
        raise ContractError("invalid base64 video") from None
    if len(data) > MAX_VIDEO_BYTES:
        raise ContractError(f"video must be at most 8 MiB, got {len(data)} bytes")
    mime = VIDEO_MIMES[prefix][0]
    mp4 = data[MP4_MAGIC_AT : MP4_MAGIC_AT + len(MP4_MAGIC)] == MP4_MAGIC
    if not (mp4 if mime == "video/mp4" else data.startswith(WEBM_MAGIC)):
        raise ContractError("video format does not match its MIME type")
    tracks = mp4_tracks(data) if mp4 else webm_tracks(data)
    if tracks > MAX_STREAMS:
        raise ContractError(f"video must have at most {MAX_STREAMS} streams, got {tracks}")
    return VideoFile(mime, data)


def mosaic_of(video: dict, url: object) -> VideoMosaic:
    """The mosaic's description checked against its limits, and its image's header."""
    if any(key not in MOSAIC_FIELDS for key in video):
        raise ContractError("state.video supports n_frames, cols, tile, timestamps and duration")
    n_frames = whole(video.get("n_frames"), "n_frames")
    check_frames(n_frames)
    cols = whole(video.get("cols"), "cols")
    if not 1 <= cols <= MAX_FRAMES:
        raise ContractError(f"state.video.cols must be 1 to {MAX_FRAMES}, got {cols}")
    tile = tile_of(video.get("tile"))
    timestamps = video.get("timestamps")
    if not isinstance(timestamps, list) or len(timestamps) != n_frames:
        count = len(timestamps) if isinstance(timestamps, list) else "none"
        raise ContractError(f"state.video.timestamps must be {n_frames} numbers, got {count}")
    for value in timestamps:
        seconds(value, "timestamps")
    duration = seconds(video.get("duration"), "duration")
    mime, data, opened = images.open_data_url(url)
    rows = math.ceil(n_frames / cols)
    width, height = opened.size
    if width < cols * tile[0] or height < rows * tile[1]:
        opened.close()
        raise ContractError(
            f"video mosaic is {width}x{height}, too small for {rows} rows of {cols} "
            f"{tile[0]}x{tile[1]} tiles"
        )
    return VideoMosaic(mime, data, opened, n_frames, cols, tile, tuple(timestamps), duration)


def whole(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ContractError(f"state.video.{name} must be an integer")
    return value


def check_frames(count: int) -> None:
    if count > MAX_FRAMES:
        raise ContractError(f"video must be at most {MAX_FRAMES} frames, got {count}")
    if count < 1:
        raise ContractError(f"video must have at least 1 frame, got {count}")


def tile_of(value: object) -> tuple[int, int]:
    """A tile's (width, height): one side for a square, or [width, height]."""
    sides = [value, value] if isinstance(value, int) and not isinstance(value, bool) else value
    ok = isinstance(sides, list) and len(sides) == 2
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sides)
    if not ok:
        raise ContractError("state.video.tile must be a positive side or [width, height]")
    if max(sides) > images.MAX_SIDE:
        raise ContractError(f"a video frame must be at most {images.MAX_SIDE} pixels per side")
    return sides[0], sides[1]


def seconds(value: object, name: str) -> int | float:
    """A time in seconds from 0 to MAX_DURATION, kept as sent (the prompt writes it so)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ContractError(f"state.video.{name} must be numbers of seconds")
    if not 0 <= value <= MAX_DURATION:
        raise ContractError(f"video {name} must be 0 to {MAX_DURATION} seconds, got {value}")
    return value


def accepted() -> dict:
    """What `state.video` takes, as `GET /v1/models` lists it."""
    return {
        "types": {mime: list(codecs) for mime, codecs in CODECS.items()},
        "max_frames": MAX_FRAMES,
        "max_seconds": MAX_DURATION,
    }


# -- frames ------------------------------------------------------------------------------------


def video_frames(source: VideoFile | VideoMosaic) -> VideoFrames:
    """The frames the model reads: the mosaic's tiles, or a file's frames sampled uniformly."""
    if isinstance(source, VideoMosaic):
        return mosaic_frames(source)
    return decode_file(source)


def mosaic_frames(mosaic: VideoMosaic) -> VideoFrames:
    """The mosaic cut back into its tiles, row-major (the reference's `crop` of each box)."""
    rgb = images.decode_rgb(mosaic.data, mosaic.mime, mosaic.opened)
    width, height = mosaic.tile
    tiles = []
    for index in range(mosaic.n_frames):
        row, col = divmod(index, mosaic.cols)
        tile = rgb[row * height : (row + 1) * height, col * width : (col + 1) * width]
        tiles.append(np.ascontiguousarray(tile))
    return VideoFrames(tuple(tiles), mosaic.timestamps, mosaic.duration, images.MAX_PIXELS)


def sample_indices(count: int, most: int = MAX_FRAMES) -> list[int]:
    """`min(count, most)` frame indices spread evenly from the first frame to the last, as Qwen's
    vision utilities sample a clip (`linspace(0, count - 1, k).round()`)."""
    k = min(count, most)
    return np.linspace(0, count - 1, k).round().astype(np.int64).tolist()


def decode_file(
    video: VideoFile,
    seconds: float = DECODE_SECONDS,
    slack: float = DECODER_SLACK,
    python: str | None = None,
) -> VideoFrames:
    """`decode_frames` in a Python process of its own (a started spare, or `python`'s), killed
    at its deadline: a container FFmpeg chokes on, or a decode that hangs inside one call, costs
    that process, never the worker, and the preparation slot is free again within `seconds` and
    `slack`."""
    handle, path = tempfile.mkstemp(prefix="omnijev-frames-", dir=frames_dir())
    os.close(handle)
    try:
        process = DECODERS.take() if python is None else start_decoder(python)
        sent = pickle.dumps((video.mime, video.data, path))
        return answer_of(process, sent, seconds, slack, path)
    finally:
        os.unlink(path)


def frames_dir(shared: Path = SHARED_MEMORY, largest: int = LARGEST_FRAMES) -> str | None:
    """`shared` where it holds the `largest` frames' bytes, else None (the temporary directory)."""
    try:
        free = shutil.disk_usage(shared).free
    except OSError:
        return None
    if free < largest or not os.access(shared, os.W_OK):
        return None
    return str(shared)


def answer_of(
    process: subprocess.Popen, sent: bytes, seconds: float, slack: float, path: str
) -> VideoFrames:
    """The decoder's answer to `sent`: its frames read back from `path`, or its refusal. The
    process is killed at its deadline; one that has answered ends on its own, and a thread
    waits for that (killing it past `slack`)."""
    talk = Exchange(process, sent)
    talk.start()
    talk.join(seconds + slack)
    if talk.is_alive():
        process.kill()
        process.wait()
        talk.join()
        raise ContractError(f"video must decode within {seconds:g} s")
    threading.Thread(target=reap, args=(process, slack), daemon=True).start()
    return frames_of_answer(talk.line, path)


def reap(process: subprocess.Popen, grace: float) -> None:
    """Waits for a decoder that has answered to end, killing it after `grace` seconds."""
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class Exchange(threading.Thread):
    """Writes the request to a decoder's stdin and reads its one line of answer (`line`, empty
    where the process died first)."""

    def __init__(self, process: subprocess.Popen, sent: bytes):
        super().__init__(daemon=True)
        self.process, self.sent, self.line = process, sent, b""

    def run(self) -> None:
        try:
            self.process.stdin.write(self.sent)
            self.process.stdin.close()
            self.line = self.process.stdout.readline(ANSWER_BYTES)
        except (OSError, ValueError):  # the process died, or was killed at its deadline
            self.line = b""


def frames_of_answer(line: bytes, path: str) -> VideoFrames:
    """The frames an answer line names, read back from `path`, or its refusal; anything but
    the two forms `answer_line` writes is an invalid video (FFmpeg crashed, the memory limit
    hit, or the process no longer ours)."""
    try:
        answer = json.loads(line)
        if "refused" in answer:
            raise ContractError(str(answer["refused"]))
        meta = answer["frames"]
        shapes = tuple(tuple(int(x) for x in shape) for shape in meta["shapes"])
        timestamps = tuple(float(ts) for ts in meta["timestamps"])
        duration, most = float(meta["duration"]), int(meta["most_pixels"])
    except ContractError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError):
        raise ContractError(INVALID_VIDEO) from None
    if not 0 < len(shapes) <= MAX_FRAMES or len(timestamps) != len(shapes):
        raise ContractError(INVALID_VIDEO)
    for shape in shapes:
        if len(shape) != 3 or shape[2] != 3 or min(shape) <= 0:
            raise ContractError(INVALID_VIDEO)
        if shape[0] * shape[1] > MAX_FRAME_PIXELS:
            raise ContractError(INVALID_VIDEO)
    return frames_read(path, shapes, timestamps, duration, most)


def answer_line(kind: str, value: object) -> bytes:
    """The decoder's answer: {"frames": `frames_written`'s fields} or {"refused": message}."""
    return json.dumps({kind: value}).encode() + b"\n"


def frames_written(path: str, frames: VideoFrames) -> dict:
    """Writes the frames' pixels to `path`, one after another; what `frames_read` needs besides."""
    with open(path, "wb") as file:
        for frame in frames.frames:
            file.write(np.ascontiguousarray(frame).data)
    return {
        "shapes": [list(frame.shape) for frame in frames.frames],
        "timestamps": list(frames.timestamps),
        "duration": frames.duration,
        "most_pixels": frames.most_pixels,
    }


def frames_read(
    path: str, shapes: tuple, timestamps: tuple, duration: float, most_pixels: int
) -> VideoFrames:
    """The frames `frames_written` left in `path`, each a view of the file mapped in memory."""
    sizes = [math.prod(shape) for shape in shapes]
    pixels = mapped(path, sum(sizes))
    pieces = np.split(pixels, np.cumsum(sizes)[:-1])
    frames = tuple(piece.reshape(shape) for piece, shape in zip(pieces, shapes, strict=True))
    return VideoFrames(frames, timestamps, duration, most_pixels)


def mapped(path: str, size: int) -> np.ndarray:
    """The file's `size` bytes as a writable uint8 array over a private mapping of it, which
    outlives the file's removal: 16 frames of 1280x720 mapped and then copied, as the upload
    does, took 14 ms on this project's CPU machine, read with `np.fromfile` and copied 34-36 ms
    and at times 298 (a fresh array's pages)."""
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size != size or size == 0:  # the decoder died mid-write
            raise ContractError(INVALID_VIDEO)
        memory = mmap.mmap(file.fileno(), size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    return np.frombuffer(memory, dtype=np.uint8)


def start_decoder(python: str = sys.executable) -> subprocess.Popen:
    """A decoder process (`decoder_main`), its imports under way while it waits for its file."""
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **DECODER_HEAP, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.Popen(
        [python, "-m", "runtime.video"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )


class Decoders:
    """`count` decoder processes started ahead of the next clips; each decodes one file and
    exits, and the one taken is replaced at once."""

    def __init__(self, count: int = DECODER_SPARES) -> None:
        self.lock = threading.Lock()
        self.count = count
        self.spares: list[subprocess.Popen] = []

    def ready(self) -> None:
        """Starts spares until `count` are alive (the worker, before it reports ready)."""
        with self.lock:
            self.fill()

    def take(self) -> subprocess.Popen:
        """The oldest spare still alive (a new one where none was), replaced at once."""
        with self.lock:
            self.fill()
            taken = self.spares.pop(0)
            self.fill()
        return taken

    def fill(self) -> None:
        """Drops the spares that died and starts new ones up to `count` (the lock held)."""
        self.spares = [spare for spare in self.spares if spare.poll() is None]
        self.spares += [start_decoder() for _ in range(self.count - len(self.spares))]


DECODERS = Decoders()


def decoder_main() -> None:
    """`python -m runtime.video`: (MIME type, bytes, a path) pickled on stdin by the worker,
    `decode_frames`'s frames written to the path and one line of JSON on stdout naming them (or
    its refusal's message, `answer_line`), within DECODER_MEMORY bytes of address space. PyAV is
    imported before the file comes (a spare waits for it); a closed stdin ends it."""
    resource.setrlimit(resource.RLIMIT_AS, (DECODER_MEMORY, DECODER_MEMORY))
    try:
        import av  # noqa: F401
    except ImportError:  # a deployment without PyAV (pyproject.toml pins it)
        av = None
    warm_heap()
    try:
        mime, data, path = pickle.load(sys.stdin.buffer)
    except EOFError:  # the worker ended before it needed this spare
        return
    try:
        if av is None:
            raise ContractError(NO_DECODER)
        answer = answer_line("frames", frames_written(path, decode_frames(VideoFile(mime, data))))
    except ContractError as error:
        answer = answer_line("refused", str(error))
    except Exception:  # PyAV's errors of a malformed container or stream
        answer = answer_line("refused", INVALID_VIDEO)
    sys.stdout.buffer.write(answer)


def warm_heap(size: int = DECODER_WARM, piece: int = WARM_PIECE) -> None:
    """Faults in `size` bytes of the heap and frees them (kept, by DECODER_HEAP)."""
    pieces = [np.ones(piece, dtype=np.uint8) for _ in range(size // piece)]
    del pieces


def clip_pixels(frames: int) -> int:
    """The pixels each of a file's `frames` frames may keep: its share of CLIP_TOKENS, at most
    an image's budget."""
    return min(images.MAX_PIXELS, images.CLIP_TOKENS // max(1, frames) * images.FACTOR**2)


def decode_frames(video: VideoFile) -> VideoFrames:
    """A file's frames: its packets read first (how many frames, which to keep, the length),
    every limit checked, then the stream decoded and the sampled frames kept."""
    import av

    started = time.monotonic()
    try:
        times, base, size = stream_packets(av, video)
        if not times:
            raise ContractError("video has no frames")
        order = sorted(times)
        picked = [order[i][0] for i in sample_indices(len(order))]
        first, last, step = order[0][0], order[-1][0], order[-1][1]
        if step <= 0 and len(order) > 1:
            step = (last - first) / (len(order) - 1)
        duration = float((last - first + step) * base)
        if duration > MAX_DURATION:
            raise ContractError(f"video must be at most {MAX_DURATION} seconds, got {duration:.1f}")
        decoded = len(order) * size[0] * size[1]
        if decoded > MAX_DECODED_PIXELS:
            raise ContractError(
                f"video must decode at most {MAX_DECODED_PIXELS} pixels, got {decoded}"
            )
        frames = decode_picked(av, video, set(picked), started)
    except ContractError:
        raise
    except Exception:  # PyAV's errors of a malformed container or stream
        raise ContractError(INVALID_VIDEO) from None
    kept = [frames.get(pts) for pts in picked]
    if any(frame is None for frame in kept):
        raise ContractError(INVALID_VIDEO)
    stamps = tuple(round(float((pts - first) * base), 2) for pts in picked)
    return VideoFrames(tuple(kept), stamps, duration, clip_pixels(len(kept)))


def open_container(av, video: VideoFile):
    """The container, its first video stream, its codec and frame size checked before any frame
    is decoded."""
    fmt = {mime: demuxer for mime, demuxer in VIDEO_MIMES.values()}[video.mime]
    container = av.open(io.BytesIO(video.data), format=fmt, options=DEMUX_OPTIONS)
    try:
        streams = len(container.streams)
        if streams > MAX_STREAMS:
            raise ContractError(f"video must have at most {MAX_STREAMS} streams, got {streams}")
        if not container.streams.video:
            raise ContractError("video has no video stream")
        stream = container.streams.video[0]
        codec, allowed = stream.codec_context.name, CODECS[video.mime]
        if codec not in allowed:
            names = " or ".join(allowed)
            raise ContractError(f"{video.mime} video codec must be {names}, got {codec}")
        check_frame_size(stream.codec_context.width, stream.codec_context.height)
    except BaseException:
        container.close()
        raise
    return container, stream


def check_frame_size(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ContractError(INVALID_VIDEO)
    if max(width, height) > images.MAX_SIDE:
        raise ContractError(
            f"a video frame must be at most {images.MAX_SIDE} pixels per side, got {width}x{height}"
        )
    if width * height > MAX_FRAME_PIXELS:
        raise ContractError(
            f"a video frame must be at most {MAX_FRAME_PIXELS} pixels, got {width * height}"
        )


def stream_packets(av, video: VideoFile) -> tuple[list[tuple[int, int]], object, tuple]:
    """(pts, duration) of every frame of the video stream, its time base and frame size, from
    the packets alone (nothing decoded)."""
    container, stream = open_container(av, video)
    with container:
        times = []
        for packet in container.demux(stream):
            if packet.size == 0:  # the demuxer's end-of-stream marker
                continue
            if packet.pts is None:
                raise ContractError(INVALID_VIDEO)
            times.append((packet.pts, packet.duration or 0))
            if len(times) > MAX_STREAM_FRAMES:
                raise ContractError(f"video must have at most {MAX_STREAM_FRAMES} frames, got more")
        size = (stream.codec_context.width, stream.codec_context.height)
        return times, stream.time_base, size


def decode_picked(av, video: VideoFile, picked: set[int], started: float) -> dict:
    """The stream decoded frame by frame; the frames whose pts are `picked`, as RGB."""
    container, stream = open_container(av, video)
    stream.thread_count = DECODER_THREADS
    kept: dict[int, np.ndarray] = {}
    with container:
        for frame in container.decode(stream):
            elapsed = time.monotonic() - started
            if elapsed > DECODE_SECONDS:
                raise ContractError(
                    f"video must decode within {DECODE_SECONDS:g} s, took {elapsed:.1f} s"
                )
            check_frame_size(frame.width, frame.height)
            if frame.pts in picked and frame.pts not in kept:
                kept[frame.pts] = frame.to_ndarray(format="rgb24")
            if len(kept) == len(picked):
                break
    return kept


if __name__ == "__main__":  # as runtime.video: its classes the ones the rest of the runtime names
    from runtime.video import decoder_main as run

    run()
    sys.stdout.flush()
    os._exit(0)  # the interpreter's teardown (PyAV, NumPy) would keep the worker waiting ~40 ms
