"""Generated clips for video load and tests: moving shapes encoded by PyAV (H.264 in MP4, VP8 and
VP9 in WebM), as a native request's `state.video` data URL."""

from __future__ import annotations

import base64
import io

import numpy as np

# (codec, container, data-URL MIME type)
CODECS = {
    "h264": ("libx264", "mp4", "video/mp4"),
    "vp8": ("libvpx", "webm", "video/webm"),
    "vp9": ("libvpx-vp9", "webm", "video/webm"),
}


def moving_frames(count: int, width: int, height: int, seed: int = 0) -> list[np.ndarray]:
    """`count` frames of a bright square crossing a dark gradient, a disc falling beside it."""
    rng = np.random.default_rng(seed)
    base = np.zeros((height, width, 3), dtype=np.uint8)
    base[..., 0] = np.linspace(0, 90, width, dtype=np.uint8)[None, :]
    base[..., 2] = rng.integers(20, 80)
    side = max(4, min(width, height) // 4)
    ys, xs = np.mgrid[0:height, 0:width]
    frames = []
    for i in range(count):
        frame = base.copy()
        x = int((width - side) * i / max(1, count - 1))
        frame[height // 4 : height // 4 + side, x : x + side] = (240, 220, 40)
        cy = int((height - 1) * i / max(1, count - 1))
        disc = (ys - cy) ** 2 + (xs - width * 3 // 4) ** 2 <= (side // 2) ** 2
        frame[disc] = (30, 200, 250)
        frames.append(frame)
    return frames


def encode_clip(frames: list[np.ndarray], codec: str = "h264", fps: float = 5) -> bytes:
    """The frames encoded as a clip at `fps` frames a second."""
    import av

    name, container_format, _ = CODECS[codec]
    height, width = frames[0].shape[:2]
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(name, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def clip(count: int, width: int, height: int, codec: str = "h264", fps: float = 5, seed=0):
    """A clip's bytes and its data-URL MIME type."""
    return encode_clip(moving_frames(count, width, height, seed), codec, fps), CODECS[codec][2]


def video_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")
