"""Every message that crosses the process boundary between the HTTP process (tokenizer manager)
and the scheduler process, as plain typed msgspec structs encoded with msgpack — never pickle,
so garbage on the socket is a decode error, not code execution.

Each frame is an :class:`Envelope` carrying the protocol version; a frame with another version
or an unknown message type is rejected by :func:`decode` with :class:`ProtocolError`.

Directions:
  * to the scheduler: GenerateReq, AbortReq, FlushCacheReq, ServerInfoReq, LoadLoraReq,
    UnloadLoraReq
  * from the scheduler: Ready, BatchOutput (token deltas and finishes), ReqError,
    FlushCacheReply, ServerInfoReply, LoraReply
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from server.sampling_params import SamplingParams

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


# ---------------------------------------------------------------- to the scheduler
class ReasoningGate(msgspec.Struct):
    """Hold a request's grammar back while the model reasons (:mod:`server.reasoning`):
    ``in_reasoning`` from the first token, or, with ``start_id``, if the first token opens a
    think block; the grammar applies once the output ends with ``end_ids``."""

    end_ids: list[int]
    in_reasoning: bool
    start_id: int | None = None


class ImagePart(msgspec.Struct):
    """One image of a request: its token run starts at ``offset`` (ids already expanded),
    ``key`` is its radix-cache id, ``data`` the encoded bytes (checked by the HTTP process)."""

    offset: int
    key: int
    data: bytes


class GenerateReq(msgspec.Struct, tag=True):
    """A tokenized request, validated at admission (:mod:`server.http.admission`): the
    scheduler trusts it. ``sampling`` travels as the SamplingParams dataclass itself (decoding
    rebuilds it through its own checks, which what admission built always passes);
    ``cache_salt``: the client's radix-cache salt (a LoRA adapter's namespace is added to it in
    the scheduler, :meth:`server.engine.Engine.make_request`)."""

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    cache_salt: str | None = None
    reasoning: ReasoningGate | None = None
    images: list[ImagePart] = []
    embed: bool = False  # an embedding request: prefill only (max_new_tokens 0), its vector back
    lora: str | None = None  # the LoRA adapter's name (server.model.lora); None: the base model
    priority: int = 0  # higher is admitted first (SGLang's sign), within the starvation bound


class AbortReq(msgspec.Struct, tag=True):
    """End a request: a client went away (``message``), or the tokenizer manager matched stop
    string ``stop`` in its text (then it finishes as "stop", not as an abort)."""

    rid: str
    message: str = "aborted by client"
    stop: str | None = None


class FlushCacheReq(msgspec.Struct, tag=True):
    """Empty the radix cache (answered by FlushCacheReply)."""


class ServerInfoReq(msgspec.Struct, tag=True):
    """Ask for the scheduler's counters (answered by ServerInfoReply)."""


class LoadLoraReq(msgspec.Struct, tag=True):
    """Serve the PEFT adapter at ``path`` as ``name`` (answered by LoraReply)."""

    name: str
    path: str


class UnloadLoraReq(msgspec.Struct, tag=True):
    """Stop serving adapter ``name`` (answered by LoraReply)."""

    name: str


# ---------------------------------------------------------------- from the scheduler
class Ready(msgspec.Struct, tag=True):
    """Sent once the model is loaded. Sizes in tokens."""

    model_name: str
    vocab_size: int
    context_len: int
    max_total_tokens: int
    dtype: str
    kv_cache_dtype: str  # the KV pool's
    kv_bytes_per_token: int = 0  # K+V bytes of one token over all layers (TokenKVPool)
    device: str = "cpu"
    attention_backend: str = "reference"
    quantization: str = "none"  # what the runner kept quantized (QuantReport.summary())
    compiled: bool = False
    batch_invariant: bool = False  # ModelRunner.batch_invariant
    speculative_ngram: int = 0  # resolved draft length (0 = off)
    hidden_size: int = 0  # the length of an embedding (the model's hidden size)
    embedding_only: bool = False  # a base model without an LM head (ArchConfig.embedding_only)
    pooling: str = "lasttoken"  # how an embedding pools: ArchConfig.pooling.method
    num_labels: int = 0  # a cross-encoder reranker's logits per sequence (0: not one)
    loras: dict[str, str] = {}  # the LoRA adapters served: name -> path


class ReqOutput(msgspec.Struct):
    """One request's progress in one step. The scheduler sends token ids; the tokenizer
    manager fills ``text``, cumulative and stream-safe (never longer than what will finally be
    returned). Logprob lists hold only this step's new entries as [logprob, token_id] pairs
    (logprob None for position 0 of the prompt)."""

    rid: str
    new_token_ids: list[int]
    text: str = ""
    finish_reason: dict[str, Any] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    output_token_logprobs: list[tuple[float, int]] = []
    output_top_logprobs: list[list[tuple[float, int]]] = []
    input_token_logprobs: list[tuple[float | None, int]] = []
    input_top_logprobs: list[list[tuple[float, int]]] = []
    embedding: list[float] | None = None  # an embedding request's vector, with its finish


class BatchOutput(msgspec.Struct, tag=True):
    """Every request's progress in one scheduler step."""

    outputs: list[ReqOutput]


class ReqError(msgspec.Struct, tag=True):
    """The scheduler refused or failed a request; ``status`` is the HTTP status to answer."""

    rid: str
    message: str
    param: str | None = None
    status: int = 400


class FlushCacheReply(msgspec.Struct, tag=True):
    """The answer to FlushCacheReq: False when requests held KV and nothing was flushed."""

    ok: bool


class LoraReply(msgspec.Struct, tag=True):
    """The answer to LoadLoraReq / UnloadLoraReq: ``message`` and the HTTP ``status`` when
    refused (400 a bad adapter, 404 an unknown name, 409 one with requests in flight), and
    the adapters served afterwards (name -> path)."""

    ok: bool
    loras: dict[str, str]
    message: str = ""
    status: int = 200


class ServerInfoReply(msgspec.Struct, tag=True):
    """The answer to ServerInfoReq: the scheduler's counters (``Scheduler.metrics``) and how
    many KV invariant checks failed so far."""

    metrics: dict[str, float]
    invariant_violations: int


Message = Union[GenerateReq, AbortReq, FlushCacheReq, ServerInfoReq, LoadLoraReq, UnloadLoraReq,
                Ready, BatchOutput, ReqError, FlushCacheReply, ServerInfoReply, LoraReply]


class Envelope(msgspec.Struct):
    """One frame on the wire: the protocol version ``v`` and the message."""

    v: int
    msg: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


def encode(msg: Message) -> bytes:
    """``msg`` as one msgpack frame in an Envelope of this PROTOCOL_VERSION."""
    return _encoder.encode(Envelope(PROTOCOL_VERSION, msg))


def decode(frame: bytes) -> Message:
    """Decode one frame. Raises ProtocolError for garbage, unknown types or another version."""
    try:
        env = _decoder.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc
    if env.v != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {env.v}, expected {PROTOCOL_VERSION}")
    return env.msg


def refused_request_id(frame: bytes) -> str | None:
    """The ``rid`` of a GenerateReq frame that :func:`decode` refused, read without the types
    (so its client gets an error instead of waiting), or None when the frame is not one."""
    try:
        msg = msgspec.msgpack.decode(frame).get("msg")
    except (msgspec.DecodeError, AttributeError):
        return None
    if not isinstance(msg, dict) or msg.get("type") != "GenerateReq":
        return None
    rid = msg.get("rid")
    return rid if isinstance(rid, str) else None
