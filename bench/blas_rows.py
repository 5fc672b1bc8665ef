"""Whether this GPU's matrix products give a row the same bytes at every packed pass size: the 4b's
product shapes in BF16, the first 256 rows of X [M, K] @ W against those at 8,192 rows, for each
BLAS setting in a process of its own (the settings are read when the library starts), what the
torch backend's load-time check finds on a 4b layer of each kind, and the milliseconds of the
MLP's products at 1,024 rows. JSON to --out, a table printed.

    python -m bench.blas_rows --out F
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from runtime.packing import PACK_SIZES

# (N, K) of the 4b's language-model products (docs/model.md): attention q (with its gate), k and
# v, o; the delta layer's fused in-projection and out; the MLP's gate, up and down
SHAPES = [(8192, 2560), (1024, 2560), (2560, 4096), (12288, 2560), (2560, 9216), (9216, 2560)]
FIRST = 256  # rows compared
VARIANTS = {
    "default": {},
    "no workspace": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "cublas": {"OMNIJEV_BLAS": "cublas"},
    "cublas, no workspace": {
        "OMNIJEV_BLAS": "cublas",
        "CUBLAS_WORKSPACE_CONFIG": ":0:0",
        "CUBLASLT_WORKSPACE_SIZE": "0",
    },
}


def measure() -> dict:
    """In this process: each shape's sizes whose first rows differ from the largest size's."""
    import torch

    if os.environ.get("OMNIJEV_BLAS"):
        torch.backends.cuda.preferred_blas_library(os.environ["OMNIJEV_BLAS"])
    generator = torch.Generator(device="cuda").manual_seed(0)
    record: dict = {"differ": {}, "mlp_ms": None}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=generator) * k**-0.5
        x = torch.randn(PACK_SIZES[-1], k, device="cuda", dtype=torch.bfloat16, generator=generator)
        full = torch.nn.functional.linear(x, w)[:FIRST]
        differ = []
        for m in PACK_SIZES:
            part = torch.nn.functional.linear(x[:m].clone(), w)[:FIRST]
            if not torch.equal(part, full):
                differ.append(m)
        record["differ"][f"{n}x{k}"] = differ
    x = torch.randn(1024, 2560, device="cuda", dtype=torch.bfloat16)
    up = torch.randn(18432, 2560, device="cuda", dtype=torch.bfloat16)
    down = torch.randn(2560, 9216, device="cuda", dtype=torch.bfloat16)

    def mlp() -> torch.Tensor:
        gate, value = torch.nn.functional.linear(x, up).chunk(2, dim=-1)
        return torch.nn.functional.linear(gate * value, down)

    for _ in range(5):
        mlp()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        mlp()
    end.record()
    end.synchronize()
    record["mlp_ms"] = start.elapsed_time(end) / 50
    record["products_differ"] = backend_check(torch)
    record["gpu"] = torch.cuda.get_device_name()
    record["torch"] = torch.__version__
    return record


def backend_check(torch) -> list[str]:
    """What the torch backend's load-time check (`products_differ`) finds here, on a 4b layer
    of each kind (random weights, fused as the backend fuses them)."""
    from types import SimpleNamespace

    from build_engines.presets import config_kwargs
    from runtime.model.language import DecoderLayer
    from runtime.model.packed import products_differ

    tc = config_kwargs("4b")["text_config"]
    layers = []
    with torch.device("cuda"):
        for kind in ("linear_attention", "full_attention"):
            layer = DecoderLayer(tc, kind, "eager").to(torch.bfloat16)
            (layer.self_attn if kind == "full_attention" else layer.linear_attn).fuse()
            layer.mlp.fuse()
            layers.append(layer)
    return products_differ(SimpleNamespace(layers=layers), PACK_SIZES)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.blas_rows")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(measure()))
        return 0
    results = {}
    for name, env in VARIANTS.items():
        done = subprocess.run(
            [sys.executable, "-m", "bench.blas_rows", "--one"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
        )
        if done.returncode:
            results[name] = {"error": done.stderr[-2000:]}
        else:
            results[name] = json.loads(done.stdout.strip().splitlines()[-1])
        shown = results[name].get("differ", results[name])
        print(f"{name}: mlp {results[name].get('mlp_ms')} ms, differ {shown}", flush=True)
        print(f"  the backend's check: {results[name].get('products_differ')}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
