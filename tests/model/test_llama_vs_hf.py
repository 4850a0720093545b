"""Our Llama-family forward pass vs transformers on the same random weights (fp32, CPU).

Each test drives the ModelRunner directly through ForwardBatches (no scheduler), with batches of
mixed lengths, and compares logits to ``AutoModelForCausalLM`` to max abs diff <= 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.req_table import ReqToTokenTable
from server.model.forward_batch import ForwardBatch, ForwardMode
from server.model.loader import load_model
from server.model.runner import ModelRunner
from tests.helpers import hf_logits

FAMILIES = ["llama", "llama3", "tied", "qwen2", "qwen3", "phi3", "mistral", "mixtral",
            "qwen3_moe", "mistral_swa", "gemma", "gemma2", "gemma3"]
TOL = 1e-4


class Harness:
    """A runner with its own pool and table; tracks each sequence's computed length."""

    def __init__(self, path: str, capacity: int = 4096):
        loaded = load_model(path)
        a = loaded.arch
        self.pool = TokenKVPool(capacity, a.num_layers, a.num_kv_heads, a.head_dim)
        for buf in (*self.pool.k_buffers, *self.pool.v_buffers):
            buf[1:] = float("nan")  # any read of a slot before it is written poisons the logits
        self.table = ReqToTokenTable(16, 512)
        self.runner = ModelRunner(loaded, self.pool, dtype=torch.float32, max_positions=512)
        self.rows: dict[int, int] = {}
        self.computed: dict[int, int] = {}

    def extend(self, seqs: dict[int, list[int]], all_logits: bool = True) -> list[torch.Tensor]:
        """Append new tokens ``seqs[sid]`` to each sequence; returns per-sequence logits
        [n_new, vocab] (all new positions) in the order of ``seqs``."""
        ids, pos, locs, rows, prefix, ext = [], [], [], [], [], []
        for sid, new in seqs.items():
            if sid not in self.rows:
                self.rows[sid], self.computed[sid] = self.table.alloc_row(), 0
            start = self.computed[sid]
            slots = self.pool.alloc(len(new))
            self.table.write(self.rows[sid], start, slots)
            ids += new
            pos += range(start, start + len(new))
            locs.append(slots)
            rows.append(self.rows[sid])
            prefix.append(start)
            ext.append(len(new))
            self.computed[sid] += len(new)
        decode = all(n == 1 for n in ext) and all(p > 0 for p in prefix)
        batch = ForwardBatch(
            ForwardMode.DECODE if decode else ForwardMode.EXTEND, [str(s) for s in seqs],
            torch.tensor(ids), torch.tensor(pos), torch.cat(locs), rows, prefix, ext,
            torch.arange(len(ids)), self.table.table)
        logits = self.runner.forward(batch).logits
        return list(logits.split(ext))


def _random_seqs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 49152, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("kind", FAMILIES)
def test_prefill_mixed_lengths(make_tiny_model, kind):
    path, hf = make_tiny_model(kind)
    seqs = _random_seqs([1, 7, 33, 100])
    h = Harness(path)
    outs = h.extend(dict(enumerate(seqs)))
    for seq, out in zip(seqs, outs):
        assert (out - hf_logits(hf, seq)).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", FAMILIES)
def test_extend_after_partial_prefix(make_tiny_model, kind):
    """Prefill a prefix of each sequence, then extend the rest in one mixed batch."""
    path, hf = make_tiny_model(kind)
    seqs = _random_seqs([10, 40, 65, 90], seed=1)
    cut = [1, 17, 64, 45]
    h = Harness(path)
    h.extend({i: s[:c] for i, (s, c) in enumerate(zip(seqs, cut))})
    outs = h.extend({i: s[c:] for i, (s, c) in enumerate(zip(seqs, cut))})
    for seq, c, out in zip(seqs, cut, outs):
        assert (out - hf_logits(hf, seq)[c:]).abs().max().item() <= TOL


@pytest.mark.parametrize("kind", FAMILIES)
def test_step_by_step_decode(make_tiny_model, kind):
    """Prefill, then decode 12 steps, one token per sequence per batched decode step."""
    path, hf = make_tiny_model(kind)
    seqs = _random_seqs([3, 20, 57], seed=2)
    steps = _random_seqs([12, 12, 12], seed=3)
    h = Harness(path)
    h.extend(dict(enumerate(seqs)))
    got = [[] for _ in seqs]
    for t in range(12):
        outs = h.extend({i: [steps[i][t]] for i in range(len(seqs))})
        for i, o in enumerate(outs):
            got[i].append(o[0])
    for i, seq in enumerate(seqs):
        full = seq + steps[i]
        ref = hf_logits(hf, full)[len(seq):]
        assert (torch.stack(got[i]) - ref).abs().max().item() <= TOL


def test_decode_with_uneven_batch_membership(make_tiny_model):
    """Sequences join and leave decode batches; stale table entries must not leak in."""
    path, hf = make_tiny_model("llama")
    a, b, c = _random_seqs([5, 30, 2], seed=4)
    h = Harness(path)
    h.extend({0: a, 1: b})
    out_a1 = h.extend({0: [11], 1: [12]})[0]
    h.extend({2: c})
    out = h.extend({2: [13], 0: [14]})
    assert (out[0][0] - hf_logits(hf, c + [13])[-1]).abs().max() <= TOL
    assert (out[1][0] - hf_logits(hf, a + [11, 14])[-1]).abs().max() <= TOL
    assert (out_a1[0] - hf_logits(hf, a + [11])[-1]).abs().max() <= TOL


def test_sharded_safetensors_load(make_tiny_model):
    path, hf = make_tiny_model("llama", seed=5, shards=True)
    import glob

    assert len(glob.glob(f"{path}/*.safetensors")) > 1
    seq = _random_seqs([16], seed=6)[0]
    out = Harness(path).extend({0: seq})[0]
    assert (out - hf_logits(hf, seq)).abs().max().item() <= TOL


def test_longrope_tables_follow_hf_on_both_sides_of_the_original_length(make_tiny_model):
    """Phi-3 LongRoPE: positions below original_max_position_embeddings rotate with the short
    factors, later ones with the long factors (HF uses the long ones for a whole sequence once
    it is longer; the two agree position by position on each side), both scaled by the
    attention factor."""
    path, hf = make_tiny_model("phi3")
    h = Harness(path)
    model = h.runner.model
    rotary = hf.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    for length in (200, 400):  # within the original 256, and past it
        cos, sin = rotary(x, torch.arange(length)[None])
        lo = 0 if length <= 256 else 256
        torch.testing.assert_close(model.cos_cache[lo:length], cos[0, lo:], atol=1e-5, rtol=0)
        torch.testing.assert_close(model.sin_cache[lo:length], sin[0, lo:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", FAMILIES)
def test_greedy_32_tokens_match_hf_generate(make_tiny_model, kind):
    """The whole engine (scheduler, radix cache, batched decode of two prompts, one longer
    than the 16-token windows) greedily generates what transformers' generate() does."""
    from server.engine import Engine

    path, hf = make_tiny_model(kind)
    prompts = _random_seqs([5, 40], seed=13)
    eng = Engine(path, dtype="float32", context_length=512, max_total_tokens=2048)
    got = [o["output_ids"] for o in eng.generate(
        input_ids=prompts, sampling_params={"max_new_tokens": 32, "temperature": 0,
                                            "ignore_eos": True})]
    for prompt, out in zip(prompts, got):
        with torch.no_grad():
            want = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                               dtype=torch.int64), max_new_tokens=32, min_new_tokens=32,
                               do_sample=False)[0, len(prompt):].tolist()
        assert out == want
