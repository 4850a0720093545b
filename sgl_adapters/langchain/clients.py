"""The openai clients the LangChain adapters talk to the bundled server's ``/v1`` with, and
the API key's default (``$SGLANG_API_KEY``): one place for :class:`ChatSGLang` and
:class:`SGLangEmbeddings`."""

from __future__ import annotations

import os
from typing import Any

import openai
from pydantic import SecretStr


def api_key_from_env() -> SecretStr | None:
    """``$SGLANG_API_KEY`` as a secret, or None when unset or empty."""
    key = os.environ.get("SGLANG_API_KEY")
    return SecretStr(key) if key else None


class OpenAIClients:
    """Lazily created sync and async openai clients on ``base_url + "/v1"``. The pydantic
    model mixing it in declares ``base_url``, ``api_key`` (SecretStr | None), ``timeout``
    (seconds), ``max_retries`` and the private attributes ``_client``, ``_async_client``."""

    def _client_kwargs(self) -> dict[str, Any]:
        key = self.api_key.get_secret_value() if self.api_key else "EMPTY"
        return {"base_url": self.base_url.rstrip("/") + "/v1", "api_key": key,
                "timeout": self.timeout, "max_retries": self.max_retries}

    @property
    def client(self) -> openai.OpenAI:
        """The sync openai client on the server's /v1 (created on first use)."""
        if self._client is None:
            self._client = openai.OpenAI(**self._client_kwargs())
        return self._client

    @property
    def async_client(self) -> openai.AsyncOpenAI:
        """The async openai client on the server's /v1 (created on first use)."""
        if self._async_client is None:
            self._async_client = openai.AsyncOpenAI(**self._client_kwargs())
        return self._async_client
