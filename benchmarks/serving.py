"""Serving throughput and latency with N concurrent streaming clients (the real ``openai``
client, /v1/completions), against our server or any OpenAI-compatible one.

    python -m benchmarks.serving [--concurrency 1,16] [--num-prompts 32] [--max-tokens 128]
    python -m benchmarks.serving --base-url http://127.0.0.1:8000/v1 --model NAME

Without ``--base-url`` it starts ``python -m server`` on the default model and stops it after.
Prints requests/s, output tokens/s, TTFT and inter-token latency (ITL) percentiles, and the mean
time per output token (TPOT) per concurrency. ITL is the gap between two streamed chunks; a
server that emits several tokens in one chunk (a verified speculative draft, jump-forward) has
fewer, wider gaps, so compare such servers by TPOT, each request's (latency - TTFT) /
(tokens - 1), as vLLM's benchmark_serving does.
Prompts are wiki_rag passages (../shared/data) cut to about ``--prompt-chars`` characters, so
every server sees the same text whatever its tokenizer; output lengths are fixed with
``ignore_eos`` (and ``min_tokens``) where the server accepts them.
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import statistics
import time

import openai

from benchmarks.common import REPO_ROOT, print_table, shared_data_dir
from sgl_adapters.backends.runtime import Runtime


def prompts(n: int, chars: int) -> list[str]:
    data = shared_data_dir()
    texts = []
    if data:
        with gzip.open(os.path.join(data, "wiki_rag", "passages.jsonl.gz"), "rt") as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
    while len(texts) < n:
        texts.append(f"Passage {len(texts)}: " + "a quiet river runs past the old mill. " * 40)
    return [(t * (chars // max(len(t), 1) + 1))[:chars] + "\n\nSummary:" for t in texts]


async def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    start = time.perf_counter()
    stamps, usage = [], None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": max_tokens})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
        if chunk.usage:
            usage = chunk.usage
    tokens = usage.completion_tokens if usage else len(stamps)
    end = time.perf_counter()
    return {"ttft": stamps[0] - start if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:])],
            # per output token after the first, whatever the chunking
            "tpot": (end - stamps[0]) / (tokens - 1) if stamps and tokens > 1 else None,
            "tokens": tokens, "latency": end - start}


async def run(base_url: str, model: str, texts: list[str], concurrency: int,
              max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "x"),
                                max_retries=0, timeout=600)
    sem = asyncio.Semaphore(concurrency)

    async def bounded(p):
        async with sem:
            return await one_request(client, model, p, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*[bounded(p) for p in texts])
    elapsed = time.perf_counter() - start
    await client.close()
    ttft = sorted(r["ttft"] for r in results)
    itl = sorted(x for r in results for x in r["itl"])
    tpot = [r["tpot"] for r in results if r["tpot"] is not None]

    def pct(xs, q):
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000 if xs else float("nan")

    out_tokens = sum(r["tokens"] for r in results)
    return {"requests/s": len(texts) / elapsed, "output tok/s": out_tokens / elapsed,
            "ttft p50 ms": pct(ttft, 0.5), "ttft p99 ms": pct(ttft, 0.99),
            "itl p50 ms": pct(itl, 0.5), "itl p99 ms": pct(itl, 0.99),
            "mean itl ms": statistics.fmean(itl) * 1000 if itl else float("nan"),
            "mean tpot ms": statistics.fmean(tpot) * 1000 if tpot else float("nan")}


def start_own_server(extra: list[str]) -> Runtime:
    """Our server on a free port (exits with this process); ``.base_url`` once healthy."""
    rt = Runtime(None, extra_args=["--log-level", "warning", *extra], cwd=REPO_ROOT)
    print(next((line.strip() for line in rt.log if "server ready:" in line), rt.base_url))
    return rt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default=None, help="an OpenAI-compatible /v1 URL; default: "
                    "start our server on the default model")
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--server-args", default="", help="extra flags for our server")
    args = ap.parse_args()
    own = None
    base_url = args.base_url
    if base_url is None:
        own = start_own_server(args.server_args.split())
        base_url = own.base_url + "/v1"
    try:
        rows = []
        for c in (int(x) for x in args.concurrency.split(",")):
            n = max(c, args.num_prompts if c > 1 else min(args.num_prompts, 4))
            r = asyncio.run(run(base_url, args.model, prompts(n, args.prompt_chars), c,
                                args.max_tokens))
            rows.append([str(c), str(n)] + [f"{v:.1f}" if "ms" in k or "tok" in k else f"{v:.2f}"
                                            for k, v in r.items()])
        print(f"{base_url}, {args.max_tokens} output tokens per request, prompts ~"
              f"{args.prompt_chars} characters")
        print_table(["clients", "requests", "requests/s", "output tok/s", "TTFT p50 ms",
                     "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "mean ITL ms", "mean TPOT ms"], rows)
    finally:
        if own is not None:
            own.shutdown()


if __name__ == "__main__":
    main()
