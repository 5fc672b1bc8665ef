"""`omnijev engines --backend torch`: the GPU user's engine directory without an ONNX export
loads into the torch backend and answers as the one built beside the ONNX files."""

from __future__ import annotations

import json

from reference.questions import pattern_png, request_body, speed_bench_questions
from runtime.cli import main
from runtime.config import RuntimeConfig
from runtime.executor import load_engine
from tests.engine_fixtures import tiny_export, tiny_variant


def test_torch_engine_dir_without_onnx_answers_as_the_full_one(tmp_path_factory, tmp_path):
    export = tiny_export(tmp_path_factory)
    full = tiny_variant(tmp_path_factory, "ort")
    out = tmp_path / "torch-engines"
    code = main(["engines", "--backend", "torch", "--checkpoint", str(export), "--out", str(out)])
    assert code == 0
    manifest = json.loads((out / "engines.json").read_text())
    assert "onnx" not in manifest and manifest["dtype"] == "float32"
    assert manifest["torch"]["files"] >= 0 and len(manifest["torch"]["sha256"]) == 64
    assert not list(out.rglob("*.onnx"))
    config = RuntimeConfig.from_env(backend="torch", prefix_cache=0)
    body = request_body(pattern_png(96, 64), speed_bench_questions(3), "image/png")
    alone = load_engine(str(export), str(out), config).answer(body)
    beside = load_engine(str(export), str(full), config).answer(body)
    strip = ("latency_s", "latency_total_s")

    def answers(response: dict) -> dict:
        return {
            name: {k: v for k, v in answer.items() if k not in strip}
            for name, answer in response["answers"].items()
        }

    assert answers(alone) == answers(beside)
