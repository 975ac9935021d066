"""Fixtures of the fault suite (Ray, the tiny model and the shared engine come from tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
