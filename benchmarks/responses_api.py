"""Multi-turn RAG conversations three ways: chat completions, the Responses API with the whole
history resent, and the Responses API chained with ``previous_response_id``.

    python -m benchmarks.responses_api [--conversations 12] [--turns 3] [--reps 2]

Each conversation is one passage of the main job's corpus (``instructions``: answer from it)
and ``--turns`` of the SQuAD questions asked about that passage, one after the other, greedy,
on the default model; one conversation at a time. The three modes run against one server, the
radix cache flushed before each mode, in the order chat, full, chained, ``--reps`` times.
Reports per turn: request latency, request body bytes, prompt and cached tokens, and whether
the answers are the same text in every mode (they must be: the same prompt, greedy).

Why: ``previous_response_id`` saves the client from resending the conversation; the server
rebuilds it from its store and the radix cache reuses its KV, so it must cost no more than
chat and answer exactly the same.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

import httpx

from benchmarks.common import print_table
from examples.rag.data import load

MODES = ("chat", "responses-full", "responses-chained")
MAX_TOKENS = 32


def conversations(n: int, turns: int) -> list[tuple[str, list[str]]]:
    """(passage text, questions) for the first ``n`` passages with >= ``turns`` questions
    (12 passages of the corpus have 3 or more SQuAD questions, 4 have 4)."""
    passages, questions = load(None)
    text = {p.id: p.text for p in passages}
    by_passage = defaultdict(list)
    for q in questions:
        if q.answer_type == "span":
            by_passage[q.gold_passage_id].append(q.question)
    picked = [(text[pid], qs[:turns]) for pid, qs in sorted(by_passage.items())
              if len(qs) >= turns and pid in text]
    return picked[:n]


def run_mode(c: httpx.Client, mode: str, convs) -> tuple[list[dict], list[list[str]]]:
    """One pass over every conversation; (per-turn records, answers per conversation)."""
    records, answers = [], []
    for passage, qs in convs:
        instructions = "Answer the question from this passage in a few words.\n\n" + passage
        history: list[dict] = []
        previous = None
        said = []
        for q in qs:
            history.append({"role": "user", "content": q})
            if mode == "chat":
                body = {"messages": [{"role": "system", "content": instructions}, *history],
                        "max_tokens": MAX_TOKENS, "temperature": 0}
                route = "/v1/chat/completions"
            else:
                body = {"instructions": instructions, "max_output_tokens": MAX_TOKENS,
                        "temperature": 0,
                        "input": history if mode == "responses-full" else q}
                if mode == "responses-chained" and previous is not None:
                    body["previous_response_id"] = previous
                route = "/v1/responses"
            raw = json.dumps(body).encode()
            t0 = time.perf_counter()
            r = c.post(route, content=raw, headers={"content-type": "application/json"})
            dt = time.perf_counter() - t0
            r.raise_for_status()
            data = r.json()
            if mode == "chat":
                text = data["choices"][0]["message"]["content"]
                u = data["usage"]
                prompt, cached = u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
            else:
                text = "".join(p["text"] for o in data["output"] if o["type"] == "message"
                               for p in o["content"])
                u = data["usage"]
                prompt, cached = u["input_tokens"], u["input_tokens_details"]["cached_tokens"]
                previous = data["id"]
            history.append({"role": "assistant", "content": text})
            said.append(text)
            records.append({"latency": dt, "bytes": len(raw), "prompt": prompt,
                            "cached": cached})
        answers.append(said)
    return records, answers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    import sgl_adapters as sgl

    convs = conversations(args.conversations, args.turns)
    rt = sgl.Runtime(max_total_tokens=32768)
    results: dict[str, list[dict]] = defaultdict(list)
    answers: dict[str, list] = {}
    try:
        with httpx.Client(base_url=rt.base_url, timeout=300) as c:
            for _ in range(args.reps):
                for mode in MODES:
                    c.post("/flush_cache").raise_for_status()
                    records, said = run_mode(c, mode, convs)
                    results[mode] += records
                    answers.setdefault(mode, said)
    finally:
        rt.shutdown()
    same = sum(a == b == d for a, b, d in zip(*(answers[m] for m in MODES)))
    rows = []
    for mode in MODES:
        rs = results[mode]
        rows.append([mode, f"{statistics.mean(r['latency'] for r in rs) * 1000:.0f}",
                     f"{statistics.median(r['latency'] for r in rs) * 1000:.0f}",
                     f"{statistics.mean(r['bytes'] for r in rs):.0f}",
                     f"{statistics.mean(r['prompt'] for r in rs):.0f}",
                     f"{sum(r['cached'] for r in rs) / sum(r['prompt'] for r in rs):.3f}"])
    print(f"{len(convs)} conversations x {args.turns} turns, {args.reps} reps, greedy, "
          f"max {MAX_TOKENS} tokens; answers identical in all modes: {same}/{len(convs)}")
    print_table(["mode", "mean latency ms", "p50 ms", "request bytes", "prompt tokens",
                 "cached fraction"], rows)


if __name__ == "__main__":
    main()
