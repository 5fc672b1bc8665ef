"""`python -m tools.hostprofile`: the per-stage host profile of the bench requests (1600×900 PNG
and JPEG; 1 question, 12 questions, 255 options), with no engines (synthetic 4b-sized heads).

Follows issue 13's stage list; `omnijev bench` prints the same table after its latency table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tools import bench, hoststages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hostprofile", description=__doc__)
    parser.add_argument("--runs", type=int, default=hoststages.RUNS)
    parser.add_argument("--checkpoint", default=None, help="its tokenizer and heads, if given")
    parser.add_argument("--device", default=None, help="upload target (default: cuda if any)")
    parser.add_argument("--out", default=None, help="write the medians as JSON")
    parser.add_argument("--threads", type=int, default=None, help="PyTorch's CPU threads")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="CPU seconds instead of wall seconds (one PyTorch thread, no tokenizer threads)",
    )
    parser.add_argument(
        "--python-defaults",
        action="store_true",
        help="Python's own GIL switch interval and threads, not the worker's (server.app)",
    )
    parser.add_argument(
        "--only", action="append", default=None, help="this request only (repeatable)"
    )
    parser.add_argument(
        "--device-heads",
        action="store_true",
        help="the heads' large products on the upload device (the worker's default on CUDA)",
    )
    args = parser.parse_args(argv)
    if not args.python_defaults:  # the stages as the worker's process runs them
        from server.app import worker_process

        worker_process()
    if args.cpu_time:
        import os

        import torch

        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        torch.set_num_threads(1)
        hoststages.use_cpu_time()
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    tokenizer = heads = calibration = None
    if args.checkpoint:
        from runtime.export_format import load_export
        from runtime.heads import Heads
        from runtime.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(Path(args.checkpoint))
        heads = Heads.from_safetensors(Path(args.checkpoint) / "heads.safetensors")
        calibration = load_export(Path(args.checkpoint), verify=False).calibration
    if args.device_heads:
        heads = heads or hoststages.synthetic_heads()
        if not heads.use_device(hoststages.device_for(args.device)):
            print("the device's products fail the heads' check: heads on the CPU", file=sys.stderr)
    requests = bench.host_requests()
    if args.only:
        requests = {name: requests[name] for name in args.only}
    results = hoststages.profile(requests, tokenizer, heads, calibration, args.runs, args.device)
    machine = hoststages.machine()
    if args.out:
        record = {"machine": machine, "command": sys.argv, "results": results}
        Path(args.out).write_text(json.dumps(record, indent=1))
    clock = "CPU time" if args.cpu_time else "wall time"
    clock += f", GIL switch interval {sys.getswitchinterval() * 1e3:g} ms"
    site = "device" if heads is not None and heads.device_mlps is not None else "CPU"
    upload = hoststages.device_for(args.device)
    print(f"host stages, {clock} ({machine}, upload to {upload}, heads' products on the {site})")
    print(hoststages.table(results))
    if heads is not None:  # which Linears took every question's rows in one product here
        print(f"heads' layers stacked: {', '.join(sorted(heads.stackable)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
