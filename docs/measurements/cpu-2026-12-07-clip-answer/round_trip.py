"""The decoder round trip of the bench's 16-frame 1280x720 clip (`decode_file` through the
worker's started spares), 12 clips a second apart, in the tree on PYTHONPATH: each clip's ms
and the median."""

import json
import statistics
import time

from bench.clips import clip
from runtime import video

CLIPS = 12
PAUSE_S = 1.0  # a spare started and its heap faulted in before the next clip

data, mime = clip(16, 1280, 720, fps=2, seed=0)
file = video.VideoFile(mime, data)
video.DECODERS.ready()
times = []
for _ in range(CLIPS):
    time.sleep(PAUSE_S)
    started = time.perf_counter()
    frames = video.decode_file(file)
    times.append(round((time.perf_counter() - started) * 1e3, 1))
    assert len(frames.frames) == 16
print(json.dumps({"ms": times, "median": statistics.median(times)}))
