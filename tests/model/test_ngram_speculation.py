"""Prompt-lookup (n-gram) speculative decoding: the proposer, and the engine's outputs with
drafts on equal to plain decoding (greedy and seeded sampling, with logprobs), with drafts
proposed and accepted on a prompt the model copies from."""

from __future__ import annotations

import pytest

from server.config import DEFAULT_NGRAM_TOKENS
from server.engine import Engine
from server.scheduler.ngram import ngram_draft
from tests.helpers import EXACT_ENGINE, EXACT_QUANTIZATION


def test_proposer_finds_the_latest_earlier_ngram():
    ids = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 2, 3]
    assert ngram_draft(ids, 3) == [7, 8, 2]  # "2 3" last seen before 7 8
    assert ngram_draft(ids + [7], 5) == [8, 2, 3, 7]  # "2 3 7" -> 8 2 3 7
    assert ngram_draft([1, 2, 3, 4], 4) == []  # no repeat
    assert ngram_draft(ids, 0) == []


@pytest.mark.parametrize("sp", [{"temperature": 0}, {"temperature": 0.3, "top_k": 5, "seed": 7}])
def test_drafts_never_change_outputs(make_tiny_model, sp):
    """The tiny tied model falls into loops ("18 18 18 ..."), which its own earlier n-grams
    predict: drafts are proposed and accepted, and the outputs (ids and logprobs, one request
    at a time and batched) are those of plain decoding in fewer forward passes."""
    path, _ = make_tiny_model("tied")
    phrase = [11, 12, 13, 14, 15, 16, 17, 18]
    prompts = [phrase * 4, phrase * 2 + [40, 41], [5, 6, 7, 5, 6, 7, 5, 6]]
    params = {"max_new_tokens": 24, "ignore_eos": True, **sp}
    outs, passes = {}, {}
    for k in (0, 6):
        eng = Engine(path, dtype="float32", **EXACT_ENGINE,
                     context_length=256, max_total_tokens=2048, speculative_ngram=k)

        def run(batch):
            res = eng.generate(input_ids=batch, sampling_params=params, return_logprob=True)
            return [(o["output_ids"], [lp for lp, _, _ in  # bitwise: rows are batch-invariant
                                       o["meta_info"]["output_token_logprobs"]]) for o in res]

        outs[k] = [run([p])[0] for p in prompts] + run(prompts)
        passes[k] = eng.scheduler.stats.forward_passes
        if k:
            stats = eng.scheduler.stats
            assert stats.accepted_draft_tokens > 0
            assert stats.accepted_draft_tokens <= stats.draft_tokens
    assert outs[6] == outs[0]
    if sp["temperature"] == 0:
        assert passes[6] < passes[0]


def test_constrained_requests_take_ngram_drafts_the_grammar_accepts(make_tiny_model):
    """A regex leaves a choice at every digit, so jump-forward drafts nothing; n-gram drafts of
    the repeating digits are cut where the grammar would reject them, and outputs stay those
    of plain decoding."""
    path, _ = make_tiny_model("tied")
    params = {"max_new_tokens": 30, "temperature": 0, "regex": "[0-9a-z ]{0,60}"}
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 3
    outs, stats = {}, {}
    for k in (0, 6):
        eng = Engine(path, dtype="float32", **EXACT_ENGINE,
                     context_length=256, max_total_tokens=2048, speculative_ngram=k)
        outs[k] = eng.generate(input_ids=prompt, sampling_params=params)["output_ids"]
        stats[k] = eng.scheduler.stats
    assert outs[6] == outs[0]
    assert stats[6].accepted_draft_tokens > 0 and stats[0].draft_tokens == 0


def test_drafts_are_on_by_default_only_where_the_runner_is_batch_invariant(make_tiny_model):
    """Auto (the default) turns n-gram drafts on where the runner is batch-invariant (native
    quantized kernels), so they can never change an output, and leaves them off on dense
    weights (torch's matmuls round a row differently in a wider pass); an explicit value wins."""
    path, _ = make_tiny_model("tied")
    common = {"dtype": "float32", "context_length": 128, "max_total_tokens": 512}
    dense = Engine(path, quantization="none", **common)
    assert not dense.runner.batch_invariant
    assert dense.scheduler.speculative_ngram == dense.config.scheduler.speculative_ngram == 0
    if EXACT_QUANTIZATION == "none":  # no native kernels on this machine: nothing else to check
        return
    exact = Engine(path, **EXACT_ENGINE, **common)
    assert exact.runner.batch_invariant and exact.runner.quant_report.row_invariant
    assert exact.scheduler.speculative_ngram == DEFAULT_NGRAM_TOKENS
    assert exact.config.scheduler.speculative_ngram == DEFAULT_NGRAM_TOKENS
    off = Engine(path, **EXACT_ENGINE, speculative_ngram=0, **common)
    assert off.scheduler.speculative_ngram == 0
    torch_ops = Engine(path, quantization=EXACT_QUANTIZATION, cpu_isa="none", **common)
    assert not torch_ops.runner.batch_invariant
    assert torch_ops.scheduler.speculative_ngram == 0
