"""BERT-family encoders in the Engine: each layout's vectors (CLS / mean / last-token pooling,
normalized or not) and cross-encoder logits equal transformers' and sentence-transformers' on
the same tiny random weights (fp32, 1e-4), whatever else shares the pass; prompts never split
into chunks; generation refused; what is not implemented refused at load with the reason."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from server.engine import Engine
from server.model.config import UnsupportedModelError
from server.model.encoder_config import encoder_arch
from server.scheduler.validation import InvalidRequestError
from tests.helpers import make_encoder

TEXTS = ["what is the capital of france?", "the cat sat on the mat", "paris",
         "a dog is on the mat, the cat is not. berlin is the capital of germany."]
QUERY = "what is the capital of france?"


def _types(tok, ids: list[int], two_types: bool) -> torch.Tensor:
    """BERT's token types of a tokenized text or pair (1 after the first [SEP])."""
    sep = ids.index(tok.sep_token_id)
    return torch.tensor([[0] * (sep + 1) + [int(two_types)] * (len(ids) - sep - 1)])


def _reference(hf, tok, ids: list[int], arch: str, pooling: str, normalize: bool) -> np.ndarray:
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]),
                 token_type_ids=_types(tok, ids, arch.startswith("Bert")))
    if "Classification" in arch:
        return out.logits[0].numpy()
    h = out.last_hidden_state[0]
    vec = {"cls": h[0], "mean": h.mean(0), "lasttoken": h[-1]}[pooling]
    return (torch.nn.functional.normalize(vec, dim=0) if normalize else vec).numpy()


@pytest.fixture(scope="module")
def encoders(tmp_path_factory):
    """(arch, pooling, normalize) -> (directory, transformers model, tokenizer)."""
    from transformers import AutoTokenizer

    made = {}

    def get(arch: str, pooling: str | None = None, normalize: bool = True):
        key = (arch, pooling, normalize)
        if key not in made:
            out = str(tmp_path_factory.mktemp("encoder"))
            hf = make_encoder(out, arch, pooling, normalize, seed=len(made))
            made[key] = (out, hf, AutoTokenizer.from_pretrained(out))
        return made[key]

    return get


@pytest.mark.parametrize("arch, pooling, normalize", [
    ("BertModel", None, True),            # no modules.json: CLS, normalized (SGLang's default)
    ("BertModel", "mean", True),
    ("BertModel", "cls", False),
    ("XLMRobertaModel", "mean", True),
    ("XLMRobertaModel", "lasttoken", True),
    ("BertForSequenceClassification", None, True),
    ("XLMRobertaForSequenceClassification", None, True),
])
def test_outputs_equal_transformers_batched_or_alone(encoders, arch, pooling, normalize):
    path, hf, tok = encoders(arch, pooling, normalize)
    cross = "Classification" in arch
    ids = [tok(QUERY, t)["input_ids"] if cross else tok(t)["input_ids"] for t in TEXTS]
    engine = Engine(path, dtype="float32")
    try:
        batch = engine.embed(ids)
        for got, one in zip(batch, ids):
            ref = _reference(hf, tok, one, arch, pooling or "cls", normalize)
            assert len(got) == (1 if cross else 32)
            assert np.allclose(got, ref, atol=1e-4), (arch, np.abs(np.array(got) - ref).max())
        # alone, and from text (the tokenizer's special tokens added): the same vector
        assert np.allclose(engine.embed(ids[2]), batch[2], atol=1e-5)
        if not cross:
            assert np.allclose(engine.embed(TEXTS[1]), batch[1], atol=1e-5)
    finally:
        engine.close()


def test_sentence_transformers_agree(encoders):
    """SentenceTransformer.encode and CrossEncoder.predict on the same directories."""
    from sentence_transformers import CrossEncoder, SentenceTransformer

    for pooling, normalize in (("mean", True), ("cls", False)):
        path, _, _ = encoders("BertModel", pooling, normalize)
        engine = Engine(path, dtype="float32")
        try:
            ours = np.array(engine.embed(TEXTS))
        finally:
            engine.close()
        theirs = SentenceTransformer(path, device="cpu").encode(TEXTS)
        assert np.allclose(ours, theirs, atol=1e-4), (pooling, np.abs(ours - theirs).max())
    # BERT: its tokenizer types the document 1, as the runner derives from the [SEP]
    path, _, tok = encoders("BertForSequenceClassification")
    engine = Engine(path, dtype="float32")
    try:
        logits = engine.embed([tok(QUERY, t)["input_ids"] for t in TEXTS])
    finally:
        engine.close()
    scores = CrossEncoder(path, device="cpu").predict([(QUERY, t) for t in TEXTS])
    assert np.allclose(torch.sigmoid(torch.tensor(logits)).numpy()[:, 0], scores, atol=1e-4)


def test_prompts_run_whole_and_generation_is_refused(encoders):
    """A budget smaller than the batch (bumped to the context length) puts the prompts in
    several passes, each whole: the same vectors as one at a time."""
    path, _, tok = encoders("BertModel", "mean")
    long = [[tok.cls_token_id] + [5 + (7 * k + 3 * i) % 80 for i in range(98)] + [tok.sep_token_id]
            for k in range(4)]
    engine = Engine(path, dtype="float32", chunked_prefill_size=16)
    try:
        assert engine.config.scheduler.chunked_prefill_size == engine.context_len == 128
        assert engine.config.cache.disable_radix_cache
        passes = engine.metrics()["forward_passes"]
        batch = engine.embed(long)
        assert engine.metrics()["forward_passes"] - passes == len(long)  # 100 + 100 > 128
        for one, vec in zip(long, batch):
            assert np.allclose(engine.embed(one), vec, atol=1e-5)
        with pytest.raises(InvalidRequestError, match="embedding model"):
            engine.generate(TEXTS[0], {"max_new_tokens": 2})
        with pytest.raises(InvalidRequestError):
            engine.embed(list(range(1, 200)))  # over the 128-token context
    finally:
        engine.close()


def test_is_embedding_serves_a_causal_lm_as_an_embedding_model(make_tiny_model):
    path, hf = make_tiny_model("llama")
    engine = Engine(path, dtype="float32", quantization="none", is_embedding=True)
    try:
        ids = [5, 17, 301, 42]
        with torch.no_grad():
            ref = torch.nn.functional.normalize(
                hf.model(torch.tensor([ids])).last_hidden_state[0, -1], dim=0).numpy()
        assert np.allclose(engine.embed(ids), ref, atol=1e-4)
        with pytest.raises(InvalidRequestError, match="embedding model"):
            engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1})
    finally:
        engine.close()


@pytest.mark.parametrize("change, message", [
    ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
    ({"hidden_act": "relu"}, "activation"),
    ({"architectures": ["BertForSequenceClassification"],
      "id2label": {"0": "a", "1": "b", "2": "c"}}, "3 labels"),
])
def test_unsupported_options_are_refused_with_the_reason(change, message):
    cfg = {"model_type": "bert", "vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 64, **change}
    with pytest.raises(UnsupportedModelError, match=message):
        encoder_arch(cfg)


def test_max_pooling_is_refused(tmp_path):
    make_encoder(str(tmp_path), "BertModel", "mean")
    with open(os.path.join(tmp_path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"pooling_mode_max_tokens": True}, f)
    with open(os.path.join(tmp_path, "config.json")) as f:
        cfg = json.load(f)
    with pytest.raises(UnsupportedModelError, match="max pooling"):
        encoder_arch(cfg, str(tmp_path))
