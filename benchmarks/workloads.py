"""The SGLang paper's workloads (§6, Table 1) as programs of the language, on the real data of
../shared/data. Each :class:`Workload` is a program, its per-program arguments, and a score
(accuracy where one is defined). The same program runs on any backend, so the native backend
(fork/select hints, one radix tree) and an OpenAI-compatible endpoint (one request per call, as
the paper's baselines) send the same prompts. :mod:`benchmarks.all` runs them.

Sizes are arguments (``n`` programs); the defaults of :mod:`benchmarks.all` fit ~10 minutes
for three configurations on a 2-core CPU with the default 135M model, so generations are short.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

import sgl_adapters as sgl
from benchmarks.common import shared_data_dir
from benchmarks.json_decode import SCHEMA as CITY_SCHEMA
from benchmarks.prefix_cache import format_example

Score = Callable[[list, list[dict]], float | None]


@dataclass
class Workload:
    """One benchmark: ``program.run_batch(args)`` and ``score(states, args)`` (accuracy in
    [0, 1], or None where the workload has none). ``run`` overrides ``run_batch`` for
    workloads that are not a single language program (the DSPy pipeline)."""

    name: str
    program: Any
    args: list[dict]
    score: Score
    run: Callable[..., list] | None = None


def _data(*parts: str) -> str:
    root = shared_data_dir()
    if root is None:
        raise SystemExit("the paper workloads need ../shared/data next to the repository")
    return os.path.join(root, *parts)


def _jsonl(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f]


def _ok(states: list) -> list:
    return [s if s.error() is None else None for s in states]


# --- MMLU, 5-shot (one gen of one token) ---------------------------------------------------

@sgl.function
def mmlu(s, head: str, question: str):
    s += head + question
    s += sgl.gen("answer", max_tokens=1, temperature=0)


def mmlu_workload(n: int) -> Workload:
    subjects = ("high_school_geography", "marketing", "astronomy", "nutrition")
    args = []
    for subject in subjects:
        rows = {}
        for split in ("dev", "test"):
            with open(_data("mmlu", split, f"{subject}_{split}.csv"), newline="") as f:
                rows[split] = list(csv.reader(f))
        head = (f"The following are multiple choice questions (with answers) about "
                f"{subject.replace('_', ' ')}.\n\n"
                + "".join(format_example(r, True) for r in rows["dev"][:5]))
        args += [{"head": head, "question": format_example(r, False), "gold": r[5]}
                 for r in rows["test"][:-(-n // len(subjects))]]
    golds = [a.pop("gold") for a in args[:n]]

    def score(states, _):
        return _mean(s is not None and s["answer"].strip() == g for s, g in zip(_ok(states), golds))

    return Workload("mmlu", mmlu, args[:n], score)


# --- HellaSwag, 20-shot, select over 4 endings ---------------------------------------------

@sgl.function
def hellaswag(s, shots: str, context: str, endings: list[str]):
    s += shots + context
    s += sgl.select("answer", choices=endings)


def hellaswag_workload(n: int) -> Workload:
    rows = _jsonl(_data("hellaswag", "hellaswag_val.jsonl.gz"))

    def ctx(r: dict) -> str:
        return r["activity_label"] + ": " + r["ctx"] + " "

    shots = "".join(ctx(r) + r["endings"][r["label"]] + "\n\n" for r in rows[:20])
    tests = rows[20:20 + n]
    args = [{"shots": shots, "context": ctx(r), "endings": r["endings"]} for r in tests]

    def score(states, _):
        return _mean(s is not None and s["answer"] == r["endings"][r["label"]]
                     for s, r in zip(_ok(states), tests))

    return Workload("hellaswag", hellaswag, args, score)


# --- ReAct agent: replay recorded HotpotQA traces ------------------------------------------

REACT_INSTRUCTION = (
    "Solve a question answering task with interleaving Thought, Action, Observation steps. "
    "Thought can reason about the current situation, and Action can be three types: \n"
    "(1) Search[entity], which searches the exact entity on Wikipedia and returns the first "
    "paragraph if it exists. If not, it will return some similar entities to search.\n"
    "(2) Lookup[keyword], which returns the next sentence containing keyword in the current "
    "passage.\n(3) Finish[answer], which returns the answer and finishes the task.\n"
    "Here are some examples.\n")


@sgl.function
def react(s, prompt: str, question: str, steps: list[dict]):
    """Each step generates the thought and action; the environment's reply is the recorded
    observation (SGLang benchmark/react: the trace fixes the agent's path)."""
    s += prompt + question + "\n"
    for i, step in enumerate(steps, 1):
        s += f"Thought {i}:" + sgl.gen(f"thought_{i}", max_tokens=24, stop=["\n"])
        s += f"\nAction {i}:" + sgl.gen(f"action_{i}", max_tokens=12, stop=["\n"])
        s += f"\nObservation {i}: {step['observation']}\n"


def react_workload(n: int) -> Workload:
    with open(_data("react", "prompts_naive.json")) as f:
        prompt = REACT_INSTRUCTION + json.load(f)["webthink_simple6"]
    traces = [next(iter(t.items())) for t in _jsonl(_data("react", "hotpotqa_100.jsonl"))][:n]
    args = [{"prompt": prompt, "question": q, "steps": steps} for q, steps in traces]

    def score(states, _):  # agreement of the generated first action with the recorded one
        return _mean(s is not None and s["action_1"].strip() == st[0]["action"].strip()
                     for s, (_, st) in zip(_ok(states), traces))

    return Workload("react", react, args, score)


# --- Tree of thought on GSM8K: fork 3 x 3 levels, majority vote of 27 leaves ---------------

@sgl.function
def tree_of_thought(s, question: str, width: int = 3, depth: int = 3):
    s += "Question: " + question + "\nAnswer: Let's think step by step.\n"
    frontier = [s]
    for _ in range(depth):
        children = []
        for node in frontier:
            forks = node.fork(width)
            for f in forks:
                f += sgl.gen("step", max_tokens=16, stop="\n", temperature=0.7) + "\n"
            children += list(forks)
        frontier = children
    for leaf in frontier:
        leaf += "So the answer is " + sgl.gen("answer", regex=r"-?[0-9]{1,7}", temperature=0)
    s.set_var("answers", [leaf["answer"] for leaf in frontier])


def tot_workload(n: int) -> Workload:
    rows = _jsonl(_data("gsm8k", "test.jsonl"))[:n]
    golds = [r["answer"].split("####")[-1].strip().replace(",", "") for r in rows]

    def score(states, _):
        return _mean(s is not None and Counter(s["answers"]).most_common(1)[0][0] == g
                     for s, g in zip(_ok(states), golds))

    return Workload("tree_of_thought", tree_of_thought, [{"question": r["question"]}
                                                         for r in rows], score)


# --- Branch-solve-merge essay judge ---------------------------------------------------------

def essay_workload(n: int) -> Workload:
    from examples.essay_judge import essay_judge, load_essays

    def score(states, _):  # share of programs whose final JSON parses (the schema forces it)
        return _mean(s is not None and _parses(s["result"]) for s in _ok(states))

    return Workload("essay_judge", essay_judge, [{"essay": e} for e in load_essays(n)], score)


# --- JSON decode: city pages to a constrained JSON object ----------------------------------

@sgl.function
def city_json(s, city: str, document: str):
    with s.user():
        s += (f"Here is a Wikipedia page about {city}:\n{document}\n\nGive the city's name, "
              "country, latitude, population and top 3 landmarks as JSON.")
    s += sgl.assistant(sgl.gen("json", json_schema=CITY_SCHEMA, max_tokens=128, temperature=0))


def json_workload(n: int, doc_chars: int = 2000) -> Workload:
    rows = [r for r in _jsonl(_data("city_pages", "wikipedia_cities_2018_rendered.jsonl.gz"))
            if r.get("in_sglang_city_list")][:n]
    args = [{"city": r["city"], "document": r["document"][:doc_chars]} for r in rows]

    def score(states, _):  # valid JSON share (the grammar makes it 1.0 where enforced)
        return _mean(s is not None and _parses(s["json"]) for s in _ok(states))

    return Workload("json_decode", city_json, args, score)


# --- Multi-turn chat: synthetic 4-turn conversations ---------------------------------------

WORDS = ("river mountain city market garden engine library window signal harbor bridge "
         "forest winter summer planet number letter music theory history science paper "
         "coffee bread stone silver copper train station island valley").split()


@sgl.function
def multi_turn(s, turns: list[str], answer_tokens: int):
    s += sgl.system("You are a helpful assistant. Answer each message.")
    for i, turn in enumerate(turns):
        s += sgl.user(turn)
        s += sgl.assistant(sgl.gen(f"answer_{i}", max_tokens=answer_tokens, temperature=0))


def multi_turn_workload(n: int, answer_tokens: int, name: str) -> Workload:
    rng = random.Random(0)

    def message() -> str:
        return "Tell me about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 80)))

    args = [{"turns": [message() for _ in range(4)], "answer_tokens": answer_tokens}
            for _ in range(n)]
    return Workload(name, multi_turn, args, lambda states, _: None)


# --- DSPy RAG pipeline (examples/rag) ------------------------------------------------------

def dspy_rag_workload(n: int) -> Workload:
    from examples.rag import metrics
    from examples.rag.data import load, mixed
    from examples.rag.retrieval import Retriever

    passages, questions = load()
    questions = mixed(questions, n)
    retriever = Retriever(passages)

    def run(backend_kind: str, base_url: str, threads: int) -> list[str]:
        import dspy

        from examples.rag.pipelines import run_dspy

        lm = None
        if backend_kind == "openai":
            lm = dspy.LM("openai/default", api_base=base_url, api_key="EMPTY", num_retries=0,
                         temperature=0.0, max_tokens=48, cache=False)
        return run_dspy(questions, retriever, 3, base_url, threads=threads, lm=lm)

    def score(answers, _):
        return _mean(metrics.f1(a, q.answers) if q.answer_type == "span"
                     else metrics.yes_no_correct(a, q.answers) for a, q in zip(answers, questions))

    return Workload("dspy_rag", None, [{} for _ in questions], score, run=run)


# --- registry -------------------------------------------------------------------------------

WORKLOADS: dict[str, Callable[[int], Workload]] = {
    "mmlu": mmlu_workload,
    "hellaswag": hellaswag_workload,
    "react": react_workload,
    "tree_of_thought": tot_workload,
    "essay_judge": essay_workload,
    "json_decode": json_workload,
    "multi_turn_short": lambda n: multi_turn_workload(n, 8, "multi_turn_short"),
    "multi_turn_long": lambda n: multi_turn_workload(n, 48, "multi_turn_long"),
    "dspy_rag": dspy_rag_workload,
}


def _mean(values) -> float | None:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else None


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except (TypeError, ValueError):
        return False

