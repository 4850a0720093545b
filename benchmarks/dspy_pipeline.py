"""A DSPy classification program (MMLU, 5-shot demos, ``Literal['A','B','C','D']`` answer) over
100 questions, three ways side by side in one run:

  (a) SGLangLM with lowering (the answer is a ``select``; markers are constants),
  (b) SGLangLM with lowering off (plain ChatAdapter text, parsed by DSPy; JSONAdapter fallback
      on parse failures),
  (c) ``dspy.LM("openai/...")`` through DSPy's own OpenAI-compatible route at the same server
      started with ``--disable-radix-cache`` (what a DSPy user gets from a generic server).

    python -m benchmarks.dspy_pipeline [--n 100] [--threads 8]

Reports programs/s, LM calls, tokens decoded, parse failures (predictions DSPy could not
produce), accuracy and the cache hit rate (cached / prompt tokens over the LM's history).
"""

from __future__ import annotations

import argparse
import csv
import os
import time
from typing import Literal

import dspy

import sgl_adapters as sgl
from benchmarks.common import print_table, shared_data_dir
from sgl_adapters.dspy import SGLangLM

SUBJECTS = ("high_school_geography", "marketing")


class MultipleChoice(dspy.Signature):
    """Answer the multiple choice question with the letter of the correct choice."""

    question: str = dspy.InputField()
    choices: str = dspy.InputField()
    answer: Literal["A", "B", "C", "D"] = dspy.OutputField()


def _example(row: list[str]) -> dspy.Example:
    choices = "\n".join(f"{c}. {row[i + 1]}" for i, c in enumerate("ABCD"))
    return dspy.Example(question=row[0], choices=choices, answer=row[5]).with_inputs(
        "question", "choices")


def load(n: int) -> list[tuple[list[dspy.Example], list[dspy.Example]]]:
    """Per subject: (5 demos from dev, test examples); n questions in all."""
    data = shared_data_dir()
    if data is None:
        raise SystemExit("needs ../shared/data/mmlu next to the repository")
    out = []
    for subject in SUBJECTS:
        rows = {}
        for split in ("dev", "test"):
            with open(os.path.join(data, "mmlu", split, f"{subject}_{split}.csv"), newline="") as f:
                rows[split] = [_example(r) for r in csv.reader(f)]
        out.append((rows["dev"][:5], rows["test"][:n // len(SUBJECTS)]))
    return out


def run(label: str, lm: dspy.LM, data, threads: int, server: sgl.RuntimeEndpoint) -> list[str]:
    server.flush_cache()  # each config starts cold
    correct = failures = total = 0
    start = time.perf_counter()
    with dspy.context(lm=lm, adapter=None):
        for demos, tests in data:
            program = dspy.Predict(MultipleChoice)
            program.demos = demos
            preds = program.batch(tests, num_threads=threads, max_errors=len(tests),
                                  provide_traceback=False, disable_progress_bar=True)
            for ex, pred in zip(tests, preds):
                total += 1
                answer = getattr(pred, "answer", None) if pred is not None else None
                failures += answer is None
                correct += answer == ex.answer
    seconds = time.perf_counter() - start
    usages = [h.get("usage") or {} for h in lm.history]
    decoded = sum(u.get("completion_tokens") or 0 for u in usages)
    prompt = sum(u.get("prompt_tokens") or 0 for u in usages)
    cached = sum(((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
                 for u in usages)
    return [label, str(total), f"{seconds:.1f}", f"{total / seconds:.2f}", str(len(lm.history)),
            str(decoded), str(failures), f"{correct / total:.3f}",
            f"{cached / prompt:.3f}" if prompt else "-"]


class MultipleChoiceConfidence(dspy.Signature):
    """Answer the multiple-choice question and say how sure you are (0 to 1)."""

    question: str = dspy.InputField()
    choices: str = dspy.InputField()
    answer: Literal["A", "B", "C", "D"] = dspy.OutputField()
    confidence: float = dspy.OutputField()


def run_cot(label: str, lm: dspy.LM, data, threads: int, url: str) -> list[str]:
    """A 3-output-field ChainOfThought (reasoning, answer, confidence): server requests,
    prompt tokens per question (as the server counted them) and parse failures."""
    import httpx

    def metrics() -> dict:
        return httpx.get(url + "/server_info").json()["metrics"]

    before = metrics()
    failures = total = 0
    with dspy.context(lm=lm, adapter=None):
        for _, tests in data:
            preds = dspy.ChainOfThought(MultipleChoiceConfidence).batch(
                tests, num_threads=threads, max_errors=10 ** 6, provide_traceback=False,
                disable_progress_bar=True)
            for pred in preds:
                total += 1
                failures += pred is None or getattr(pred, "answer", None) is None \
                    or not isinstance(getattr(pred, "confidence", None), float)
    after = metrics()
    requests = after["finished_requests"] - before["finished_requests"]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return [label, str(total), f"{requests / total:.2f}", f"{prompt / total:.0f}",
            str(failures)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--openai-target-only", action="store_true",
                    help="run only (d): SGLangLM(backend='openai') vs dspy.LM on a generic "
                         "OpenAI endpoint")
    args = ap.parse_args()
    data = load(args.n)
    if args.openai_target_only:
        return openai_target(data, args)
    with sgl.Runtime(max_total_tokens=32768) as rt, \
            sgl.Runtime(max_total_tokens=32768, disable_radix_cache=True) as plain:
        common = {"cache": False, "temperature": 0.0, "max_tokens": 64}
        rows = [
            run("(a) SGLangLM, lowering", SGLangLM(base_url=rt.base_url, **common), data,
                args.threads, rt),
            run("(b) SGLangLM, lowering off", SGLangLM(base_url=rt.base_url, lowering=False,
                                                       **common), data, args.threads, rt),
            run("(c) dspy.LM openai route, no radix cache",
                dspy.LM("openai/default", api_base=plain.base_url + "/v1", api_key="EMPTY",
                        num_retries=0, **common), data, args.threads, plain),
        ]
    print(f"MMLU ({', '.join(SUBJECTS)}), {args.n} questions, 5-shot demos, dspy.Predict, "
          f"{args.threads} threads, default model")
    print_table(["config", "programs", "seconds", "programs/s", "LM calls", "tokens decoded",
                 "parse failures", "accuracy", "cache hit rate"], rows)



def openai_target(data, args) -> None:
    """(d) Our /v1 with the radix cache off acting as "some OpenAI server"."""
    with sgl.Runtime(max_total_tokens=32768, disable_radix_cache=True) as plain:
        common = {"cache": False, "temperature": 0.0, "max_tokens": 128}
        rows = [
            run_cot("SGLangLM(backend='openai')", SGLangLM(
                "default", base_url=plain.base_url + "/v1", backend="openai", **common),
                data, args.threads, plain.base_url),
            run_cot("dspy.LM('openai/default')", dspy.LM(
                "openai/default", api_base=plain.base_url + "/v1", api_key="EMPTY",
                num_retries=0, **common), data, args.threads, plain.base_url),
        ]
    print(f"(d) ChainOfThought(question, choices -> reasoning, answer: Literal, confidence: "
          f"float), MMLU, {sum(len(t) for _, t in data)} questions, {args.threads} threads, "
          "our /v1 with the radix cache off as a generic OpenAI endpoint")
    print_table(["LM", "questions", "requests / question", "prompt tokens / question",
                 "parse failures"], rows)


if __name__ == "__main__":
    main()
