"""``ChatSGLang``: a LangChain chat model for the bundled server.

It overrides the methods ``BaseChatModel`` defines (``_generate``, ``_agenerate``, ``_stream``,
``_astream``, ``bind_tools``, ``with_structured_output``) and talks to the server's OpenAI route
with the ``openai`` client. What makes it more than ``ChatOpenAI(base_url=...)``:

* tools with ``tool_choice`` any/required/<name> and structured output (``json_schema``,
  ``function_calling``, ``json_mode``) are enforced by the server's grammar, so calls and
  objects always validate, even on a 135M model;
* ``batch``/``abatch`` find the prompt prefix all inputs share (system prompt, few-shot
  messages, retrieved context), send it once as a prefill-only cache hint, then run the
  requests concurrently, so the prefix is computed once;
* ``usage_metadata.input_token_details.cache_read`` reports the server's cached tokens;
* ``llm.bind(substring_of=passages)`` (a text or a list; ``max_words=`` bounds it) makes every
  answer a contiguous word span of the passages (grounded extraction, an EBNF grammar on the
  server);
  ``regex=``, ``json_schema=`` and ``ebnf=`` bind the other constraints.

Every request carries a ``max_tokens``: the caller's (``max_tokens=`` on the model, or per call),
else :data:`DEFAULT_MAX_TOKENS`, never "the rest of the context". The public methods take
``ChatOpenAI``'s arguments; docs/adapters.md's "LangChain" section lists where they differ (pinned by
``tests/adapters/test_langchain.py``).
"""

from __future__ import annotations

import os
from operator import itemgetter
from typing import Any, AsyncIterator, Iterator, Literal, Sequence

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from sgl_adapters.backends.runtime_endpoint import RuntimeEndpoint
from sgl_adapters.lang.grounding import substring_grammar
from sgl_adapters.lang.hints import PrefixHints
from sgl_adapters.langchain.clients import OpenAIClients, api_key_from_env
from sgl_adapters.langchain.messages import chunk_from_openai, from_openai, to_openai

# Output tokens of a request whose caller set no max_tokens (ChatAnthropic's long-standing
# default; ChatOpenAI sends none and OpenAI's server allows the rest of the context, which on a
# small model that loops means minutes of decoding).
DEFAULT_MAX_TOKENS = 1024


class ChatSGLang(OpenAIClients, BaseChatModel):
    """Chat model for the bundled server (``python -m server``).

    Example::

        llm = ChatSGLang(base_url="http://127.0.0.1:30000", temperature=0)
        llm.invoke("Hello")
        llm.with_structured_output(Person).invoke("Ada Lovelace, 36")   # always a Person
    """

    model: str = Field(default="default", alias="model_name")
    base_url: str = "http://127.0.0.1:30000"
    api_key: SecretStr | None = Field(default_factory=api_key_from_env)
    temperature: float | None = None
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, alias="max_completion_tokens")
    """Output tokens per request (None: :data:`DEFAULT_MAX_TOKENS`)."""
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    seed: int | None = None
    timeout: float | None = 600.0
    max_retries: int = 2
    streaming: bool = False
    n: int = 1
    logprobs: bool | None = None
    top_logprobs: int | None = None

    model_config = ConfigDict(populate_by_name=True)

    _client: Any = PrivateAttr(default=None)
    _async_client: Any = PrivateAttr(default=None)
    _hints: PrefixHints | None = PrivateAttr(default=None)

    # Not lc-serializable: langchain-core 1.x's load() only revives classes on its own
    # allowlist (langchain_core.load.mapping), so the round trip cannot work for a third-party
    # package; the standard suite's test_serdes skips itself for that reason.

    @property
    def lc_secrets(self) -> dict[str, str]:
        """LangChain's secret fields and the environment variables they come from."""
        return {"api_key": "SGLANG_API_KEY"}

    # -- clients: client / async_client from OpenAIClients -------------------------------------
    @property
    def hints(self) -> PrefixHints:
        """The prefix hinter that prefills a batch's shared prefix once (created on first
        use; into the LoRA adapter's cache when ``model`` names one)."""
        if self._hints is None:
            key = self.api_key.get_secret_value() if self.api_key else None
            self._hints = PrefixHints(RuntimeEndpoint(self.base_url, api_key=key,
                                                      timeout=self.timeout or 600.0,
                                                      model=self.model))
        return self._hints

    # -- LangChain metadata --------------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "sglang-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "base_url": self.base_url, **self._default_params()}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="sglang", ls_model_name=kwargs.get("model",
                                                                                self.model),
                                 ls_model_type="chat")
        if self.temperature is not None:
            params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        params["ls_max_tokens"] = kwargs.get("max_tokens") or self.max_tokens or DEFAULT_MAX_TOKENS
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    # -- requests ------------------------------------------------------------------------------
    def _default_params(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("temperature", "top_p", "seed")
               if getattr(self, k) is not None}
        out["max_tokens"] = self.max_tokens or DEFAULT_MAX_TOKENS
        extra = {k: getattr(self, k) for k in ("top_k", "min_p") if getattr(self, k) is not None}
        if extra:
            out["extra_body"] = extra
        if self.n != 1:
            out["n"] = self.n
        if self.logprobs:
            out["logprobs"] = True
            if self.top_logprobs is not None:
                out["top_logprobs"] = self.top_logprobs
        return out

    def _request(self, messages: list[BaseMessage], stop: list[str] | None,
                 kwargs: dict[str, Any]) -> dict[str, Any]:
        body = {"model": self.model, **self._default_params(), **kwargs,
                "messages": [to_openai(m) for m in messages]}
        if "max_completion_tokens" in body:  # ChatOpenAI's name for it, per call
            body["max_tokens"] = body.pop("max_completion_tokens")
        if body.get("max_tokens") is None:
            body["max_tokens"] = self.max_tokens or DEFAULT_MAX_TOKENS
        if stop or self.stop:
            body["stop"] = stop or self.stop
        if "substring_of" in kwargs:  # grounded extraction: the answer is a span of these texts
            body["ebnf"] = substring_grammar(body.pop("substring_of"),
                                             body.pop("max_words", None))
        for key in ("top_k", "min_p", "regex", "json_schema", "ebnf"):
            if key in body:
                body.setdefault("extra_body", {})[key] = body.pop(key)
        return body

    def _result(self, resp: Any) -> ChatResult:
        gens = [ChatGeneration(message=from_openai(c, resp.model or self.model,
                                                   resp.usage if i == 0 else None),
                               generation_info={"finish_reason": c.finish_reason})
                for i, c in enumerate(resp.choices)]
        return ChatResult(generations=gens, llm_output={"model_name": resp.model or self.model})

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        if self.streaming:
            return _merge_chunks(self._stream(messages, stop, run_manager, **kwargs))
        return self._result(self.client.chat.completions.create(
            **self._request(messages, stop, kwargs)))

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if self.streaming:
            return _merge_chunks([c async for c in self._astream(messages, stop, run_manager,
                                                                 **kwargs)])
        resp = await self.async_client.chat.completions.create(
            **self._request(messages, stop, kwargs))
        return self._result(resp)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        body = {**self._request(messages, stop, kwargs), "stream": True,
                "stream_options": {"include_usage": True}}
        for raw in self.client.chat.completions.create(**body):
            chunk = self._chunk(raw)
            if chunk is not None:
                if run_manager:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        body = {**self._request(messages, stop, kwargs), "stream": True,
                "stream_options": {"include_usage": True}}
        async for raw in await self.async_client.chat.completions.create(**body):
            chunk = self._chunk(raw)
            if chunk is not None:
                if run_manager:
                    await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk

    def _chunk(self, raw: Any) -> ChatGenerationChunk | None:
        message = chunk_from_openai(raw, raw.model or self.model)
        if message is None:
            return None
        info = ({"finish_reason": message.response_metadata["finish_reason"]}
                if "finish_reason" in message.response_metadata else None)
        return ChatGenerationChunk(message=message, generation_info=info)

    # -- batches share their prefix ------------------------------------------------------------
    def _hint_shared_prefix(self, inputs: Sequence[LanguageModelInput]) -> None:
        if len(inputs) < 2:
            return
        try:
            template = self.hints.backend.chat_template
            texts = []
            for value in inputs:
                msgs = self._convert_input(value).to_messages()
                turns = [to_openai(m) for m in msgs]
                if any(not isinstance(t["content"], str) or t["role"] not in template.roles
                       for t in turns):
                    return
                texts.append(template.render([(t["role"], t["content"]) for t in turns]))
        except Exception:  # noqa: BLE001 - a hint is only an optimisation
            return
        self.hints.ensure(os.path.commonprefix(texts))

    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig]
              | None = None, *, return_exceptions: bool = False, **kwargs: Any) -> list[Any]:
        """LangChain's batch, after the inputs' shared prompt prefix is prefilled once."""
        self._hint_shared_prefix(inputs)
        return super().batch(inputs, config, return_exceptions=return_exceptions, **kwargs)

    async def abatch(self, inputs: list[LanguageModelInput], config: RunnableConfig
                     | list[RunnableConfig] | None = None, *, return_exceptions: bool = False,
                     **kwargs: Any) -> list[Any]:
        """LangChain's abatch, after the inputs' shared prompt prefix is prefilled once."""
        import asyncio

        await asyncio.to_thread(self._hint_shared_prefix, inputs)
        return await super().abatch(inputs, config, return_exceptions=return_exceptions,
                                    **kwargs)

    # -- tools and structured output -----------------------------------------------------------
    def bind_tools(self, tools: Sequence[Any], *, tool_choice: str | bool | dict | None = None,
                   strict: bool | None = None, parallel_tool_calls: bool | None = None,
                   response_format: Any = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, BaseMessage]:
        """Bind tools, as ``ChatOpenAI.bind_tools``. ``tool_choice``: "auto", "none",
        "any"/"required" (some call), a tool name (that call), True (the only tool). Forced
        calls are grammar-enforced whatever ``strict`` says (it is passed on in the tool
        specs); ``parallel_tool_calls`` is passed on (a forced reply holds one call);
        ``response_format`` (a schema or an OpenAI response format) constrains replies that
        are not calls. Raises ValueError for a tool_choice naming no bound tool."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None:
            names = [t["function"]["name"] for t in formatted]
            if tool_choice is True:
                if len(names) != 1:
                    raise ValueError("tool_choice=True needs exactly one tool")
                tool_choice = names[0]
            if tool_choice == "any":
                tool_choice = "required"
            if isinstance(tool_choice, str) and tool_choice not in ("auto", "none", "required"):
                if tool_choice not in names:
                    raise ValueError(f"tool_choice {tool_choice!r} is not one of {names}")
                tool_choice = {"type": "function", "function": {"name": tool_choice}}
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        if response_format is not None:
            kwargs["response_format"] = _response_format(response_format, strict)
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: Any = None, *,
                               method: Literal["function_calling", "json_mode",
                                               "json_schema"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               tools: list | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Outputs that always validate, as ``ChatOpenAI.with_structured_output``: the schema
        becomes a grammar on the server. ``schema``: pydantic class, TypedDict or JSON-schema
        dict (may be None for json_mode, which then returns any JSON object as a dict; given a
        schema, json_mode enforces it like json_schema). ``kwargs`` are bound to the model.
        Raises ValueError for a missing schema, ``strict`` with json_mode, an unknown method,
        or ``tools`` (a reply that is either a call or the schema's object needs a grammar
        for both; not built yet)."""
        if tools:
            raise ValueError("tools alongside structured output are not supported: bind the "
                             "tools with bind_tools(..., response_format=schema) instead")
        if method == "json_mode" and strict is not None:
            raise ValueError("Argument `strict` is not supported with `method`='json_mode'")
        if method != "json_mode" and schema is None:
            raise ValueError(f"method={method!r} needs a schema (only json_mode takes None)")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        if method == "function_calling":
            tool = convert_to_openai_tool(schema)
            name = tool["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, ls_structured_output_format={
                "kwargs": {"method": method, "strict": strict}, "schema": tool}, **kwargs)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True)
                                if is_pydantic else
                                JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        elif method in ("json_schema", "json_mode"):
            # json_mode: valid JSON always (a JSON-object grammar); with a schema, its grammar
            fmt = ({"type": "json_object"} if schema is None
                   else _response_format(schema, True if strict is None else strict))
            llm = self.bind(response_format=fmt, ls_structured_output_format={
                "kwargs": {"method": method} if method == "json_mode"
                else {"method": method, "strict": strict},
                "schema": schema if method == "json_mode"
                else fmt["json_schema"]["schema"]}, **kwargs)
            parser = (PydanticOutputParser(pydantic_object=schema) if is_pydantic
                      else JsonOutputParser())
        else:
            raise ValueError(f"unknown method {method!r}")
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                            parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback],
                                                            exception_key="parsing_error")

    # -- token counting ------------------------------------------------------------------------
    def get_num_tokens_from_messages(self, messages: Sequence[BaseMessage],
                                     tools: Sequence[Any] | None = None, *,
                                     allow_fetching_images: bool = True) -> int:
        """Prompt tokens of ``messages`` (and ``tools``) as the server counts them: the model's
        own tokenizer and chat template, from a prefill-only request's usage (its KV stays in
        the radix cache, so a call that follows pays nothing for the count).
        ``allow_fetching_images`` is accepted for ChatOpenAI's signature (images are sent as
        they are). Raises openai.APIError when the server refuses the messages."""
        body = self._request(list(messages), None, {"max_tokens": 0})
        if tools:
            body["tools"] = [convert_to_openai_tool(t) for t in tools]
        return self.client.chat.completions.create(**body).usage.prompt_tokens


def _response_format(schema: Any, strict: bool | None) -> dict[str, Any]:
    """An OpenAI ``response_format`` (json_schema) for a pydantic class, TypedDict or JSON
    schema; an OpenAI response format dict is returned as it is."""
    if isinstance(schema, dict) and schema.get("type") in ("json_schema", "json_object"):
        return schema
    json_schema = (schema.model_json_schema() if hasattr(schema, "model_json_schema")
                   else convert_to_json_schema(schema))
    return {"type": "json_schema", "json_schema": {
        "name": json_schema.get("title", "output"), "schema": json_schema,
        "strict": True if strict is None else strict}}


def _merge_chunks(chunks) -> ChatResult:
    merged = None
    for chunk in chunks:
        merged = chunk if merged is None else merged + chunk
    if merged is None:
        raise ValueError("the stream returned no chunks")
    return ChatResult(generations=[ChatGeneration(message=merged.message,
                                                  generation_info=merged.generation_info)])
