"""Multi-LoRA through the HTTP server: adapters given at start-up and loaded at run time, picked
by ``model`` (OpenAI routes, the ``openai`` client) and ``lora_path`` (/generate), mixed in
one batch, each with its own radix-cache namespace; greedy outputs equal transformers + peft."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from tests.live_server import assert_healthy

peft = pytest.importorskip("peft")
NEW = 6  # tokens per greedy generation
PROMPTS = [[5, 17, 300, 42, 9, 1000, 77], [8, 8, 120, 4000, 33], [901, 14, 15, 92, 65, 35, 89]]


def _greedy(model, ids: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                             dtype=torch.int64), max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def _generate(client, ids, lora=None, max_new=NEW) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new,
                                                  "temperature": 0, "ignore_eos": True}}
    if lora is not None:
        body["lora_path"] = lora
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_mixed_adapters_in_one_batch_match_peft(lora_server):
    server, hf, adapters = lora_server
    jobs = [(ids, lora) for ids in PROMPTS for lora in (None, "a0", "a1")]
    with server.client() as c, concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda j: _generate(c, *j)["output_ids"], jobs))
    for (ids, lora), got in zip(jobs, outs):
        assert got == _greedy(hf if lora is None else adapters[lora][1], ids), (ids, lora)
    assert len({tuple(o) for o in outs[:3]}) > 1  # the adapters change the answers
    assert_healthy(server)


def test_models_lists_adapters_and_openai_client_picks_them(lora_server):
    import openai

    server, _, adapters = lora_server
    with server.client() as c:
        cards = c.get("/v1/models").json()["data"]
        base = cards[0]["id"]
        assert [(m["id"], m.get("parent")) for m in cards] == [(base, None), ("a0", base),
                                                               ("a1", base)]
        assert cards[2]["root"] == adapters["a1"][0]
        assert c.get("/v1/models/a0").json()["parent"] == base
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = {}
    for model in (base, "a0", f"{base}:a0", "a1"):
        r = client.completions.create(model=model, prompt="The capital of France is",
                                      max_tokens=NEW, temperature=0)
        texts[model] = r.choices[0].text
    assert texts["a0"] == texts[f"{base}:a0"]
    assert len(set(texts.values())) == 3
    with pytest.raises(openai.NotFoundError, match="'nope' is not loaded"):
        client.chat.completions.create(model=f"{base}:nope", max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}])


def test_embeddings_on_an_adapter(lora_server):
    server, _, _ = lora_server
    with server.client() as c:
        vec = {m: c.post("/v1/embeddings", json={"input": "a red fox", "model": m}).json()
               ["data"][0]["embedding"] for m in ("base", "a0", "a1")}
    assert vec["a0"] != vec["base"] and vec["a1"] != vec["a0"]


def test_unknown_lora_path_is_a_404_and_changes_nothing(lora_server):
    server, _, _ = lora_server
    with server.client() as c:
        r = c.post("/generate", json={"input_ids": [1, 2, 3], "lora_path": "nope",
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 404 and "nope" in r.json()["error"]["message"]
        r = c.post("/generate", json={"input_ids": [[1, 2], [3, 4]], "lora_path": ["a0"],
                                      "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400
    assert_healthy(server)


def test_each_adapter_has_its_own_cache_namespace(lora_server):
    server, _, adapters = lora_server
    ids = list(range(40, 140))  # long enough to be cached
    with server.client() as c:
        first = _generate(c, ids, "a0", 1)["meta_info"]["cached_tokens"]
        again = _generate(c, ids, "a0", 1)["meta_info"]["cached_tokens"]
        by_path = _generate(c, ids, adapters["a0"][0], 1)["meta_info"]["cached_tokens"]
        other = _generate(c, ids, "a1", 1)["meta_info"]["cached_tokens"]
        base = _generate(c, ids, None, 1)["meta_info"]["cached_tokens"]
    assert first == 0 and again >= 90 and by_path == again
    assert other == 0 and base == 0  # no KV computed with other weights is reused


def test_load_and_unload_at_run_time(lora_server):
    server, hf, adapters = lora_server
    path, model = adapters["a2"]
    with server.client() as c:
        r = c.post("/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"})
        assert r.status_code == 400 and "adapter_config.json" in r.json()["error"]["message"]
        # loaded while another adapter's request decodes: that request is not disturbed
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            running = pool.submit(_generate, c, PROMPTS[2], "a0", 300)
            while not any(r["completion_tokens"] for r in server.server_info()["requests"]):
                time.sleep(0.005)
            r = c.post("/load_lora_adapter", json={"lora_name": "a2", "lora_path": path})
            assert r.status_code == 200 and r.json()["loaded_adapters"]["a2"] == path
            assert not running.done()  # the load happened mid-generation
            during = running.result()["output_ids"]
        assert during == _generate(c, PROMPTS[2], "a0", 300)["output_ids"]
        assert _generate(c, PROMPTS[0], "a2")["output_ids"] == _greedy(model, PROMPTS[0])
        # a fourth adapter: the three slots are full
        r = c.post("/load_lora_adapter", json={"lora_name": "a3", "lora_path": path})
        assert r.status_code == 400 and "slots are in use" in r.json()["error"]["message"]
        # unloading an adapter with a request running is refused
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long = pool.submit(_generate, c, PROMPTS[1], "a2", 400)
            while not any(r["completion_tokens"] for r in server.server_info()["requests"]):
                assert not long.done()
                time.sleep(0.005)
            r = c.post("/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
            long.result()
        r = c.post("/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200 and "a2" not in r.json()["loaded_adapters"]
        assert c.post("/unload_lora_adapter", json={"lora_name": "a2"}).status_code == 404
        assert "a2" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = c.post("/generate", json={"input_ids": [1, 2], "lora_path": "a2"})
        assert r.status_code == 404
    assert_healthy(server)
