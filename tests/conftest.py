"""Shared fixtures: tiny random-weight HF models (fp32, CPU) saved as real safetensors
directories with the default model's tokenizer, and the embedded default model."""

from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter (tests/kernels). The variable must
# be set before anything imports triton: peft (the LoRA tests' reference) imports it too, and a
# triton imported without it leaves the interpreter half-enabled for the kernel tests after.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from server.model.loader import default_model_path, load_model
from tests.helpers import LORA_TARGETS, make_adapter, tiny_config
from tests.live_server import ServerProcess

pytest_plugins = ["tests.harness", "pytester"]


@pytest.fixture(scope="session")
def default_tokenizer():
    """The default model's tokenizer (converted from its GGUF once, then cached on disk), or,
    where the default model is not installed (a GPU machine that received only the checkout),
    the saved copy in ``$SGL_TOKENIZER_DIR``."""
    import os

    saved = os.environ.get("SGL_TOKENIZER_DIR")
    if saved:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(saved)
    return load_model(default_model_path()).tokenizer


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory, default_tokenizer) -> Callable[..., tuple[str, object]]:
    """make_tiny_model(kind, seed=0, **config_overrides) -> (dir, transformers model).

    The directory holds config.json, safetensors weights (sharded with ``shards=True``) and the
    default tokenizer; the returned HF model (eval, fp32) has the same weights.
    """
    from transformers import AutoModelForCausalLM

    cache: dict = {}

    def make(kind: str = "llama", seed: int = 0, shards: bool = False, **overrides):
        key = (kind, seed, shards, tuple(sorted(overrides.items())))
        if key not in cache:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(tiny_config(kind, **overrides)).eval()
            # Random init gives tiny logits; scale norms up so greedy choices are well separated
            # (ties would make token comparisons flaky) while staying in fp32 precision.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("norm.weight"):
                        p.normal_(1.0, 0.5)
            path = str(tmp_path_factory.mktemp(f"tiny-{kind}"))
            model.save_pretrained(path, max_shard_size="2MB" if shards else "1GB")
            default_tokenizer.save_pretrained(path)
            cache[key] = (path, model)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, default_tokenizer):
    """(checkpoint dir, transformers LlavaForConditionalGeneration, fp32): a CLIP tower on
    28x28 images with 14-pixel patches (4 patches + CLS; the "default" strategy drops CLS: 4
    positions per image), the projector and the tiny Llama; the tokenizer gains "<image>"
    (id ``tests.helpers.IMAGE_TOKEN``); a CLIP image processor."""
    import copy

    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from tests.helpers import IMAGE_TOKEN, TINY_VOCAB

    text = tiny_config("llama", vocab_size=TINY_VOCAB + 1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, image_size=28, patch_size=14,
                              projection_dim=32)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN,
                         vision_feature_layer=-2, vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # well-separated logits, as make_tiny_model does
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "language_model" in name:
                p.normal_(1.0, 0.5)
    path = str(tmp_path_factory.mktemp("tiny-llava"))
    model.save_pretrained(path)
    tok = copy.deepcopy(default_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
    assert tok.convert_tokens_to_ids("<image>") == IMAGE_TOKEN
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}) \
        .save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def tiny_engine(make_tiny_model):
    """An Engine on the tiny Llama (fp32), shared by tests that only need *a* model."""
    from server.engine import Engine

    path, _ = make_tiny_model("llama")
    return Engine(path, max_total_tokens=8192, context_length=512, dtype="float32")


@pytest.fixture(scope="session")
def default_engine():
    """An Engine on the embedded SmolLM2-135M-Instruct, dequantized to fp32 (the reference path,
    compared token for token with transformers' own GGUF loader)."""
    from server.engine import Engine

    return Engine(max_total_tokens=16384, dtype="float32", quantization="none")


@pytest.fixture(scope="session")
def tiny_server(make_tiny_model):
    """A server on the tiny random Llama (fp32), shared by most tests."""
    path, _ = make_tiny_model("llama")
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
                           "--context-length", "512")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.fixture(scope="session")
def default_server():
    """A server on the embedded SmolLM2-135M-Instruct as users start it (the default
    configuration: the GGUF's int4 weights, the CPU's own kernels and dtype). Tests on it
    assert what holds whatever text the model writes (its length is bounded by max_tokens);
    model ability that varies with a CPU class's numerics is a non-strict xfail."""
    server = ServerProcess("--max-total-tokens", "16384")
    yield server
    assert server.stop() == 0, "".join(server.log[-40:])


@pytest.fixture(scope="session")
def lora_server(make_tiny_model, tmp_path_factory):
    """A server on the tiny random Llama (fp32) serving LoRA adapters a0 and a1 (three slots):
    (server, the base HF model, {"a0"|"a1"|"a2": (adapter dir, its peft model)}); a2 is for
    loading at run time."""
    path, hf = make_tiny_model("llama")
    root = tmp_path_factory.mktemp("adapters")
    adapters = {}
    for i, (rank, targets) in enumerate([(4, LORA_TARGETS), (8, ["q_proj", "v_proj", "down_proj"]),
                                         (2, ["o_proj", "up_proj"])]):
        out = str(root / f"a{i}")
        adapters[f"a{i}"] = (out, make_adapter(hf, out, rank, 2 * rank, targets, False, i))
    server = ServerProcess("--model", path, "--dtype", "float32", "--max-total-tokens", "4096",
                           "--context-length", "512", "--lora-paths",
                           f"a0={adapters['a0'][0]}", adapters["a1"][0],
                           "--max-loras-per-batch", "3")
    yield server, hf, adapters
    assert server.stop() == 0, "".join(server.log[-40:])


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip cleanly where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
