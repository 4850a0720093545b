"""SamplingParams validation and the batched Sampler on fixed logits (no model)."""

import dataclasses
import math

import pytest
import torch

from server.model.sampling import Sampler, SamplingParams, SamplingParamsError, SamplingState, make_generator


@pytest.mark.parametrize("field, value", [
    ("max_new_tokens", -1), ("max_new_tokens", 1.5), ("max_new_tokens", "8"), ("max_new_tokens", True),
    ("temperature", -0.1), ("temperature", math.nan), ("temperature", math.inf),
    ("top_p", 0.0), ("top_p", 1.01), ("top_k", -2), ("top_k", 2.0), ("min_p", -0.1), ("min_p", 1.1),
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("repetition_penalty", 0.0),
    ("seed", 1 << 63), ("seed", 1.0), ("n", 0), ("n", 1000),
    ("stop", [""]), ("stop", ["x" * 300]), ("stop", ["a"] * 17), ("stop_token_ids", [-1]),
    ("logit_bias", {"a": 1.0}), ("logit_bias", {5: 101.0}), ("ignore_eos", "yes"),
])
def test_invalid_params_raise_typed_error_naming_the_field(field, value):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_min_new_tokens_bounded_by_max():
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(max_new_tokens=4, min_new_tokens=5)
    assert err.value.param == "min_new_tokens"


def test_from_dict_normalizes_and_rejects_unknown():
    p = SamplingParams.from_dict({"stop": "END", "logit_bias": {"7": 2.0}, "top_p": None})
    assert p.stop == ("END",) and p.logit_bias == ((7, 2.0),) and p.top_p == 1.0
    with pytest.raises(SamplingParamsError):
        SamplingParams.from_dict({"temprature": 0.5})
    assert SamplingParams.from_dict({"temprature": 0.5}, ignore_unknown=True) == SamplingParams()
    hash(p)  # frozen and hashable: usable as a cache key


def test_validate_for_vocab():
    with pytest.raises(SamplingParamsError):
        SamplingParams(stop_token_ids=(100,)).validate_for_vocab(100)
    with pytest.raises(SamplingParamsError):
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)


def _state(params, prompt=(), output=()):
    return SamplingState(params, list(prompt), list(output), make_generator(params.seed))


def _logits(rows=1, vocab=50, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_degenerate_filters_equal_argmax():
    logits = _logits(4)
    states = [_state(SamplingParams(temperature=0)), _state(SamplingParams(top_k=1)),
              _state(SamplingParams(top_p=1e-9)), _state(SamplingParams(min_p=1.0))]
    out = Sampler().sample(logits, states)
    assert out.next_ids == logits.argmax(-1).tolist()


def test_seeded_sampling_reproduces_and_ignores_batch_neighbours():
    logits = _logits(1, vocab=1000)
    p = SamplingParams(temperature=1.0, seed=1234)
    a = [Sampler(0).sample(logits, [_state(p)]).next_ids[0] for _ in range(3)]
    st = _state(p)
    seq1 = [Sampler(0).sample(logits, [st]).next_ids[0] for _ in range(20)]
    st = _state(p)
    neighbour = _state(SamplingParams(temperature=1.0))
    seq2 = [Sampler(7).sample(torch.cat([_logits(1, 1000, 9), logits]), [neighbour, st]).next_ids[1]
            for _ in range(20)]
    assert len(set(a)) == 1 and seq1 == seq2 and len(set(seq1)) > 1


def test_draws_follow_the_tempered_distribution():
    """The inverse-CDF draw samples softmax(logits / T): empirical frequencies of 20k draws
    within 4 standard errors of the exact probabilities (and top_k renormalises the rest)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 20_000
    for params, probs in ((SamplingParams(temperature=0.7),
                           torch.softmax(logits[0] / 0.7, -1)),
                          (SamplingParams(temperature=1.0, top_k=3),
                           torch.softmax(logits[0, :3], -1))):
        s = Sampler(11)
        st = _state(params)
        rows = [st] * 100
        counts = torch.zeros(logits.shape[1])
        for _ in range(n // 100):
            ids = s.sample(logits.expand(100, -1), rows).next_ids
            counts += torch.bincount(torch.tensor(ids), minlength=logits.shape[1])
        freq = counts / n
        expected = torch.zeros(logits.shape[1])
        expected[:len(probs)] = probs
        stderr = (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() <= 4 * stderr + 1e-9).all(), (freq, expected)


def test_a_row_draws_the_same_with_or_without_sorting_neighbours():
    """Temperature-only rows skip the vocabulary sort unless a neighbour needs it (top-k or
    top-p): the same seed gives the same tokens either way."""
    logits = _logits(2, vocab=5000, seed=4)
    p = SamplingParams(temperature=0.9, min_p=0.01, seed=99)
    alone, st = [], _state(p)
    for _ in range(30):
        alone.append(Sampler(0).sample(logits[:1], [st]).next_ids[0])
    mixed, st = [], _state(p)
    sorter = _state(SamplingParams(temperature=1.0, top_p=0.5))
    for _ in range(30):
        mixed.append(Sampler(0).sample(logits, [st, sorter]).next_ids[0])
    assert alone == mixed and len(set(alone)) > 1


@pytest.mark.parametrize("params", [dict(top_p=0.9), dict(top_k=50), dict(top_p=0.5, min_p=0.05),
                                    dict(top_p=0.999999)])
def test_ranked_rows_look_at_the_head_only_when_that_is_exact(monkeypatch, params):
    """top-k / top-p rows rank only the 1024 most likely ids when the kept set must lie
    inside them, else sort everything; both give the same kept probabilities."""
    from server.model import sampling

    logits = _logits(3, vocab=8000, seed=7) / 3  # flat: top-p 0.999999 needs the full sort
    states = [_state(SamplingParams(temperature=0.8, **params)) for _ in range(3)]
    head = sampling._kept_ranked(logits, states)
    monkeypatch.setattr(sampling, "RANK_HEAD", 10**9)  # always the full sort
    full = sampling._kept_ranked(logits, states)
    torch.testing.assert_close(head, full, atol=1e-6, rtol=0)
    assert (head > 0).sum() < 8000 * 3  # something was dropped


def test_top_k_top_p_restrict_support():
    logits = torch.tensor([[5.0, 4.0, 3.0, -10.0, -10.0]])
    s = Sampler(0)
    top2 = {s.sample(logits, [_state(SamplingParams(top_k=2))]).next_ids[0] for _ in range(200)}
    assert top2 == {0, 1}
    probs = torch.softmax(logits[0], -1)
    p = float(probs[0]) + 1e-3  # just over the first token: the first two survive
    topp = {s.sample(logits, [_state(SamplingParams(top_p=p))]).next_ids[0] for _ in range(200)}
    assert topp == {0, 1}


def test_logit_bias_and_banned_ids():
    logits = _logits(1)
    out = Sampler().sample(logits, [_state(SamplingParams(temperature=0, logit_bias={17: 100.0}))])
    assert out.next_ids == [17]
    st = _state(SamplingParams(temperature=0))
    st.banned_ids = (int(logits.argmax()),)
    assert Sampler().sample(logits, [st]).next_ids[0] != int(logits.argmax())


def test_penalties_follow_openai_and_hf_definitions():
    # three rows in one batch: each processor touches only its own row
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]]).repeat(4, 1)
    states = [_state(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
                     output=[2, 2, 3]),
              _state(SamplingParams(repetition_penalty=2.0), prompt=[0, 0], output=[1]),
              _state(SamplingParams(logit_bias={3: -1.5, 0: 1.0})), _state(SamplingParams())]
    states[3].banned_ids = (0, 2)
    Sampler.apply_processors(logits, states)
    assert logits.tolist() == [[2.0, -2.0, 1.0 - 2 * 0.5 - 0.25, 0.5 - 0.5 - 0.25],
                               [1.0, -4.0, 1.0, 0.5], [3.0, -2.0, 1.0, -1.0],
                               [float("-inf"), -2.0, float("-inf"), 0.5]]


def test_logprobs_are_raw_log_softmax():
    logits = _logits(3, vocab=40)
    states = [_state(SamplingParams(temperature=0, frequency_penalty=1.0), output=[5]),
              _state(SamplingParams(temperature=0.7, seed=3)), _state(SamplingParams(temperature=0))]
    out = Sampler().sample(logits, states, want_logprobs=True, num_top_logprobs=3)
    ref = torch.log_softmax(logits, -1)
    for b, tok in enumerate(out.next_ids):
        assert out.logprobs[b] == pytest.approx(ref[b, tok].item(), abs=1e-6)
        top = ref[b].topk(3)
        assert [t for _, t in out.top_logprobs[b]] == top.indices.tolist()
        assert [v for v, _ in out.top_logprobs[b]] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_replace_keeps_validation():
    with pytest.raises(SamplingParamsError):
        dataclasses.replace(SamplingParams(), top_p=2.0)


def test_the_inverse_cdf_never_draws_an_id_without_mass_and_ignores_the_batch():
    """The two-level search lands where a float64 running sum over the whole row would (but
    for ~1e-7 of the mass at block edges), never on an id with no mass (masked ids, the padded
    tail of the last block, u at the top of [0, 1)), and draws a row alone as in a batch."""
    from server.model.sampling import CDF_BLOCK, _inverse_cdf

    g = torch.Generator().manual_seed(5)
    same = total = 0
    for vocab in (7, CDF_BLOCK, 3 * CDF_BLOCK + 5, 49152):
        probs = torch.softmax(torch.randn(6, vocab, generator=g) * 4, dim=-1)
        probs[:, ::3] = 0.0  # masked ids
        probs[2] = 0.0
        probs[2, -1] = 1.0  # all the mass on the last id
        u = torch.rand(6, generator=g, dtype=torch.float64)
        u[0], u[1] = 0.0, 1.0 - 2.0**-53
        ids = _inverse_cdf(probs, u)
        assert (probs.gather(1, ids[:, None]) > 0).all() and ids[2] == vocab - 1
        for r in range(6):
            assert _inverse_cdf(probs[r:r + 1], u[r:r + 1]).item() == ids[r]
        cum = probs.double().cumsum(dim=-1)
        exact = torch.searchsorted(cum, u[:, None] * cum[:, -1:], right=True).squeeze(1)
        same += int((exact[:1] == ids[:1]).sum()) + int((exact[2:] == ids[2:]).sum())
        total += 5
    assert same >= total - 1


def _native_sampler(seed: int) -> Sampler:
    from kernels import cpu as native

    if not native.available("avx2"):
        pytest.skip(native.unavailable_reason("avx2"))
    s = Sampler(seed, native=True)
    assert s._tempered is not None
    return s


def test_the_native_tempered_draw_follows_the_distribution_and_min_p():
    """sgl_cpu::sample_tempered samples softmax(logits / T) (20k draws within 4 standard errors
    of the exact probabilities), drops ids under min-p and never draws a masked (-inf) id."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0, float("-inf")]])
    n = 20_000
    for params in (SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, min_p=0.2)):
        s = _native_sampler(11)
        rows = [_state(params)] * 100
        counts = torch.zeros(logits.shape[1])
        for _ in range(n // 100):
            ids = s.sample(logits.expand(100, -1).contiguous(), rows).next_ids
            counts += torch.bincount(torch.tensor(ids), minlength=logits.shape[1])
        expected = torch.softmax(logits[0] / params.temperature, -1)
        expected[expected < params.min_p * expected.max()] = 0.0
        expected /= expected.sum()
        freq = counts / n
        stderr = (expected * (1 - expected) / n).sqrt()
        assert ((freq - expected).abs() <= 4 * stderr + 1e-9).all(), (freq, expected)
        assert counts[expected == 0].sum() == 0


def test_a_native_row_draws_the_same_alone_and_beside_ranked_rows():
    """The native path draws a row the same whatever else is in the batch (a top-p neighbour
    runs the torch path beside it), and stays close to the torch path: one kernel's exp
    against another's moves a draw only where u lands within ~1e-7 of a token's edge."""
    logits = _logits(2, vocab=5000, seed=4)
    p = SamplingParams(temperature=0.9, min_p=0.01, seed=99)
    alone, mixed, torch_path = [], [], []
    for out, sampler, pair in ((alone, _native_sampler(0), False), (mixed, _native_sampler(0), True),
                               (torch_path, Sampler(0), False)):
        st = _state(p)
        sorter = _state(SamplingParams(temperature=1.0, top_p=0.5))
        for _ in range(40):
            if pair:
                out.append(sampler.sample(logits, [st, sorter]).next_ids[0])
            else:
                out.append(sampler.sample(logits[:1], [st]).next_ids[0])
    assert alone == mixed and len(set(alone)) > 1
    assert sum(a == b for a, b in zip(alone, torch_path)) >= 38


class _AllowedSet:
    """A grammar stand-in over one set of allowed tokens: what the sampler asks of a grammar
    (one token, or its row of xgrammar's bitmask: bit j of word w is token 32 w + j)."""

    def __init__(self, allowed):
        self.allowed = set(allowed)

    def allows(self, t: int) -> bool:
        return t in self.allowed

    def fill_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for t in self.allowed:
            w, j = divmod(t, 32)
            bitmask[row, w] |= (1 << j) - (1 << 32 if j == 31 else 0)


def test_a_refused_greedy_row_takes_its_masked_argmax_from_its_top_few():
    """A greedy row whose argmax the grammar refuses: the best allowed token found among its
    next best few is the token masking the row and taking its argmax gives (ties: the first
    index), the row is left as it was, and where the few are all refused the row is masked as
    before; through Sampler.sample every row gets its masked argmax."""
    from server.model.sampling import best_allowed

    gen = torch.Generator().manual_seed(5)
    vocab, told = 64, 0
    for trial in range(400):
        row = torch.randint(-6, 6, (vocab,), generator=gen).float()  # many ties
        allowed = torch.randperm(vocab, generator=gen)[:1 + trial % 20].tolist()
        grammar = _AllowedSet(allowed)
        masked = torch.full((vocab,), float("-inf"))
        masked[allowed] = row[allowed]
        want = int(masked.argmax())
        before = row.clone()
        got = best_allowed(row, grammar, int(row.argmax()))
        assert got is None or got == want
        assert torch.equal(row, before)
        told += got is not None
        st = SamplingState(SamplingParams(temperature=0.0), [], [], None, grammar=grammar)
        assert Sampler().sample(row[None], [st]).next_ids == [want]
    assert told > 100  # the top few decide many rows


@pytest.mark.parametrize("rows", [None, [0, 1, 2], [0, 1, 2, 3, 4], [3, 1], [4], [2, 2, 0]])
def test_argmax_rows_equals_torchs_argmax_of_the_rows_taken(rows):
    """argmax_rows reads the rows it is given in place (NumPy on the CPU): the same ids as
    indexing them and taking torch's argmax, first index on ties, a NaN counted as the
    maximum, in the order given."""
    from server.model.sampling import argmax_rows

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g)
    logits[1, 7] = logits[1, 900] = 50.0  # a tie: the first index wins
    logits[3, 500] = math.nan
    want = (logits if rows is None else logits[torch.tensor(rows)]).argmax(-1)
    got = argmax_rows(logits, rows)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    view = logits[1:]  # a view that does not start at the buffer's first row
    assert argmax_rows(view, [2, 0]).tolist() == view[torch.tensor([2, 0])].argmax(-1).tolist()
