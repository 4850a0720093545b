"""Batch invariance, measured: does a request's greedy output depend on what shares its forward
passes? Runs the same prompts alone (radix cache off), then all together, with chunked prefill,
with decodes riding along a prefill (mixed chunks) and from cached prefixes, and counts the
requests whose tokens and logprobs stay bitwise equal to their solo run.

    python -m benchmarks.invariance [--model M] [--device cuda] [--attention-backends a,b]
                                    [--dtype auto] [--quantization auto] [--prompts 16]

The CPU default is invariant by construction (tests/model/test_batch_invariance.py asserts it);
this reports what holds elsewhere (CUDA backends, dense weights), where no flag makes it so.
"""

from __future__ import annotations

import argparse
import gc
import random

from benchmarks.common import print_table
from server.engine import Engine


def prompts(count: int, vocab: int, seed: int = 21) -> list[list[int]]:
    """Half share a 70-token system prefix (so cache hits happen), half stand alone; 2-120
    tokens each; token ids in [3, vocab)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(70)]
    out = []
    for i in range(count):
        head = system if i % 2 == 0 else []
        out.append(head + [rng.randrange(3, vocab) for _ in range(rng.randrange(2, 50))])
    return out


def _result(out: dict) -> tuple[tuple, tuple]:
    meta = out["meta_info"]
    return tuple(out["output_ids"]), tuple(lp for lp, _, _ in meta["output_token_logprobs"])


def _compare(got: list[tuple], solo: list[tuple]) -> list[str]:
    tokens = sum(g[0] == s[0] for g, s in zip(got, solo))
    exact = sum(g == s for g, s in zip(got, solo))
    diff = max((abs(a - b) for g, s in zip(got, solo) if g[0] == s[0]
                for a, b in zip(g[1], s[1])), default=0.0)
    return [f"{tokens}/{len(solo)}", f"{exact}/{len(solo)}", f"{diff:.2e}"]


def probe(model: str | None, backend: str, args: argparse.Namespace) -> list[list[str]]:
    """One backend's rows: [backend, case, same tokens, bitwise logprobs, max |dlogprob|]."""
    common = {"device": args.device, "attention_backend": backend, "dtype": args.dtype,
              "quantization": args.quantization, "context_length": 1024,
              "max_total_tokens": 16384}
    sp = {"max_new_tokens": args.new_tokens, "temperature": 0, "ignore_eos": True}
    solo_eng = Engine(model, disable_radix_cache=True, **common)
    ps = prompts(args.prompts, solo_eng.arch.vocab_size)
    solo = [_result(solo_eng.generate(input_ids=p, sampling_params=sp, return_logprob=True))
            for p in ps]
    rows = []

    def run(case: str, eng: Engine, warm: bool = False) -> None:
        if warm:
            eng.generate(input_ids=ps, sampling_params={**sp, "max_new_tokens": 1})
        outs = eng.generate(input_ids=ps, sampling_params=sp, return_logprob=True)
        rows.append([backend, case, *_compare([_result(o) for o in outs], solo)])

    run(f"all {len(ps)} in one batch", solo_eng)
    del solo_eng
    for case, kw, warm in (("chunked prefill 32, mixed chunks", {"chunked_prefill_size": 32,
                                                                  "mixed_chunk": True}, False),
                           ("cached prefixes (radix cache on)", {}, True)):
        eng = Engine(model, **kw, **common)
        run(case, eng, warm)
        del eng
        gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backends", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=8)
    args = ap.parse_args()
    rows = []
    for backend in args.attention_backends.split(","):
        rows += probe(args.model, backend, args)
        if args.device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()
    print(f"{args.prompts} prompts (half share a 70-token prefix), greedy, {args.new_tokens} "
          f"new tokens, device {args.device}, dtype {args.dtype}, quantization "
          f"{args.quantization}; compared with each prompt run alone, radix cache off")
    print_table(["attention", "case", "same tokens", "bitwise logprobs", "max |dlogprob|"], rows)


if __name__ == "__main__":
    main()
