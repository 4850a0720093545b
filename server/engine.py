"""In-process Engine: the same scheduler and runner as the server, without HTTP or IPC.

Used for offline batches, tests, benchmarks and (later) the frontend's in-process backend::

    from server.engine import Engine
    engine = Engine()  # the embedded SmolLM2-135M-Instruct
    out = engine.generate(engine.apply_chat_template([{"role": "user", "content": "Hi"}]),
                          {"max_new_tokens": 32, "temperature": 0})
    out["text"], out["meta_info"]["completion_tokens"]

Outputs follow the native ``/generate`` response: ``{"text", "output_ids", "meta_info": {"id",
"prompt_tokens", "completion_tokens", "finish_reason", and logprob lists when asked}}``, logprob
entries being ``(logprob, token_id, None)`` as SGLang's ``Engine`` returns them.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Any, Iterator, Mapping, Sequence

import torch

from server.cache.kv_pool import TokenKVPool
from server.cache.manager import CacheManager
from server.cache.radix_tree import RadixCache
from server.cache.req_table import ReqToTokenTable
from server.cache.tiers import build_tiers
from server.chat_template import render_chat
from server.config import ConfigError, EngineConfig
from server.constrained.grammar import GrammarCompiler
from server.constrained.reasoning_gate import ReasoningGatedMatcher
from server.constrained.spec import make_spec
from server.detokenizer import OutputText, StopRegexTimeout
from server.images import EngineImages
from server.model.build import build_runner, draft_options, encoder_engine_config
from server.model.loader import load_model
from server.model.lora_files import LoraError
from server.model.lora_registry import LoraRegistry, slot_shape
from server.model.pooling import unserved
from server.model.sampling import Sampler, SamplingParams
from server.model.tp_worker import RankZero
from server.multimodal import vision_spec
from server.resolve import resolve
from server.scheduler.outputs import TokenDelta, native_output
from server.scheduler.pending import PendingRequests
from server.scheduler.request import LogprobOptions, Req
from server.scheduler.scheduler import Scheduler
from server.scheduler.validation import InvalidRequestError

log = logging.getLogger("server.scheduler")  # the step loop's (the server logs it there)
Prompt = str | Sequence[int]
class Engine:
    """Load a model and serve batched generation in this process.

    Args:
        model: model path (see :mod:`server.model.loader`); None = the embedded default.
        **kwargs: any field of :class:`ModelConfig` (``model`` is its ``path``),
            :class:`CacheConfig`, :class:`SchedulerConfig`, :class:`ParallelConfig`, or
            ``seed`` (:meth:`EngineConfig.from_kwargs`; each field's docstring and flag are in
            :mod:`server.config`). The device defaults to "cpu" here, "auto" on the CLI.

        config: a whole EngineConfig instead of ``model`` and keywords (the server uses this).

    Raises:
        server.config.ConfigError, server.model.loader.ModelLoadError.
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None,
                 **kwargs: Any):
        # builds the parts in dependency order (model, pool, runner, cache, scheduler)
        if config is None:
            config = EngineConfig.from_kwargs(model=model, **kwargs)
        elif model is not None or kwargs:
            raise ValueError("give either config or model/keyword options, not both")
        loaded = load_model(config.model.path)
        self.config = resolve(config, kv_elements_per_token=loaded.arch.kv_elements_per_token,
                              model_context_length=loaded.arch.max_position_embeddings,
                              head_dim=loaded.arch.head_dim, windowed=loaded.arch.windowed)
        if self.config.model.is_embedding:  # --is-embedding: vectors only, no generation
            loaded = dataclasses.replace(loaded, arch=dataclasses.replace(
                loaded.arch, embedding_only=True))
        if loaded.arch.encoder is not None:
            self.config = encoder_engine_config(self.config)
        mc, cc, sc = self.config.model, self.config.cache, self.config.scheduler
        self.arch = loaded.arch
        self.tokenizer = loaded.tokenizer
        self.model_name = mc.served_model_name or loaded.name
        self.context_len = mc.context_length
        self._ranks = RankZero(self.config, loaded.arch) if self.config.parallel.tp_size > 1 \
            else None  # tensor parallelism: this process is rank 0 of the group
        self.tp = self._ranks.group if self._ranks is not None else None
        # an encoder keeps no KV: its pool is an allocator without buffers
        self.kv_pool = TokenKVPool(cc.max_total_tokens, 0 if loaded.arch.encoder else
                                   loaded.arch.num_layers,
                                   len(self.tp.shard.kv_heads) if self.tp
                                   else loaded.arch.num_kv_heads, loaded.arch.head_dim,
                                   dtype=mc.torch_kv_dtype, device=mc.device)
        self.req_table = ReqToTokenTable(sc.max_running_requests, self.context_len, mc.device)
        linear = mc.linear_kernel
        lora_slots, lora_rank = self._lora_shape()
        self.runner = build_runner(loaded, self.config, self.kv_pool,
                                   req_to_token=self.req_table.table, tp=self.tp,
                                   lora_slots=lora_slots, max_lora_rank=lora_rank)
        self.loras = LoraRegistry(self.runner.lora, self.runner.model)
        for name, path in self.config.lora.adapters():
            self.load_lora(name, path, error=ConfigError)
        self.cache = CacheManager(self.kv_pool, self.req_table,
                                  RadixCache(disabled=cc.disable_radix_cache),
                                  build_tiers(loaded, cc, mc, self.kv_pool,
                                              self.tp is not None))
        sc = draft_options(sc, self.runner)  # drafts only where they cannot change outputs
        self.config = dataclasses.replace(self.config, scheduler=sc)
        self.scheduler = Scheduler(sc, self.cache, vocab_size=loaded.arch.vocab_size,
                                   context_len=self.context_len,
                                   sampler=Sampler(self.config.seed, native=linear is not None),
                                   seed=self.config.seed, tokenizer=loaded.tokenizer,
                                   whole_prompts=loaded.arch.encoder is not None)
        self.eos_ids = frozenset(self._eos_ids())
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.images = EngineImages(vision_spec(loaded.vision) if loaded.vision is not None
                                   else None, loaded.path, loaded.tokenizer.bos_token_id)
        self.pending = PendingRequests(self.make_request, self.scheduler.add_request,
                                       lambda: self.grammars, self.images.preprocess_async)
        self.vision_spec = self.images.spec
        if self.runner.compiled:
            self._warm_up()

    def _lora_shape(self) -> tuple[int, int]:
        try:
            return slot_shape(self.config.lora)
        except LoraError as exc:
            raise ConfigError(f"--lora-paths: {exc}") from exc

    def load_lora(self, name: str, path: str, error: type[Exception] = LoraError) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` (requests pick it with
        ``lora=name``). Raises ``error`` (LoraError by default) saying why it was refused
        (:meth:`server.model.lora.LoraRegistry.load`)."""
        try:
            self.loras.load(name, path)
        except LoraError as exc:
            raise error(str(exc)) from exc

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``. Raises KeyError (unknown) or LoraBusyError (requests
        using it are queued or running)."""
        sched = self.scheduler
        self.loras.unload(name, (r.lora_slot for r in (*sched.waiting, *sched.prefilling,
                                                        *sched.running)))

    def check_parallel(self) -> None:
        """Between steps: raise TensorParallelError if a tensor-parallel rank died."""
        if self._ranks is not None:
            self._ranks.check()

    def close(self) -> None:
        """Stop the grammar compile processes and the tensor-parallel ranks, and leave the
        process group (idempotent)."""
        with self._grammars_lock:
            if self._grammars is not None:
                self._grammars.close()
                self._grammars = None
        if self._ranks is not None:
            self._ranks.close()
            self._ranks, self.tp = None, None

    def _warm_up(self) -> None:
        """Compile (or load from the cache) the graphs of a multi-token extend and a one-token
        decode before serving, then forget the warm-up's KV and counters."""
        self.generate(input_ids=[0, 1, 2, 3], sampling_params={"max_new_tokens": 2,
                                                               "temperature": 0})
        self.flush_cache()
        self.scheduler.reset_stats()

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler for this model's tokenizer (built on first use, or ahead of it
        by :meth:`prepare_grammars`)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.arch.vocab_size)
            return self._grammars

    def prepare_grammars(self) -> threading.Thread:
        """Build the grammar compiler, its JSON mask and its compile processes on a background
        thread (importing xgrammar, indexing the vocabulary, starting the forkserver: ~3-4 s
        that a server's first constrained request would otherwise wait). Returns the started
        thread."""
        def prepare() -> None:
            self.grammars.json_safe_mask()
            self.grammars.utf8_masks()
            self.grammars.compile(make_spec(regex="[0-9]"))

        thread = threading.Thread(target=prepare, name="grammar-prepare", daemon=True)
        thread.start()
        return thread

    def _eos_ids(self) -> set[int]:
        ids = set(self.arch.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    # ---------------------------------------------------------------- helpers
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, tools: list[dict] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render chat messages with the model's own template (text, not tokens), as the
        server does (:func:`server.chat_template.render_chat`). Raises ChatTemplateError."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools,
                           template_kwargs)

    def encode(self, text: str) -> list[int]:
        """Tokenize a prompt (the tokenizer's own special-token rules, e.g. a BOS)."""
        return self.tokenizer(text)["input_ids"]

    def make_request(self, prompt: Prompt, params: SamplingParams,
                     logprobs: LogprobOptions = LogprobOptions(), rid: str | None = None,
                     cache_salt: str | None = None, reasoning: Any = None,
                     images: Sequence[tuple[int, int, bytes]] = (),
                     pixels: Sequence[torch.Tensor] | None = None, embed: bool = False,
                     lora: str | None = None, priority: int = 0) -> Req:
        """Tokenize and wrap one prompt (str or token ids) as a scheduler request.

        ``cache_salt`` puts the request in its own radix-cache namespace: it shares cached KV
        only with requests of the same salt. ``reasoning`` (a
        :class:`server.protocol.ReasoningGate`) holds the grammar back while the model
        thinks. ``images``: (offset, radix key, encoded bytes) of each image of a prompt whose
        image tokens are already expanded (``images.expand``); ``pixels``: their pixel
        values when already computed (``images.preprocess_async``), else they are computed
        here. ``embed``: an embedding request (``params.max_new_tokens`` must be 0): it
        finishes after its prefill with ``Req.embedding`` set; an embedding-only model
        (``arch.embedding_only``) takes nothing else. ``lora``: the served LoRA adapter to run
        with (:meth:`load_lora`; its KV is cached apart); ``priority``: higher is admitted
        first (``SchedulerConfig.priority``). Raises GrammarError for a
        constraint that does not compile, InvalidRequestError for images a model cannot
        take or an adapter not loaded (status 404)."""
        if embed and params.max_new_tokens:
            raise InvalidRequestError("max_new_tokens", "an embedding request generates nothing")
        if embed and self.arch.encoder is None and unserved(self.arch.pooling):
            raise InvalidRequestError("model", unserved(self.arch.pooling))
        if self.arch.embedding_only and (params.max_new_tokens or logprobs.return_logprob):
            raise InvalidRequestError("model", f"{self.model_name} is an embedding model (no LM "
                                      "head): it serves /v1/embeddings and /encode")
        try:
            adapter = self.loras.resolve(lora)
        except KeyError:
            raise InvalidRequestError("model", f"LoRA adapter {lora!r} is not loaded (loaded: "
                                      f"{self.loras.names()})", status=404) from None
        if adapter is not None:  # its own radix namespace: no KV shared with other weights
            cache_salt = f"{cache_salt or ''}\x00{adapter.namespace}"
        ids = self.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        image_inputs = self.images.inputs(ids, images, pixels) if images else ()
        grammar = (self.grammars.matcher(params.grammar, sorted(self.eos_ids))
                   if params.grammar is not None else None)
        if grammar is not None and reasoning is not None:
            grammar = ReasoningGatedMatcher(grammar, reasoning.end_ids, reasoning.in_reasoning,
                                            reasoning.start_id)
        return Req(rid=rid or uuid.uuid4().hex, input_ids=ids, params=params,
                   eos_ids=self.eos_ids, logprobs=logprobs, namespace=cache_salt,
                   grammar=grammar, images=image_inputs, embed=embed,
                   pooling=None if self.arch.encoder else self.arch.pooling,
                   lora_slot=-1 if adapter is None else adapter.slot, priority=priority)

    # ---------------------------------------------------------------- generation
    def generate(self, prompt: Prompt | Sequence[Prompt] | None = None,
                 sampling_params: Mapping[str, Any] | SamplingParams | None = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, cache_salt: str | None = None,
                 image_data: Sequence[bytes] = (), lora: str | None = None) -> dict | list[dict]:
        """Generate for one prompt (returns a dict) or a batch (returns a list).

        ``prompt`` is text or a list of texts; ``input_ids`` token ids or a list of them. With
        ``n > 1`` a single prompt returns a list of n outputs, a batch a flat list (prompt-major).
        ``image_data``: encoded images (PNG, JPEG, ...) of a single prompt, one per image token
        in it (or placed at its start when it has none); multimodal models only. ``lora``: a
        loaded LoRA adapter's name (:meth:`load_lora`).

        Raises:
            SamplingParamsError, InvalidRequestError: before anything is queued.
        """
        if (prompt is None) == (input_ids is None):
            raise InvalidRequestError("prompt", "give exactly one of prompt and input_ids")
        single = isinstance(prompt, str) or (input_ids is not None and (
            len(input_ids) == 0 or isinstance(input_ids[0], int)))
        prompts: list[Prompt] = ([prompt if prompt is not None else input_ids] if single
                                 else list(prompt if prompt is not None else input_ids))
        params = (sampling_params if isinstance(sampling_params, SamplingParams)
                  else SamplingParams.from_dict(sampling_params))
        lp = LogprobOptions(return_logprob, logprob_start_len, top_logprobs_num)
        images: list = []
        if image_data:
            if not single:
                raise InvalidRequestError("image_data", "images go with a single prompt")
            p = prompts[0]
            prompts[0], images = self.images.expand(
                self.encode(p) if isinstance(p, str) else list(p), image_data)
        reqs = []
        for p in prompts:
            for i in range(params.n):
                seeded = params if params.seed is None or params.n == 1 else \
                    dataclasses.replace(params, seed=params.seed + i, n=1)
                reqs.append(self.make_request(p, seeded, lp, cache_salt=cache_salt,
                                              images=images, lora=lora))
        outputs = self.run(reqs)
        return outputs[0] if single and params.n == 1 else outputs

    def embed(self, inputs: Prompt | Sequence[Prompt], lora: str | None = None
              ) -> list[float] | list[list[float]]:
        """Embed one prompt (text or token ids; returns its vector) or a batch (a list of
        vectors), float32 values as ``/v1/embeddings`` returns them: an encoder's own pooling
        (a cross-encoder's relevance logits), else the decoder's (``arch.pooling``: the last
        token's final hidden state or the mean of all, L2-normalized by default). Texts get
        the tokenizer's special tokens. Raises InvalidRequestError (e.g. an empty or too long
        prompt) before anything is queued."""
        single = isinstance(inputs, str) or (len(inputs) > 0 and isinstance(inputs[0], int))
        reqs = [self.make_request(p, SamplingParams(max_new_tokens=0), embed=True, lora=lora)
                for p in ([inputs] if single else inputs)]
        self.run(reqs)
        return reqs[0].embedding if single else [r.embedding for r in reqs]

    def run(self, reqs: Sequence[Req]) -> list[dict]:
        """Queue ``reqs`` and step until all finish; outputs in the same order.

        Validation errors are raised before any of them is queued.
        """
        for req in reqs:  # validate all first, so a bad one queues nothing
            self.scheduler.validate(req)
        texts = {r.rid: OutputText(self.tokenizer, r.input_ids, r.params.stop,
                                   r.params.skip_special_tokens, r.params.stop_regex,
                                   r.params.no_stop_trim) for r in reqs}
        for req in reqs:
            self.scheduler.add_request(req)
        for deltas in self.stream_steps():
            for d in deltas:
                text = texts.get(d.rid)
                if text is None or text.finish_reason is not None:
                    continue
                try:
                    text.feed(d.new_token_ids, d.finish_reason.to_dict() if d.finish_reason
                              else None)
                except StopRegexTimeout as exc:  # this request ends; the others go on
                    text.finish_reason = {"type": "error", "message": str(exc)}
                    self.scheduler.abort(d.rid, str(exc), error=True)
                    continue
                if text.finish_reason is not None and d.finish_reason is None:
                    # a stop string: the scheduler sees ids only
                    self.scheduler.stop(d.rid, text.finish_reason["matched"])
        return [native_output(r, texts[r.rid]) for r in reqs]

    def metrics(self) -> dict[str, float]:
        """Scheduler and cache counters (see ``Scheduler.metrics``)."""
        return self.scheduler.metrics()

    def flush_cache(self) -> bool:
        """Empty the radix cache; False (nothing done) while requests hold KV memory."""
        return self.scheduler.flush_cache()

    def step(self) -> list[TokenDelta] | None:
        """One scheduler step and its forward pass, the one step the offline engine and the
        server's scheduler loop both run: the step's token deltas, or None when no batch could
        be formed (nothing runnable now, or cached pages still coming from disk:
        ``scheduler.reading_ahead``). A pass that raises, in the runner or in sampling, ends
        only that batch's requests, with an "error" finish (their deltas are returned and the
        exception logged): one bad batch never stops the engine."""
        batch = self.scheduler.step()
        if batch is None:
            return None
        try:
            return self.scheduler.update(batch, self.runner.forward(batch))
        except Exception as exc:  # noqa: BLE001 - isolate: fail this batch, keep serving
            log.exception("batch failed; its requests end with an error")
            return self.scheduler.fail_batch(batch, f"internal error: {type(exc).__name__}: "
                                                    f"{exc}")

    def stream_steps(self) -> Iterator[list[TokenDelta]]:
        """Run :meth:`step` until idle, yielding each step's token deltas. Raises
        RuntimeError when queued work cannot be scheduled (two empty steps in a row with no
        cached pages coming from disk: a read that completes between a step and the check
        gets its retry)."""
        empty = 0
        while self.scheduler.has_work:
            deltas = self.step()
            if deltas is not None:
                empty = 0
                yield deltas
            elif self.scheduler.reading_ahead:  # cached pages are coming from disk
                time.sleep(0.001)
            else:
                empty += 1
                if empty > 1:
                    raise RuntimeError("scheduler has queued work but cannot schedule it")
