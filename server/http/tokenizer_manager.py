"""TokenizerManager: the HTTP process's side of the scheduler connection.

Tokenizes and applies the chat template, validates a request before the scheduler sees it
(RELIABILITY rule 2: bounds, token ids, context length, fit in the KV pool; every rejection
answers), sends it over ZeroMQ and streams the scheduler's outputs back to the handler.
A consumer that stops listening (client disconnect, cancelled task) aborts its request at once.

Errors raised to the HTTP layer are :class:`ApiError` with an HTTP status and an OpenAI error
``type``/``param``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Sequence

import zmq
import zmq.asyncio

from server import protocol as P
from server.chat_template import ChatTemplateError, render_chat
from server.detokenizer import OutputText, StopRegexTimeout
from server.http.errors import ApiError
from server.http.outputs import coalesce, with_text
from server.multimodal import ImageError, VisionSpec, expand_prompt_images, image_bytes
from server.reasoning import ReasoningParser
from server.sampling_params import SamplingParams, SamplingParamsError
from server.scheduler.validation import InvalidRequestError, validate_request

log = logging.getLogger("server.tokenizer_manager")


TOKENIZER_THREADS = 2


@dataclass
class GenerateInput:
    """One tokenized request. Lengths in tokens."""

    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    rid: str | None = None
    cache_salt: str | None = None  # its own radix-cache namespace (the client's cache_salt)
    # where the output starts when reasoning is split (server.reasoning): "maybe", "reasoning"
    reasoning_state: str | None = None  # or "off"; None = the text is not split
    # (offset, radix key, encoded bytes) per image, ids already expanded (server.multimodal)
    images: list[tuple[int, int, bytes]] = field(default_factory=list)
    # False when the client gave no max_tokens and params.max_new_tokens is the rest of the
    # context (counted: such a request's length is up to the model)
    max_tokens_given: bool = True
    embed: bool = False  # an embedding request (params.max_new_tokens 0): the vector comes back
    lora: str | None = None  # a served LoRA adapter's name (server.http.lora_routes)
    priority: int = 0  # higher is admitted first (SGLang's sign)


@dataclass
class InFlight:
    """A request the HTTP process is serving (for /server_info's ``requests``): ``rid``,
    prompt and output lengths (tokens), its ``max_new_tokens`` and whether the client set it,
    and ``started`` (time.monotonic(), seconds)."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    max_tokens_given: bool
    started: float
    completion_tokens: int = 0
    unread_since: float | None = None  # time.monotonic() of the oldest output not yet taken
    stalled: bool = False

    def as_dict(self, now: float) -> dict[str, Any]:
        """This request as /server_info lists it (tokens, and seconds since it started)."""
        return {"rid": self.rid, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "max_new_tokens": self.max_new_tokens, "max_tokens_given": self.max_tokens_given,
                "seconds": round(now - self.started, 3)}


class TokenizerManager:
    """Args:
        tokenizer: the model's transformers tokenizer.
        info: the scheduler's Ready message (vocab, context and pool sizes).
        send, recv: zmq.asyncio PUSH (to the scheduler) and PULL (from it) sockets.
        max_queued_requests: requests in flight beyond which new ones get 503 + Retry-After.
        reasoning: the model's think markers (:mod:`server.reasoning`), or None.
        vision: a multimodal model's image token and positions per image
            (:mod:`server.multimodal`), or None for text-only models.
        stream_stall_s: seconds a request's outputs may wait unread (a client that stopped
            reading) before it is aborted with a 408 error event.
    """

    def __init__(self, tokenizer: Any, info: P.Ready, send: zmq.asyncio.Socket,
                 recv: zmq.asyncio.Socket, max_queued_requests: int = 1024,
                 reasoning: ReasoningParser | None = None, vision: VisionSpec | None = None,
                 stream_stall_s: float = 30.0):
        self.tokenizer = tokenizer
        self.reasoning = reasoning
        if vision is not None:  # the token's text as this tokenizer spells it
            text = tokenizer.convert_ids_to_tokens(vision.image_token_id)
            vision = dataclasses.replace(vision, image_token=text or vision.image_token)
        self.vision = vision
        self.info = info
        self.loras = dict(info.loras)  # the LoRA adapters served (name -> path)
        self.send_sock = send
        self.recv_sock = recv
        self.max_queued_requests = max_queued_requests
        self.stream_stall_s = stream_stall_s
        self.queues: dict[str, asyncio.Queue] = {}
        self.in_flight: dict[str, InFlight] = {}
        # requests that gave no max_tokens (bounded only by the context) and generated
        self.unbounded_requests = 0
        self._replies: dict[type, asyncio.Future] = {}
        self._reply_lock = asyncio.Lock()
        self._recv_task: asyncio.Task | None = None
        self.scheduler_alive = True
        self.unavailable: str | None = None  # why new requests get 503 (fail_all)
        self.observers: list[Any] = []  # called as obs(event, rid, seconds) for metrics
        # Tokenization and chat templates of requests run here, off the event loop.
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(
            TOKENIZER_THREADS, thread_name_prefix="tokenize")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start receiving the scheduler's outputs (on the running event loop)."""
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def close(self) -> None:
        """Stop receiving and drop the tokenizer threads' queued work."""
        if self._recv_task is not None:
            self._recv_task.cancel()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    def fail_all(self, message: str, scheduler_gone: bool = True) -> None:
        """Every waiting handler gets a 503 error with ``message`` now, and so does every new
        request: the scheduler is gone, or (``scheduler_gone`` False) a drain has ended."""
        self.unavailable = message
        self.scheduler_alive = self.scheduler_alive and not scheduler_gone
        for rid, q in list(self.queues.items()):
            q.put_nowait(P.ReqError(rid, message, status=503))

    async def _recv_loop(self) -> None:
        while True:
            frame = await self.recv_sock.recv()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as exc:
                log.warning("dropped a bad frame from the scheduler: %s", exc)
                continue
            if isinstance(msg, P.BatchOutput):
                now = time.monotonic()
                for out in msg.outputs:
                    q = self.queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
                        await self._check_stall(out.rid, q, now)
            elif isinstance(msg, P.ReqError):
                q = self.queues.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)
            else:
                fut = self._replies.pop(type(msg), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    async def _check_stall(self, rid: str, q: asyncio.Queue, now: float) -> None:
        """Bound what a client that stops reading costs: once its outputs have waited
        ``stream_stall_s`` unread, abort the request in the scheduler and queue a 408 error (the
        handler sends it after the backlog, as one chunk, if the client reads again)."""
        entry = self.in_flight.get(rid)
        if entry is None or entry.stalled:
            return
        if entry.unread_since is None:  # the handler took everything before this output
            entry.unread_since = now
        elif now - entry.unread_since > self.stream_stall_s:
            entry.stalled = True
            q.put_nowait(P.ReqError(rid, f"the client read no output for {self.stream_stall_s:g} s; "
                                    "the request was aborted", status=408))
            await self.send_sock.send(P.encode(P.AbortReq(rid)))
            self._observe("abort", 0.0)

    # ------------------------------------------------------------------ tokenization
    def encode(self, text: str, param: str = "prompt") -> list[int]:
        """Tokenize; text that is not valid Unicode (lone surrogates from JSON escapes such as
        \\ud800) cannot be encoded as UTF-8 and is a 400 naming ``param``."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"{param}: text is not valid Unicode ({exc.reason} at position "
                           f"{exc.start})", param=param) from exc
        return self.tokenizer(text)["input_ids"]

    async def encode_async(self, text: str, param: str = "prompt") -> list[int]:
        """:meth:`encode` on the tokenizer threads, so a huge prompt never blocks the event
        loop (the Rust tokenizer releases the GIL: /health kept answering within ~50 ms while
        a 5 MB prompt was tokenized). Raises ApiError."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, self.encode, text, param)

    async def expand_images(self, ids: list[int], images: Sequence[Any], param: str
                            ) -> tuple[list[int], list[tuple[int, int, bytes]]]:
        """Decode and check ``images`` (data: URLs or base64; on the tokenizer threads) and
        expand the prompt's image tokens (:mod:`server.multimodal`). Returns the ids and
        :attr:`GenerateInput.images`. Raises ApiError (400) naming ``param``."""
        if self.vision is None:
            raise ApiError(400, f"{param}: this model is text-only (it takes no images)",
                           param=param)

        def check() -> tuple[list[int], list[tuple[int, int, bytes]]]:
            try:
                return expand_prompt_images(ids, [image_bytes(x) for x in images], self.vision,
                                            self.tokenizer.bos_token_id)
            except ImageError as exc:
                raise ApiError(400, f"{param}: {exc}", param=param) from exc

        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, check)

    async def apply_chat_template_async(self, messages: Sequence[dict],
                                        tools: list[dict] | None = None,
                                        template_kwargs: dict[str, Any] | None = None
                                        ) -> list[int]:
        """:meth:`apply_chat_template` on the tokenizer threads. Raises ApiError."""
        return await asyncio.get_running_loop().run_in_executor(
            self._tokenize_pool, lambda: self.apply_chat_template(
                messages, tools=tools, template_kwargs=template_kwargs))

    @property
    def template_renders_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` list itself (else a system prompt
        describes them: :func:`server.http.tools.tools_system_prompt`)."""
        return "tools" in (getattr(self.tokenizer, "chat_template", None) or "")

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the rendered conversation (:func:`server.chat_template.render_chat`);
        ``template_kwargs`` become template variables (e.g. Qwen3's ``enable_thinking``).
        Raises ApiError."""
        try:
            text = render_chat(self.tokenizer, messages, add_generation_prompt, tools,
                               template_kwargs)
        except ChatTemplateError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        return self.encode(text, param="messages")

    def reasoning_state(self, prompt_ids: Sequence[int]) -> str | None:
        """Where an output after ``prompt_ids`` starts (:meth:`ReasoningParser.prompt_state`);
        None when the model has no reasoning parser."""
        if self.reasoning is None:
            return None
        return self.reasoning.prompt_state(self.decode(list(prompt_ids[-8:])))

    def _gate(self, inp: GenerateInput) -> P.ReasoningGate | None:
        if self.reasoning is None or inp.reasoning_state is None or inp.params.grammar is None:
            return None
        return self.reasoning.gate(inp.reasoning_state)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens kept (for logprob token strings)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ------------------------------------------------------------------ requests
    def validate(self, inp: GenerateInput, rename: dict[str, str] | None = None) -> None:
        """Raise ApiError(400) if the request can never run. ``rename`` maps engine field
        names to the API's own (e.g. max_new_tokens -> max_tokens) in the error."""
        try:
            validate_request(inp.input_ids, inp.params, vocab_size=self.info.vocab_size,
                             context_len=self.info.context_len,
                             kv_capacity=self.info.max_total_tokens)
        except (InvalidRequestError, SamplingParamsError) as exc:
            message, param = str(exc), exc.param
            for ours, theirs in (rename or {}).items():
                message = message.replace(ours, theirs)
                param = theirs if param == ours else param
            raise ApiError(400, message, param=param) from exc
        if inp.logprob_start_len >= len(inp.input_ids):
            raise ApiError(400, f"logprob_start_len {inp.logprob_start_len} is not below the "
                           f"prompt length {len(inp.input_ids)}", param="logprob_start_len")

    def check_capacity(self, count: int) -> None:
        """Raise ApiError 503 (+ Retry-After) unless ``count`` more requests fit in flight now
        and requests are served (:meth:`fail_all` was not called)."""
        if self.unavailable is not None:
            raise ApiError(503, self.unavailable, type="server_error")
        if len(self.queues) + count > self.max_queued_requests:
            raise ApiError(503, f"too many requests in flight ({len(self.queues)} of "
                           f"{self.max_queued_requests}; this request needs {count})",
                           type="server_error", headers={"Retry-After": "1"})

    async def generate(self, inp: GenerateInput) -> AsyncIterator[P.ReqOutput]:
        """Send one request and yield its outputs (text filled in, cut at a stop string) until
        it finishes. ``inp`` must have passed :meth:`validate` (the routes' admission step,
        which names the API's own fields in errors): it is not checked again here. Raises
        ApiError.

        Cancelling the consumer (a client disconnect) aborts the request in the scheduler.
        """
        # send, receive, text and stop strings, and the cancel/abort path of one request share
        # its state (queue, in-flight record) and its finally
        self.check_capacity(1)
        rid = inp.rid or uuid.uuid4().hex
        if rid in self.queues:
            raise ApiError(400, f"duplicate request id {rid!r}", param="rid")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[rid] = q
        entry = self.in_flight[rid] = InFlight(rid, len(inp.input_ids), inp.params.max_new_tokens,
                                               inp.max_tokens_given, time.monotonic())
        finished = False
        start = began = time.perf_counter()
        try:
            await self.send_sock.send(P.encode(P.GenerateReq(
                rid=rid, input_ids=inp.input_ids, sampling=inp.params,
                return_logprob=inp.return_logprob, logprob_start_len=inp.logprob_start_len,
                top_logprobs_num=inp.top_logprobs_num, cache_salt=inp.cache_salt,
                reasoning=self._gate(inp),
                images=[P.ImagePart(o, k, d) for o, k, d in inp.images], embed=inp.embed,
                lora=inp.lora, priority=inp.priority)))
            first = True
            pending: collections.deque = collections.deque()
            text = OutputText(self.tokenizer, inp.input_ids, inp.params.stop,
                              inp.params.skip_special_tokens, inp.params.stop_regex,
                              inp.params.no_stop_trim)
            while True:
                if not pending:
                    pending.append(await q.get())
                while not q.empty():
                    pending.append(q.get_nowait())
                entry.unread_since = None
                item = coalesce(pending)
                if isinstance(item, P.ReqError):
                    finished = True
                    raise ApiError(item.status, item.message, param=item.param,
                                   type="invalid_request_error" if item.status < 500
                                   else "server_error")
                try:
                    item, stop = with_text(item, text)
                except StopRegexTimeout as exc:  # the finally block aborts it in the scheduler
                    raise ApiError(400, str(exc), param="stop_regex") from exc
                entry.completion_tokens = item.completion_tokens
                if stop is not None:  # the scheduler sees ids only: tell it to stop
                    finished = True
                    await self.send_sock.send(P.encode(P.AbortReq(rid, stop=stop)))
                now = time.perf_counter()
                if first and not inp.max_tokens_given:  # counted once it generates
                    self.unbounded_requests += 1
                self._observe("ttft" if first else "itl", now - start)
                first, start = False, now
                if item.finish_reason is not None:
                    finished = True
                    self._observe("e2e", now - began)
                yield item
                if finished:
                    return
        finally:
            self.queues.pop(rid, None)
            self.in_flight.pop(rid, None)
            if not finished and self.scheduler_alive:
                await self.send_sock.send(P.encode(P.AbortReq(rid)))
                self._observe("abort", 0.0)

    def _observe(self, event: str, seconds: float) -> None:
        for obs in self.observers:
            obs(event, seconds)

    async def abort(self, rid: str) -> None:
        """Ask the scheduler to abort ``rid`` (a no-op there if unknown or finished)."""
        await self.send_sock.send(P.encode(P.AbortReq(rid, "aborted by /abort_request")))

    async def ask(self, msg: P.Message, reply: type, timeout: float = 10.0):
        """``msg`` to the scheduler -> its ``reply`` answer. Raises ApiError(503) on timeout."""
        async with self._reply_lock:
            fut = asyncio.get_running_loop().create_future()
            self._replies[reply] = fut
            await self.send_sock.send(P.encode(msg))
            try:
                return await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError as exc:
                raise ApiError(503, "the scheduler did not answer", type="server_error") from exc

    async def flush_cache(self) -> bool:
        """Empty the radix cache; False when requests still hold KV. Raises ApiError(503)."""
        return (await self.ask(P.FlushCacheReq(), P.FlushCacheReply)).ok

    async def server_info(self) -> P.ServerInfoReply:
        """Scheduler metrics and invariant-violation count. Raises ApiError(503)."""
        return await self.ask(P.ServerInfoReq(), P.ServerInfoReply)
