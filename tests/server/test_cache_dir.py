"""--cache-dir through the live server: what was cached before a SIGTERM is a cache hit after
the restart."""

from __future__ import annotations

import os

from tests.live_server import ServerProcess


def test_cached_prefix_survives_a_server_restart(make_tiny_model, tmp_path):
    path, _ = make_tiny_model("llama")
    args = ("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
            "--context-length", "512", "--cache-dir", str(tmp_path))
    body = {"input_ids": list(range(100, 400)), "sampling_params": {"max_new_tokens": 4,
                                                                     "temperature": 0}}
    server = ServerProcess(*args)
    with server.client() as c:
        first = c.post("/generate", json=body).json()
    assert server.stop() == 0
    assert first["meta_info"]["cached_tokens"] == 0
    assert sum(len(files) for _, _, files in os.walk(tmp_path)) >= 4  # 303 tokens: 4 pages
    server = ServerProcess(*args)
    try:
        with server.client() as c:
            again = c.post("/generate", json=body).json()
            metrics = c.get("/server_info").json()["metrics"]
    finally:
        assert server.stop() == 0
    assert again["meta_info"]["cached_tokens"] == 4 * 64
    assert again["output_ids"] == first["output_ids"]
    assert metrics["tier_loaded_tokens"] == 4 * 64 and metrics["disk_tier_pages"] >= 4
