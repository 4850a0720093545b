"""The essay judge of the SGLang paper (Fig. 2): branch-solve-merge as a program of the language.

    python -m examples.essay_judge [--base-url URL] [--n 2]

A relevance ``select``, three forked judgments (one per dimension, sharing the essay's prefix in
the cache), a merge into a summary, a letter grade constrained by a regex, and a JSON record
constrained by a schema. Essays come from ../shared/data/llm_judge (SGLang's
benchmark/llm_judge) when it is there, otherwise a short built-in essay. Without ``--base-url``
the bundled server is started on the default model.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import sgl_adapters as sgl

DIMENSIONS = ("clarity", "organization", "evidence")
ESSAY_CHARS = 1500  # keeps prompts well inside the default model's context
RESULT_SCHEMA = {
    "type": "object",
    "properties": {
        "related": {"type": "boolean"},
        "grade": {"type": "string", "pattern": "^[A-F]$"},
        "strength": {"type": "string", "maxLength": 80},
    },
    "required": ["related", "grade", "strength"],
    "additionalProperties": False,
}
BUILTIN_ESSAY = (
    "Why cities should plant more trees\n\nTrees cool streets in summer: shaded asphalt can be "
    "more than ten degrees cooler than asphalt in the sun. They also slow storm water, so drains "
    "overflow less often after heavy rain. Critics say trees are expensive to maintain, but the "
    "savings on cooling and drainage repay the cost within a few decades. Cities that want "
    "healthier, calmer neighbourhoods should plant and protect more trees.")


@sgl.function
def essay_judge(s, essay: str):
    s += sgl.system("You are an expert essay grader. Answer briefly.")
    with s.user():
        s += "Essay:\n" + essay + "\n\nIs this text an essay that argues a point? Answer yes or no."
    s += sgl.assistant(sgl.select("related", ["yes", "no"]))
    forks = s.fork(len(DIMENSIONS))
    for f, dim in zip(forks, DIMENSIONS):
        f += sgl.user(f"Judge the essay's {dim} in one or two sentences.")
        f += sgl.assistant(sgl.gen("judgment", max_tokens=48, stop="\n\n"))
    forks.join()
    with s.user():
        s += "Judgments:\n"
        for dim, judgment in zip(DIMENSIONS, s["judgment"]):
            s += f"- {dim}: " + judgment + "\n"
        s += "Summarize these judgments in one sentence."
    s += sgl.assistant(sgl.gen("summary", max_tokens=48, stop="\n"))
    s += sgl.user("Give the essay a letter grade from A to F.")
    s += sgl.assistant("Grade: " + sgl.gen("grade", regex="[A-F]"))
    s += sgl.user("Output the result as JSON with keys related, grade and strength.")
    s += sgl.assistant(sgl.gen("result", json_schema=RESULT_SCHEMA, max_tokens=96))


def load_essays(n: int) -> list[str]:
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))), "shared", "data", "llm_judge", "articles.jsonl")
    if not os.path.exists(path):
        return [BUILTIN_ESSAY][:n]
    with open(path) as f:
        return [json.loads(line)[:ESSAY_CHARS] for line in f][:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="a running bundled server (default: start one)")
    ap.add_argument("--n", type=int, default=2, help="essays to judge")
    args = ap.parse_args()
    backend = (sgl.RuntimeEndpoint(args.base_url) if args.base_url
               else sgl.Runtime(max_total_tokens=16384))
    try:
        essays = load_essays(args.n)
        start = time.perf_counter()
        states = essay_judge.run_batch([{"essay": e} for e in essays], backend=backend,
                                       temperature=0)
        for essay, s in zip(essays, states):
            if s.error():
                print(f"error: {s.error()}")
                continue
            print(f"== {essay.splitlines()[0][:70]}")
            print(f"related: {s['related']}; grade: {s['grade']}; summary: {s['summary']}")
            print(f"JSON: {json.loads(s['result'])}")
        print(f"{len(essays)} essays in {time.perf_counter() - start:.1f} s")
    finally:
        backend.shutdown()


if __name__ == "__main__":
    main()
