"""Shared fixtures: the real model, fetched once into the kvdiag cache and reused."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir():
    """The converted SmolLM2 folder (fetched on first use; later sessions reuse the cache)."""
    from kvdiag.model import ensure_model

    return ensure_model()
