"""Session fixtures every test module may ask for: the tiny synthetic export and its release."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.checkpoint_fixtures import tiny_export, tiny_release


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> Path:
    return tiny_export(tmp_path_factory)


@pytest.fixture(scope="session")
def release_dir(tmp_path_factory) -> Path:
    return tiny_release(tmp_path_factory)
