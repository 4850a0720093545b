"""Fixtures of the server tests (the live servers themselves are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.live_server import assert_healthy


@pytest.fixture
def healthy(tiny_server):
    """After the test: the server is healthy (:func:`assert_healthy`)."""
    yield tiny_server
    assert_healthy(tiny_server)
