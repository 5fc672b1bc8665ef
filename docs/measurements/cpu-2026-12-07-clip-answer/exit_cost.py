"""Run in c492ce9's tree (its decoder answers with a pickle): for 8 clips, the ms from sending
the bench's 16-frame 1280x720 clip to a fresh decoder to its complete answer, and to the
process's end."""

import os
import pickle
import tempfile
import time

from bench.clips import clip
from runtime import video

data, mime = clip(16, 1280, 720, fps=2, seed=0)
times = []
for _ in range(8):
    process = video.start_decoder()
    time.sleep(1.5)  # imported and its heap faulted in
    path = tempfile.mktemp(dir="/dev/shm")
    started = time.perf_counter()
    process.stdin.write(pickle.dumps((mime, data, path)))
    process.stdin.close()
    pickle.load(process.stdout)  # the answer, complete
    answered = time.perf_counter()
    process.wait()
    ended = time.perf_counter()
    times.append((round((answered - started) * 1e3, 1), round((ended - started) * 1e3, 1)))
    os.unlink(path)
print(times)
