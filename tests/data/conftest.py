"""Fixtures shared by the data tests: a small generated spleen set, and a private cache folder."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def spleen(tmp_path_factory) -> Path:
    """Ten generated spleen CT cases (5 folds: 8 training cases, so 2 ranks split them evenly)."""
    from fastvision.data.synth.medical import synth_spleen

    return synth_spleen(tmp_path_factory.mktemp("parity") / "spleen", seed=2, cases=10, test_cases=0, size=20)


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """``FASTVISION_CACHE`` in the test's folder (the recipes' ``data.cache_dir: auto``)."""
    monkeypatch.setenv("FASTVISION_CACHE", str(tmp_path / "fvcache"))
