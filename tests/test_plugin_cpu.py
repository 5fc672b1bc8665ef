"""The readout kernel's arithmetic: plugins/kernel_cpu.cpp (the CUDA kernel's order of operations,
built here with g++) against plugins/readout.py's reference; the CUDA kernel where nvcc and a GPU
exist."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from plugins.readout import CHUNK, DOMAIN, OP_TYPE, token_logprobs_reference, token_logprobs_std

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
# no contraction: the kernel's fmaf calls are the only fused operations
CXX_FLAGS = ["-O2", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off"]
NVCC_FLAGS = ["-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-arch=native"]
POINTER = ctypes.c_void_p
SIZE = ctypes.c_int64


def random_case(rows: int, vocab: int, width: int, seed: int = 0, scale: float = 1.0):
    rng = np.random.default_rng(seed)
    hidden = (scale * rng.standard_normal((rows, width))).astype(np.float32)
    embedding = rng.standard_normal((vocab, width)).astype(np.float32)
    tokens = rng.integers(0, vocab, rows).astype(np.int64)
    return hidden, embedding, tokens


def bf16_values(array: np.ndarray) -> np.ndarray:
    return torch.from_numpy(array).bfloat16().float().numpy()


def float64_logprobs(hidden, embedding, tokens) -> np.ndarray:
    logits = hidden.astype(np.float64) @ embedding.astype(np.float64).T
    top = logits.max(axis=1, keepdims=True)
    total = np.log(np.exp(logits - top).sum(axis=1))
    return logits[np.arange(len(tokens)), tokens] - top[:, 0] - total


@pytest.fixture(scope="module")
def kernel_cpu(tmp_path_factory):
    compiler = shutil.which("g++")
    if compiler is None:
        pytest.skip("g++ not found")
    library = tmp_path_factory.mktemp("kernel_cpu") / "libkernel_cpu.so"
    source = PLUGINS / "kernel_cpu.cpp"
    subprocess.run([compiler, *CXX_FLAGS, str(source), "-o", str(library)], check=True)
    function = ctypes.CDLL(str(library)).omnijev_token_logprobs_cpu
    function.restype = ctypes.c_int
    function.argtypes = [POINTER, POINTER, POINTER, SIZE, SIZE, SIZE, SIZE, ctypes.c_int32, POINTER]

    def run(hidden, embedding, tokens, chunk: int = CHUNK, bf16: bool = False) -> np.ndarray:
        hidden = np.ascontiguousarray(hidden, np.float32)
        embedding = np.ascontiguousarray(embedding, np.float32)
        tokens = np.ascontiguousarray(tokens, np.int64)
        out = np.full(len(tokens), -1.0, np.float32)
        status = function(
            hidden.ctypes.data, embedding.ctypes.data, tokens.ctypes.data, len(tokens),
            embedding.shape[0], embedding.shape[1], chunk, int(bf16), out.ctypes.data,
        )  # fmt: skip
        assert status == 0
        return out

    return run


def test_float32_matches_reference(kernel_cpu):
    hidden, embedding, tokens = random_case(9, 1000, 40)
    got = kernel_cpu(hidden, embedding, tokens)
    reference = token_logprobs_reference(hidden, embedding, tokens)
    assert got.dtype == np.float32 and (got < 0).all()
    # float32 logits summed in another order than BLAS: agreement to a few float32 ulps
    assert np.abs(got - reference).max() < 2e-5
    assert np.abs(got - float64_logprobs(hidden, embedding, tokens)).max() < 2e-5


def test_result_does_not_depend_on_chunk(kernel_cpu):
    hidden, embedding, tokens = random_case(5, 777, 33, seed=1)
    results = [kernel_cpu(hidden, embedding, tokens, chunk=c) for c in (1, 7, 64, 777, CHUNK)]
    for other in results[1:]:
        assert np.array_equal(results[0], other)


def test_large_logits_stay_finite(kernel_cpu):
    hidden, embedding, tokens = random_case(4, 500, 64, seed=2, scale=50.0)
    got = kernel_cpu(hidden, embedding, tokens, chunk=128)
    assert np.isfinite(got).all()
    expected = float64_logprobs(hidden, embedding, tokens)
    assert np.abs(got - expected).max() < 1e-3 * max(1.0, np.abs(expected).max())


def test_bf16_logits_round_as_the_bf16_matmul(kernel_cpu):
    """BF16 inputs: logits rounded to bfloat16 as torch's BF16 matmul rounds them; agreement
    within the worker's tolerance, one BF16 ulp of the logit + 1e-3 (docs/contract.md §5)."""
    hidden, embedding, tokens = random_case(6, 2000, 64, seed=3)
    hidden, embedding = bf16_values(hidden), bf16_values(embedding)
    got = kernel_cpu(hidden, embedding, tokens, bf16=True)
    as_bf16 = [torch.from_numpy(x).bfloat16() for x in (hidden, embedding)]
    expected = token_logprobs_std(*as_bf16, torch.from_numpy(tokens)).numpy()
    logits = hidden @ embedding.T
    picked = np.abs(logits[np.arange(len(tokens)), tokens])
    assert (np.abs(got - expected) <= bf16_values(picked) * 2.0**-7 + 1e-3).all()
    unrounded = kernel_cpu(hidden, embedding, tokens, bf16=False)
    assert not np.array_equal(got, unrounded)  # the rounding is really applied


def test_token_outside_vocabulary_gives_nan(kernel_cpu):
    hidden, embedding, tokens = random_case(3, 50, 16, seed=4)
    tokens[1] = 50
    got = kernel_cpu(hidden, embedding, tokens)
    assert np.isnan(got[1]) and np.isfinite(got[[0, 2]]).all()


def constant(path: Path, name: str) -> str:
    match = re.search(rf"constexpr \w+(?: const\*)? {name} = ([^;]+);", path.read_text())
    assert match, f"{name} not found in {path.name}"
    return match.group(1).strip()


def test_cpu_check_and_kernel_share_their_order_and_names():
    for name in ("kLanes", "kWarps"):
        assert constant(PLUGINS / "kernel_cpu.cpp", name) == constant(
            PLUGINS / "token_logprobs_kernel.cu", name
        )
    header = PLUGINS / "token_logprobs.h"
    assert int(constant(header, "kDefaultChunk")) == CHUNK
    assert constant(header, "kPluginName") == f'"{OP_TYPE}"'
    assert constant(header, "kPluginNamespace") == f'"{DOMAIN}"'
    assert constant(header, "kPluginVersion") == '"1"'


@pytest.mark.gpu
def test_cuda_kernel_matches_cpu_check(kernel_cpu, tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None or not torch.cuda.is_available():
        pytest.skip("needs nvcc and a CUDA device")
    library = tmp_path / "libkernel_cuda.so"
    source = PLUGINS / "token_logprobs_kernel.cu"
    subprocess.run([nvcc, *NVCC_FLAGS, str(source), "-o", str(library)], check=True)
    function = ctypes.CDLL(str(library)).omnijev_token_logprobs_cuda
    function.restype = ctypes.c_int
    function.argtypes = [POINTER] * 4 + [SIZE] * 4 + [ctypes.c_int32, POINTER]
    # rows cross the kernel's 8-row blocks; vocab and width are not multiples of 8 or 32
    hidden, embedding, tokens = random_case(19, 3001, 72, seed=5)
    for bf16 in (False, True):
        if bf16:
            hidden, embedding = bf16_values(hidden), bf16_values(embedding)
        dtype = torch.bfloat16 if bf16 else torch.float32
        h, e = (torch.from_numpy(x).to("cuda", dtype) for x in (hidden, embedding))
        t = torch.from_numpy(tokens).cuda()
        out = torch.empty(len(tokens), device="cuda")
        stream = torch.cuda.current_stream().cuda_stream
        status = function(
            h.data_ptr(), e.data_ptr(), t.data_ptr(), out.data_ptr(), len(tokens),
            e.shape[0], e.shape[1], 512, int(bf16), stream,
        )  # fmt: skip
        assert status == 0
        got = out.cpu().numpy()
        cpu = kernel_cpu(hidden, embedding, tokens, chunk=512, bf16=bf16)
        # same order of operations; only expf may differ (CUDA's is within 2 ulp)
        assert np.abs(got - cpu).max() < 1e-5
        if not bf16:
            reference = token_logprobs_reference(hidden, embedding, tokens)
            assert np.abs(got - reference).max() < 2e-5
