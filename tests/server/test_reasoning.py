"""Reasoning models: <think>...</think> comes back apart from the answer (OpenAI chat
``reasoning_content``, streamed too; native ``reasoning_text``), ``enable_thinking`` reaches the
template through ``chat_template_kwargs``, and a grammar holds only after the reasoning ends.

The model is a tiny random Qwen3 whose tokenizer has <think> and </think> as single (non-special)
tokens and a Qwen3-like template; random weights never close a think block on their own, so
``logit_bias`` steers the markers where a test needs them."""

from __future__ import annotations

import re
import shutil

import httpx
import pytest
import torch
from openai import OpenAI

from server.constrained.grammar import GrammarCompiler
from server.constrained.jump_forward import accepted_prefix
from server.constrained.reasoning_gate import ReasoningGatedMatcher
from server.constrained.spec import GrammarSpec
from server.reasoning import ReasoningParser, ReasoningParserError, ReasoningStream, split
from sgl_adapters.backends.runtime import Runtime

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}"
            "<think>\n\n</think>\n\n{% endif %}{% endif %}")
VOCAB = 49216


@pytest.fixture(scope="module")
def thinking_model(make_tiny_model, tmp_path_factory):
    from transformers import AutoTokenizer

    src, _ = make_tiny_model("qwen3", vocab_size=VOCAB)
    path = str(tmp_path_factory.mktemp("thinking"))
    shutil.copytree(src, path, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(src)
    tok.add_tokens(["<think>", "</think>"])  # as Qwen3's: added tokens, not special ones
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def server(thinking_model):
    with Runtime(thinking_model[0], dtype="float32", max_total_tokens=4096, context_length=512,
                 log_level="warning") as rt:
        yield rt, thinking_model[1]


def test_split_and_stream_deltas():
    assert split("<think>a b</think>\n\nanswer", "maybe") == ("a b", "answer")
    assert split("plain", "maybe") == (None, "plain")
    assert split("thinking cut short", "reasoning") == ("thinking cut short", "")
    assert split("\nstep</think>{}", "reasoning") == ("step", "{}")
    assert split("x</think>y", "off") == (None, "x</think>y")
    for state, text in (("maybe", '<think>\nstep one</think>\n\n{"a": 1}'),
                        ("reasoning", "thinking </thi and on</think>ok"),
                        ("maybe", "<thin is not a marker")):
        stream, parts = ReasoningStream(state), ["", ""]
        for n in range(1, len(text) + 1):  # one character per chunk: markers split anywhere
            r, a = stream.feed(text[:n], final=n == len(text))
            parts[0] += r
            parts[1] += a
        reasoning, answer = split(text, state)
        assert parts[1] == answer and parts[0].strip() == (reasoning or "")


def test_parser_needs_single_token_markers(thinking_model, default_tokenizer):
    _, tok = thinking_model
    parser = ReasoningParser.for_tokenizer("auto", tok)
    assert parser.start_id == tok.convert_tokens_to_ids("<think>")
    assert parser.end_ids == (tok.convert_tokens_to_ids("</think>"),)
    assert ReasoningParser.for_tokenizer("auto", default_tokenizer) is None  # no <think>
    assert ReasoningParser.for_tokenizer("none", tok) is None
    with pytest.raises(ReasoningParserError, match="one token"):
        ReasoningParser.for_tokenizer("qwen3", default_tokenizer)
    assert parser.prompt_state("<|im_start|>assistant\n") == "maybe"
    assert parser.prompt_state("assistant\n<think>\n") == "reasoning"
    assert parser.prompt_state("assistant\n<think>\n\n</think>\n\n") == "off"


def test_gate_holds_the_grammar_until_the_reasoning_ends(thinking_model):
    _, tok = thinking_model
    grammars = GrammarCompiler(tok, VOCAB)
    start, end = tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]

    def gate(in_reasoning, start_id=None):
        inner = grammars.matcher(GrammarSpec("regex", "(yes|no)"), eos)
        return ReasoningGatedMatcher(inner, [end], in_reasoning, start_id)

    plain = grammars.matcher(GrammarSpec("regex", "(yes|no)"), eos).allowed_mask()
    g = gate(True)
    assert bool(g.allowed_mask().all())  # anything while thinking, grammar untouched
    assert accepted_prefix(g, tok.encode("yes", add_special_tokens=False)) == []  # no drafts
    free = tok.encode(" (maybe) 42", add_special_tokens=False)
    assert all(g.accept(t) for t in free) and not g.terminated
    assert g.jump_forward_string() == ""
    assert g.accept(end)
    assert torch.equal(g.allowed_mask(), plain)  # the answer is constrained
    assert not g.accept(free[0])
    for t in tok.encode("yes", add_special_tokens=False) + eos:
        assert g.accept(t)
    assert g.terminated
    m = gate(False, start)  # the first token decides: <think> or the grammar's own
    allowed = m.allowed_mask()
    assert allowed[start] and torch.equal(allowed.logical_and(~plain).nonzero().flatten(),
                                          torch.tensor([start]))
    assert m.accept(start) and m.state == "reasoning"
    m = gate(False, start)
    assert not m.accept(free[0])
    assert m.accept(tok.encode("no", add_special_tokens=False)[0]) and m.state == "active"
    bitmask = torch.zeros(2, (VOCAB + 31) // 32, dtype=torch.int32)
    gate(False, start).fill_bitmask(bitmask, 1)
    assert (bitmask[1, start // 32] >> (start % 32)) & 1 == 1 and bitmask[0].eq(0).all()


def test_chat_returns_reasoning_apart_and_enable_thinking_reaches_the_template(server):
    rt, tok = server
    client = OpenAI(base_url=rt.base_url + "/v1", api_key="none")
    think = str(tok.convert_tokens_to_ids("<think>"))
    msgs = [{"role": "user", "content": "Is water wet?"}]
    # the model opens a think block (steered) and runs out of tokens inside it
    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                         logit_bias={think: 100})
    msg = out.choices[0].message
    assert msg.content == "" and msg.reasoning_content == "<think>" * 3
    # enable_thinking=False renders a closed think block: no reasoning, the text is the answer
    out = client.chat.completions.create(model="m", messages=msgs, max_tokens=4, temperature=0,
                                         logit_bias={think: 100},
                                         extra_body={"chat_template_kwargs":
                                                     {"enable_thinking": False}})
    msg = out.choices[0].message
    assert msg.reasoning_content is None and msg.content == "<think>" * 4
    assert out.usage.prompt_tokens > len(tok.apply_chat_template(msgs, tokenize=True,
                                                                  add_generation_prompt=True))
    # streamed: the same parts as reasoning_content / content deltas
    chunks = client.chat.completions.create(model="m", messages=msgs, max_tokens=4,
                                            temperature=0, logit_bias={think: 100},
                                            stream=True)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "<think>" * 3
    assert "".join(d.content or "" for d in deltas) == ""
    # a reserved template variable is a clear 400
    r = httpx.post(rt.base_url + "/v1/chat/completions", json={
        "messages": msgs, "chat_template_kwargs": {"tools": []}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_grammar_applies_after_the_reasoning(server):
    rt, tok = server
    client = OpenAI(base_url=rt.base_url + "/v1", api_key="none")
    end = tok.convert_tokens_to_ids("</think>")
    # "maybe": </think> is neither <think> nor allowed by the grammar, so the steer is refused
    # and the answer is grammar-valid from the first token
    out = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "yes or no?"}], max_tokens=8,
        temperature=0, logit_bias={str(end): 100}, extra_body={"regex": "(yes|no)"})
    msg = out.choices[0].message
    assert msg.reasoning_content is None and msg.content in ("yes", "no")
    # native: the prompt opens the think block; the model closes it (steered), then the
    # regex holds for the answer only
    prompt = "<|im_start|>user\nyes or no?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    r = httpx.post(rt.base_url + "/generate", timeout=60, json={
        "text": prompt, "separate_reasoning": True,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": "(yes|no)",
                            "logit_bias": {str(end): 100}}}).json()
    assert r["reasoning_text"] == "" and r["text"] in ("yes", "no")
    assert r["output_ids"][0] == end
    # without separate_reasoning the native API is unchanged: the regex applies at once
    r = httpx.post(rt.base_url + "/generate", timeout=60, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                            "regex": "(yes|no)"}}).json()
    assert "reasoning_text" not in r and re.fullmatch("yes|no", r["text"])
    # unconstrained thinking in the native API is all reasoning while the block is open
    r = httpx.post(rt.base_url + "/generate", timeout=60, json={
        "text": prompt, "separate_reasoning": True,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert r["text"] == "" and len(r["reasoning_text"]) > 0


def test_responses_api_returns_reasoning_items(server):
    """/v1/responses: the thinking is a ``reasoning`` item before the message, streamed as
    reasoning_text deltas; the answer alone is the output text."""
    rt, tok = server
    client = OpenAI(base_url=rt.base_url + "/v1", api_key="none")
    think = str(tok.convert_tokens_to_ids("<think>"))
    kw = dict(model="m", input="Is water wet?", max_output_tokens=4, temperature=0,
              extra_body={"logit_bias": {think: 100}})
    # steered into a think block that the token limit cuts (as the chat test above)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "<think>" * 3 and r.output_text == ""
    assert r.status == "incomplete" and r.usage.output_tokens_details.reasoning_tokens == 3
    events = list(client.responses.create(stream=True, **kw))
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning", "message"]
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == "<think>" * 3
