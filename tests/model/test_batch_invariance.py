"""Batch invariance (``EXACT_QUANTIZATION``: int4 linears and an int8 lm_head on the native
CPU kernels, the native attention; this machine's default dtype and linear kernel, the AVX2
kernels in float32 where the machine has a faster default, and the AMX class's decisions with
``deterministic_inference``): a request's
tokens and logprobs are bitwise those it gets alone, whatever else shares its forward passes,
in what order it arrives, where chunked prefill cuts it, whether decodes ride along with a
prefill (mixed chunks), whether its prefix comes from the radix cache or is recomputed, and how
many threads the pass runs on (``--cpu-threads``, which adapts to the load by default)."""

from __future__ import annotations

import os
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernels import cpu as native_kernels
from kernels.cpu_features import cpu_isa
from server.engine import Engine
from tests.helpers import EXACT_QUANTIZATION, assert_no_request_memory

SP = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
CONFIGS = {
    # what users run on this machine: its class's dtype and linear kernel (AVX2 FMA in
    # float32, or AVX-512 VNNI on int8 activations in bfloat16 on an AVX512-BF16 CPU)
    "default": {"quantization": EXACT_QUANTIZATION},
    # a bf16/AMX CPU's decisions (bf16 emulated where the CPU lacks it) with the flag that
    # turns its dense bf16 prefill copies off
    "bf16 class, deterministic": {"cpu_isa": "amx", "quantization": EXACT_QUANTIZATION,
                                  "deterministic_inference": True},
}
if native_kernels.linear_kernel(cpu_isa()) not in (None, "avx2"):
    # the AVX2 kernels too, where the machine's default runs others
    CONFIGS["avx2 kernels"] = {"cpu_isa": "avx2", "quantization": EXACT_QUANTIZATION}


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    system = [rng.randrange(3, 49152) for _ in range(70)]
    shared = [system + [rng.randrange(3, 49152) for _ in range(rng.randrange(1, 30))]
              for _ in range(4)]
    alone = [[rng.randrange(3, 49152) for _ in range(rng.randrange(2, 90))] for _ in range(4)]
    return shared + alone


def _result(out: dict) -> tuple:
    meta = out["meta_info"]
    return (tuple(out["output_ids"]),
            tuple(lp for lp, _, _ in meta["output_token_logprobs"]),  # exact floats
            tuple(lp for lp, _, _ in meta["input_token_logprobs"][1:]))


class _Setup:
    """Per configuration: the prompts' results alone (no cache), and one engine per
    (chunked_prefill_size, mixed_chunk), each built on first use."""

    def __init__(self, path: str, config: dict):
        self.path, self.config = path, {"context_length": 512, "max_total_tokens": 8192,
                                        **config}
        self.prompts = _prompts()
        solo = Engine(path, disable_radix_cache=True, cpu_threads=len(os.sched_getaffinity(0)),
                      **self.config)
        if not solo.runner.batch_invariant:  # an AMX machine's default: see the test below
            pytest.skip("this machine's default runs long extends on AMX bf16 tiles, "
                        "not the int4 kernel's bits ('bf16 class, deterministic' covers it)")
        self.solo = [_result(solo.generate(input_ids=p, sampling_params=SP, return_logprob=True,
                                           logprob_start_len=0)) for p in self.prompts]
        self.engines: dict[tuple[int, bool], Engine] = {}

    def engine(self, chunk: int, mixed: bool) -> Engine:
        if (chunk, mixed) not in self.engines:
            self.engines[chunk, mixed] = Engine(self.path, chunked_prefill_size=chunk,
                                                mixed_chunk=mixed, **self.config)
        return self.engines[chunk, mixed]


@pytest.fixture(scope="module")
def setups(make_tiny_model):
    path, _ = make_tiny_model("llama", seed=4)
    made: dict[str, _Setup] = {}

    def get(name: str) -> _Setup:
        if name not in made:
            made[name] = _Setup(path, CONFIGS[name])
        return made[name]
    return get


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(order=st.permutations(range(8)), size=st.integers(1, 8),
       chunk=st.sampled_from([5, 16, 1024]), mixed=st.booleans(),
       warm=st.lists(st.integers(0, 7), max_size=3))
def test_a_requests_logprobs_do_not_depend_on_its_batch(setups, config, order, size, chunk,
                                                        mixed, warm):
    setup = setups(config)
    eng = setup.engine(chunk, mixed)
    eng.flush_cache()
    for i in warm:  # cached prefixes (and whole prompts) for some of the batch
        eng.generate(input_ids=setup.prompts[i], sampling_params={**SP, "max_new_tokens": 1})
    picked = list(order[:size])
    outs = eng.generate(input_ids=[setup.prompts[i] for i in picked], sampling_params=SP,
                        return_logprob=True, logprob_start_len=0)
    for i, out in zip(picked, outs):
        assert _result(out) == setup.solo[i], f"prompt {i} in batch {picked} (chunk {chunk})"
    eng.scheduler.check_invariants()
    assert_no_request_memory(eng.cache)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core: one thread count")
@pytest.mark.parametrize("config", list(CONFIGS))
def test_the_thread_count_never_changes_a_result(setups, config):
    """The default thread count follows the load (server.model.cpu_threads): every prompt,
    batched on one thread, gets bitwise what it gets alone on every core."""
    setup = setups(config)
    one = Engine(setup.path, cpu_threads=1, **setup.config)
    outs = one.generate(input_ids=setup.prompts, sampling_params=SP, return_logprob=True,
                        logprob_start_len=0)
    assert one.runner.threads.threads == 1
    assert [_result(o) for o in outs] == setup.solo


def test_the_bf16_class_default_trades_invariance_for_prefill_speed(make_tiny_model):
    """Without the flag a bf16/AMX CPU runs extends of 64+ tokens on AMX bf16 tiles (or, where
    the CPU has none, dense bf16 weight copies) and shorter ones on the int4 kernel: the same
    prompt's logprobs then depend on where chunked prefill cuts it. What
    --enable-deterministic-inference is for."""
    path, _ = make_tiny_model("llama", seed=4)
    prompt = _prompts()[0]
    got = [_result(Engine(path, cpu_isa="amx", quantization="int4", context_length=512,
                          max_total_tokens=2048, chunked_prefill_size=chunk)
                   .generate(input_ids=prompt, sampling_params=SP, return_logprob=True,
                             logprob_start_len=0)) for chunk in (5, 1024)]
    assert got[0] != got[1]


@pytest.mark.skipif(not native_kernels.available("avx512_vnni"),
                    reason=f"VNNI kernels: {native_kernels.unavailable_reason('avx512_vnni')}")
def test_the_avx512_bf16_class_on_the_vnni_kernel_keeps_no_dense_copies(make_tiny_model):
    """On an AVX512-BF16 CPU the VNNI kernel outruns the dense bf16 copies at every row count,
    so the default keeps none: it is batch-invariant, drafts n-grams, and a prompt's logprobs
    do not depend on where chunked prefill cuts it."""
    path, _ = make_tiny_model("llama", seed=4)
    prompt = _prompts()[0]
    engines = [Engine(path, cpu_isa="avx512_bf16", quantization="int4", context_length=512,
                      max_total_tokens=2048, chunked_prefill_size=chunk) for chunk in (5, 1024)]
    report = engines[0].runner.quant_report
    assert report.native == "avx512_vnni" and report.prefill_copy_bytes == 0
    assert engines[0].config.model.dtype == "bfloat16" and engines[0].runner.batch_invariant
    assert engines[0].config.scheduler.speculative_ngram > 0
    got = [_result(e.generate(input_ids=prompt, sampling_params=SP, return_logprob=True,
                              logprob_start_len=0)) for e in engines]
    assert got[0] == got[1]
