"""The bundled server over its native API (``POST /generate``; DESIGN.md §4).

* ``generate``: the whole prompt text goes with every call; the server's radix cache finds the
  part already computed, so a program pays only for its new tokens.
* ``select``: choices are scored with prefill-only requests (``max_new_tokens: 0``) that return
  prompt logprobs. The prompt is sent first alone (it is then cached, and its token count is
  known); then all ``prompt + choice`` texts go in one batch request whose logprobs start a few
  tokens before the boundary, so a token the tokenizer merges across the boundary is still
  scored (:func:`~sgl_adapters.lang.choices.choice_token_count`).
* ``cache_prefix``: a prefill-only request, used before forks and batches.
"""

from __future__ import annotations

import base64
import json
import os
from typing import Any, Iterator

import httpx

from sgl_adapters.backends.base import BackendError, GenCall, GenResult, SelectResult
from sgl_adapters.lang.chat_template import ChatTemplate
from sgl_adapters.lang.choices import choice_token_count, choose

# Prompt logprobs start this many tokens before the prompt's end, so that a merge of the
# prompt's last tokens with the choice's first ones stays inside the scored window.
BOUNDARY_TOKENS = 8


_UNRESOLVED = object()  # RuntimeEndpoint.lora not looked up yet


class RuntimeEndpoint:
    """Backend for the bundled server at ``base_url`` (e.g. ``http://127.0.0.1:30000``).

    Args:
        base_url: server root (no ``/v1``).
        api_key: sent as ``Authorization: Bearer`` when the server requires a key.
        timeout: seconds per HTTP request (generation included).
        model: the served model or LoRA adapter to run (as ``GET /v1/models`` lists it: an
            adapter's name or "BASE:NAME"); an adapter is sent as every /generate's
            ``lora_path`` (:attr:`lora`); None or any other name: the base model.
    Raises BackendError on any failed request (the server's message and status are kept).
    """

    is_chat_model = False

    def __init__(self, base_url: str = "http://127.0.0.1:30000", api_key: str | None = None,
                 timeout: float = 600.0, model: str | None = None):
        self.base_url, self.model = base_url.rstrip("/"), model
        self._lora: Any = _UNRESOLVED  # the adapter's name (or None) once looked up
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout)
        self._template: ChatTemplate | None = None
        self._model_info: dict[str, Any] | None = None

    # -- HTTP ----------------------------------------------------------------------------------
    def _get(self, path: str) -> Any:
        """GET ``path``'s JSON. Raises BackendError."""
        try:
            r = self._http.get(path)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}: {exc}") from exc
        if r.status_code != 200:
            raise BackendError(_error_message(r), r.status_code)
        return r.json()

    @property
    def lora(self) -> str | None:
        """The LoRA adapter ``model`` names on the server (looked up in ``GET /v1/models``
        once), or None for the base model. Raises BackendError."""
        if self._lora is _UNRESOLVED:
            adapters = ({m["id"] for m in self._get("/v1/models")["data"] if m.get("parent")}
                        if self.model else set())
            tail = (self.model or "").rpartition(":")[2]
            self._lora = self.model if self.model in adapters else (
                tail if ":" in (self.model or "") and tail in adapters else None)
        return self._lora

    def _with_lora(self, body: dict[str, Any]) -> dict[str, Any]:
        """A /generate body on ``model``'s adapter, unless it names one itself."""
        if "lora_path" in body or not self.model or self.lora is None:
            return body
        return {**body, "lora_path": self.lora}

    def _post(self, path: str, body: dict[str, Any]) -> Any:
        body = self._with_lora(body) if path == "/generate" else body
        try:
            r = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {self.base_url}{path}: {exc}") from exc
        if r.status_code != 200:
            raise BackendError(_error_message(r), r.status_code)
        return r.json()

    def get_model_info(self) -> dict[str, Any]:
        """The server's /get_model_info, fetched once. Raises BackendError."""
        if self._model_info is None:
            self._model_info = self._get("/get_model_info")
        return self._model_info

    @property
    def image_token(self) -> str | None:
        """The text that marks an image's place in a prompt on a multimodal server (e.g.
        "<image>"), None on a text-only one."""
        return self.get_model_info().get("image_token")

    @property
    def chat_template(self) -> ChatTemplate:
        """Role markers rendered from the server model's Jinja chat template (fetched once)."""
        if self._template is None:
            self._template = ChatTemplate.from_jinja(self.get_model_info().get("chat_template"))
        return self._template

    # -- Backend protocol ----------------------------------------------------------------------
    def _body(self, call: GenCall) -> dict[str, Any]:
        sp = call.sampling
        body: dict[str, Any] = {"text": call.text, "sampling_params": sp.native()}
        if sp.lora is not None:  # gen(lora=...) wins over the backend's model
            body["lora_path"] = sp.lora
        if call.priority:  # the program's later calls first (the server's priority order)
            body["priority"] = call.priority
        if sp.return_logprob:
            body.update(return_logprob=True, top_logprobs_num=sp.top_logprobs_num or 0)
        if call.images:
            body["image_data"] = [_image_data(x) for x in call.images]
        return body

    def generate(self, call: GenCall) -> GenResult:
        """One /generate of ``call``: its text and meta_info. Raises BackendError."""
        out = self._post("/generate", self._body(call))
        return GenResult(out["text"], out["meta_info"])

    def generate_stream(self, call: GenCall) -> Iterator[str | GenResult]:
        """A streamed /generate: text deltas, then the GenResult. Raises BackendError."""
        body = self._with_lora({**self._body(call), "stream": True})
        sent, last = 0, None
        try:
            with self._http.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise BackendError(_error_message(r), r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data:") or line.strip() == "data: [DONE]":
                        continue
                    last = json.loads(line[5:])
                    if "error" in last:
                        raise BackendError(last["error"].get("message", str(last)))
                    text = last["text"]  # cumulative
                    if len(text) > sent:
                        yield text[sent:]
                        sent = len(text)
        except httpx.HTTPError as exc:
            raise BackendError(f"stream from {self.base_url} failed: {exc}") from exc
        if last is None:
            raise BackendError("the stream ended without a result")
        yield GenResult(last["text"], last["meta_info"])

    def select(self, call: GenCall, choices: tuple[str, ...], method: str,
               temperature: float = 0.0) -> SelectResult:
        """SGLang's select: the prompt is prefilled once (cached), then every ``call.text +
        choice`` is scored by prefill-only prompt logprobs over the choice's tokens, and
        :func:`sgl_adapters.lang.choices.choose` picks by ``method``. Raises BackendError."""
        prompt = self._post("/generate", {"text": call.text, "priority": call.priority,
                                          "sampling_params": {"max_new_tokens": 0}})
        start = max(prompt["meta_info"]["prompt_tokens"] - BOUNDARY_TOKENS, 0)
        scored = self._score([call.text + c for c in choices], start, call.priority)
        logprobs = [lp[-choice_token_count([t for _, _, t in e], c):]
                    for lp, e, c in zip(*scored, choices)]
        unconditional = None
        if method == "unconditional_likelihood_normalized":
            alone = self._score(list(choices), 0, call.priority)
            unconditional = [[x for x in lp if x is not None] for lp in alone[0]]
        index, scores = choose(method, [[x for x in lp if x is not None] for lp in logprobs],
                               unconditional, temperature)
        meta = {"method": method, "normalized_prompt_logprobs": scores,
                "input_token_logprobs": [e[-len(lp):] for lp, e in zip(logprobs, scored[1])],
                "prompt_tokens": prompt["meta_info"]["prompt_tokens"],
                "cached_tokens": prompt["meta_info"]["cached_tokens"]}
        if unconditional is not None:
            meta["unconditional_token_logprobs"] = unconditional
        return SelectResult(choices[index], meta)

    def _score(self, texts: list[str], start: int, priority: int = 0
               ) -> tuple[list[list[float | None]], list[list]]:
        """Prompt logprobs from position ``start`` of each text: (logprobs, [lp, id, text])."""
        outs = self._post("/generate", {
            "text": texts, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "priority": priority,
            "logprob_start_len": start, "return_text_in_logprobs": True})
        entries = [o["meta_info"]["input_token_logprobs"] for o in outs]
        return [[lp for lp, _, _ in e] for e in entries], entries

    def cache_prefix(self, text: str) -> None:
        """Prefill ``text`` now (a max_new_tokens 0 request), so later calls reuse its KV."""
        if text:
            self._post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 0}})

    def flush_cache(self) -> None:
        """Empty the server's radix cache. Raises BackendError while requests run."""
        self._post("/flush_cache", {})

    def shutdown(self) -> None:
        """Close the HTTP client (the server keeps running)."""
        self._http.close()


def _image_data(image: str | bytes) -> str:
    """``image_data`` for the server: a data: URL of the bytes (a local file is read here:
    the server takes images inline only); data: URLs and http(s) URLs pass as they are (the
    server refuses the latter, having no network)."""
    if isinstance(image, str) and not image.startswith(("data:", "http://", "https://")) \
            and os.path.isfile(image):
        with open(image, "rb") as f:
            image = f.read()
    if isinstance(image, bytes):
        return "data:application/octet-stream;base64," + base64.b64encode(image).decode()
    return image


def _error_message(r: httpx.Response) -> str:
    try:
        err = r.json()
        return err.get("error", {}).get("message") or err.get("detail") or r.text
    except (ValueError, AttributeError):
        return r.text or r.reason_phrase
