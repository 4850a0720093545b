"""API-key auth: the pure decision, and a sweep of every registered route of a live server
with and without the key (RELIABILITY rule 9)."""

from __future__ import annotations

import types

import pytest

from server.http.app import create_app
from server.http.auth import OPEN_PATHS, is_authorized
from tests.live_server import ServerProcess

KEY = "sk-test-123"


def test_decision_function():
    assert is_authorized("/v1/models", {}, None)
    assert not is_authorized("/v1/models", {}, KEY)
    assert is_authorized("/v1/models", {"authorization": f"Bearer {KEY}"}, KEY)
    assert is_authorized("/v1/models", {"authorization": f"bearer {KEY}"}, KEY)
    assert is_authorized("/v1/models", {"x-api-key": KEY}, KEY)
    assert not is_authorized("/v1/models", {"authorization": f"Bearer {KEY}x"}, KEY)
    assert not is_authorized("/v1/models", {"authorization": KEY}, KEY)
    assert all(is_authorized(p, {}, KEY) for p in OPEN_PATHS)


def registered_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the app registers, FastAPI's own docs routes included."""
    app = create_app(types.SimpleNamespace(observers=[]), model_name="m", model_path=None)
    out = []

    def walk(routes):
        for route in routes:
            included = getattr(route, "original_router", None)  # FastAPI's included routers
            if included is not None:
                walk(included.routes)
                continue
            for method in sorted(getattr(route, "methods", None) or {"GET"}):
                if method != "HEAD":
                    out.append((method, route.path))

    walk(app.routes)
    return out


@pytest.fixture(scope="module")
def keyed_server(make_tiny_model):
    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "2048",
                           "--context-length", "512", "--api-key", KEY)
    yield server
    assert server.stop() == 0


def test_every_route_needs_the_key_except_health_and_metrics(keyed_server):
    routes = registered_routes()
    assert len(routes) >= 15 and ("POST", "/v1/chat/completions") in routes
    bodies = {"/generate": {"text": "x", "sampling_params": {"max_new_tokens": 1}},
              "/v1/completions": {"prompt": "x", "max_tokens": 1},
              "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}],
                                       "max_tokens": 1},
              "/abort_request": {"rid": "none"}}
    with keyed_server.client() as c:
        for method, path in routes:
            kw = {"json": bodies.get(path, {})} if method == "POST" else {}
            without = c.request(method, path, **kw)
            with_key = c.request(method, path, headers={"Authorization": f"Bearer {KEY}"}, **kw)
            if path in OPEN_PATHS:
                assert without.status_code != 401, (method, path)
            else:
                assert without.status_code == 401, (method, path, without.status_code)
                assert without.json()["error"]["type"] == "authentication_error"
            assert with_key.status_code != 401, (method, path)
            assert with_key.status_code < 500, (method, path, with_key.text)
