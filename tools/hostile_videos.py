"""Malformed and hostile `state.video` values for the fuzz run (tools/fuzz.py): truncated and
corrupted clips, frames past the size limits, a stream of repeated 4K key frames (a decode
bomb), 9,001 frames, a thousand streams, wrong codecs and containers, and mosaic descriptions
past their limits. Each must be refused (or answered) fast, never with a 500 or a crash.
"""

from __future__ import annotations

import base64
import io
import random

import numpy as np

from runtime import video as limits

COUNT = 50  # issue 48: 50 malformed or hostile video bodies in the fuzz run
STREAMS = 1000  # FFmpeg's MP4 muxer itself fails at some 2,000
FPS = 5


def url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def encode(codec: str, fmt: str, width: int, height: int, frames: int = 3) -> bytes:
    """A clip of moving bars, `frames` long, encoded by PyAV (x264 at its fastest preset)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format=fmt) as container:
        options = {"preset": "ultrafast"} if codec == "libx264" else {}
        stream = container.add_stream(codec, rate=FPS, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for index in range(frames):
            rgb = np.zeros((height, width, 3), dtype=np.uint8)
            rgb[:, (index * 8) % width :: 16] = 200
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def repeated(data: bytes, fmt: str, count: int = 1, streams: int = 1, gap: int = 0) -> bytes:
    """The clip's first (key) frame muxed `count` times into each of `streams` streams, a frame
    step apart and `gap` time-base units after the first: a valid stream of any length for the
    bytes of one frame."""
    import av

    with av.open(io.BytesIO(data), format=fmt) as source:
        template = source.streams.video[0]
        payload = bytes(next(p for p in source.demux(template) if p.size))
        step = int(1 / (FPS * template.time_base))
        buffer = io.BytesIO()
        with av.open(buffer, "w", format=fmt) as container:
            outputs = [container.add_stream_from_template(template) for _ in range(streams)]
            for output in outputs:
                for index in range(count):
                    packet = av.Packet(payload)
                    packet.stream, packet.time_base = output, template.time_base
                    packet.pts = packet.dts = index * step + (gap if index else 0)
                    packet.is_keyframe = True
                    container.mux(packet)
    return buffer.getvalue()


def audio_only() -> bytes:
    import av

    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        samples = np.zeros((1, 1024), dtype=np.float32)
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            container.mux(packet)
    return buffer.getvalue()


def flipped(data: bytes, rng: random.Random, count: int) -> bytes:
    """`count` random bytes of the clip changed."""
    out = bytearray(data)
    for _ in range(count):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def mosaic(image: str, **changes: object) -> dict:
    video = {"n_frames": 4, "cols": 2, "tile": [32, 24], "timestamps": [0, 1, 2, 3]}
    return {"images": [image], "video": {**video, "duration": 4, **changes}}


def hostile_videos(image: str, seed: int = 0) -> dict[str, dict]:
    """COUNT named native states, each with a malformed or hostile video; `image` a valid PNG
    data URL (64×48) for the mosaic forms."""
    rng = random.Random(seed)
    mp4 = encode("libx264", "mp4", 64, 48, frames=6)
    webm = encode("libvpx", "webm", 64, 48, frames=6)
    tiny = encode("libx264", "mp4", 16, 16, frames=1)
    states: dict[str, object] = {
        "empty mp4": url(b""),
        "ftyp only": url(mp4[:32]),
        "no comma": "data:video/mp4;base64",
        "avi": url(mp4, "video/x-msvideo"),
        "bad base64": "data:video/mp4;base64,!!!!",
        "webm as mp4": url(webm),
        "mp4 as webm": url(mp4, "video/webm"),
        "garbage after ftyp": url(mp4[:8] + bytes(range(256)) * 64),
        "ebml garbage": url(
            b"\x1a\x45\xdf\xa3" + bytes(rng.randrange(256) for _ in range(4096)), "video/webm"
        ),
        "over 8 MiB": url(mp4[:12] + b"\0" * (limits.MAX_VIDEO_BYTES + 1)),
        "4112 wide": url(encode("libx264", "mp4", 4112, 16, frames=1)),
        "8.7 M pixels a frame": url(encode("libx264", "mp4", 4000, 2176, frames=1)),
        "130 4K key frames": url(repeated(encode("libx264", "mp4", 3840, 2160, 1), "mp4", 130)),
        "9001 frames": url(repeated(tiny, "mp4", limits.MAX_STREAM_FRAMES + 1)),
        "1000 streams": url(repeated(tiny, "mp4", 1, STREAMS)),
        "1000 webm tracks": url(
            repeated(encode("libvpx", "webm", 16, 16, 1), "webm", 1, STREAMS), "video/webm"
        ),
        "400 s long": url(
            repeated(encode("libvpx", "webm", 16, 16, 1), "webm", 2, gap=400_000), "video/webm"
        ),
        "mpeg4 in mp4": url(encode("mpeg4", "mp4", 64, 48)),
        "vp9 in mp4": url(encode("libvpx-vp9", "mp4", 64, 48)),
        "audio only": url(audio_only()),
        "zero frames": url(repeated(tiny, "mp4", 0)),
        "video and images": None,  # filled below
        "video number": 7,
        "video list": [url(mp4)],
        "mosaic 40 frames": mosaic(image, n_frames=40),
        "mosaic 0 frames": mosaic(image, n_frames=0),
        "mosaic huge tile": mosaic(image, tile=[100_000, 100_000]),
        "mosaic tile 0": mosaic(image, tile=0),
        "mosaic too small": mosaic(image, tile=[64, 48]),
        "mosaic duration 1e9": mosaic(image, duration=1e9),
        "mosaic negative time": mosaic(image, timestamps=[0, -1, 2, 3]),
        "mosaic timestamps text": mosaic(image, timestamps=["0", "1", "2", "3"]),
        "mosaic cols 0": mosaic(image, cols=0),
        "mosaic extra field": mosaic(image, fps=30),
        "mosaic without images": {"video": mosaic(image)["video"]},
    }
    states["video and images"] = {"video": url(mp4), "images": [image]}
    states = {name: v if isinstance(v, dict) else {"video": v} for name, v in states.items()}
    for fraction in (0.1, 0.3, 0.5, 0.7, 0.9):
        states[f"mp4 cut at {fraction:.0%}"] = {"video": url(mp4[: int(len(mp4) * fraction)])}
        states[f"webm cut at {fraction:.0%}"] = {
            "video": url(webm[: int(len(webm) * fraction)], "video/webm")
        }
    for index in range(COUNT - len(states)):
        source, mime = (mp4, "video/mp4") if index % 2 else (webm, "video/webm")
        states[f"{mime} {8 << index % 4} bytes changed #{index}"] = {
            "video": url(flipped(source, rng, 8 << index % 4), mime)
        }
    return states
