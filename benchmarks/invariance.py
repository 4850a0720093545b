"""Batch invariance, measured: does a request's greedy output depend on what shares its forward
passes? Runs the same prompts alone (radix cache off), then all together, with chunked prefill,
with decodes riding along a prefill (mixed chunks) and from cached prefixes, and counts the
requests whose tokens and logprobs stay bitwise equal to their solo run.

    python -m benchmarks.invariance [--model M] [--device cuda] [--attention-backends a,b]
                                    [--dtype auto] [--quantization auto] [--prompts 16]

    python -m benchmarks.invariance --kernels --device cuda --attention-backends triton,flashinfer

The CPU default is invariant by construction (tests/model/test_batch_invariance.py asserts it);
this reports what holds elsewhere (CUDA backends, dense weights), where no flag makes it so.
``--kernels`` asks the same of each kernel alone (bf16 ``F.linear``, the backend's RMSNorm,
decode and extend attention), to say which kernel breaks it.
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


def _attend(backend, pool_k, pool_v, table, rows, prefix, extend, q):
    """One pass of ``backend`` over sequences in table ``rows``; the new tokens' K/V written are
    the pool's own values, so every pass sees the same pool. Returns [T, H, D]."""
    import torch

    from kernels.base import AttentionInputs

    loc = torch.cat([table[r, p:p + e] for r, p, e in zip(rows, prefix, extend)])
    backend.begin(AttentionInputs(is_decode=set(extend) == {1}, req_to_token=table, req_rows=rows,
                                  prefix_lens=prefix, extend_lens=extend, out_cache_loc=loc))
    backend.store_kv(0, pool_k[loc].clone(), pool_v[loc].clone())
    return backend.attend(0, q, q.shape[-1] ** -0.5)


def kernel_rows(name: str, device: str) -> list[list[str]]:
    """[kernel, case, bitwise-equal outputs] rows for one attention backend ("triton",
    "flashinfer", else the reference) on ``device``: decode and extend attention and RMSNorm,
    Llama-3-8B's attention shape (32 query heads, 8 KV heads, head_dim 128), bf16, K/V slots
    shuffled over an 8,192-slot pool. (bf16 ``F.linear``: :func:`linear_rows`.)"""
    import torch

    torch.manual_seed(0)
    dt, hq, hkv, d, cap = torch.bfloat16, 32, 8, 128, 8192
    k = torch.randn(cap, hkv, d, device=device).to(dt)
    v = torch.randn(cap, hkv, d, device=device).to(dt)
    if name == "triton":
        from kernels.triton import TritonAttention as Backend
    elif name == "flashinfer":
        from kernels.flashinfer import FlashInferAttention as Backend
    else:
        from kernels.reference import ReferenceAttention as Backend
    be = Backend([k], [v])
    lens = [37, 100, 512, 1000, 3, 260, 777, 64]
    table = torch.zeros(len(lens) + 1, 1024, dtype=torch.int64, device=device)
    perm = torch.randperm(cap - 1, device=device) + 1
    for i, n in enumerate(lens):
        table[i + 1, :n] = perm[i * 1024:i * 1024 + n]
    rows = list(range(1, len(lens) + 1))
    qs = [torch.randn(n, hq, d, device=device).to(dt) for n in lens]

    def equal(a, b) -> str:
        return f"{sum(torch.equal(x, y) for x, y in zip(a, b))}/{len(a)}"

    out = []
    # decode: each sequence's last token alone vs all 8 in one pass
    qd = torch.stack([q[-1] for q in qs])
    alone = [_attend(be, k, v, table, [r], [n - 1], [1], qd[i:i + 1])[0]
             for i, (r, n) in enumerate(zip(rows, lens))]
    both = _attend(be, k, v, table, rows, [n - 1 for n in lens], [1] * len(lens), qd)
    out.append([name, "decode: 8 sequences batched vs alone", equal(list(both), alone)])
    # the same token by the extend path (a verify pass, a mixed chunk) vs the decode path
    ext = [_attend(be, k, v, table, [r], [n - 2], [2], qs[i][-2:])[1]
           for i, (r, n) in enumerate(zip(rows, lens)) if n >= 2]
    out.append([name, "last token: extend of 2 vs decode", equal(ext, [a for a, n in
                                                                      zip(alone, lens) if n >= 2])])
    # extend: whole prompt alone vs all 8 prompts in one pass, and vs a cached prefix
    whole = [_attend(be, k, v, table, [r], [0], [n], qs[i]) for i, (r, n) in
             enumerate(zip(rows, lens))]
    batch = _attend(be, k, v, table, rows, [0] * len(lens), lens, torch.cat(qs)).split(lens)
    out.append([name, "extend: 8 prompts batched vs alone", equal(list(batch), whole)])
    cut = [n // 2 for n in lens]
    hit = [_attend(be, k, v, table, [r], [c], [n - c], qs[i][c:]) for i, (r, n, c) in
           enumerate(zip(rows, lens, cut))]
    out.append([name, "extend: second half after a cached first half vs whole",
                equal(hit, [w[c:] for w, c in zip(whole, cut)])])
    x = torch.randn(64, 4096, device=device).to(dt)
    wn = torch.randn(4096, device=device).to(dt)
    full = be.rms_norm(x, wn, 1e-5)
    out.append([name, "rms_norm: 64 rows vs each alone",
                equal(list(full), [be.rms_norm(x[i:i + 1], wn, 1e-5)[0] for i in range(64)])])
    return out


LINEAR_SHAPES = [(4096, 14336), (2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048),
                 (2048, 128256)]  # (in, out): Llama-3-8B's up; Llama-3.2-1B's qkv, o, gate/up, down, lm_head


def linear_rows(device: str) -> list[list[str]]:
    """bf16 ``F.linear`` [M, in] x [out, in]^T: is row 0 bitwise the same for every M?"""
    import torch

    torch.manual_seed(0)
    ms = [2, 3, 4, 8, 16, 32, 64, 128, 256]
    rows = []
    for k, n in LINEAR_SHAPES:
        w = torch.randn(n, k, device=device).to(torch.bfloat16)
        x = torch.randn(256, k, device=device).to(torch.bfloat16)
        one = torch.nn.functional.linear(x[:1], w)[0]
        same = [m for m in ms if torch.equal(torch.nn.functional.linear(x[:m], w)[0], one)]
        rows.append([f"F.linear bf16 {k}->{n}", "row 0 at M = 1 vs M in " + ",".join(map(str, ms)),
                     f"{len(same)}/{len(ms)} (equal at M = {','.join(map(str, same)) or 'none'})"])
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
    ap.add_argument("--kernels", action="store_true", help="each kernel alone instead of the "
                    "engine (attention backends triton, flashinfer or reference)")
    args = ap.parse_args()
    if args.kernels:
        rows = linear_rows(args.device)
        for backend in filter(None, args.attention_backends.split(",")):
            rows += kernel_rows(backend, args.device)
        print(f"device {args.device}: bitwise equal outputs, bf16")
        print_table(["kernel", "case", "bitwise equal"], rows)
        return
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
