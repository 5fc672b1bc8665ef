"""`python -m bench.hostprofile`: the host stages of the bench requests (1600×900 PNG and JPEG;
1 question, 12 questions, 255 options) without engines: the built-in tokenizer or a checkpoint's,
and synthetic 4b-sized heads or a checkpoint's. `omnijev bench` prints the same table with its
engine's own preparation."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench import hoststages
from bench.workloads import host_requests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostprofile", description=__doc__)
    parser.add_argument("--runs", type=int, default=hoststages.RUNS)
    parser.add_argument("--checkpoint", default=None, help="its tokenizer and heads, if given")
    parser.add_argument("--out", default=None, help="write the medians and every run as JSON")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch's CPU threads")
    parser.add_argument(
        "--python-defaults",
        action="store_true",
        help="Python's own GIL switch interval and threads, not the worker's (server.app)",
    )
    parser.add_argument("--only", action="append", default=None, help="this request only")
    args = parser.parse_args(argv)
    if not args.python_defaults:  # the stages as the worker's process runs them
        from server.app import worker_process

        worker_process()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    parts = {}
    if args.checkpoint:
        from runtime.export_format import load_export
        from runtime.heads import Heads
        from runtime.tokenizer import load_tokenizer

        checkpoint = Path(args.checkpoint)
        parts["tokenizer"] = load_tokenizer(checkpoint)
        parts["heads"] = Heads.from_safetensors(checkpoint / "heads.safetensors")
        parts["calibration"] = load_export(checkpoint, verify=False).calibration
    requests = host_requests()
    unknown = sorted(set(args.only or ()) - set(requests))
    if unknown:
        parser.error(f"unknown request {unknown[0]!r}; one of {sorted(requests)}")
    if args.only:
        requests = {name: requests[name] for name in args.only}
    results = hoststages.profile(requests, args.runs, **parts)
    machine = hoststages.machine()
    if args.out:
        record = {"machine": machine, "command": sys.argv, "results": results}
        Path(args.out).write_text(json.dumps(record, indent=1))
    interval = f"GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"
    print(f"host stages, wall time, {interval} ({machine})")
    print(hoststages.table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
