"""Admission: one place that turns an API request body into the validated requests sent to the
scheduler, all before the response starts (so a streaming request fails exactly like a
non-streaming one): chat template and tokenization (on the tokenizer threads), SamplingParams,
constraints (response_format, regex, json_schema, tools), default max_tokens, and validation
with the API's own field names in error messages. Grammars themselves compile in the
scheduler process, off its loop (:mod:`server.scheduler.loop`); a spec that cannot compile
comes back before the headers (:func:`server.http.responses.start_streams`).

Errors: :class:`server.http.tokenizer_manager.ApiError` (400) naming the field.
"""

from __future__ import annotations

import json
from typing import Any

from server.http.errors import ApiError
from server.http.schemas import (
    MAX_BATCH,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    _OpenAISampling,
)
from server.http.tokenizer_manager import GenerateInput, TokenizerManager
from server.http.tools import call_schema, forced_names, parse_tools, tools_system_prompt
from server.sampling_params import SamplingParams, SamplingParamsError

# Engine field -> the API's name, for error messages.
COMPLETION_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                    "input_ids": "prompt"}
CHAT_NAMES = {**COMPLETION_NAMES, "input_ids": "messages"}


async def admit_completion(manager: TokenizerManager, body: CompletionRequest
                           ) -> tuple[list[list[int]], list[GenerateInput]]:
    """/v1/completions: (prompt token ids, one input per prompt x n, prompt-major)."""
    if body.tools:
        raise ApiError(400, "'tools' is for /v1/chat/completions", param="tools")
    if body.suffix:
        raise ApiError(400, "'suffix' is not supported", param="suffix")
    single = isinstance(body.prompt, str) or all(isinstance(p, int) for p in body.prompt)
    check_batch(manager, (1 if single else len(body.prompt)) * body.n, "prompt")  # before
    prompts = await _prompts(manager, body.prompt)  # tokenizing 1,010 prompts cost 0.24 s
    want_lp = body.logprobs is not None
    given = body.max_tokens if "max_tokens" in body.model_fields_set or \
        body.max_new_tokens is None else body.max_new_tokens
    inputs = []
    for ids in prompts:
        max_tokens = given if given is not None else _default_max_tokens(manager, len(ids))
        for j in range(body.n):
            inputs.append(GenerateInput(
                ids, _params(body, max_tokens, j), return_logprob=want_lp,
                logprob_start_len=0 if (want_lp and body.echo) else -1,
                top_logprobs_num=body.logprobs or 0, max_tokens_given=given is not None,
                lora=lora_of_model(manager, body.model), priority=-body.priority))
    for inp in inputs:  # every choice is checked before any is sent
        manager.validate(inp, COMPLETION_NAMES)
    return prompts, inputs


async def admit_chat(manager: TokenizerManager, body: ChatCompletionRequest
                     ) -> tuple[list[GenerateInput], dict[str, dict], bool]:
    """/v1/chat/completions: (n inputs, the parsed tools, whether replies may be tool calls)."""
    tools = parse_tools(body.tools)
    names = forced_names(tools, body.tool_choice)
    vision = manager.vision
    messages, images = _messages(body, vision.image_token if vision is not None else None)
    constraint = None
    use_tools = bool(tools) and names != []
    if use_tools:
        if not manager.template_renders_tools:
            messages = [{"role": "system", "content": tools_system_prompt(tools)}] + messages
        if names:
            if body.response_format or body.regex or body.json_schema or body.ebnf:
                raise ApiError(400, "a forced tool call cannot be combined with another "
                               "constraint", param="tool_choice")
            constraint = {"json_schema": call_schema(tools, names)}
    ids = await manager.apply_chat_template_async(
        messages, tools=[{"type": "function", "function": t} for t in tools.values()]
        if use_tools and manager.template_renders_tools else None,
        template_kwargs=body.chat_template_kwargs)
    image_parts: list = []
    if images:
        ids, image_parts = await manager.expand_images(ids, images, "messages")
    state = manager.reasoning_state(ids) if body.separate_reasoning else None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    given = max_tokens is not None
    if not given:
        max_tokens = _default_max_tokens(manager, len(ids))
    check_batch(manager, body.n, "n")
    inputs = [GenerateInput(ids, _params(body, max_tokens, j, constraint),
                            return_logprob=body.logprobs, top_logprobs_num=body.top_logprobs or 0,
                            reasoning_state=state, images=image_parts, max_tokens_given=given,
                            lora=lora_of_model(manager, body.model), priority=-body.priority)
              for j in range(body.n)]
    for inp in inputs:
        manager.validate(inp, CHAT_NAMES)
    return inputs, tools, use_tools


def lora_of_model(manager: TokenizerManager, model: str | None) -> str | None:
    """The LoRA adapter an OpenAI ``model`` names, as vLLM and SGLang read it: an adapter's
    name, or "BASE:NAME" with BASE the served model's name; None (the base model) for any
    other name. Raises ApiError(404) for "BASE:NAME" where NAME is no served adapter."""
    if not model or model in manager.loras:
        return model or None
    base, sep, name = model.rpartition(":")
    if not sep or base != manager.info.model_name:
        return None
    if name not in manager.loras:
        raise ApiError(404, f"LoRA adapter {name!r} is not loaded (served: "
                       f"{sorted(manager.loras)})", param="model", type="not_found_error")
    return name


def lora_of_path(manager: TokenizerManager, lora_path: str | None) -> str | None:
    """/generate's ``lora_path`` (SGLang's): a served adapter's name or the path it was loaded
    from -> its name; None: the base model. Raises ApiError(404) naming an unknown one."""
    if lora_path is None or lora_path in manager.loras:
        return lora_path
    for name, path in manager.loras.items():
        if path == lora_path:
            return name
    raise ApiError(404, f"LoRA adapter {lora_path!r} is not loaded (served: "
                   f"{sorted(manager.loras)})", param="lora_path", type="not_found_error")


def check_batch(manager: TokenizerManager, count: int, param: str) -> None:
    """A request runs ``count`` sequences (prompts x n): at most MAX_BATCH and the server's
    queue size (413 naming the limit, which no retry changes), and all of them or none enter
    the queue (503 + Retry-After when they do not fit now), so a batch never half-starts."""
    limit = min(MAX_BATCH, manager.max_queued_requests)
    if count > limit:
        raise ApiError(413, f"{param}: a request runs at most {limit} sequences (prompts "
                       f"x n); this one asks for {count}: split it", param=param)
    manager.check_capacity(count)


def _constraint(body: _OpenAISampling) -> dict[str, Any]:
    """response_format (json_object, json_schema) or the regex / json_schema extensions, as
    SamplingParams fields. Raises ApiError for a malformed response_format."""
    rf = body.response_format
    given = [n for n in ("regex", "json_schema", "ebnf") if getattr(body, n) is not None]
    if rf is not None and rf.get("type") not in (None, "text"):
        if given:
            raise ApiError(400, f"give response_format or {given[0]}, not both", param=given[0])
        if rf.get("type") == "json_object":
            return {"json_schema": {"type": "object"}}
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ApiError(400, "response_format.json_schema must be an object with a "
                               "'schema'", param="response_format")
            return {"json_schema": spec.get("schema") or {"type": "object"}}
        raise ApiError(400, f"response_format type {rf.get('type')!r} is not supported",
                       param="response_format")
    return {"regex": body.regex, "json_schema": body.json_schema, "ebnf": body.ebnf}


def _params(body: _OpenAISampling, max_tokens: int, seed_offset: int = 0,
            constraint: dict[str, Any] | None = None) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    fields = {
        "max_new_tokens": max_tokens, "temperature": body.temperature, "top_p": body.top_p,
        "top_k": body.top_k, "min_p": body.min_p, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "stop": stop,
        "stop_token_ids": body.stop_token_ids, "ignore_eos": body.ignore_eos,
        "min_new_tokens": body.min_tokens, "skip_special_tokens": body.skip_special_tokens,
        "no_stop_trim": body.no_stop_trim,
        "seed": None if body.seed is None else body.seed + seed_offset,
        "logit_bias": body.logit_bias,
        **(constraint if constraint is not None else _constraint(body)),
    }
    try:
        return SamplingParams.from_dict(fields)
    except SamplingParamsError as exc:
        param = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}.get(
            exc.param, exc.param)
        raise ApiError(400, str(exc).replace(exc.param, param, 1), param=param) from exc


def _default_max_tokens(manager: TokenizerManager, prompt_len: int) -> int:
    """Without max_tokens: as many as fit both the context and the KV pool (a pool smaller
    than the context length must not refuse every such request)."""
    room = min(manager.info.context_len, manager.info.max_total_tokens)
    return max(room - prompt_len, 0)


async def _generate_images(manager: TokenizerManager, image_data: Any, prompts: list[list[int]],
                           single: bool) -> list[tuple[list[int], list]]:
    """/generate ``image_data`` (SGLang's shapes: one image or a list of them for a single
    prompt; a list with one entry, an image or a list, per prompt of a batch) -> (expanded ids,
    image parts) per prompt. Raises ApiError."""
    if image_data is None:
        return [(ids, []) for ids in prompts]
    if single:
        per_prompt = [image_data if isinstance(image_data, list) else [image_data]]
    else:
        if not isinstance(image_data, list) or len(image_data) != len(prompts):
            raise ApiError(400, "image_data must have one entry per prompt of the batch",
                           param="image_data")
        per_prompt = [x if isinstance(x, list) else ([] if x is None else [x])
                      for x in image_data]
    out = []
    for ids, imgs in zip(prompts, per_prompt):
        out.append(await manager.expand_images(ids, imgs, "image_data") if imgs else (ids, []))
    return out


async def admit_embedding(manager: TokenizerManager, given: Any, param: str,
                          lora: str | None = None) -> list[GenerateInput]:
    """/v1/embeddings ``input`` or /encode ``text``/``input_ids`` (``param`` names it): one
    prefill-only input per text, each must hold at least one token; ``lora``: a served
    adapter computes them. Raises ApiError."""
    single = isinstance(given, str) or all(isinstance(p, int) for p in given)
    check_batch(manager, 1 if single else len(given), param)
    inputs = []
    for k, ids in enumerate(await _prompts(manager, given, param)):
        where = param if single else f"{param}[{k}]"
        if not ids:
            raise ApiError(400, f"{where} is empty: an embedding needs at least one token",
                           param=param)
        if len(ids) > manager.info.context_len:
            raise ApiError(400, f"{where} has {len(ids)} tokens; the context length is "
                           f"{manager.info.context_len}", param=param)
        inp = GenerateInput(ids, SamplingParams(max_new_tokens=0), embed=True, lora=lora)
        manager.validate(inp, {"input_ids": param})
        inputs.append(inp)
    return inputs


async def _prompts(manager: TokenizerManager, prompt: Any, param: str = "prompt"
                   ) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await manager.encode_async(prompt, param)]
    if not prompt:
        raise ApiError(400, f"{param} is empty", param=param)
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [await manager.encode_async(p, param) for p in prompt]
    return [list(p) for p in prompt]


def _messages(body: ChatCompletionRequest, image_token: str | None = None
              ) -> tuple[list[dict[str, Any]], list[Any]]:
    """(template messages, image URLs in order). An ``image_url`` part becomes
    ``image_token`` in its message's text (None: the model is text-only, a 400)."""
    out, images = [], []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if part.type == "image_url" and image_token is not None:
                    url = part.image_url.get("url") if isinstance(part.image_url, dict) \
                        else part.image_url
                    if not isinstance(url, str):
                        raise ApiError(400, f"{where}.image_url must have a string 'url'",
                                       param=f"{where}.image_url")
                    images.append(url)
                    texts.append(image_token)
                    continue
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"{where}: content part type {part.type!r} is not "
                                   "supported by this text-only model" if part.type ==
                                   "image_url" else f"{where}: content part type {part.type!r} "
                                   "is not supported", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        role = "system" if m.role == "developer" else m.role
        if m.tool_calls and not content:  # an earlier call, shown to the model as it wrote it
            content = "\n".join(json.dumps(_earlier_call(c, f"messages[{i}].tool_calls[{j}]"))
                                for j, c in enumerate(m.tool_calls))
        out.append({"role": role, "content": content or ""})
    return out, images


def _earlier_call(call: Any, where: str) -> dict[str, Any]:
    """{"name", "arguments"} of an assistant message's earlier tool call. Raises ApiError 400
    naming the field when it is not {"function": {"name": str, "arguments": JSON text}}."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(400, f"{where}.function must be an object with a string 'name'",
                       param=f"{where}.function")
    args = fn.get("arguments") or "{}"
    try:
        arguments = json.loads(args) if isinstance(args, str) else None
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        raise ApiError(400, f"{where}.function.arguments must be a JSON object encoded as a "
                       "string", param=f"{where}.function.arguments")
    return {"name": fn["name"], "arguments": arguments}


async def admit_generate(manager: TokenizerManager, body: GenerateRequest
                         ) -> tuple[list[GenerateInput], bool]:
    """/generate: (one input per prompt, whether the body was a single prompt)."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError(400, "give exactly one of 'text' and 'input_ids'", param="text")
    given = body.text if body.text is not None else body.input_ids
    single = isinstance(given, str) if body.text is not None else \
        (not given or isinstance(given[0], int))
    # sized before tokenizing (1,010 prompts took 0.24 s of the HTTP process to refuse)
    check_batch(manager, 1 if single else len(given),
                 "text" if body.text is not None else "input_ids")
    if body.text is not None:
        prompts = [await manager.encode_async(t, "text")
                   for t in ([body.text] if single else body.text)]
    else:
        prompts = [list(body.input_ids)] if single else [list(p) for p in body.input_ids]
    if not prompts:
        raise ApiError(400, "the batch is empty", param="text")
    images = await _generate_images(manager, body.image_data, prompts, single)
    sp = body.sampling_params
    sps = sp if isinstance(sp, list) else [sp or {}] * len(prompts)
    rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
    loras = body.lora_path if isinstance(body.lora_path, list) else \
        [body.lora_path] * len(prompts)
    if len(sps) != len(prompts) or len(rids) != len(prompts) or len(loras) != len(prompts):
        raise ApiError(400, "sampling_params, rid and lora_path lists must match the batch "
                       "size", param="sampling_params")
    inputs = []
    for k, (_, d, rid) in enumerate(zip(prompts, sps, rids)):
        try:
            params = SamplingParams.from_sglang(d)
        except SamplingParamsError as exc:
            raise ApiError(400, f"sampling_params.{exc}", param=exc.param) from exc
        if params.n != 1:
            raise ApiError(400, "sampling_params.n > 1 is not supported on /generate; send the "
                           "prompt several times", param="n")
        if rid is not None and len(prompts) > 1 and not isinstance(body.rid, list):
            rid = f"{rid}-{k}"
        ids, image_parts = images[k]
        state = manager.reasoning_state(ids) if body.separate_reasoning else None
        if image_parts and body.return_logprob and body.logprob_start_len >= 0:
            raise ApiError(400, "prompt logprobs (logprob_start_len >= 0) are not available "
                           "with image_data", param="logprob_start_len")
        inputs.append(GenerateInput(ids, params, body.return_logprob, body.logprob_start_len,
                                    body.top_logprobs_num, rid, body.cache_salt, state,
                                    image_parts, lora=lora_of_path(manager, loras[k]),
                                    priority=body.priority))
    for inp in inputs:
        manager.validate(inp)
    return inputs, single
