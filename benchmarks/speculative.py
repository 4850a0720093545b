"""Prompt-lookup (n-gram) speculative decoding on vs off, side by side in one run.

    python -m benchmarks.speculative [--n 16] [--tokens 48] [--draft 8] [--in-flight 1]

Workload: the main job's span questions (../shared/data/wiki_rag) with their k=3 BM25 passages,
answered by the default model as free text (greedy, ``--tokens`` new tokens, the answer and
whatever the model copies after it). Engines with drafts off and on alternate A/B to cancel
drift. Reports output tok/s, forward passes per output token, the draft acceptance rate
(accepted / proposed draft tokens) and whether the outputs are identical (they must be).
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.common import print_table
from examples.rag.data import load, mixed
from examples.rag.pipelines import SYSTEM, _passages_text
from examples.rag.retrieval import Retriever
from server.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16, help="span questions")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--draft", type=int, default=8, help="draft tokens per step when on")
    ap.add_argument("--in-flight", type=int, default=1, help="questions decoded together")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="auto: the class's own (bf16 on the "
                    "AVX512-BF16/AMX classes, whose dense prefill copies are not "
                    "batch-invariant: outputs can differ there)")
    ap.add_argument("--quantization", default="auto", help="auto: the GGUF's int4 weights on "
                    "the native kernels (batch-invariant: outputs identical); none: dense "
                    "weights on torch's matmuls (not batch-invariant)")
    args = ap.parse_args()
    passages, questions = load(None)
    retriever = Retriever(passages)
    spans = [q for q in mixed(questions, 4 * args.n) if q.answer_type == "span"][:args.n]
    engines = {k: Engine(None, max_total_tokens=32768, speculative_ngram=k, dtype=args.dtype,
                      quantization=args.quantization)
               for k in (0, args.draft)}
    prompts = [engines[0].apply_chat_template([
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"Passages:\n{_passages_text(retriever.search(q.question, 3))}"
                                    f"\n\nQuestion: {q.question}"}]) for q in spans]
    sp = {"max_new_tokens": args.tokens, "temperature": 0}
    for eng in engines.values():  # cache the prompts: the table measures decoding
        eng.generate(prompts, sampling_params={"max_new_tokens": 0})
    rates: dict[int, list[float]] = {k: [] for k in engines}
    outs: dict[int, list] = {}
    for _ in range(args.repeats):
        for k, eng in engines.items():
            eng.scheduler.reset_stats()
            start = time.perf_counter()
            got = []
            for i in range(0, len(prompts), args.in_flight):
                got += [o["output_ids"] for o in eng.generate(prompts[i:i + args.in_flight],
                                                              sampling_params=sp)]
            rates[k].append(sum(map(len, got)) / (time.perf_counter() - start))
            outs[k] = got
    rows = []
    for k, eng in engines.items():
        st = eng.scheduler.stats
        accept = st.accepted_draft_tokens / st.draft_tokens if st.draft_tokens else None
        rows.append([f"{k} (off)" if not k else str(k), f"{statistics.median(rates[k]):.1f}",
                     f"{st.forward_passes / st.generated_tokens:.2f}",
                     "-" if accept is None else f"{accept:.2f}"])
    same = sum(a == b for a, b in zip(outs[0], outs[args.draft]))
    print(f"{len(prompts)} span questions, {args.tokens} tokens each, {args.in_flight} in flight, "
          f"default model ({engines[0].config.model.dtype}); identical outputs: "
          f"{same}/{len(prompts)}")
    print_table(["draft tokens", "output tok/s", "passes / token", "acceptance"], rows)


if __name__ == "__main__":
    main()
