"""Engine.generate on a tiny random Llama (fp32): batching, chunking and memory pressure do not
change greedy outputs; logprobs agree with transformers; seeds, stop strings, n, prefill-only."""

from __future__ import annotations

import random

import pytest
import torch

from server.engine import Engine
from server.model.sampling import SamplingParamsError
from server.scheduler.validation import InvalidRequestError
from tests.helpers import assert_no_request_memory, failing_once, hf_logits


def _prompts(n, seed=0, lo=1, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_batch_of_64_equals_one_at_a_time(tiny_engine):
    prompts = _prompts(64)
    rng = random.Random(1)
    params = [{"max_new_tokens": rng.randrange(1, 17), "temperature": 0} for _ in prompts]
    singles = [tiny_engine.generate(input_ids=p, sampling_params=sp)["output_ids"]
               for p, sp in zip(prompts, params)]
    reqs = [tiny_engine.make_request(p, tiny_engine_params(sp)) for p, sp in zip(prompts, params)]
    batched = [o["output_ids"] for o in tiny_engine.run(reqs)]
    assert batched == singles
    assert_no_request_memory(tiny_engine.cache)


def tiny_engine_params(d):
    from server.model.sampling import SamplingParams

    return SamplingParams.from_dict(d)


@pytest.mark.parametrize("kwargs", [
    {"chunked_prefill_size": 7}, {"chunked_prefill_size": 61},
    {"max_total_tokens": 300, "max_new_tokens_reserve": 1},  # forces retraction
    {"max_running_requests": 3},
])
def test_chunking_and_memory_pressure_keep_greedy_outputs(make_tiny_model, tiny_engine, kwargs):
    path, _ = make_tiny_model("llama")
    prompts = _prompts(12, seed=2, hi=100)
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    want = [o["output_ids"] for o in tiny_engine.generate(input_ids=prompts, sampling_params=sp)]
    eng = Engine(path, context_length=512, dtype="float32",
                 **{"max_total_tokens": 4096, **kwargs})
    got = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=sp)]
    assert got == want
    if kwargs.get("max_total_tokens") == 300:
        assert eng.scheduler.stats.retractions > 0
    assert_no_request_memory(eng.cache)


def test_logprobs_agree_with_transformers(make_tiny_model, tiny_engine):
    _, hf = make_tiny_model("llama")
    prompt = _prompts(1, seed=3, lo=20, hi=21)[0]
    out = tiny_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 6,
                                                                  "temperature": 0},
                               return_logprob=True, logprob_start_len=5, top_logprobs_num=4)
    meta = out["meta_info"]
    full = prompt + out["output_ids"]
    ref = torch.log_softmax(hf_logits(hf, full), dim=-1)
    for i, (lp, tok, _) in enumerate(meta["output_token_logprobs"]):
        pos = len(prompt) - 1 + i
        assert tok == full[pos + 1]
        assert lp == pytest.approx(ref[pos, tok].item(), abs=1e-4)
        top = ref[pos].topk(4)
        assert [t for _, t, _ in meta["output_top_logprobs"][i]] == top.indices.tolist()
    inputs = meta["input_token_logprobs"]
    assert [t for _, t, _ in inputs] == prompt[5:]
    for k, (lp, tok, _) in enumerate(inputs):
        assert lp == pytest.approx(ref[5 + k - 1, tok].item(), abs=1e-4)
    assert len(meta["input_top_logprobs"]) == len(prompt) - 5


def test_prompt_logprobs_from_position_zero_and_prefill_only(tiny_engine):
    prompt = _prompts(1, seed=4, lo=9, hi=10)[0]
    out = tiny_engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0},
                               return_logprob=True, logprob_start_len=0)
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"]["type"] == "length"
    assert meta["input_token_logprobs"][0] == (None, prompt[0], None)
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt


def test_seeded_sampling_reproduces(tiny_engine):
    sp = {"max_new_tokens": 16, "temperature": 1.0, "seed": 42, "ignore_eos": True}
    prompt = _prompts(1, seed=5)[0]
    a = tiny_engine.generate(input_ids=prompt, sampling_params=sp)["output_ids"]
    # same seed inside a batch with other (unseeded) requests
    batch = tiny_engine.generate(input_ids=[_prompts(1, seed=6)[0], prompt],
                                 sampling_params=sp)
    assert batch[1]["output_ids"] == a
    c = tiny_engine.generate(input_ids=prompt, sampling_params={**sp, "seed": 43})["output_ids"]
    assert c != a


def test_n_returns_distinct_samples(tiny_engine):
    outs = tiny_engine.generate(input_ids=_prompts(1, seed=7)[0], sampling_params={
        "max_new_tokens": 8, "temperature": 1.0, "n": 3, "seed": 1, "ignore_eos": True})
    assert len(outs) == 3 and len({tuple(o["output_ids"]) for o in outs}) == 3


def test_stop_string_spanning_two_tokens(tiny_engine):
    tok = tiny_engine.tokenizer
    prompt = "The quick brown fox"
    base = tiny_engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0,
                                         "ignore_eos": True})
    ids = base["output_ids"]
    pieces = [tok.decode(ids[:k]) for k in range(len(ids) + 1)]
    # a stop string made of the last 2 chars of one token's text and the first 2 of the next
    k = next(k for k in range(1, len(ids) - 1)
             if len(pieces[k]) - len(pieces[k - 1]) >= 2 and len(pieces[k + 1]) - len(pieces[k]) >= 2
             and pieces[k][-2:] + pieces[k + 1][len(pieces[k]):len(pieces[k]) + 2] not in pieces[k])
    stop = pieces[k][-2:] + pieces[k + 1][len(pieces[k]):len(pieces[k]) + 2]
    out = tiny_engine.generate(prompt, {"max_new_tokens": 24, "temperature": 0,
                                        "ignore_eos": True, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == base["text"][:base["text"].index(stop)]
    assert out["output_ids"] == ids[:k + 1]


def test_invalid_requests_raise_before_queueing(tiny_engine):
    with pytest.raises(SamplingParamsError):
        tiny_engine.generate("hi", {"temperature": -1})
    with pytest.raises(InvalidRequestError, match="context length"):
        tiny_engine.generate("hi", {"max_new_tokens": 10_000})
    with pytest.raises(InvalidRequestError):
        tiny_engine.generate(input_ids=[[1, 2], [10**9]])
    assert not tiny_engine.scheduler.has_work
    tiny_engine.scheduler.check_invariants()


def test_choice_scoring_batch_shares_the_prefix(tiny_engine):
    """select(): a batch of prefill-only prefix + choice_i requests with prompt logprobs reuses
    the cached prefix for every choice and scores each choice's tokens."""
    prefix = _prompts(1, seed=9, lo=40, hi=41)[0]
    choices = [[101, 102], [103], [104, 105, 106]]
    tiny_engine.generate(input_ids=prefix, sampling_params={"max_new_tokens": 0})  # the hint
    outs = tiny_engine.generate(input_ids=[prefix + c for c in choices],
                                sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                logprob_start_len=len(prefix))
    for c, o in zip(choices, outs):
        assert o["meta_info"]["cached_tokens"] == len(prefix) - 1
        assert [t for _, t, _ in o["meta_info"]["input_token_logprobs"]] == c


def test_e2e_latency_is_per_request(tiny_engine):
    outs = tiny_engine.generate(input_ids=_prompts(2, seed=12, lo=5, hi=6),
                                sampling_params={"max_new_tokens": 1, "temperature": 0})
    long = tiny_engine.make_request(_prompts(1, seed=13)[0], tiny_engine_params(
        {"max_new_tokens": 64, "temperature": 0, "ignore_eos": True}))
    short = tiny_engine.make_request(_prompts(1, seed=14)[0], tiny_engine_params(
        {"max_new_tokens": 1, "temperature": 0}))
    a, b = tiny_engine.run([long, short])
    assert 0 < b["meta_info"]["e2e_latency"] < a["meta_info"]["e2e_latency"]
    assert all(o["meta_info"]["e2e_latency"] > 0 for o in outs)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_a_bfloat16_kv_pool_beside_float32_compute(make_tiny_model, tiny_engine, backend):
    """--kv-cache-dtype bfloat16 with float32 activations: the pool holds bfloat16 K/V (half
    the bytes a token), prompt logprobs stay within bf16 rounding of the float32 pool's, and a
    batch still equals one request at a time."""
    path, _ = make_tiny_model("llama")
    eng = Engine(path, max_total_tokens=4096, context_length=512, dtype="float32",
                 kv_cache_dtype="bfloat16", attention_backend=backend)
    assert eng.kv_pool.k_buffers[0].dtype == torch.bfloat16
    assert eng.kv_pool.bytes_per_token() * 2 == tiny_engine.kv_pool.bytes_per_token()
    prompt = _prompts(1, seed=5, lo=60, hi=61)[0]
    sp = {"max_new_tokens": 1, "temperature": 0}
    got, want = [e.generate(input_ids=prompt, sampling_params=sp, return_logprob=True,
                            logprob_start_len=0)["meta_info"]["input_token_logprobs"]
                 for e in (eng, tiny_engine)]
    assert [t for _, t, _ in got] == [t for _, t, _ in want]
    diff = max(abs(a[0] - b[0]) for a, b in zip(got[1:], want[1:]))
    assert 0 < diff < 0.05  # rounded K/V: close, not identical
    prompts = _prompts(6, seed=6, hi=80)
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    singles = [eng.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
    batched = [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    assert batched == singles
    assert_no_request_memory(eng.cache)


def test_a_failing_pass_ends_only_its_batch_offline_too(tiny_engine, monkeypatch):
    """Engine.step isolates a pass that raises (a fault we cannot cause otherwise) as the
    server's loop does: that batch's requests end with an "error" finish, and the engine then
    serves the next requests and keeps its KV invariants."""
    monkeypatch.setattr(tiny_engine.runner, "forward", failing_once(tiny_engine.runner.forward))
    sp = {"max_new_tokens": 3, "temperature": 0}
    doomed = tiny_engine.generate(input_ids=[[5, 6, 7]], sampling_params=sp)[0]
    reason = doomed["meta_info"]["finish_reason"]
    assert reason["type"] == "error" and "simulated" in reason["message"]
    fine = tiny_engine.generate(input_ids=[[5, 6, 7]], sampling_params=sp)[0]
    assert fine["meta_info"]["finish_reason"]["type"] == "length"
    assert len(fine["output_ids"]) == 3
    tiny_engine.scheduler.check_invariants()


def test_a_read_ahead_that_lands_between_step_and_check_is_retried():
    """Engine.stream_steps: a step that found a request's cached pages still on their way
    from disk, whose read completes before the engine looks again, is retried, not reported
    as "cannot schedule" (CI saw that once with --cache-dir)."""
    class Scheduler:  # step 1: pages not ready; then ready; step 2 runs; then done
        def __init__(self):
            self.calls = 0

        @property
        def has_work(self):
            return self.calls < 2

        @property
        def reading_ahead(self):
            return False  # the read landed right after step 1 looked

        def step(self):
            self.calls += 1
            return None if self.calls == 1 else "batch"

        def update(self, batch, out):
            return [("delta", batch, out)]

    class Runner:
        def forward(self, batch):
            return "logits"

    eng = Engine.__new__(Engine)
    eng.scheduler, eng.runner = Scheduler(), Runner()
    assert list(eng.stream_steps()) == [[("delta", "batch", "logits")]]

    class Stuck(Scheduler):
        @property
        def has_work(self):
            return True

        def step(self):
            return None

    eng.scheduler = Stuck()
    with pytest.raises(RuntimeError, match="cannot schedule"):
        list(eng.stream_steps())
