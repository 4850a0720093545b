"""/v1/rerank and /score on a live server: each score is P(yes) over {yes, no} at the answer
position of the judge prompt, equal to transformers' on the same weights; results are ordered,
cut at top_n, and bad inputs are 4xx naming the field."""

from __future__ import annotations

import math

import pytest
import torch

from server.http.rerank_routes import rerank_messages

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin is in Germany."]


def _reference(path: str, hf_model, query: str, doc: str) -> float:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = tok.apply_chat_template(rerank_messages(query, doc), tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    ids = tok(text)["input_ids"]
    yes, no = (tok(w, add_special_tokens=False)["input_ids"][0] for w in ("yes", "no"))
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1]
    return torch.softmax(logits[[no, yes]], dim=0)[1].item()


def test_scores_are_p_yes_and_results_are_ordered(tiny_server, make_tiny_model):
    path, hf = make_tiny_model("llama")
    with tiny_server.client() as c:
        r = c.post("/v1/rerank", json={"query": QUERY, "documents": [
            DOCS[0], {"text": DOCS[1]}, DOCS[2]]})
        top = c.post("/rerank", json={"query": QUERY, "documents": DOCS, "top_n": 2,
                                      "return_documents": False})
        scored = c.post("/score", json={"text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    results = body["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2]
    assert [x["relevance_score"] for x in results] == \
        sorted((x["relevance_score"] for x in results), reverse=True)
    for x in results:
        assert x["document"]["text"] == DOCS[x["index"]]
        assert math.isclose(x["relevance_score"], _reference(path, hf, QUERY, DOCS[x["index"]]),
                            abs_tol=1e-4)
    assert body["usage"]["total_tokens"] > 0
    assert [x["index"] for x in top.json()["results"]] == [x["index"] for x in results[:2]]
    assert all("document" not in x for x in top.json()["results"])
    by_index = {x["index"]: x["relevance_score"] for x in results}
    assert [d["index"] for d in scored.json()["data"]] == [0, 1, 2]
    for d in scored.json()["data"]:
        assert math.isclose(d["score"], by_index[d["index"]], abs_tol=1e-5)


@pytest.mark.parametrize("route, body, param, status", [
    ("/v1/rerank", {"query": "q", "documents": []}, "documents", 400),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n", 400),
    ("/v1/rerank", {"query": "q", "documents": [{"title": "no text"}]}, "documents.0.str", 400),
    ("/v1/rerank", {"query": "q", "documents": ["d"] * 200}, "documents", 413),
    ("/v1/rerank", {"query": "q " * 600, "documents": ["d"]}, "documents", 400),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c"]}, "text_1", 400),
])
def test_bad_inputs_are_4xx_naming_the_field(tiny_server, route, body, param, status):
    with tiny_server.client() as c:
        r = c.post(route, json=body)
        assert r.status_code == status, r.text
        assert r.json()["error"]["param"] == param
        assert c.post("/score", json={"text_1": "a", "text_2": "b"}).is_success
    metrics = tiny_server.server_info()["metrics"]
    assert metrics["kv_usage"] == 0 and metrics["running_requests"] == 0
