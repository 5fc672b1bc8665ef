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

# the slowest modules on the 2-core CI machine (about 200, 135 and 110 s of the suite's 800 in one
# process) run first, so that at the end no pytest-xdist worker is left alone with one of them
# (`make test` passes --no-loadscope-reorder, which keeps this order)
SLOWEST_MODULES = ("test_torch_backend.py", "test_onnx_export.py", "test_engines.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return SLOWEST_MODULES.index(name) if name in SLOWEST_MODULES else len(SLOWEST_MODULES)

    items.sort(key=rank)  # stable: each module keeps its own order


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="session")
def release_dir(tmp_path_factory) -> Path:
    return tiny_release(tmp_path_factory)
