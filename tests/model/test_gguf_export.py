"""benchmarks/gguf_export.py (the peers' llama.cpp runs our benchmark checkpoints through it):
a tiny random Llama written as GGUF and read back by our loader computes what the Hugging Face
directory computes, up to the quantization it was asked for; unsupported checkpoints are
refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from benchmarks.gguf_export import export
from server.engine import Engine
from tests.helpers import has_default_model

pytestmark = pytest.mark.skipif(not has_default_model(), reason="needs the default model's "
                                "GGUF (its tokenizer metadata)")


def _sharp_attention(path: str, out) -> str:
    """A copy of a tiny checkpoint with Q and K scaled up: random Q.K scores are near 0, so
    attention is near uniform and rows of Q/K in the wrong order would go unnoticed."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, out)
    weights = load_file(os.path.join(out, "model.safetensors"))
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] = weights[name] * 6.0
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return str(out)


def _logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                          return_logprob=True, top_logprobs_num=20)
    return torch.tensor([[lp, t] for lp, t, _ in out["meta_info"]["output_top_logprobs"][0]])


@pytest.mark.parametrize("qtype,tol,overlap", [("Q8_0", 0.02, 18), ("Q4_0", 0.3, 12)])
def test_the_exported_gguf_computes_what_the_checkpoint_computes(make_tiny_model, tmp_path,
                                                                 qtype, tol, overlap):
    import gguf

    path = _sharp_attention(make_tiny_model("llama", seed=5)[0], tmp_path / "sharp")
    out = str(tmp_path / f"tiny.{qtype}.gguf")
    export(path, out, gguf.GGMLQuantizationType[qtype])
    reader = gguf.GGUFReader(out)
    assert {t.tensor_type.name for t in reader.tensors if len(t.shape) == 2} == {qtype}
    hf = Engine(path, dtype="float32", quantization="none", context_length=128)
    gg = Engine(out, dtype="float32", quantization="none", context_length=128)
    for ids in ([1, 2, 3, 4, 5, 6], list(range(300, 340))):
        a, b = _logprobs(hf, ids), _logprobs(gg, ids)
        # the same top-20 tokens but for near ties, with logprobs within the rounding
        assert len(set(a[:, 1].tolist()) & set(b[:, 1].tolist())) >= overlap
        assert (a[:5, 0] - b[:5, 0]).abs().max() < tol


def test_unsupported_checkpoints_are_refused(make_tiny_model, tmp_path):
    import gguf

    path, _ = make_tiny_model("llama", seed=5)
    bad = tmp_path / "scaled"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="plain Llama"):
        export(str(bad), str(tmp_path / "x.gguf"), gguf.GGMLQuantizationType.Q8_0)
    assert not os.path.exists(tmp_path / "x.gguf")
