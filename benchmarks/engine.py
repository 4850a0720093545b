"""Engine throughput on the default model, side by side with transformers in one run.

    python -m benchmarks.engine [--model PATH] [--dtypes auto,float32] [--new-tokens 64]
        [--quantization auto|none|int8|int4]
        [--device auto|cpu|cuda] [--attention-backends auto,reference,triton,flashinfer]
        [--batches 1,8,32] [--cuda-graph on,off] [--temperature 0]

Prints one markdown table: prefill tokens/s (512-token prompts), decode tokens/s at each batch
size (default 1, 8, 32 on CPU and 1, 16, 64, 256 on CUDA; 128-token prompts, decode steps
only), and transformers' ``generate`` at batch 1 on the
same prompts (decode rate = (t(N tokens) - t(1 token)) / (N - 1)). Then a per-op profile of a
decode step at the smallest and largest batch, and the scheduler's own Python per decode step
at the largest batch (greedy and temperature 0.7) against the runner's forward. Prompts are
real Wikipedia passages from ../shared/data/wiki_rag when present (else this repository's
source text), chat-templated and cut to length in tokens.

Decode at batch 1 reads every weight once per token, so "b=1 GB/s" = weight bytes x tokens/s
is the achieved memory bandwidth (KV reads are < 1% of it at 128 tokens); it is printed next to
the device's measured copy bandwidth (read + write bytes of a 256 MiB ``copy_``) and, on a
CPU, its read bandwidth (a sum over 256 MiB). "prefill linear TOP/s" = 2 x the decoder
layers' multiply-adds per token x prefill tok/s, next to the matrix peaks torch reaches on the
CPU in the same run (bf16 / fp32 / int8 2048^3 products: ``benchmarks.common.matrix_peaks``).
The attention column names the kernel (the native CPU one: avx2, avx512_vnni, avx512_bf16).
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import os
import time

import torch

from benchmarks.common import copy_bandwidth, matrix_peaks, print_table, read_bandwidth, shared_data_dir
from kernels.cpu_features import cpu_description
from server.engine import Engine
from server.model.forward_batch import ForwardMode
from server.model.sampling import SamplingParams


def load_texts(n: int) -> tuple[list[str], str]:
    data = shared_data_dir()
    path = os.path.join(data, "wiki_rag", "passages.jsonl.gz") if data else None
    if path and os.path.isfile(path):
        with gzip.open(path, "rt") as f:
            texts = [json.loads(line)["text"] for _, line in zip(range(n), f)]
        return texts, "wiki_rag passages"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = open(os.path.join(root, "server", "scheduler", "scheduler.py")).read()
    return [src[i * 500:] for i in range(n)], "repository source (../shared/data not found)"


def make_prompts(engine: Engine, texts: list[str], length: int,
                 n: int | None = None) -> list[list[int]]:
    """``n`` (default len(texts)) distinct chat-templated 'summarize' prompts cut to exactly
    ``length`` tokens, cycling through ``texts`` (the template's end, the assistant header, is
    kept so the model is asked to answer)."""
    out = []
    tail = engine.encode(engine.apply_chat_template([{"role": "user", "content": "x"}]))[-4:]
    for i in range(len(texts) if n is None else n):
        t = texts[i % len(texts)]
        ids = engine.encode(engine.apply_chat_template(
            [{"role": "user", "content": f"Summarize passage {i}:\n" + t * 4}]))
        out.append(ids[:length - len(tail)] + tail)
    return out


def run_engine(engine: Engine, prompts: list[list[int]], new_tokens: int,
               temperature: float = 0.0, whole_batches: bool = True) -> dict[str, float]:
    """Returns prefill and decode tokens/s, counting forward-pass and sampling time per
    mode. With ``whole_batches``, raises RuntimeError when a decode step ran fewer than all
    the prompts (the decode rate would not be the batch's); mixed lengths need it off (with
    mixed chunks, short prompts decode, and may finish, while long ones still extend)."""
    if len(prompts) != len({tuple(p) for p in prompts}):
        raise ValueError("prompts must be distinct")
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    for r in [engine.make_request(p, params) for p in prompts]:
        engine.scheduler.add_request(r)
    t = {ForwardMode.EXTEND: 0.0, ForwardMode.DECODE: 0.0}
    n = {ForwardMode.EXTEND: 0, ForwardMode.DECODE: 0}
    while engine.scheduler.has_work:
        batch = engine.scheduler.step()
        start = time.perf_counter()
        engine.scheduler.update(batch, engine.runner.forward(batch))
        t[batch.mode] += time.perf_counter() - start
        if whole_batches and batch.mode is ForwardMode.DECODE \
                and batch.batch_size != len(prompts):
            raise RuntimeError(f"decode ran at batch {batch.batch_size}, not {len(prompts)}")
        n[batch.mode] += batch.num_tokens
    rate = {m: n[m] / t[m] if t[m] else 0.0 for m in t}
    return {"prefill": rate[ForwardMode.EXTEND], "decode": rate[ForwardMode.DECODE]}


def hf_decode_rate(model, prompt: list[int], new_tokens: int) -> float:
    ids = torch.tensor([prompt])
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None)

    def timed(n):
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - start

    timed(2)  # warm-up
    return (new_tokens - 1) / (timed(new_tokens) - timed(1))


def profile_decode_step(engine: Engine, prompts: list[list[int]]) -> list[list[str]]:
    """Per-op CPU time of one decode step at batch len(prompts) (its 10 costliest ops), the
    ops' total, and the step's wall time unprofiled (the rest is Python between the ops)."""
    params = SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True)
    for r in [engine.make_request(p, params) for p in prompts]:
        engine.scheduler.add_request(r)
    rows: list[list[str]] = []
    timed = False
    while engine.scheduler.has_work:
        batch = engine.scheduler.step()
        if batch.mode is ForwardMode.DECODE and not rows:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                out = engine.runner.forward(batch)
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events)
            rows = [[e.key, f"{e.self_cpu_time_total / 1e3:.1f}",
                     f"{100 * e.self_cpu_time_total / total:.0f}%", str(e.count)]
                    for e in events[:10]]
            rows.append(["(total of the ops)", f"{total / 1e3:.1f}", "100%", ""])
        else:
            start = time.perf_counter()
            out = engine.runner.forward(batch)
            if batch.mode is ForwardMode.DECODE and rows and not timed:
                timed = True
                rows.append(["(the next step's wall time, unprofiled)",
                             f"{(time.perf_counter() - start) * 1e3:.1f}", "", ""])
        engine.scheduler.update(batch, out)
    return rows


def scheduler_share(engine: Engine, prompts: list[list[int]], temperature: float,
                    new_tokens: int = 32) -> list[str]:
    """Per decode step of ``len(prompts)`` streams: milliseconds in the scheduler's own Python
    (building the batch; sampling, appending and finish checks) and in the runner's forward,
    and the scheduler's share of the two, as a table row."""
    params = SamplingParams(max_new_tokens=new_tokens, temperature=temperature, ignore_eos=True)
    for r in [engine.make_request(p, params) for p in prompts]:
        engine.scheduler.add_request(r)
    sched = fwd = 0.0
    steps = 0
    while engine.scheduler.has_work:
        a = time.perf_counter()
        batch = engine.scheduler.step()
        b = time.perf_counter()
        out = engine.runner.forward(batch)
        c = time.perf_counter()
        engine.scheduler.update(batch, out)
        d = time.perf_counter()
        if batch.mode is ForwardMode.DECODE:
            sched, fwd, steps = sched + (b - a) + (d - c), fwd + (c - b), steps + 1
    return [str(len(prompts)), f"{temperature:g}", f"{sched / steps * 1e3:.2f}",
            f"{fwd / steps * 1e3:.2f}", f"{sched / (sched + fwd):.0%}"]


def weight_bytes(engine: Engine) -> int:
    """Bytes one decode step reads: all weights (packed quantized ones included, the dense
    prefill copies not), except an untied input embedding, of which a step reads one row per
    token (a tied one is read whole by the logits)."""
    model, report = engine.runner.model, engine.runner.quant_report
    total = report.weight_bytes - report.prefill_copy_bytes
    if model.lm_head is not None:
        emb = model.embed_tokens
        total -= sum(t.numel() * t.element_size()
                     for t in (*emb.parameters(), *emb.buffers()))
    return total


def layer_matmul_params(engine: Engine) -> int:
    """Multiply-adds per token of the decoder layers' linear layers (the products a prefill
    token costs, attention and the logits aside)."""
    total = 0
    for layer in engine.runner.model.layers:
        for mod in layer.modules():
            if hasattr(mod, "in_features") and hasattr(mod, "out_features"):
                total += mod.in_features * mod.out_features
    return total


def long_context(args, device: str, texts: list[str], read_gbs: float | None) -> None:
    """One stream's decode rate after prompts of each of ``args.context_lengths`` tokens (the
    texts joined until long enough), for each of ``args.kv_cache_dtypes``, and its ratio to the
    first length's, with the KV bytes one step reads at each length. With ``read_gbs`` (the
    read bandwidth measured before, GB/s), the read bandwidth is measured again after every
    timed run, and each row gets the highest ratio the best of those allows: a step at N
    tokens reads the weights and N tokens of KV, so it takes at least (weight + KV bytes) /
    read bandwidth, however well the rest overlaps with the reads. (The best of the run,
    because a shared machine's bandwidth drifts by 1.5x within minutes: a bound from one
    reading taken in a slow minute would understate what the rates measured in a fast one
    allow.) A second bound takes the step as it runs, its K/V read after the rest of the step
    (the linears): the first length's step plus the extra K/V at the best read bandwidth, the
    most a step can reach unless its K/V stream overlaps its weight stream (on a 2-core Zen 4
    prefetching the K/V under the weights made the two 15% slower: benchmarks/kv_stream.cpp).
    Each row's share of the best read bandwidth (its bytes x rate / bandwidth) and the ratio a
    runner whose steps all stream at one share would reach, (weight + first KV bytes) / (weight
    + KV bytes), show how much of a row's ratio the model's bytes allow: a ratio above that one
    needs the long step to stream at a higher share than the short one."""
    lengths = [int(v) for v in args.context_lengths.split(",")]
    # per row: the first length's rate and this row's, their KV bytes, and this row's weight
    # + KV bytes
    rows, floors = [], []
    reads = [read_gbs] if read_gbs else []
    for kv_dtype in args.kv_cache_dtypes.split(","):
        engine = Engine(args.model, device=device, kv_cache_dtype=kv_dtype,
                        quantization=args.quantization,
                        max_total_tokens=max(32768, 2 * max(lengths)),
                        context_length=max(lengths) + args.new_tokens + 8,
                        speculative_ngram=0)
        joined = "\n\n".join(texts)
        while len(engine.encode(joined)) < max(lengths):
            joined += "\n\n" + joined
        first, first_kv = None, 0
        for i, n in enumerate(lengths):
            prompt = make_prompts(engine, [f"{i}\n" + joined], n, 1)[0]
            run_engine(engine, [prompt], 4)  # warm-up at this length
            engine.flush_cache()
            rate = 0.0
            for _ in range(args.repeats):  # the best of a few: shared machines are noisy
                rate = max(rate, run_engine(engine, [prompt], args.new_tokens)["decode"])
                engine.flush_cache()
                if reads:
                    reads.append(read_bandwidth())
            first = first or rate
            kv_bytes = n * engine.kv_pool.bytes_per_token()
            first_kv = first_kv or kv_bytes
            floors.append((first, rate, first_kv, kv_bytes, weight_bytes(engine) + kv_bytes))
            rows.append([engine.config.model.dtype, engine.config.model.kv_cache_dtype, str(n),
                         f"{kv_bytes / 1e6:.0f}", f"{rate:.1f}", f"{rate / first:.2f}"])
        attention = engine.runner.attention.name
        del engine
        gc.collect()
    bw = max(reads) * 1e9 if reads else 0.0  # bytes/s
    for row, (first, rate, first_kv, kv_bytes, floor_bytes) in zip(rows, floors):
        row += ([f"{min(1.0, bw / (first * floor_bytes)):.2f}",
                 f"{1 / (1 + first * (kv_bytes - first_kv) / bw):.2f}",
                 f"{rate * floor_bytes / bw:.2f}"] if bw else ["", "", ""])
        row.append(f"{(floor_bytes - kv_bytes + first_kv) / floor_bytes:.2f}")
    print(f"\nOne stream, {args.new_tokens} new tokens after a prompt of N tokens, the best of "
          f"{args.repeats} runs (attention {attention})"
          + (f"; read bandwidth {min(reads):.1f}-{max(reads):.1f} GB/s over the runs, the "
             "bound at its best:" if reads else ":"))
    print_table(["dtype", "KV dtype", "prompt tokens", "KV MB a step", "decode tok/s",
                 "vs the first", "bound at the read bandwidth",
                 "bound, K/V after the rest", "share of the read bandwidth",
                 "ratio at one share"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model path (default: embedded SmolLM2)")
    ap.add_argument("--dtypes", default="auto,float32",
                    help="engine dtypes to run, comma-separated (auto = bf16 on native-bf16 CPUs)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--quantization", default="auto",
                    help="auto (a GGUF's own types), none, int8 or int4 (quantized at load)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda[:N]")
    ap.add_argument("--attention-backends", default="auto",
                    help="comma-separated: auto, reference, triton, flashinfer")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="decode sampling temperature (0 = greedy)")
    ap.add_argument("--batches", default=None,
                    help="decode batch sizes (default 1,8,32 on CPU; 1,16,64,256 on CUDA)")
    ap.add_argument("--context-lengths", default=None,
                    help="e.g. 256,4096: one stream's decode tok/s after a prompt of each length "
                         "(printed after the main table)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs per --context-lengths point; the fastest is reported")
    ap.add_argument("--kv-cache-dtypes", default="auto",
                    help="KV pool dtypes for --context-lengths, comma-separated (auto = the "
                         "compute dtype; bfloat16 halves the bytes a step reads)")
    ap.add_argument("--cuda-graph", default="on",
                    help="on, off or on,off: decode through captured CUDA graphs (CUDA only)")
    args = ap.parse_args()
    device = args.device if args.device != "auto" else (
        "cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    batches = [int(b) for b in (args.batches or ("1,16,64,256" if cuda else "1,8,32")).split(",")]
    graphs = args.cuda_graph.split(",") if cuda else ["off"]
    device_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    read_gbs = None if cuda else read_bandwidth()
    read = "" if cuda else f", read {read_gbs:.1f} GB/s"
    print(f"device: {device_name}; copy bandwidth {copy_bandwidth(device):.1f} GB/s (read + "
          f"written){read}; CPU: {cpu_description()}")
    peaks = {} if cuda else matrix_peaks()
    if peaks:
        print("matrix peaks (torch, 2048^3): " + ", ".join(
            f"{k} {v:.2f} T{'OP' if k == 'int8' else 'FLOP'}/s" for k, v in peaks.items()))

    texts, source = load_texts(32)
    print(f"prompts: {source}; torch threads: {torch.get_num_threads()}")
    top = max(batches)
    header = ["engine", "attention", "dtype", "cuda graph", "prefill tok/s (512)",
              "prefill linear TOP/s", "b=1 GB/s"] + [f"decode b={b}" for b in batches] + [
                  f"b={top} / b={batches[0]}"]
    rows, engine = [], None
    for backend, dtype, graph in [(b, d, g) for b in args.attention_backends.split(",")
                                  for d in args.dtypes.split(",") for g in graphs]:
        engine = Engine(args.model, dtype=dtype, device=device, attention_backend=backend,
                        quantization=args.quantization,
                        max_total_tokens=max(32768, top * (128 + args.new_tokens + 8)),
                        max_running_requests=max(128, top), disable_cuda_graph=graph == "off",
                        # one token per decode step, and every prompt prefilled before the
                        # first decode (mixed chunks would decode, and finish, the first
                        # prompts while later ones still extend): the step rate at batch b
                        speculative_ngram=0, mixed_chunk=False)
        long_prompts = make_prompts(engine, texts[:8], 512)
        short = make_prompts(engine, texts, 128, top)
        # warm-up: a short and a long prefill and decode (kernels compile on first use)
        run_engine(engine, short[:2] + make_prompts(engine, texts[8:10], 512), 4,
                   whole_batches=False)
        engine.flush_cache()  # the short prompts are prefixes of the long ones
        prefill = run_engine(engine, long_prompts, 0)["prefill"]
        decode = {b: run_engine(engine, short[:b], args.new_tokens, args.temperature)["decode"]
                  for b in batches}
        gbs = (f"{weight_bytes(engine) * decode[1] / 1e9:.1f}" if 1 in decode else "")
        tops = 2 * layer_matmul_params(engine) * prefill / 1e12
        attention = engine.runner.attention
        rows.append(["sgl-adapters Engine", getattr(attention, "kernel", attention.name),
                     engine.config.model.dtype, graph if cuda else "", f"{prefill:.0f}",
                     f"{tops:.2f}", gbs]
                    + [f"{decode[b]:.1f}" for b in batches]
                    + [f"{decode[top] / decode[batches[0]]:.1f}x"])
        del engine
        gc.collect()  # free the weights before the next engine loads its own
        if cuda:
            torch.cuda.empty_cache()
    if not args.no_hf and device == "cpu":
        from transformers import AutoModelForCausalLM

        from server.model.loader import default_model_path

        path = args.model or default_model_path()
        for dtype in (torch.float32, torch.bfloat16):
            kw = ({"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {})
            hf = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path) if kw else path, dtype=dtype, **kw).eval()
            eng_prompt = short[0]
            rate = hf_decode_rate(hf, eng_prompt, args.new_tokens)
            rows.append(["transformers generate", "", str(dtype).replace("torch.", "")]
                        + [""] * 4 + [f"{rate:.1f}" if b == 1 else "" for b in batches] + [""])
            del hf
    print_table(header, rows)
    if args.context_lengths:
        long_context(args, device, texts, read_gbs)
    if cuda:
        return
    engine = Engine(args.model, max_total_tokens=32768, device=device, speculative_ngram=0,
                    quantization=args.quantization)
    for b in sorted({batches[0], top}):
        prof = profile_decode_step(engine, make_prompts(engine, texts, 128, b))
        print(f"\nOne decode step, batch {b}, 128-token prompts, dtype "
              f"{engine.config.model.dtype}:")
        print_table(["op", "self CPU ms", "share", "calls"], prof)
    share = [scheduler_share(engine, make_prompts(engine, texts, 128, top), t)
             for t in (0.0, 0.7)]
    print(f"\nThe scheduler's own Python per decode step ({top} streams, 128-token prompts):")
    print_table(["streams", "temperature", "scheduler ms", "forward ms", "scheduler share"],
                share)


if __name__ == "__main__":
    main()
