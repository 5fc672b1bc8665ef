"""A 12-question request about a 16-frame clip: its prompts' ids by this tree's
`encode_video_prompts` and by another file's (the previous version), their times and whether the
ids are the same.

    PYTHONPATH=. python docs/measurements/cpu-2026-12-08-video-prompts/encode_prompts.py OLD_FILE
"""

import importlib.util
import statistics
import sys
import time

from bench import traffic
from runtime import video_prepare
from runtime.contract import compile_request
from runtime.strict_json import parse_body
from runtime.tokenizer import load_tokenizer
from runtime.types import PreparedVideo

RUNS = 30


def timed(encode, prompts, tokenizer, counts) -> tuple[float, list]:
    times = []
    for _ in range(RUNS):
        started = time.perf_counter()
        ids = encode(prompts, tokenizer, counts)
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times), ids


def main() -> None:
    spec = importlib.util.spec_from_file_location("previous", sys.argv[1])
    previous = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(previous)
    tokenizer = load_tokenizer("artifacts/demo/checkpoint")
    body = traffic.request(0, 0, questions=12, size=(1280, 720), clip=16).body
    questions = compile_request(parse_body(body)).questions
    for frames in (1, 2, 5, 16):
        stamps = tuple(round(0.5 * i, 2) for i in range(frames))
        video = PreparedVideo(frames=(), timestamps=stamps, duration=8.0)
        prompts = [video_prepare.video_prompt(q, video) for q in questions]
        counts = [4096 // 16] * frames
        new_ms, new = timed(video_prepare.encode_video_prompts, prompts, tokenizer, counts)
        old_ms, old = timed(previous.encode_video_prompts, prompts, tokenizer, counts)
        print(f"{frames} frames: {new_ms:.2f} ms against {old_ms:.2f}, same ids: {new == old}")


if __name__ == "__main__":
    main()
