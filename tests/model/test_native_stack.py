"""The decoder stack as one native call (server/model/native_stack.py): the same tokens and
bitwise the same logprobs as the Python loop over layers, for every linear kernel the machine
runs, both compute dtypes, biases and sliding windows; models it does not take keep the loop."""

from __future__ import annotations

import pytest

from kernels import cpu as native
from server.engine import Engine
from server.model.native_stack import unsupported_reason

pytestmark = pytest.mark.skipif(not native.available(),
                                reason=f"sgl_cpu kernels: {native.unavailable_reason()}")

SP = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}
PROMPTS = [[5 + i for i in range(40)], [900, 17, 33, 2], list(range(300, 371))]
# every linear kernel this machine runs, by the CPU class that picks it ("amx": extends of 64+
# tokens on AMX tiles, shorter passes on the VNNI kernel)
ISAS = (["avx2"] + (["avx512_bf16"] if native.available("avx512_vnni") else [])
        + (["amx"] if native.amx_available() else []))


def _results(engine: Engine) -> list[tuple]:
    outs = engine.generate(input_ids=PROMPTS, sampling_params=SP, return_logprob=True,
                           logprob_start_len=0)
    return [(tuple(o["output_ids"]),
             tuple(lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]),
             tuple(lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]))
            for o in outs]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind,overrides", [("llama", {}), ("qwen2", {}),
                                            ("mistral_swa", {})])
def test_one_native_call_equals_the_python_loop(make_tiny_model, isa, dtype, kind, overrides):
    path, _ = make_tiny_model(kind, seed=5, **overrides)
    engine = Engine(path, dtype=dtype, cpu_isa=isa, quantization="int4", context_length=256,
                    max_total_tokens=4096, chunked_prefill_size=128 if isa == "amx" else 32,
                    disable_radix_cache=True)
    model = engine.runner.model
    assert model.native_stack is not None, unsupported_reason(model, engine.runner.attention)
    assert (engine.runner.quant_report.amx_modules > 0) == (isa == "amx")
    stacked = _results(engine)
    model.native_stack = None  # the Python loop over the same weights and pool
    assert _results(engine) == stacked


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lora_adapters_in_one_native_call_equal_the_python_loop(make_tiny_model, tmp_path, isa,
                                                                dtype):
    """Rows of several LoRA adapters and the base model in one pass (server/model/lora.py):
    the native stack's forward_lora gives bitwise the Python loop's tokens and logprobs in
    each of lora.py's modes."""
    pytest.importorskip("peft")
    from server.model.sampling import SamplingParams
    from server.scheduler.request import LogprobOptions
    from tests.helpers import LORA_TARGETS, make_adapter

    path, hf = make_tiny_model("llama", seed=5)
    for i in range(3):
        make_adapter(hf, str(tmp_path / f"a{i}"), 4 * (i + 1), 8, LORA_TARGETS, False, seed=i)
    engine = Engine(path, dtype=dtype, cpu_isa=isa, quantization="int4", context_length=256,
                    max_total_tokens=4096, disable_radix_cache=True, max_loras_per_batch=4,
                    max_lora_rank=16, lora_paths=tuple(f"a{i}={tmp_path}/a{i}" for i in range(3)))
    model = engine.runner.model
    assert model.native_stack is not None, unsupported_reason(model, engine.runner.attention)
    sp = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)

    def results() -> list[tuple]:
        reqs = [engine.make_request(p, sp, LogprobOptions(True, 0), lora=lora) for p in PROMPTS
                for lora in (None, "a0", "a1", "a2")]
        return [(tuple(o["output_ids"]),
                 tuple(lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]),
                 tuple(lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]))
                for o in engine.run(reqs)]

    stack, weights = model.native_stack, engine.runner.lora
    packed = weights.ensure_packed()
    modes = [(True, packed), (False, packed), (False, 0)]
    for sgmv, packed in modes:  # the per-row kernel (decode), reordered, plain matmuls
        weights.sgmv, weights.packed_slots = sgmv, packed
        stacked = results()
        model.native_stack = None
        assert results() == stacked
        model.native_stack = stack
        assert len({o[0] for o in stacked}) > len(PROMPTS)  # the adapters matter


def test_models_it_does_not_take_run_the_python_loop(make_tiny_model):
    gemma, _ = make_tiny_model("gemma2", seed=1)
    dense, _ = make_tiny_model("llama", seed=1)
    for path, kwargs, reason in [(gemma, {"quantization": "int4"}, "differ from Llama"),
                                 (dense, {"quantization": "none"}, "not on a native"),
                                 (dense, {"quantization": "int4", "cpu_isa": "none"},
                                  "attention backend")]:
        engine = Engine(path, context_length=128, max_total_tokens=1024, **kwargs)
        assert engine.runner.model.native_stack is None
        assert reason in unsupported_reason(engine.runner.model, engine.runner.attention)
        assert len(engine.generate(input_ids=[5, 6, 7], sampling_params=SP)["output_ids"]) == 5


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("stack", [True, False], ids=["native_stack", "python_loop"])
def test_a_pass_that_wants_fewer_rows_gives_those_rows_the_same_bits(make_tiny_model, isa,
                                                                      stack):
    """The runner asks the model for its logit rows alone, so the last layer runs o_proj and
    the MLP on them only (no rows at all for a prompt chunk that samples nothing). With prompt
    logprobs every row is wanted: the output tokens' logprobs must not change between the two
    (32-token chunks, so most prompt passes want no row or one)."""
    path, _ = make_tiny_model("llama", seed=7)
    engine = Engine(path, dtype="bfloat16", cpu_isa=isa, quantization="int4",
                    context_length=256, max_total_tokens=4096, chunked_prefill_size=32,
                    disable_radix_cache=True)
    if not stack:
        engine.runner.model.native_stack = None

    def outputs(prompt_logprobs: bool) -> list[tuple]:
        kw = {"logprob_start_len": 0} if prompt_logprobs else {}
        outs = engine.generate(input_ids=PROMPTS, sampling_params=SP, return_logprob=True,
                               **kw)
        return [(tuple(o["output_ids"]),
                 tuple(lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]))
                for o in outs]

    assert outputs(prompt_logprobs=False) == outputs(prompt_logprobs=True)
