"""Fixtures of the server tests (the live servers themselves are in tests/conftest.py)."""

from __future__ import annotations

import pytest

from tests.live_server import wait_idle


@pytest.fixture
def healthy(tiny_server):
    """After the test: /health_generate answers 200 and the KV invariants hold."""
    yield tiny_server
    with tiny_server.client() as c:
        assert c.get("/health_generate").status_code == 200
    info = wait_idle(tiny_server)
    assert info["invariants_ok"], info
    assert info["metrics"]["kv_usage"] == 0.0, info
