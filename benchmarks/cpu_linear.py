"""The native quantized linear layers (``kernels.cpu``) against this machine's limits, measured
in one run: weight bytes read per second against the copy bandwidth, and multiply-adds per
second against a large dense matmul, for the shapes of a model at several row counts.

    python -m benchmarks.cpu_linear                      # the default model's shapes (SmolLM2-135M)
    python -m benchmarks.cpu_linear --shapes 2048x2048,2048x16384,8192x2048 --rows 1,16,512
    python -m benchmarks.cpu_linear --rows 1 --no-lm-head --layers 30  # a decode step's linears

Each shape is [K, N] (in_features x out_features) as int4 (the packed Q4_1 layout), then the
default model's int8 lm_head [576, 49152] unless ``--no-lm-head``. Every linear kernel this
machine runs (``--kernels``, default all: "avx2", "avx512_vnni"), the AMX int4 kernel where the
machine has AMX tiles, and oneDNN's dense bf16 matmul of the dequantized weight (``F.linear``,
the dense prefill copies' path) are timed on the same inputs. Per cell: milliseconds a call
(median of ``--reps``), GB/s of packed weight read, and GFLOP/s. The limits printed first: the
copy bandwidth, dense fp32 and bf16 2048^3 matmuls (oneDNN; the bf16 one is "the matrix units'
peak" where the CPU has bf16 dot products). The machine's CPU class is printed first. Weights
are cache-resident when they fit (the same ones every call), so a model's real decode, which
streams every layer's weights from memory, runs slower: ``--layers 30`` adds one row through 30
layers of the int4 shapes, each with its own weights, called in order as a decode step calls
them (the weights stream from DRAM), against ``torch.sum`` over the same weights in the same
order (a plain read's rate at these per-call sizes, each call starting and ending its threads),
alternated in the same run."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.common import copy_bandwidth, read_bandwidth, read_views
from kernels import cpu as native
from kernels.cpu_features import cpu_description, native_bf16
from server.model.quantization import quantize_int4, quantize_int8

# SmolLM2-135M: fused QKV, O, fused gate/up, down; the tied lm_head is int8
DEFAULT_SHAPES = "576x960,576x576,576x3072,1536x576"
LM_HEAD = (576, 49152)


def _median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def dense_gflops(n: int = 2048, dtype=torch.float32, reps: int = 5) -> float:
    """A large dense matmul's multiply-adds x 2 per second (torch/oneDNN), GFLOP/s."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / _median_ms(lambda: a @ b, reps) / 1e6


def _kernel_calls(kernel: str, kind: str, qw) -> tuple:
    """(call(x) -> y, the tensors it reads: the packed weight and its scales) of one linear
    kernel."""
    n = qw.shape[0]
    if kernel == "avx2" and kind == "int4":
        packed = native.pack_int4(qw.q, qw.scale, qw.zero)
        return (lambda x: native.int4_linear(x, packed, n)), [packed]
    if kernel == "avx2":
        q, s = qw.q.contiguous(), qw.scale.float().contiguous()
        return (lambda x: native.int8_linear(x, q, s)), [q, s]
    if kind == "int4":
        packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
        return (lambda x: native.vnni_int4_linear(x, packed, n)), [packed]
    packed, s = native.vnni_pack_int8(qw.q), qw.scale.float().contiguous()
    return (lambda x: native.vnni_int8_linear(x, packed, s)), [packed, s]


def layer_stack(kernel: str, shapes: list[tuple[int, int]], layers: int, dtype,
                reps: int) -> tuple[float, float, int]:
    """One row through ``layers`` layers of int4 linears of ``shapes`` ([(K, N)], each layer
    its own weights) by ``kernel``, and torch.sum over the same packed weights in the same
    order: (kernel ms a pass, sum ms a pass, bytes a pass), medians of ``reps`` alternated
    passes."""
    calls, weights = [], []
    for _ in range(layers):
        for k, n in shapes:
            call, read = _kernel_calls(kernel, "int4", quantize_int4(torch.randn(n, k)))
            weights += read
            calls.append((call, torch.randn(1, k).to(dtype)))
    flat = read_views(weights)
    kernel_ms, sum_ms = [], []
    for _ in range(reps):
        kernel_ms.append(_median_ms(lambda: [call(x) for call, x in calls], 1))
        sum_ms.append(_median_ms(lambda: [w.sum() for w in flat], 1))
    return (statistics.median(kernel_ms), statistics.median(sum_ms),
            sum(w.nbytes for w in weights))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="KxN,... (in x out features)")
    ap.add_argument("--rows", default="1,4,16,64,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16" if native_bf16() else "float32",
                    choices=["float32", "bfloat16"], help="activations (default: this CPU "
                    "class's compute dtype)")
    ap.add_argument("--kernels", default=",".join(native.LINEAR_KERNELS),
                    help="linear kernels to time (those the machine cannot run are skipped)")
    ap.add_argument("--no-dense", action="store_true", help="skip oneDNN's dense bf16 matmul")
    ap.add_argument("--no-lm-head", action="store_true", help="skip the int8 576x49152 head")
    ap.add_argument("--layers", type=int, default=0,
                    help="also one row through this many layers of the int4 shapes, from DRAM")
    args = ap.parse_args(argv)
    native.require()
    kernels = [k for k in args.kernels.split(",") if native.available(k)]
    dtype = getattr(torch, args.dtype)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"CPU: {cpu_description()}; torch threads: {torch.get_num_threads()}")
    print(f"kernels: {', '.join(kernels)}; activations {args.dtype}")
    bw, read, peak = copy_bandwidth("cpu"), read_bandwidth(), dense_gflops()
    peak_bf16 = dense_gflops(dtype=torch.bfloat16)
    print(f"copy bandwidth {bw:.1f} GB/s (read + written), read {read:.1f} GB/s; dense 2048^3 "
          f"matmul: fp32 {peak:.0f} GFLOP/s, bf16 {peak_bf16:.0f} GFLOP/s\n")
    cases = [("int4", *(int(v) for v in spec.split("x"))) for spec in args.shapes.split(",")]
    if not args.no_lm_head:
        cases.append(("int8", *LM_HEAD))
    print("| kind | K x N | kernel | rows | ms | weight GB/s | share of copy bw | GFLOP/s | "
          "share of bf16 peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for kind, k, n in cases:
        w = torch.randn(n, k)
        qw = quantize_int4(w) if kind == "int4" else quantize_int8(w)
        calls = []
        for kernel in kernels:
            call, read = _kernel_calls(kernel, kind, qw)
            calls.append((kernel, call, sum(t.nbytes for t in read)))
        if kind == "int4" and native.amx_available():  # the long extends' kernel there
            packed = native.vnni_pack_int4(qw.q, qw.scale, qw.zero)
            calls.append(("amx (bf16 tiles)", lambda x, p=packed: native.amx_int4_linear(x, p, n),
                          packed.nbytes))
        if not args.no_dense:
            dense = qw.dequantize().to(torch.bfloat16)
            calls.append(("oneDNN bf16 dense", lambda x: F.linear(x.to(torch.bfloat16), dense),
                          dense.nbytes))
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            for name, call, nbytes in calls:
                ms = _median_ms(lambda: call(x), args.reps)
                gbps, gflops = nbytes / ms / 1e6, 2 * m * k * n / ms / 1e6
                print(f"| {kind} | {k} x {n} | {name} | {m} | {ms:.3f} | {gbps:.1f} | "
                      f"{gbps / bw:.0%} | {gflops:.0f} | {gflops / peak_bf16:.0%} |")
    if args.layers:
        shapes = [(k, n) for kind, k, n in cases if kind == "int4"]
        print(f"\nOne row through {args.layers} layers of {args.shapes}, each its own weights, in "
              "order (median of alternated passes):")
        print("| kernel | MB a pass | kernel ms | kernel GB/s | torch.sum ms | torch.sum GB/s |")
        print("|---|---|---|---|---|---|")
        for kernel in kernels:
            ms, sum_ms, nbytes = layer_stack(kernel, shapes, args.layers, dtype, args.reps)
            print(f"| {kernel} | {nbytes / 1e6:.0f} | {ms:.2f} | {nbytes / ms / 1e6:.1f} | "
                  f"{sum_ms:.2f} | {nbytes / sum_ms / 1e6:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
