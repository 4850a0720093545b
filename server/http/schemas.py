"""Request bodies of the HTTP APIs (pydantic, with bounds). Unknown fields are ignored, as the
OpenAI API does. Sampling fields are checked again, with the engine's own rules, when they become
SamplingParams; bounds here only keep absurd values (huge lists, deep nesting) out early.

Field names follow the OpenAI API and, for ``/generate``, SGLang's native API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_MESSAGES = 1024
MAX_BATCH = 256


class _Body(BaseModel):
    # NaN and infinities are refused as such ("should be a finite number"), not by a bound
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
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
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    # SGLang's native name, sent to /v1/completions by clients such as llama-index-llms-sglang;
    # used when max_tokens is not given
    max_new_tokens: int | None = Field(None, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": "data:image/png;base64,..."}


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=0)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # template variables, e.g. {"enable_thinking": false} for Qwen3 (SGLang / vLLM name)
    chat_template_kwargs: dict[str, Any] | None = None
    # with a reasoning parser: thinking in message.reasoning_content, apart from content
    separate_reasoning: bool = True


class GenerateRequest(_Body):
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


class AbortRequest(_Body):
    rid: str
