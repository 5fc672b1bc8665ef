"""The `omnijev` command line: one entry point whose subcommands wrap every stage of the project."""

from __future__ import annotations

import argparse
import importlib
import sys

from runtime import config

# subcommand -> (module, function, help); modules are imported only when their command runs.
COMMANDS = {
    "explain": ("runtime.explain", "cli_explain", "show what preparation makes of a request"),
    "checkpoint": ("build_engines.checkpoints", "cli_checkpoint", "write a synthetic checkpoint"),
    "merge": ("build_engines.merge", "cli_merge", "merge a release into an export"),
    "reference": ("reference.mso1", "cli_reference", "answer a request with the PyTorch reference"),
    "export": ("build_engines.onnx_export", "cli_export", "export ONNX files from a checkpoint"),
    "engines": ("build_engines.engines", "cli_engines", "export, check and build engines"),
    "run": ("runtime.executor", "cli_run", "answer a request file through the engines"),
    "parity": ("bench.parity", "cli_parity", "compare answers with the float32 reference"),
    "bench": ("bench.latency", "cli_bench", "time the workloads, with the reference beside"),
    "calibrate": ("calibration.fit", "cli_calibrate", "fit temperatures to labelled head outputs"),
    "serve": ("server.app", "cli_serve", "serve POST /v1/systemone"),
    "demo": ("tools.demo", "cli_demo", "build the tiny demo model and serve it on the CPU"),
}

# `omnijev serve --replicas N`: the same app as replicas on Ray Serve
REPLICATED_SERVE = ("server.ray_serve", "cli_serve")


def client_counts(text: str) -> tuple[int, ...]:
    """`--clients 1,4,16` (or 0 for none): the client counts, in turn."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"client counts are numbers, got {text!r}") from None
    if counts == (0,):
        return ()
    if any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError(f"client counts are at least 1, got {text!r}")
    return counts


def image_count(text: str) -> int:
    """`--more-images N`: a count of further stills, 0 or more."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the image count is a number, got {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"the image count is at least 0, got {count}")
    return count


def add_arguments(name: str, parser: argparse.ArgumentParser) -> None:
    """Each command's options, declared here so that `omnijev --help` lists them all."""
    if name in ("explain", "reference", "run"):
        parser.add_argument("request", help="request JSON file")
    if name in ("explain", "reference", "run", "export", "engines", "serve", "parity", "bench"):
        parser.add_argument("--checkpoint", required=name != "explain", help="export directory")
    if name == "calibrate":
        parser.add_argument("records", help="JSON lines of {type, mu, label}")
        parser.add_argument("--checkpoint", default=None, help="start from this export's values")
        parser.add_argument("--plot", metavar="FILE.png", help="draw the reliability diagram")
    if name == "checkpoint":
        parser.add_argument("--preset", choices=("tiny", "4b"), default="tiny")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--out", required=True)
        parser.add_argument("--release-only", action="store_true", help="do not merge")
    if name == "merge":
        parser.add_argument("--release", required=True)
        parser.add_argument("--out", required=True)
    if name == "reference":
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
        parser.add_argument("--device", default=None)
    if name in ("export", "engines"):
        parser.add_argument("--out", required=True)
        parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    if name == "export":
        parser.add_argument(
            "--gdn",
            choices=("ort", "std"),
            default="ort",
            help="fused ONNX Runtime ops, or standard ops (64 tokens a pass)",
        )
        parser.add_argument(
            "--readout",
            choices=("std", "plugin"),
            default="std",
            help="standard ops, or the omnijev::TokenLogProbs plugin node",
        )
        parser.add_argument(
            "--attention",
            choices=("ort", "std"),
            default=None,
            help="vision attention: ONNX Runtime's fused MultiHeadAttention or standard ops "
            "(default: follows --gdn)",
        )
    if name == "engines":
        parser.add_argument(
            "--backend",
            choices=("all", "torch"),
            default="all",
            help="all: ONNX, its check and the TensorRT plans; torch: the torch engine alone "
            "(no ONNX export), its compiler caches filled on this GPU",
        )
        parser.add_argument("--skip-plans", action="store_true", help="ONNX only")
        parser.add_argument("--timing-cache", default=None, help="replay this timing cache")
        parser.add_argument(
            "--torch-artifacts",
            action="store_true",
            help="also fill the torch backend's compiler caches (on the GPU they are for)",
        )
    if name in ("run", "serve", "parity", "bench"):
        parser.add_argument("--engines", required=True)
        config.add_arguments(parser)
    if name in ("parity", "bench"):
        parser.add_argument("--out", default=None, help="write the full report as JSON")
    if name == "parity":
        parser.add_argument(
            "--bf16-reference",
            action="store_true",
            help="also the BF16 reference's distance to the float32 one (the bar for BF16)",
        )
        parser.add_argument(
            "--more-images",
            type=image_count,
            default=0,
            help="seeded stills beside the four (more answers: chance told from cause in BF16)",
        )
    if name == "bench":
        parser.add_argument(
            "--host-only", action="store_true", help="the host stages alone, without engines"
        )
        parser.add_argument("--runs", type=int, default=20)
        parser.add_argument("--reference-dtype", choices=("float32", "bfloat16"), default=None)
        parser.add_argument(
            "--clients",
            type=client_counts,
            default=None,
            help="closed-loop clients of the traffic suite over HTTP, in turn (0: none; "
            "default 1,4,16 on a GPU, none on the CPU, where its images take seconds each)",
        )
        parser.add_argument("--client-requests", type=int, default=64)
    if name == "serve":
        parser.add_argument(
            "--warm-up",
            action="append",
            metavar="REQUEST.json",
            help="also answer this request before reporting ready (repeatable): its shapes' "
            "sessions and CUDA graphs are then built before the first client",
        )
        parser.add_argument(
            "--allowed-host",
            action="append",
            metavar="HOST",
            help="a Host header name to answer (repeatable; default localhost, 127.0.0.1, ::1; "
            "'*' any; also OMNIJEV_ALLOWED_HOSTS)",
        )
        parser.add_argument(
            "--no-docs", action="store_true", help="no /docs, /redoc or /openapi.json"
        )
        parser.add_argument(
            "--batch-wait-ms",
            type=float,
            default=0.0,
            metavar="MS",
            help="how long a request that reaches the model alone waits for others to share "
            "its passes (default 0: requests already waiting are batched, one client is never "
            "slowed)",
        )
        replicas = parser.add_argument_group(
            "replicas on Ray Serve (docs/ray-serve.md; without --replicas, one process)"
        )
        replicas.add_argument(
            "--replicas", type=int, default=None, metavar="N", help="worker replicas (at least)"
        )
        replicas.add_argument(
            "--max-replicas", type=int, default=None, metavar="M", help="autoscale up to M"
        )
        replicas.add_argument(
            "--target-ongoing",
            type=float,
            default=8.0,
            help="ongoing requests a replica that autoscaling aims at (default 8)",
        )
        replicas.add_argument(
            "--replica-gpus",
            type=float,
            default=None,
            help="GPUs a replica holds; 0.5 puts two on one GPU (default 1 on CUDA, else 0)",
        )
        replicas.add_argument(
            "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves a replica"
        )
        replicas.add_argument(
            "--ray-address",
            default=None,
            help="a running Ray cluster ('auto': this host's); default: start Ray here",
        )
    if name in ("serve", "demo"):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnijev", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (_, _, help_text) in COMMANDS.items():
        add_arguments(name, sub.add_parser(name, help=help_text))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module_name, function_name, _ = COMMANDS[args.command]
    if args.command == "serve" and args.replicas is not None:
        module_name, function_name = REPLICATED_SERVE
    function = getattr(importlib.import_module(module_name), function_name)
    return int(function(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
