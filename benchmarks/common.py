"""Helpers shared by the benchmarks: where the shared data lives, table printing, and the
machine's copy bandwidth."""

from __future__ import annotations

import os
import time
from typing import Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared_data_dir() -> str | None:
    """``$SGL_SHARED_DATA`` if set, else ``../shared/data`` next to the repository (DESIGN.md
    §6); None when absent (e.g. on a GPU machine that received only the checkout)."""
    path = os.environ.get("SGL_SHARED_DATA") or os.path.join(os.path.dirname(REPO_ROOT),
                                                             "shared", "data")
    return path if os.path.isdir(path) else None


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a markdown table (pasteable into README.md)."""
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "| " + " | ".join(f"{{:<{w}}}" for w in widths) + " |"
    print(fmt.format(*header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(fmt.format(*row))


def run_in_flight(engine, prompts, params, in_flight: int):
    """Run ``prompts`` (token-id lists) through an in-process Engine the way concurrent clients
    would: at most ``in_flight`` requests outstanding, a new one submitted as one finishes.

    Returns (finished Req objects in prompt order, elapsed seconds).
    """
    import time
    from collections import deque

    pending = deque(enumerate(prompts))
    reqs: list = [None] * len(prompts)
    active: set[str] = set()

    def submit() -> None:
        while pending and len(active) < in_flight:
            i, prompt = pending.popleft()
            reqs[i] = engine.make_request(prompt, params)
            engine.scheduler.add_request(reqs[i])
            active.add(reqs[i].rid)

    start = time.perf_counter()
    submit()
    for deltas in engine.stream_steps():
        for d in deltas:
            if d.finish_reason is not None:
                active.discard(d.rid)
        submit()
    return reqs, time.perf_counter() - start


def optimal_hit_rate(prompts, sequences=()) -> float:
    """Best achievable cache hit rate for a set of requests (SGLang paper Theorem 3.1): with
    all of them in one radix tree, each tree node (a distinct token prefix) is computed once.

    Args:
        prompts: token-id lists, one per request.
        sequences: (prompt, prompt + generated output) token-id list pairs of generation
            requests: output tokens are computed by decoding, so a later prompt that repeats
            them needs no prefill for them.

    Returns 1 - (prompt-prefix nodes not produced by any decode) / (total prompt tokens).
    """
    def nodes(ids, start=0):
        h, out = 0, []
        for i, t in enumerate(ids):
            h = hash((h, t))
            if i >= start:
                out.append(h)
        return out

    needed: set[int] = set()
    total = 0
    for p in prompts:
        needed.update(nodes(p))
        total += len(p)
    for prompt, seq in sequences:
        needed.difference_update(nodes(seq, len(prompt)))
    return 1 - len(needed) / total if total else 0.0


def read_bandwidth(mib: int = 256, repeats: int = 5) -> float:
    """Measured CPU read bandwidth in GB/s: the best of ``repeats`` sums over a filled
    ``mib``-MiB int64 tensor (torch's threads; what a weight-streaming decode step can reach)."""
    import torch

    x = torch.ones((mib << 20) // 8, dtype=torch.int64)
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.nbytes / best / 1e9


def read_views(tensors) -> list:
    """Flat views of ``tensors`` for timing a plain read of their bytes with ``Tensor.sum``:
    int64 words where a tensor's size allows (a uint8 or bf16 sum widens every element and runs
    ~4x slower than a read), else the tensor as it is. Same storage, no copy."""
    import torch

    return [t.view(-1).view(torch.int64) if t.nbytes % 8 == 0 and t.is_contiguous()
            else t.view(-1) for t in tensors]


def matrix_peaks(n: int = 2048, seconds: float = 1.0) -> dict[str, float]:
    """The CPU's matrix throughput as torch reaches it, in tera-ops per second (a multiply-add
    is 2 ops), on n x n x n products, the best of ``seconds`` of runs each: "bf16" (oneDNN's
    bf16 GEMM: AMX or AVX512-BF16 where present), "fp32" and "int8" (``torch._int_mm``, int8 x
    int8 -> int32: VNNI / AMX-INT8 where present). A kind torch cannot run here is left out."""
    import torch

    ops = 2 * n ** 3
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    cases = {"bf16": lambda: a16 @ b16, "fp32": lambda: a @ b,
             "int8": lambda: torch._int_mm(a8, b8)}
    a16, b16 = a.bfloat16(), b.bfloat16()
    a8 = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b8 = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    peaks = {}
    for name, fn in cases.items():
        try:
            fn()
        except RuntimeError:
            continue
        best, end = float("inf"), time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        peaks[name] = ops / best / 1e12
    return peaks


def copy_bandwidth(device: str, mib: int = 256, repeats: int = 10) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written per second) of a
    ``mib``-MiB tensor copied ``repeats`` times."""
    import torch

    # filled: an untouched CPU tensor maps every page to the one zero page, whose reads hit
    # the cache (a 256 MiB copy then "ran" at 75-110 GB/s on a machine whose DRAM copies 44)
    x = torch.ones(mib << 20, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        y.copy_(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return 2 * x.numel() * repeats / (time.perf_counter() - start) / 1e9
