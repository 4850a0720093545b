"""A LangChain chain with structured output over 100 inputs, side by side in one run:
``prompt | ChatSGLang.with_structured_output(CityFacts)`` against the bundled server, and the same
chain with ``ChatOpenAI(base_url=...)`` (langchain-openai) against the same server started with
``--disable-radix-cache`` (a generic OpenAI-compatible server).

    python -m benchmarks.langchain_pipeline [--n 100] [--concurrency 8]

Inputs: Wikipedia city pages (../shared/data/city_pages) in 600-character windows, after a long
shared system prompt with two worked examples. Reports programs/s, validation failures
(exceptions or objects that do not validate) and the server's cache hit rate.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import time

import httpx
import pydantic
from langchain_core.messages import SystemMessage
from langchain_core.prompts import ChatPromptTemplate

import sgl_adapters as sgl
from benchmarks.common import print_table, shared_data_dir
from sgl_adapters.langchain import ChatSGLang

SYSTEM = (
    "You extract facts about a city from the start of its Wikipedia page. Give the city's name "
    "as the page writes it, the country it is in, its population as a whole number (0 when the "
    "page does not say) and whether it lies on a sea coast. Answer with JSON only.\n\n"
    "Example page: Lyon is the third-largest city of France, with 522,000 inhabitants, on the "
    "Rhone and Saone rivers.\nExample answer: {\"name\": \"Lyon\", \"country\": \"France\", "
    "\"population\": 522000, \"coastal\": false}\n\n"
    "Example page: Valparaiso is a major city, seaport and naval base of Chile, with about "
    "296,000 people.\nExample answer: {\"name\": \"Valparaiso\", \"country\": \"Chile\", "
    "\"population\": 296000, \"coastal\": true}")


class CityFacts(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: int = pydantic.Field(ge=0)
    coastal: bool


def pages(n: int) -> list[str]:
    data = shared_data_dir()
    if data is None:
        raise SystemExit("needs ../shared/data/city_pages next to the repository")
    docs = []
    for name in ("wikipedia_cities_2024_api_extract", "wikipedia_cities_2018_rendered"):
        with gzip.open(os.path.join(data, "city_pages", f"{name}.jsonl.gz"), "rt") as f:
            docs += [json.loads(line)["document"] for line in f]
    # 92 pages: their first 600 characters, then the next 600 of the longest ones
    windows = [d[:600] for d in docs] + [d[600:1200] for d in sorted(docs, key=len, reverse=True)]
    return windows[:n]


def run(label: str, llm, inputs: list[str], concurrency: int, base_url: str) -> list[str]:
    httpx.post(base_url + "/flush_cache", timeout=30)
    before = httpx.get(base_url + "/server_info", timeout=30).json()["metrics"]
    chain = (ChatPromptTemplate.from_messages([SystemMessage(SYSTEM), ("human", "Page: {page}")])
             | llm.with_structured_output(CityFacts))
    start = time.perf_counter()
    outs = chain.batch([{"page": p} for p in inputs], config={"max_concurrency": concurrency},
                       return_exceptions=True)
    seconds = time.perf_counter() - start
    after = httpx.get(base_url + "/server_info", timeout=30).json()["metrics"]
    failures = sum(not isinstance(o, CityFacts) for o in outs)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    return [label, str(len(inputs)), f"{seconds:.1f}", f"{len(inputs) / seconds:.2f}",
            str(failures), f"{cached / prompt:.3f}" if prompt else "-"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=8)
    args = ap.parse_args()
    try:
        from langchain_openai import ChatOpenAI
    except ImportError:
        raise SystemExit("pip install 'langchain-openai>=1,<2' for the ChatOpenAI baseline")
    inputs = pages(args.n)
    with sgl.Runtime(max_total_tokens=32768) as rt, \
            sgl.Runtime(max_total_tokens=32768, disable_radix_cache=True) as plain:
        rows = [
            run("ChatSGLang", ChatSGLang(base_url=rt.base_url, temperature=0, max_tokens=96),
                inputs, args.concurrency, rt.base_url),
            run("ChatOpenAI, no radix cache", ChatOpenAI(
                base_url=plain.base_url + "/v1", api_key="EMPTY", model="default",
                temperature=0, max_tokens=96), inputs, args.concurrency, plain.base_url),
        ]
    print(f"{args.n} city pages (600 chars) -> CityFacts, shared system prompt with 2 examples, "
          f"{args.concurrency} concurrent, default model")
    print_table(["chain", "inputs", "seconds", "inputs/s", "validation failures",
                 "cache hit rate"], rows)


if __name__ == "__main__":
    main()
