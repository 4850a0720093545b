"""Offline engine demo (``make run`` until examples/rag lands in issue [8/9]).

Loads the embedded SmolLM2-135M-Instruct, answers a handful of real reading-comprehension
questions (../shared/data/wiki_rag: SQuAD and BoolQ questions with their gold Wikipedia passage)
in one continuous batch, and prints each answer next to the gold one, then tokens/s.

    python examples/offline_engine.py [--n 8] [--max-new-tokens 48] [--model PATH]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from server.engine import Engine  # noqa: E402

FALLBACK = [  # used when ../shared/data is not next to the repository
    ("The Eiffel Tower was completed in 1889 for the World's Fair in Paris.",
     "When was the Eiffel Tower completed?", "1889"),
    ("Water boils at 100 degrees Celsius at sea level.",
     "At what temperature does water boil at sea level?", "100 degrees Celsius"),
]


def load_questions(n: int) -> list[tuple[str, str, str]]:
    """(passage, question, gold answer) triples, alternating SQuAD spans and BoolQ yes/no."""
    data = os.path.join(os.path.dirname(REPO), "shared", "data", "wiki_rag")
    if not os.path.isdir(data):
        return FALLBACK[:n]
    with gzip.open(os.path.join(data, "passages.jsonl.gz"), "rt") as f:
        passages = {p["id"]: p["text"] for p in map(json.loads, f)}
    with gzip.open(os.path.join(data, "questions.jsonl.gz"), "rt") as f:
        questions = [json.loads(line) for line in f]
    by_type = {t: [q for q in questions if q["answer_type"] == t] for t in ("span", "yes_no")}
    picked = [q for pair in zip(by_type["span"], by_type["yes_no"]) for q in pair][:n]
    return [(passages[q["gold_passage_id"]], q["question"], q["answers"][0]) for q in picked]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()

    start = time.perf_counter()
    engine = Engine(args.model)
    print(f"loaded {engine.model_name} ({engine.config.model.dtype}, KV pool "
          f"{engine.config.cache.max_total_tokens} tokens) in {time.perf_counter() - start:.1f} s")
    items = load_questions(args.n)
    prompts = [engine.apply_chat_template([
        {"role": "system", "content": "Answer the question from the passage, in a few words."},
        {"role": "user", "content": f"Passage: {passage}\n\nQuestion: {question}"}])
        for passage, question, _ in items]
    start = time.perf_counter()
    outs = engine.generate(prompts, {"max_new_tokens": args.max_new_tokens, "temperature": 0})
    elapsed = time.perf_counter() - start
    for (_, question, gold), out in zip(items, outs):
        print(f"\nQ: {question}\n   gold: {gold}\n   model: {out['text'].strip()}")
    prompt_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    new_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    print(f"\n{len(outs)} requests in one batch: {prompt_tokens} prompt + {new_tokens} generated "
          f"tokens in {elapsed:.1f} s = {(prompt_tokens + new_tokens) / elapsed:.0f} tok/s total, "
          f"{new_tokens / elapsed:.1f} generated tok/s")


if __name__ == "__main__":
    main()
