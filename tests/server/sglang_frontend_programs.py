"""SGLang's own frontend (``import sglang``) against our server, run by
tests/server/test_clients.py in a subprocess: importing sglang patches transformers process-wide,
which must not leak into the other tests. Prints one JSON object of results.

Usage: python -m tests.server.sglang_frontend_programs URL [tiny|chat]
"""

from __future__ import annotations

import json
import sys

import sglang as sgl


@sgl.function
def answer(s, question):
    s += "Q: " + question + "\nA:" + sgl.gen("a", max_tokens=8, temperature=0)


@sgl.function
def long_answer(s, question):
    # 48 tokens: n-gram drafts (up to 8 tokens a step) can produce a short greedy answer of a
    # repetitive random model in one step, and a stream of one step is one piece
    s += "Q: " + question + "\nA:" + sgl.gen("a", max_tokens=48, temperature=0)


@sgl.function
def pick(s):
    s += "The best colour is " + sgl.select("c", choices=["red", "green", "blue"])


@sgl.function
def number(s):
    s += "A number: " + sgl.gen("n", regex=r"[0-9]{3}", max_tokens=8)


@sgl.function
def branches(s):
    s += "Two ideas:\n"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f"Idea {i}:" + sgl.gen("idea", max_tokens=6, temperature=0)
    forks.join()
    s["ideas"] = [f["idea"] for f in forks]


@sgl.function
def parallel_encoding(s, question, contexts):
    # SGLang's test_parallel_encoding: its frontend asks the server to splice the forks' KV
    s += "USER: Please memorize these statements.\n"
    forks = s.fork(len(contexts))
    forks += lambda i: f"Statement {i}: " + contexts[i] + "\n"
    forks.join(mode="concate_and_append")
    s += "Question: " + question + "\nASSISTANT:" + sgl.gen("answer", max_tokens=8,
                                                           temperature=0)


@sgl.function
def scored(s):
    s += "Hello there" + sgl.gen("x", max_tokens=5, temperature=0, return_logprob=True,
                                 top_logprobs_num=2, logprob_start_len=0)


@sgl.function
def chat(s, question):
    s += sgl.system("You are a concise assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("a", max_tokens=24, temperature=0))


def tiny(url: str) -> dict:
    be = sgl.RuntimeEndpoint(url)
    out = {"answer": answer.run(question="what is a radix tree?", backend=be)["a"]}
    p = pick.run(backend=be)
    out["pick"] = p["c"]
    out["pick_meta"] = p.get_meta_info("c")
    out["number"] = number.run(backend=be)["n"]
    b = branches.run(backend=be)
    out["ideas"] = b["ideas"]
    p = parallel_encoding.run(question="Who is the father of Julian?", backend=be, contexts=[
        "Ethan is the father of Liam.", "Noah is the father of Julian."])
    out["parallel_text"], out["parallel_answer"] = p.text(), p["answer"]
    s = scored.run(backend=be)
    out["scored"] = s["x"]
    out["scored_meta"] = s.get_meta_info("x")
    st = long_answer.run(question="stream me", backend=be, stream=True)
    out["stream_pieces"] = list(st.text_iter("a"))
    out["stream_plain"] = long_answer.run(question="stream me", backend=be)["a"]
    batch = answer.run_batch([{"question": q} for q in ("one", "two", "three")], backend=be)
    out["batch"] = [x["a"] for x in batch]
    out["single"] = [answer.run(question=q, backend=be)["a"] for q in ("one", "two", "three")]
    return out


def chat_template(url: str) -> dict:
    guessed = sgl.RuntimeEndpoint(url)
    named = sgl.RuntimeEndpoint(url, chat_template_name="chatml")
    state = chat.run(question="What is the capital of France?", backend=named)
    return {"model_path": guessed.get_model_name(),
            "guessed_template": guessed.get_chat_template().name,
            "answer": state["a"], "text": state.text()}


if __name__ == "__main__":
    url, mode = sys.argv[1], sys.argv[2]
    print(json.dumps(tiny(url) if mode == "tiny" else chat_template(url)))
