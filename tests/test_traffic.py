"""The traffic suite (bench.traffic): one stream per seed, the held-out one another, questions of
every promised kind, and every request answered 200 by the worker over HTTP, the load driver's
report complete (`python -m bench.load` against uvicorn, the contract and preparation real)."""

from __future__ import annotations

import json

import numpy as np

from bench import load, traffic
from runtime.contract import MAX_ROWS, compile_question
from tests.server_helpers import RealishEngine, ThreadServer

DRAWS = 300  # question sets drawn for the pool's coverage (no images: quick)


def test_a_seed_gives_one_stream_and_the_held_out_seed_another():
    first = [traffic.request(0, i).body for i in range(3)]
    assert first == [traffic.request(0, i).body for i in range(3)]
    held_out = [r.body for r in traffic.stream(0, 3, held_out=True)]
    other_seed = [r.body for r in traffic.stream(1, 3)]
    assert not set(first) & set(held_out) and not set(first) & set(other_seed)
    # every image drawn anew: no two requests share their image, so no prefix cache hits
    images = [json.loads(b)["state"]["images"][0] for b in first + held_out + other_seed]
    assert len(set(images)) == len(images)


def test_every_block_of_requests_holds_every_image_size():
    assert len(traffic.SIZES) >= 8 and (3000, 1000) in traffic.SIZES
    for seed, stream in ((0, "suite"), (5, "held-out")):
        sizes = [traffic.size_of(seed, stream, i) for i in range(2 * len(traffic.SIZES))]
        assert sorted(sizes[: len(traffic.SIZES)]) == sorted(traffic.SIZES)
        assert sorted(sizes[len(traffic.SIZES) :]) == sorted(traffic.SIZES)
        assert sizes[: len(traffic.SIZES)] != sizes[len(traffic.SIZES) :]  # another order


def test_the_question_pool_covers_what_the_suite_promises():
    assert traffic.TEMPLATES >= 60
    kinds, choices, levels, regions = set(), [], set(), 0
    for draw in range(DRAWS):
        rng = np.random.default_rng([9, draw])
        count = int(rng.integers(1, traffic.MAX_QUESTIONS + 1))
        questions = traffic.questions_for(rng, count, (1920, 1080))
        assert len(questions) == count
        assert sum(traffic.answer_rows(q) for q in questions.values()) <= MAX_ROWS
        for qid, question in questions.items():
            compiled = compile_question(qid, question)  # the contract accepts it
            kinds.add(question["type"])
            regions += "region" in json.dumps(question)
            if question["type"] == "score":
                levels.add(len(compiled.keys))
            elif question["type"] == "choice" and "region" not in json.dumps(question):
                texts = compiled.option_texts
                choices.append(len(texts))
                leads = [text.split()[0] for text in texts]
                assert len(set(leads)) == len(leads), texts  # no two options share a lead
    assert kinds == {"noul", "choice", "score"} and regions > 0
    assert levels == set(range(2, 11))
    assert min(choices) == 2 and max(choices) > 128


def test_every_traffic_request_is_answered_over_http(tmp_path):
    """Ten requests, one of each image size, both formats, through the worker's real contract
    and preparation: all 200, and the driver's report has every field."""
    out = tmp_path / "load.json"
    with ThreadServer(RealishEngine()) as server:
        argv = ["--url", f"{server.url}/v1/systemone", "--clients", "1,3", "--seed", "0"]
        argv += ["--requests", str(len(traffic.SIZES)), "--out", str(out)]
        assert load.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["suite"] == "traffic" and record["seed"] == 0 and not record["held_out"]
    assert [run["clients"] for run in record["runs"]] == [1, 3]
    for run in record["runs"]:
        assert run["ok"] == run["requests"] == len(traffic.SIZES)
        assert run["requests_per_s"] > 0 and {"p50", "p90", "p99", "max"} <= set(run["latency_ms"])
        stages = run["server_ms_per_request"]  # from the worker's /metrics
        assert stages["execute"] == run["gpu_ms_per_request"] and stages["prepare"] > 0
        assert run["requests_per_batch"] == 1.0  # this engine runs every request alone
        assert {tuple(r["size"]) for r in run["records"]} == set(traffic.SIZES)
        assert all(r["status"] == 200 and r["latency_ms"] > 0 for r in run["records"])
    assert {r["format"] for r in record["runs"][0]["records"]} == {"PNG", "JPEG"}
    # every answer's digest, the same with one client and with three
    assert all(len(r["answers"]) == 64 for run in record["runs"] for r in run["records"])
    assert record["answers_differing"] == []


def test_the_load_driver_sends_bench_requests_too():
    with ThreadServer(RealishEngine()) as server:
        argv = ["--url", f"{server.url}/v1/systemone", "--clients", "2", "--requests", "4"]
        assert load.main([*argv, "--suite", "bench", "--questions", "3"]) == 0


def test_the_load_driver_mixes_clips_with_stills(tmp_path, capsys):
    """`--clip-frames K --clip-share F`: that share of the requests ask the same questions about a
    K-frame clip (H.264) in place of their still; the worker answers every one, and the driver
    gives each kind's quantiles."""
    out = tmp_path / "load.json"
    with ThreadServer(RealishEngine()) as server:
        argv = ["--url", f"{server.url}/v1/systemone", "--clients", "2", "--requests", "6"]
        argv += ["--image-size", "320x240", "--questions", "2", "--out", str(out)]
        assert load.main([*argv, "--clip-frames", "3", "--clip-share", "0.5"]) == 0
    records = json.loads(out.read_text())["runs"][0]["records"]
    kinds = [r["format"] for r in records]
    assert "MP4" in kinds and set(kinds) - {"MP4"} and all(r["status"] == 200 for r in records)
    assert "2 clients: " in capsys.readouterr().out
    clip = traffic.request(0, 1, questions=2, size=(320, 240), clip=3)
    still = traffic.request(0, 1, questions=2, size=(320, 240))
    assert json.loads(clip.body)["state"]["video"].startswith("data:video/mp4;base64,")
    assert json.loads(clip.body)["questions"] == json.loads(still.body)["questions"]
    assert load.clip_frames(load.parse_args(["--clip-frames", "16"]), 3, "suite") == [16] * 3
    records = [{"format": "MP4", "latency_ms": 9.0}, {"format": "PNG", "latency_ms": 1.0}]
    kinds = load.by_format({"records": records})
    assert kinds == {"MP4": {"p50": 9.0, "p99": 9.0}, "PNG": {"p50": 1.0, "p99": 1.0}}


def test_requests_about_a_few_screenshots_share_their_images():
    made = [traffic.request(0, index, images=2) for index in range(4)]
    images = [json.loads(r.body)["state"]["images"][0] for r in made]
    questions = [json.loads(r.body)["questions"] for r in made]
    assert images[0] == images[2] and images[1] == images[3] and images[0] != images[1]
    assert questions[0] != questions[2]
    # the stream without `images` is unchanged by it
    assert traffic.request(0, 2).body != made[2].body
    assert made[0].size == traffic.request(0, 0).size
