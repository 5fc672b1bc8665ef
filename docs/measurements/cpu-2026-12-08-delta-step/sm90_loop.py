"""The packed delta kernel compiled for sm_90 on a machine without a GPU: registers, and the
instructions of its token loop by kind, for this tree's kernel or another file's.

    PYTHONPATH=. python docs/measurements/cpu-2026-12-08-delta-step/sm90_loop.py [OLD_FILE]
"""

import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SIGNATURE = {
    "q": "*bf16", "k": "*bf16", "v": "*bf16", "g": "*fp32", "beta": "*fp32", "states": "*fp32",
    "slots": "*fp32", "row_start": "*i64", "row_length": "*i64", "row_parent": "*i64",
    "row_prefix": "*i64", "out": "*fp32", "scale": "fp32", "sq_n": "i64", "sv_n": "i64",
}  # fmt: skip
KINDS = ("SHFL", "BAR", "STS", "LDS", "LDG", "FFMA", "FMUL", "FADD")
TOOLS = pathlib.Path(triton.__file__).parent / "backends/nvidia/bin"


def kernels_module(path: str | None):
    if path is None:
        from runtime.model import packed_kernels

        return packed_kernels
    spec = importlib.util.spec_from_file_location("other_packed_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def address(line: str) -> int:
    return int(re.search(r"/\*([0-9a-f]{4})\*/", line).group(1), 16)


def loop_counts(sass: str) -> dict:
    """The instructions between the loop's backward branch and its target, by kind."""
    lines = [x for x in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", x)]
    for line in lines:
        if "BRA" not in line:
            continue
        target = re.search(r"0x([0-9a-f]+)", line.split("BRA")[1])
        if target and int(target.group(1), 16) < address(line):
            start, end = int(target.group(1), 16), address(line)
            body = [x for x in lines if start <= address(x) <= end]
            ops = [re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", x) for x in body]
            names = [m.group(1) for m in ops if m]
            return {"instructions": len(body), **{k: names.count(k) for k in KINDS}}
    return {}


def main() -> None:
    module = kernels_module(sys.argv[1] if len(sys.argv) > 1 else None)
    for text in (True, False):
        constants = dict(H=16, HV=32, K=128, V=128, BV=16, EPS=1e-6, TEXT=text, SLOTS=64)
        signature = {**SIGNATURE, **dict.fromkeys(constants, "constexpr")}
        source = ASTSource(module._packed_delta_kernel, signature, constexprs=constants)
        done = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
        with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
            cubin.write(done.asm["cubin"])
            cubin.flush()
            dump = [str(TOOLS / "cuobjdump"), "--dump-resource-usage", cubin.name]
            usage = subprocess.run(dump, capture_output=True, text=True).stdout
            sass = subprocess.run(
                [str(TOOLS / "cuobjdump"), "-sass", cubin.name], capture_output=True, text=True
            ).stdout
        registers = re.search(r"REG:(\d+)", usage).group(1)
        spilled = re.search(r"STACK:(\d+)", usage).group(1)
        print(f"TEXT={text}: {registers} registers, stack {spilled}, loop {loop_counts(sass)}")


if __name__ == "__main__":
    main()
