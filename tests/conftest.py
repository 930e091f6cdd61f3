"""Fixtures shared by the model-parity test modules."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import parity  # noqa: E402


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> parity.References:
    """Tiny checkpoints and their single-process reference runs, built once per session."""
    return parity.References(str(tmp_path_factory.mktemp("models")))
