"""The batched sampler: logit processors and draws for the requests of one step, on the
logits' device. The settings it applies are :class:`server.sampling_params.SamplingParams`
(re-exported here).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from server.sampling_params import (  # noqa: F401 - re-exported for the model side
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
    SamplingParamsError,
)


@dataclass
class SamplingState:
    """What the sampler needs about one request beyond its params (owned by the request)."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    generator: torch.Generator | None
    banned_ids: tuple[int, ...] = ()  # e.g. EOS/stop ids while output < min_new_tokens
    # the grammar cursor (``server.constrained.grammar.Matcher``): fills its row of the batch's
    # token bitmask; None = unconstrained
    grammar: Any = None


@dataclass
class SampleOutput:
    """next_ids: [B] chosen tokens; logprobs: [B] their raw logprobs (None if not asked);
    top_logprobs: per row, a list of (logprob, token_id) of the top-k raw logprobs."""

    next_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[float, int]]] | None


def make_generator(seed: int | None) -> torch.Generator | None:
    """A CPU generator seeded with ``seed`` (taken mod 2^64) for a seeded request; None
    (the sampler's shared generator) for an unseeded one."""
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed & ((1 << 64) - 1))
    return g


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """logprobs: [N, V]. Returns, per row, the top-k (logprob, token_id) pairs, best first."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]


def take_rows(logits: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """logits[rows] ([len(rows), V]); a view, with no index tensor to copy to the device, when
    the rows are 0..n-1 (every decode step)."""
    if all(r == i for i, r in enumerate(rows)):
        return logits[:len(rows)]
    return logits[torch.tensor(list(rows), device=logits.device)]


def argmax_rows(logits: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor:
    """[B] int64: the first index of each row's maximum in ``logits`` [B, V] (a NaN counts as
    the maximum), as ``logits.argmax(-1)``; with ``rows``, of those rows only, in their order
    ([len(rows)]). On the CPU through NumPy, whose vectorized argmax takes ~3.4 us for a
    49,152-entry float32 row where torch's takes ~28 us (2 cores, torch 2.13; 16 rows: 36 us
    against 230), each of ``rows`` read in place (indexing them first copied 192 KB a row)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        if rows is not None and not all(r == i for i, r in enumerate(rows)):  # scattered
            x = logits.numpy()
            return torch.tensor([int(x[r].argmax()) for r in rows], dtype=torch.int64)
        return torch.from_numpy((logits if rows is None else take_rows(logits, rows)).numpy().argmax(-1))
    return (logits if rows is None else take_rows(logits, rows)).argmax(dim=-1)


class Sampler:
    """Turns [B, V] float32 logits into next tokens for B requests in one batched pass, on the
    logits' device (CPU or CUDA).

    Logit processors run as one tensor op per kind over the rows that use it. Draws are by
    inverse CDF: each sampled row takes one uniform number from its request's generator (or the
    sampler's), drawn on the host, so a seeded request gives the same tokens on any device and
    in any batch. The chosen ids, their logprobs and the top logprobs cross to the host in one
    copy (the step's only device-to-host transfer on CUDA).

    With ``native`` (and the ``kernels.cpu`` library built), CPU rows with temperature (and
    min-p) only are drawn by ``sgl_cpu::sample_tempered`` (``kernels/cpu/csrc/sample.cpp``):
    the same rule in one pass over each row instead of five torch ops. Its exp is not torch's,
    so a seeded row may differ from the torch path at the ~1e-7 level of probability; which
    path runs depends only on the configuration (``--cpu-isa none`` keeps torch's), never on
    the batch.
    """

    def __init__(self, seed: int = 0, native: bool = False):
        self.generator = torch.Generator()
        self.generator.manual_seed(seed)
        self._tempered = None
        if native:
            from kernels import cpu as kernels_cpu

            if kernels_cpu.available("avx2"):
                self._tempered = torch.ops.sgl_cpu.sample_tempered

    def sample(self, logits: torch.Tensor, states: Sequence[SamplingState], *,
               want_logprobs: bool = False, num_top_logprobs: int = 0) -> SampleOutput:
        """logits: [B, V] float32 on any device (not modified). Returns B rows."""
        b = logits.shape[0]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        if any(_has_processors(st) for st in states):  # else no copy: nothing writes logits
            logits = logits.clone()
            self.apply_processors(logits, states, greedy_shortcut=True)
        rows = [i for i, st in enumerate(states) if not st.params.is_greedy]
        if len(rows) == b:  # no argmax
            next_ids = self._draw(logits, states)
        else:
            next_ids = argmax_rows(logits)
            if rows:
                idx = _index(rows, logits.device)
                next_ids[idx] = self._draw(logits[idx], [states[i] for i in rows])
        if raw_logprobs is None:
            return SampleOutput(next_ids.tolist(), None, None)
        # One transfer: [B, 2 + 2k] float64 of (id, logprob, top logprobs, top ids); ids below
        # 2**53 are exact in float64.
        k = min(max(num_top_logprobs, 0), logits.shape[-1])
        parts = [next_ids[:, None].double(), raw_logprobs.gather(1, next_ids[:, None]).double()]
        if k:
            vals, ids = raw_logprobs.topk(k, dim=-1)
            parts += [vals.double(), ids.double()]
        host = torch.cat(parts, dim=1).cpu()
        chosen = host[:, 0].long().tolist()
        lp = host[:, 1].tolist()
        if not k:
            return SampleOutput(chosen, lp, [[] for _ in range(b)])
        vals, ids = host[:, 2:2 + k].tolist(), host[:, 2 + k:].long().tolist()
        return SampleOutput(chosen, lp, [list(zip(v, i)) for v, i in zip(vals, ids)])

    @staticmethod
    def apply_processors(logits: torch.Tensor, states: Sequence[SamplingState],
                         greedy_shortcut: bool = False) -> None:
        """Logit bias, repetition/frequency/presence penalties, banned ids and grammar masks,
        in place on ``logits`` [B, V] float32 (any device), each as one batched tensor op over
        the rows that use it (grammar rows through xgrammar's bitmask apply: the bitmask is
        filled on the host and applied on the logits' device).

        With ``greedy_shortcut`` (CPU logits), a greedy row whose best token the grammar
        allows keeps its logits unmasked: masking every other token cannot change its argmax
        (the first index of the row's maximum is still the first among the allowed ids), and
        a bitmask fill and apply cost ~0.3 ms a row against a few microseconds to ask the
        grammar about one token. A greedy row whose best token the grammar refuses asks about
        its next best few instead (:func:`best_allowed`), and its answer becomes the row's
        maximum. Only the argmax of such a row is then meaningful."""
        # One function: the processors' order (bias, penalties, bans, then the grammar, whose
        # greedy shortcut reads the processed row) is the sampling rule itself.
        vocab, dev = logits.shape[-1], logits.device
        bias = [(b, t, v) for b, st in enumerate(states) for t, v in st.params.logit_bias]
        if bias:
            rows, toks, vals = zip(*bias)
            logits.index_put_((_index(rows, dev), _index(toks, dev)),
                              _values(vals, logits.dtype, dev), accumulate=True)
        rep = [(b, st) for b, st in enumerate(states) if st.params.repetition_penalty != 1.0]
        if rep:  # HF/CTRL: divide positive logits, multiply negative ones (prompt + output)
            triples = [(b, t, st.params.repetition_penalty) for b, st in rep
                       for t in set(st.prompt_ids).union(st.output_ids)]
            if triples:
                rows, toks, pens = zip(*triples)
                rows, toks = _index(rows, dev), _index(toks, dev)
                pen = _values(pens, logits.dtype, dev)
                vals = logits[rows, toks]
                logits[rows, toks] = torch.where(vals > 0, vals / pen, vals * pen)
        freq = [(b, st) for b, st in enumerate(states) if st.output_ids
                and (st.params.frequency_penalty or st.params.presence_penalty)]
        if freq:  # OpenAI: output-token counts
            rows = _index([b for b, _ in freq], dev)
            counts = torch.zeros(len(freq), vocab, dtype=logits.dtype, device=dev)
            index = _index([i for i, (_, st) in enumerate(freq) for _ in st.output_ids], dev)
            toks = _index([t for _, st in freq for t in st.output_ids], dev)
            counts.index_put_((index, toks), torch.ones(len(toks), dtype=logits.dtype, device=dev),
                              accumulate=True)
            fp = _values([st.params.frequency_penalty for _, st in freq], logits.dtype, dev)
            pp = _values([st.params.presence_penalty for _, st in freq], logits.dtype, dev)
            logits[rows] -= fp[:, None] * counts + pp[:, None] * (counts > 0).to(logits.dtype)
        banned = [(b, t) for b, st in enumerate(states) for t in st.banned_ids]
        if banned:
            rows, toks = zip(*banned)
            logits[_index(rows, dev), _index(toks, dev)] = float("-inf")
        constrained = [b for b, st in enumerate(states) if st.grammar is not None]
        greedy = [b for b in constrained if states[b].params.is_greedy]
        if greedy and greedy_shortcut and dev.type == "cpu":
            best = argmax_rows(logits[_index(greedy, dev)]).tolist()
            allowed = set()
            for b, t in zip(greedy, best):  # a refused argmax: most often one of the next few
                chosen = best_allowed(logits[b], states[b].grammar, t)
                if chosen is not None:
                    if chosen != t:
                        logits[b, chosen] = float("inf")  # the row's argmax, as its masked row's
                    allowed.add(b)
            constrained = [b for b in constrained if b not in allowed]
        if constrained:
            import xgrammar as xgr

            bitmask = xgr.allocate_token_bitmask(len(states), vocab)
            for b in constrained:
                states[b].grammar.fill_bitmask(bitmask, b)
            if dev.type != "cpu":
                bitmask = bitmask.pin_memory().to(dev, non_blocking=True)
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab,
                                            indices=constrained)

    def _draw(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p (decided in descending-probability order), then
        one inverse-CDF draw per row over the kept probabilities in token-id order: the first
        id whose cumulative mass exceeds u times the total, u ~ U[0, 1) from the row's
        generator. Token-id order (not rank order) keeps the draw stable when logits change in
        the last bits (another batch composition): near-equal tokens swapping ranks would
        otherwise change which token a given u selects."""
        dev = logits.device
        vocab = logits.shape[-1]
        ranked = [0 < st.params.top_k < vocab or st.params.top_p < 1.0 for st in states]
        u = torch.tensor([float(torch.rand((), generator=st.generator or self.generator))
                          for st in states], dtype=torch.float64)
        if dev.type != "cpu":
            u = u.pin_memory().to(dev, non_blocking=True)
        ids = None
        for flag in (False, True):  # plain rows, then ranked ones; each row drawn on its own
            rows = [i for i, r in enumerate(ranked) if r == flag]
            if not rows:
                continue
            if len(rows) == len(states):
                return self._draw_rows(logits, states, u, ranked=flag)
            idx = _index(rows, dev)
            if ids is None:
                ids = torch.empty(len(states), dtype=torch.int64, device=dev)
            ids[idx] = self._draw_rows(logits[idx], [states[i] for i in rows], u[idx],
                                       ranked=flag)
        return ids

    def _draw_rows(self, logits: torch.Tensor, states: Sequence[SamplingState], u: torch.Tensor,
                   ranked: bool) -> torch.Tensor:
        """[B] ids of rows that all have (``ranked``) or all lack top-k / top-p: ranked rows
        through the ranking, plain ones through the native kernel where it serves (CPU float32
        logits), else through softmax and the two-level search."""
        if ranked:
            return _inverse_cdf(_kept_ranked(logits, states), u)
        if (self._tempered is not None and logits.device.type == "cpu"
                and logits.dtype == torch.float32):
            inv_t = torch.tensor([1.0 / st.params.temperature for st in states])
            min_p = torch.tensor([st.params.min_p for st in states], dtype=torch.float32)
            return self._tempered(logits, inv_t, min_p, u)
        return _inverse_cdf(_kept_plain(logits, states), u)


RANK_HEAD = 1024  # top-k / top-p rows first look at this many most likely ids (CPU)
CDF_BLOCK = 1024  # ids per block of the two-level inverse-CDF search


def _inverse_cdf(kept: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """[B] int64: per row, the first id whose cumulative kept mass (token-id order) exceeds u
    times the row's total; ``kept`` [B, V] float32 >= 0 with some mass in every row,
    ``u`` [B] float64 in [0, 1). Two levels instead of one [B, V] float64 running sum (16 x
    49,152 on 2 CPU cores: ~0.26 -> ~0.1 ms): the running sum of block totals (CDF_BLOCK ids,
    each summed in float32, a relative error ~1e-7 in where a block starts) picks the block,
    then that block's running sum in float64 the id. Each row's arithmetic is its own (the same
    draw in any batch), and an id with no mass is never chosen (where rounding puts the target
    past a block's own running sum, its last id with mass is taken)."""
    b, v = kept.shape
    nb = -(-v // CDF_BLOCK)
    if nb * CDF_BLOCK != v:
        kept = torch.nn.functional.pad(kept, (0, nb * CDF_BLOCK - v))
    blocks = kept.view(b, nb, CDF_BLOCK)
    sums = blocks.sum(dim=-1).double()  # [B, nb]: float32 block totals, 5x faster than float64
    ends = sums.cumsum(dim=-1)
    target = u[:, None] * ends[:, -1:]
    last_block = torch.where(sums > 0, torch.arange(nb, device=kept.device), -1).amax(
        dim=-1, keepdim=True)  # target may round to the total: no block past the mass
    j = torch.minimum(torch.searchsorted(ends, target, right=True), last_block)  # [B, 1]
    before = torch.where(j > 0, ends.gather(1, (j - 1).clamp(min=0)), 0.0)
    block = blocks.gather(1, j[:, :, None].expand(b, 1, CDF_BLOCK)).squeeze(1)  # [B, BLOCK]
    i = torch.searchsorted(block.double().cumsum_(dim=-1), target - before, right=True)
    ids = torch.arange(CDF_BLOCK, device=kept.device)[None, :]
    last = torch.where(block > 0, ids, -1).amax(dim=-1, keepdim=True)  # the block has mass
    return (j * CDF_BLOCK + torch.minimum(i, last)).squeeze(1)


def _kept_plain(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Rows without top-k / top-p: kept probabilities [B, V] (float32 from float32 logits) in
    token-id order after temperature and min-p; no sort over the vocabulary (~2 ms a row on 2
    CPU cores for 49k ids)."""
    dev = logits.device
    temps = _values([st.params.temperature for st in states], logits.dtype, dev)[:, None]
    probs = torch.softmax(logits / temps, dim=-1)
    if any(st.params.min_p > 0.0 for st in states):  # min-p 0 drops nothing (probs >= 0)
        min_p = _values([st.params.min_p for st in states], logits.dtype, dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def _kept_ranked(logits: torch.Tensor, states: Sequence[SamplingState]) -> torch.Tensor:
    """Rows with top-k and/or top-p, decided in descending-probability order; returns the
    kept probabilities [B, V] (float32 from float32 logits) in token-id order.

    On a CPU the ranking first takes the RANK_HEAD most likely ids (``topk``), which is exact
    when every row's kept set must lie inside them (top-k <= RANK_HEAD, or the head already
    holds more than top-p of the mass, so every later id is dropped by top-p); otherwise, and
    on GPUs (where the check would cost a device sync), the whole vocabulary is sorted."""
    dev = logits.device
    vocab = logits.shape[-1]
    temps = _values([st.params.temperature for st in states], logits.dtype, dev)[:, None]
    min_p = _values([st.params.min_p for st in states], logits.dtype, dev)[:, None]
    top_p = _values([st.params.top_p for st in states], logits.dtype, dev)[:, None]
    top_k = [st.params.top_k if 0 < st.params.top_k < vocab else vocab for st in states]
    probs, ids = None, None
    if dev.type == "cpu" and vocab > RANK_HEAD:
        full = torch.softmax(logits / temps, dim=-1)
        head, head_ids = full.topk(RANK_HEAD, dim=-1)
        mass = head.sum(dim=-1).tolist()
        if all(k <= RANK_HEAD or (st.params.top_p < 1.0 and m > st.params.top_p)
               for k, st, m in zip(top_k, states, mass)):
            probs, ids = head, head_ids
    if probs is None:
        sorted_logits, ids = (logits / temps).sort(dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(probs.shape[-1], device=dev)[None, :]
    drop = ranks >= _index(top_k, dev)[:, None]
    drop |= (probs.cumsum(dim=-1) - probs) > top_p  # the smallest set reaching top_p
    drop |= probs < min_p * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return torch.zeros(logits.shape, dtype=probs.dtype, device=dev).scatter_(
        1, ids, probs.masked_fill(drop, 0.0))


def argmax_decides(st: SamplingState) -> bool:
    """Whether ``st``'s sample is its row's raw argmax whenever its grammar (if any) allows
    that token: greedy, and no processor but the grammar changes its logits (set
    ``st.banned_ids`` first). :meth:`Sampler.apply_processors`' greedy shortcut then leaves the
    row unmasked, so the sampler returns that argmax."""
    p = st.params
    return p.is_greedy and not (p.logit_bias or p.repetition_penalty != 1.0 or st.banned_ids
                                or (st.output_ids and (p.frequency_penalty
                                                       or p.presence_penalty)))


def best_allowed(row: torch.Tensor, grammar, argmax: int, k: int = 16) -> int | None:
    """The first index of the maximum of ``row`` [V] among the tokens ``grammar`` allows (what
    masking the row and taking its argmax gives): ``argmax`` (the row's argmax, as
    :func:`argmax_rows` gave it) when the grammar allows it, else found by asking the grammar
    about the row's next best tokens in turn, at most ``k`` in all: each refused one is set
    aside (-inf) and the argmax taken again, which visits equal values in index order. None
    when the k are refused or the best left is NaN or -inf (masking decides those). ``row`` is
    left as it was (on the CPU in float32 it is read in place, through NumPy: ~3 us an
    argmax)."""
    if grammar.allows(argmax):
        return argmax
    x = row.detach().to("cpu", torch.float32).numpy()
    set_aside: list[tuple[int, float]] = [(argmax, float(x[argmax]))]
    x[argmax] = -math.inf
    try:
        for _ in range(k - 1):
            t = int(x.argmax())
            v = float(x[t])
            if not v > -math.inf:  # NaN (argmax_rows' maximum) or -inf: cannot tell here
                return None
            if grammar.allows(t):
                return t
            set_aside.append((t, v))
            x[t] = -math.inf
        return None
    finally:
        for t, v in reversed(set_aside):
            x[t] = v


def _has_processors(st: SamplingState) -> bool:
    """Whether :meth:`Sampler.apply_processors` would change ``st``'s row of the logits."""
    p = st.params
    return bool(p.logit_bias or p.repetition_penalty != 1.0 or st.banned_ids
                or st.grammar is not None
                or (st.output_ids and (p.frequency_penalty or p.presence_penalty)))


def _index(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 index tensor on ``device`` (pinned, non-blocking host-to-device copy on CUDA)."""
    t = torch.tensor(values, dtype=torch.int64)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _values(values: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=dtype)
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)
