"""Turning the runner's logits into request progress: prompt logprobs, sampling, appending
tokens, and stop conditions on ids (EOS, stop token ids, length, context; stop strings are
matched on text by the front ends).

Pure bookkeeping on :class:`Req` objects; memory is released by the scheduler when a request
finishes, never here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from server.constrained.jump_forward import accepted_prefix, draft_tokens
from server.model.forward_batch import RunnerOutput
from server.model.sampling import Sampler, argmax_decides, argmax_rows, best_allowed, take_rows, top_logprobs
from server.scheduler.ngram import ngram_draft
from server.scheduler.request import FinishReason, Req

if TYPE_CHECKING:
    from server.detokenizer import OutputText


@dataclass
class TokenDelta:
    """What one step changed for one request: new token ids, and the finish reason once
    finished (text is the front ends' business: :mod:`server.detokenizer`)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None


def record_prompt_rows(req: Req, positions: Sequence[int], rows: Sequence[int],
                       out: RunnerOutput) -> None:
    """What a prompt pass leaves a request besides its KV: the logprobs of its prompt tokens
    (when wanted) and, for a mean-pooled embedding, the sum of the rows' final hidden states
    (restarted when the pass computes position 0: a retracted request recomputes it all)."""
    if req.wants_input_logprobs:
        record_input_logprobs(req, positions, rows, out.logits)
    if req.pools_every_row and out.pooled is None and positions:
        if out.hidden is None:
            raise RuntimeError("this forward pass kept no hidden states")
        rows_sum = take_rows(out.hidden, rows).float().sum(0)
        restart = positions[0] == 0 or req.pooled_sum is None
        req.pooled_sum = rows_sum if restart else req.pooled_sum + rows_sum


def record_input_logprobs(req: Req, positions: Sequence[int], rows: Sequence[int],
                          logits: torch.Tensor) -> None:
    """Store the logprob of each prompt token p + 1 given logits row of position p."""
    pairs = [(p, r) for p, r in zip(positions, rows) if p + 1 < len(req.input_ids)]
    if not pairs:
        return
    lp = torch.log_softmax(take_rows(logits, [r for _, r in pairs]), dim=-1)
    targets = [req.input_ids[p + 1] for p, _ in pairs]
    index = torch.tensor(targets, device=lp.device)[:, None]
    chosen = lp.gather(1, index).squeeze(1).tolist()
    req.input_token_logprobs.extend(zip(chosen, targets))
    if req.logprobs.top_logprobs_num:
        req.input_top_logprobs.extend(top_logprobs(lp, req.logprobs.top_logprobs_num))


def request_embedding(req: Req, out: RunnerOutput, row: int) -> list[float]:
    """An embedding request's vector, as float32 values, once its prompt is computed: an
    encoder's pooled output (``out.pooled``), else a decoder's ``req.pooling``: the mean of
    every prompt position's final hidden state (``req.pooled_sum``) or the last position's
    (``row``: as Qwen3-Embedding, e5-mistral and gte-Qwen2 pool), L2-normalized when the model
    normalizes. Raises RuntimeError when the pass kept no hidden states."""
    if out.pooled is not None:
        return out.pooled[row].tolist()
    if req.pools_every_row:
        vector = req.pooled_sum / req.fill_len
    elif out.hidden is None:
        raise RuntimeError("this forward pass kept no hidden states")
    else:
        vector = out.hidden[row].float()
    normalize = req.pooling is None or req.pooling.normalize
    return (torch.nn.functional.normalize(vector, dim=0) if normalize else vector).tolist()


def sample_and_append(sampler: Sampler, items: Sequence[tuple[Req, int]], logits: torch.Tensor,
                      context_len: int, jump_forward_tokenizer: Any = None,
                      speculative_ngram: int = 0) -> list[tuple[Req, int, FinishReason | None]]:
    """Sample one token for each (request, logits row); append it and check stop conditions.
    With ``jump_forward_tokenizer`` or ``speculative_ngram``, a request that goes on gets its next
    draft (:func:`set_draft`).

    A greedy constrained request whose logits only its grammar changes (:func:`argmax_decides`,
    CPU logits) takes its row's argmax, or :func:`best_allowed` where the grammar refuses it,
    without a sampler call (which copies the rows to apply the mask); the sampler decides
    the rest, and both give the same tokens.

    Returns (request, sampled token, finish reason or None) per item, in order.
    """
    reqs = [r for r, _ in items]
    for r in reqs:
        r.sampling.banned_ids = r.banned_ids()
        r.sampling.grammar = r.grammar
    toks: dict[int, int] = {}
    fast = [i for i, r in enumerate(reqs) if r.grammar is not None and logits.device.type == "cpu"
            and not r.logprobs.return_logprob and argmax_decides(r.sampling)]
    if fast:
        best = argmax_rows(logits, [items[i][1] for i in fast]).tolist()
        for i, t in zip(fast, best):
            t = best_allowed(logits[items[i][1]], reqs[i].grammar, t)
            if t is not None:
                toks[i] = t
    rest = [i for i in range(len(reqs)) if i not in toks]
    sampled = None
    if rest:
        want = any(reqs[i].logprobs.return_logprob for i in rest)
        k = max(reqs[i].logprobs.top_logprobs_num for i in rest)
        sampled = sampler.sample(take_rows(logits, [items[i][1] for i in rest]),
                                 [reqs[i].sampling for i in rest], want_logprobs=want,
                                 num_top_logprobs=k)
        toks.update(zip(rest, sampled.next_ids))
    at = {i: j for j, i in enumerate(rest)}  # item -> its row of the sampler's output
    out = []
    for i, req in enumerate(reqs):
        tok = toks[i]
        req.output_ids.append(tok)
        if req.logprobs.return_logprob:
            req.output_token_logprobs.append((sampled.logprobs[at[i]], tok))
            if req.logprobs.top_logprobs_num:
                req.output_top_logprobs.append(
                    sampled.top_logprobs[at[i]][:req.logprobs.top_logprobs_num])
        reason = check_finished(req, tok, context_len)
        if reason is None and (jump_forward_tokenizer is not None or speculative_ngram):
            set_draft(req, tok, context_len, jump_forward_tokenizer, speculative_ngram)
        out.append((req, tok, reason))
    return out


def verify_draft(sampler: Sampler, req: Req, rows: range, logits: torch.Tensor,
                 context_len: int) -> tuple[list[int], FinishReason | None]:
    """Sample ``req``'s verify rows in order as plain decoding would (row i follows draft
    token i - 1), appending each token, until a sample differs from its draft token
    (``req.draft``, not changed here), the request finishes or the rows run out.

    A greedy request whose logits only its grammar changes (:func:`argmax_decides`) takes the
    argmax of all its rows in one call and asks the grammar about each in turn (a few
    microseconds), and about the next best few of a row whose argmax it refuses
    (:func:`best_allowed`); a row they cannot decide, and every other request, goes through
    :func:`sample_and_append` one row at a time (~0.3 ms a row: a logits copy and a sampler
    call each). Both give the same tokens.

    Returns (the tokens produced, the finish reason or None)."""
    best = None
    if not req.logprobs.return_logprob:
        req.sampling.banned_ids = req.banned_ids()
        if argmax_decides(req.sampling):
            best = argmax_rows(logits[rows.start:rows.stop]).tolist()
    produced: list[int] = []
    reason = None
    for i, row in enumerate(rows):
        tok = best[i] if best is not None and not req.banned_ids() else None
        if tok is not None and req.grammar is not None:
            tok = best_allowed(logits[row], req.grammar, tok)  # the masked argmax, or None
        if tok is not None:
            req.output_ids.append(tok)
            reason = check_finished(req, tok, context_len)
        else:
            (_, tok, reason), = sample_and_append(sampler, [(req, row)], logits, context_len)
        produced.append(tok)
        if reason is not None or i >= len(req.draft) or tok != req.draft[i]:
            break
    return produced, reason


def check_finished(req: Req, tok: int, context_len: int) -> FinishReason | None:
    """Stop conditions on token ids after appending ``tok`` (stop strings are matched on text
    by the front ends, which then abort the request); advances the grammar. A grammar that
    rejects the token (every token was masked: the grammar dead-ends here, or min_tokens /
    logit_bias banned all it allows) ends the request with a 400 error."""
    p = req.params
    if req.grammar is not None:
        if not req.grammar.accept(tok):
            return FinishReason("error", status=400, message=(
                f"the constraint allows no next token after {len(req.output_ids) - 1} output "
                "tokens: the grammar dead-ends there for this model's vocabulary, or min_tokens, "
                "logit_bias or stop_token_ids banned every token it allows"))
        if req.grammar.terminated:  # it accepted a stop token: the constrained output is done
            return FinishReason("stop", matched=tok)
    if tok in p.stop_token_ids or (tok in req.eos_ids and not p.ignore_eos):
        return FinishReason("stop", matched=tok)
    if len(req.output_ids) >= p.max_new_tokens or req.fill_len >= context_len:
        return FinishReason("length")
    return None


def set_draft(req: Req, tok: int, context_len: int, jump_forward_tokenizer: Any = None,
              speculative_ngram: int = 0) -> None:
    """``req.draft`` after its last token ``tok`` (which :func:`check_finished` accepted):
    with ``jump_forward_tokenizer``, the tokens its grammar forces next
    (:mod:`server.constrained.jump_forward`); where it forces none and ``speculative_ngram`` is set,
    a prompt-lookup draft of up to that many tokens (:mod:`server.scheduler.ngram`), cut where
    the grammar would reject it; else none."""
    p = req.params
    req.draft = []
    room = min(p.max_new_tokens - len(req.output_ids), context_len - req.fill_len - 1)
    if req.grammar is not None and jump_forward_tokenizer is not None:
        req.draft = draft_tokens(req.grammar, jump_forward_tokenizer, tok, room)
        req.draft_source = "jump_forward"
    if not req.draft and speculative_ngram:
        draft = ngram_draft(req.fill_ids, min(room, speculative_ngram))
        req.draft = draft if req.grammar is None else accepted_prefix(req.grammar, draft)
        req.draft_source = "ngram"


def opening_draft(req: Req, context_len: int, jump_forward_tokenizer: Any = None) -> list[int]:
    """The tokens ``req``'s grammar forces before its first output token (a JSON schema's
    ``{"name": "``), drafted after its prompt's last token so that its prompt's pass verifies
    them (:mod:`server.constrained.jump_forward`) instead of a pass of their own; [] without
    jump-forward or a grammar, once the request has output, or when the pass must read its
    prompt's rows (prompt logprobs, embeddings)."""
    if (jump_forward_tokenizer is None or req.grammar is None or req.output_ids or req.embed
            or req.wants_input_logprobs or req.pools_every_row):
        return []
    room = min(req.params.max_new_tokens, context_len - req.fill_len - 1)
    return draft_tokens(req.grammar, jump_forward_tokenizer, req.input_ids[-1], room)


def native_output(req: Req, text: "OutputText") -> dict:
    """The native ``/generate`` response of a finished request as the offline Engine returns it
    (``{"text", "output_ids", "meta_info"}``; logprob entries ``(logprob, token_id, None)``),
    cut at a stop string ``text`` (a :class:`server.detokenizer.OutputText`) matched: tokens
    the scheduler produced past it are dropped."""
    n = text.num_tokens
    meta: dict[str, Any] = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": n,
        "cached_tokens": req.cached_tokens,
        "finish_reason": text.finish_reason,
        "e2e_latency": req.finish_time - req.arrival_time,  # seconds, this request
    }
    if req.logprobs.return_logprob:  # SGLang's entries: (logprob, token_id, text or None)
        meta["output_token_logprobs"] = _entries(req.output_token_logprobs[:n])
        meta["input_token_logprobs"] = _entries(req.input_token_logprobs)
        if req.logprobs.top_logprobs_num:
            meta["output_top_logprobs"] = [_entries(t) for t in req.output_top_logprobs[:n]]
            meta["input_top_logprobs"] = [_entries(t) for t in req.input_top_logprobs]
    return {"text": text.text, "output_ids": list(req.output_ids[:n]), "meta_info": meta}


def _entries(pairs) -> list[tuple[float | None, int, None]]:
    return [(lp, tok, None) for lp, tok in pairs]
