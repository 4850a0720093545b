"""EBNF constraints on both APIs and grounded extraction (``substring_of``): the substring
grammar accepts every word span of a passage and nothing else (not across passages), and a
live server keeps generated answers inside the passages."""

from __future__ import annotations

import re

import pytest
from openai import OpenAI

import sgl_adapters as sgl
from server.constrained.grammar import GrammarCompiler
from server.constrained.spec import GrammarSpec
from sgl_adapters.lang.grounding import substring_grammar

P1 = "Guglielmo Marconi sent signals in 1895, from Pontecchio."
P2 = 'The "wireless" age began; ships used it by 1900.'


@pytest.fixture(scope="module")
def grammars(default_tokenizer):
    return GrammarCompiler(default_tokenizer, len(default_tokenizer))


def _accepts(grammars, tok, grammar: str, text: str) -> bool:
    m = grammars.matcher(GrammarSpec("ebnf", grammar), [tok.eos_token_id])
    return all(m.accept(t) for t in tok.encode(text, add_special_tokens=False)) \
        and m.accept(tok.eos_token_id) and m.terminated


def test_substring_grammar_accepts_every_span_and_nothing_else(grammars, default_tokenizer):
    tok = default_tokenizer
    g = substring_grammar([P1, P2])
    for text in (P1, P2):
        spans = [m.span() for m in re.finditer(r"\w+", text)]
        for i in range(len(spans)):
            for j in range(i, len(spans)):
                assert _accepts(grammars, tok, g, text[spans[i][0]:spans[j][1]])
    for bad in ("Marconi  sent", "Marconi sent radio", "arconi", "Pontecchio. The",
                "1895 from", "", "Marconi sent signals in 1895, from Pontecchio. The"):
        assert not _accepts(grammars, tok, g, bad), bad
    assert len(g) < 40 * (len(P1) + len(P2))  # linear in the text, not in its spans
    short = substring_grammar([P1, P2], max_words=2)
    assert _accepts(grammars, tok, short, "Guglielmo Marconi")
    assert _accepts(grammars, tok, short, "by 1900") and _accepts(grammars, tok, short, "1895")
    assert not _accepts(grammars, tok, short, "Guglielmo Marconi sent")
    content = substring_grammar([P1, P2], max_words=4, edge_stopwords={"the", "in", "by"})
    assert _accepts(grammars, tok, content, "signals in 1895")
    assert _accepts(grammars, tok, content, "wireless")
    for bad in ("The", "The \"wireless", "signals in", "in 1895", "used it by"):
        assert not _accepts(grammars, tok, content, bad), bad
    with pytest.raises(ValueError):
        substring_grammar(["...", ""])


def test_ebnf_on_both_apis_and_bad_ebnf_is_a_400(healthy):
    grammar = 'root ::= "yes" | "no" | "maybe " [0-9]'
    with healthy.client() as c:
        r = c.post("/generate", json={"text": "Well?", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ebnf": grammar}}).json()
        assert re.fullmatch(r"yes|no|maybe [0-9]", r["text"])
        for body, path in (({"text": "x", "sampling_params": {"ebnf": "root ::= ("}},
                            "/generate"),
                           ({"messages": [{"role": "user", "content": "x"}],
                             "ebnf": "root ::= undefined_rule"}, "/v1/chat/completions"),
                           ({"prompt": "x", "ebnf": "no rules here"}, "/v1/completions")):
            resp = c.post(path, json=body)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == "ebnf"
            # the compiler's reason, without its timestamp and C++ source path
            assert ".cc:" not in resp.text and "/project/" not in resp.text
        msg = c.post("/generate", json={"text": "x", "sampling_params": {
            "ebnf": "root ::= undefined_rule"}}).json()["error"]["message"]
        assert msg.startswith("ebnf: cannot compile: EBNF parser error") and \
            "undefined_rule" in msg, msg
    client = OpenAI(base_url=healthy.url + "/v1", api_key="none")
    out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}],
                                         max_tokens=8, temperature=0,
                                         extra_body={"ebnf": grammar})
    assert re.fullmatch(r"yes|no|maybe [0-9]", out.choices[0].message.content)


def test_gen_substring_of_copies_from_the_passages(healthy):
    @sgl.function
    def extract(s, passages):
        s += "Passages:\n" + "\n".join(passages) + "\nWho? "
        s += sgl.gen("answer", max_tokens=12, temperature=0, substring_of=passages)

    backend = sgl.RuntimeEndpoint(healthy.url)
    try:
        state = extract.run(passages=[P1, P2], backend=backend)
    finally:
        backend.shutdown()
    answer = state["answer"]
    assert state.error() is None and answer
    assert answer in P1 or answer in P2
    assert re.fullmatch(r"\w.*\w|\w", answer)  # starts and ends on a word
