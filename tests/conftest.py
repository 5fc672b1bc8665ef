"""Session fixtures every test module may ask for: the tiny synthetic export and its release."""

from __future__ import annotations

import os
from pathlib import Path

# Inductor's CPU code without SIMD: the compiled-block tests check what Dynamo and Inductor make
# of the blocks (the GPU's kernels are Triton, not this C++), and choosing vector tilings for
# dynamic shapes took about a quarter of their compile time on the 2-core CI machine (a cold
# `test_compiled_layer_blocks_answer_as_the_eager_modules`: 200 s, 155 s without). Set before
# anything imports Inductor's config, which reads it once.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402

from tests.checkpoint_fixtures import tiny_export, tiny_release  # noqa: E402


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="session")
def release_dir(tmp_path_factory) -> Path:
    return tiny_release(tmp_path_factory)
