"""Constrained JSON decoding with jump-forward on vs off, side by side in one run (SGLang paper
§4 "json_decode_regex" / city mode): a Wikipedia city page (../shared/data/city_pages) cut to a
fixed length, then a JSON object with several constrained fields.

    python -m benchmarks.json_decode [--doc-tokens 512] [--in-flight 4] [--repeats 2]
                                     [--speculative-ngram K]

Documents are cached first with prefill-only requests (not timed), so the table measures the
decoding that jump-forward changes. Engines with jump-forward off and on are alternated A/B to
cancel drift. Prints programs/s, forward passes per output token, grammar compile time, and how
many outputs are identical between the two modes. In fp32 they all are (the verified drafts make
jump-forward exact); in bf16 the engine's logits depend on batch shape, so as a control the
benchmark also counts how many outputs stay identical with jump-forward off when only the number
of requests in flight changes.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics

from benchmarks.common import print_table, run_in_flight, shared_data_dir
from server.engine import Engine
from server.model.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "latitude": {"type": "number", "minimum": -90, "maximum": 90},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
        "top 3 landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30},
                            "minItems": 3, "maxItems": 3},
    },
    "required": ["name", "country", "latitude", "population", "top 3 landmarks"],
    "additionalProperties": False,
}


def city_prompts(engine: Engine, doc_tokens: int) -> list[list[int]]:
    data = shared_data_dir()
    if data is None:
        raise SystemExit("needs ../shared/data/city_pages next to the repository")
    path = os.path.join(data, "city_pages", "wikipedia_cities_2018_rendered.jsonl.gz")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f]
    rows = [r for r in rows if r.get("in_sglang_city_list")]
    prompts = []
    for r in rows:
        doc = engine.tokenizer.decode(engine.encode(r["document"])[:doc_tokens])
        prompts.append(engine.encode(engine.apply_chat_template([{"role": "user", "content": (
            f"Here is a Wikipedia page about {r['city']}:\n{doc}\n\nGive the city's name, "
            "country, latitude, population and top 3 landmarks as JSON.")}])))
    return prompts


def json_params() -> SamplingParams:
    """Each program's request: greedy, at most 160 tokens, constrained to SCHEMA."""
    return SamplingParams(max_new_tokens=160, temperature=0, json_schema=SCHEMA)


def run(engine: Engine, prompts, in_flight: int):
    engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0})  # cache the docs
    before = engine.metrics()
    params = json_params()
    reqs, elapsed = run_in_flight(engine, prompts, params, in_flight)
    after = engine.metrics()
    out_tokens = after["generated_tokens"] - before["generated_tokens"]
    passes = after["forward_passes"] - before["forward_passes"]
    return {"seconds": elapsed, "tokens": out_tokens, "passes": passes,
            "outputs": [r.output_ids for r in reqs],
            "valid": sum(_valid(engine.tokenizer.decode(r.output_ids, skip_special_tokens=True))
                         for r in reqs)}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--in-flight", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--speculative-ngram", type=int, default=0, help="add a third engine: "
                    "jump-forward on plus prompt-lookup drafts of up to K tokens (values copied "
                    "from the page)")
    args = ap.parse_args()
    # n-gram drafts pinned off (their default is on where the runner is batch-invariant), so
    # "off" and "on" compare jump-forward alone
    modes = {"off": {"disable_jump_forward": True, "speculative_ngram": 0},
             "on": {"speculative_ngram": 0}}
    if args.speculative_ngram:
        modes[f"on + ngram {args.speculative_ngram}"] = {
            "speculative_ngram": args.speculative_ngram}
    engines = {name: Engine(args.model, max_total_tokens=65536, device=args.device,
                            attention_backend=args.attention_backend, **kw)
               for name, kw in modes.items()}
    prompts = city_prompts(engines["off"], args.doc_tokens)
    results: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(args.repeats):
        for name, eng in engines.items():
            eng.flush_cache()
            results[name].append(run(eng, prompts, args.in_flight))
    rows = []
    for name, rs in results.items():
        secs = statistics.median(r["seconds"] for r in rs)
        r = rs[-1]
        rows.append([f"jump-forward {name}", str(len(prompts)), f"{secs:.1f}",
                     f"{len(prompts) / secs:.2f}", str(r["tokens"]), str(r["passes"]),
                     f"{r['passes'] / r['tokens']:.2f}", f"{r['valid']}/{len(prompts)}"])
    same = _identical(results["off"][-1], results["on"][-1])
    control_in_flight = 1 if args.in_flight != 1 else 4
    engines["off"].flush_cache()
    control = _identical(results["off"][-1], run(engines["off"], prompts, control_in_flight))
    compile_s = engines["on"].grammars.compile_seconds
    print(f"{len(prompts)} city pages cut to {args.doc_tokens} tokens (cached), JSON schema with "
          f"5 fields, greedy, {args.in_flight} in flight, median of {args.repeats} A/B repeats, "
          f"dtype {engines['on'].config.model.dtype}")
    print_table(["mode", "programs", "seconds", "programs/s", "output tokens", "forward passes",
                 "passes/token", "valid JSON"], rows)
    speed = float(rows[1][3]) / float(rows[0][3])
    print(f"jump-forward on vs off: {speed:.2f}x programs/s; identical outputs {same}/"
          f"{len(prompts)}; grammar compile time {compile_s * 1000:.1f} ms (one schema, cached)")
    if args.speculative_ngram:
        name = list(engines)[2]
        st = engines[name].scheduler.stats
        print(f"{name} vs on: {float(rows[2][3]) / float(rows[1][3]):.2f}x programs/s; "
              f"identical outputs {_identical(results['on'][-1], results[name][-1])}/"
              f"{len(prompts)}; drafts accepted {st.accepted_draft_tokens}/{st.draft_tokens} "
              "(jump-forward and n-gram together)")
    print(f"control, jump-forward off at {args.in_flight} vs {control_in_flight} in flight: "
          f"identical outputs {control}/{len(prompts)}")


def _identical(a: dict, b: dict) -> int:
    return sum(x == y for x, y in zip(a["outputs"], b["outputs"]))


if __name__ == "__main__":
    main()
