"""Request bodies of the HTTP APIs (pydantic, with bounds). Unknown fields are ignored, as the
OpenAI API does. Sampling fields are checked again, with the engine's own rules, when they become
SamplingParams; bounds here only keep absurd values (huge lists, deep nesting) out early.

Field names follow the OpenAI API and, for ``/generate``, SGLang's native API.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_MESSAGES = 1024
MAX_BATCH = 256


def _invalid(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (which no UTF-8 encoder accepts)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_at(data: Any) -> str | None:
    """The path ("stop[1]", "metadata.user") of the first string in parsed JSON ``data``
    (keys included) holding a lone UTF-16 surrogate (a JSON escape such as "\\ud800" with no
    pair); None when every string is valid Unicode. One pass; paths are built only for
    containers and the string found (a list of 100k token ids costs no string work). Valid
    data, the usual case, is settled by encoding it once with msgspec (a 2 MB schema: 8 ms
    instead of 184 ms of walking)."""
    if isinstance(data, str):
        return "body" if _invalid(data) else None
    try:  # fast path: the whole body encodes as UTF-8, so no string holds a lone surrogate
        msgspec.json.encode(data)
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError):  # not JSON data (a caller's own object): walk it
        pass
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            entries = ((f"{path}.{k}" if path else str(k), k, v) for k, v in node.items())
        elif isinstance(node, list):
            entries = ((f"{path}[{i}]", None, v) for i, v in enumerate(node)
                       if isinstance(v, (str, dict, list)))
        else:
            continue
        for where, key, value in entries:
            if isinstance(key, str) and _invalid(key):
                return where.encode("utf-8", "backslashreplace").decode("utf-8")  # printable
            if isinstance(value, str):
                if _invalid(value):
                    return where.encode("utf-8", "backslashreplace").decode("utf-8")
            elif isinstance(value, (dict, list)):
                stack.append((value, where))
    return None


class _Body(BaseModel):
    # NaN and infinities are refused as such ("should be a finite number"), not by a bound
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(_Body):
    """Base of every top-level request body: unknown fields ignored, non-finite numbers and
    invalid Unicode refused (the whole body checked once, nested parts included)."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """A lone surrogate in a field that reaches an encoder later (a stop string, a
        grammar, a request id) was a 500: refused here with the field's path."""
        bad = lone_surrogate_at(data)
        if bad is not None:
            raise ValueError(f"{bad}: text is not valid Unicode (a lone UTF-16 surrogate, "
                             "e.g. an unpaired \\ud800 escape)")
        return data


class StreamOptions(_Body):
    """OpenAI ``stream_options``: ``include_usage`` adds a final usage chunk."""

    include_usage: bool = False


class _OpenAISampling(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    priority: int = Field(0, ge=-2 ** 31, lt=2 ** 31)  # vLLM's: lower is admitted first
    n: int = Field(1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = Field(None, ge=0, le=100)
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (SGLang/vLLM names)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    # arrive with constrained decoding ([4/9]); refused clearly until then
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    regex: str | None = None
    json_schema: Any = None
    ebnf: str | None = None


class CompletionRequest(_OpenAISampling):
    """The body of ``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    # SGLang's native name, sent to /v1/completions by clients such as llama-index-llms-sglang;
    # used when max_tokens is not given
    max_new_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None


class ContentPart(_Body):
    """One part of a chat message's content: text, or an image URL."""

    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": "data:image/png;base64,..."}


class ChatMessage(_Body):
    """One chat message: role, content (text or parts), tool calls and their results."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAISampling):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # template variables, e.g. {"enable_thinking": false} for Qwen3 (SGLang / vLLM name)
    chat_template_kwargs: dict[str, Any] | None = None
    # with a reasoning parser: thinking in message.reasoning_content, apart from content
    separate_reasoning: bool = True


class GenerateRequest(RequestBody):
    """SGLang-style native request: ``text`` or ``input_ids``, single or batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)  # -1: no prompt logprobs
    top_logprobs_num: int = Field(0, ge=0, le=20)
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    image_data: Any = None
    cache_salt: str | None = None
    # with a reasoning parser: thinking in "reasoning_text", the grammar on the answer only
    separate_reasoning: bool = False
    # SGLang's: a served LoRA adapter's name (or the path it was loaded from), per prompt in
    # a batch; None: the base model
    lora_path: str | list[str | None] | None = None
    priority: int = Field(0, ge=-2 ** 31, lt=2 ** 31)  # SGLang's: higher is admitted first


class LoadLoraAdapterRequest(RequestBody):
    """SGLang's ``POST /load_lora_adapter``: serve the PEFT adapter at ``lora_path`` as
    ``lora_name``."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoraAdapterRequest(RequestBody):
    """SGLang's ``POST /unload_lora_adapter``."""

    lora_name: str = Field(min_length=1, max_length=256)


class EmbeddingRequest(RequestBody):
    """The body of ``POST /v1/embeddings`` (OpenAI's shape): a text, a list of texts, token
    ids or a list of them."""

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class EncodeRequest(RequestBody):
    """The body of SGLang's native ``POST /encode``: ``text`` or ``input_ids``, single or
    batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None


class RerankDocument(_Body):
    """A document to rerank given as an object (Jina's and Cohere's shape)."""

    text: str


class RerankRequest(RequestBody):
    """The body of ``POST /v1/rerank`` (the Jina / Cohere shape SGLang and vLLM accept)."""

    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = True
    instruct: str | None = None  # the task the relevance is judged for (Qwen3-Reranker's)


class ScoreRequest(RequestBody):
    """The body of vLLM's ``POST /score``: ``text_1`` (one query, or one per ``text_2``)
    scored against each of ``text_2``."""

    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    instruct: str | None = None


class ConcatenateRequest(RequestBody):
    """The body of SGLang's ``POST /concate_and_append_request``."""

    src_rids: list[str] = Field(max_length=256)
    dst_rid: str


class AbortRequest(RequestBody):
    """The body of ``POST /abort_request``."""

    rid: str
