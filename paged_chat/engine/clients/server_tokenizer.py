"""ServerTokenizer: the served model's tokenizer and chat template where they live, on the
server, through vLLM's `/tokenize` and `/detokenize` (at the server's root, not under /v1).

A RemoteClient uses it when no local tokenizer matches the served model (a cluster's
`Qwen/Qwen2.5-72B-Instruct`, a vLLM started with `--served-model-name smollm2`). It offers
what a Conversation and the client call on a tokenizer, each one HTTP round trip:
`encode`, `decode` and `apply_chat_template` (the server templates the messages, as its
chat completions would). Per-token detokenizing is not among them: a reply's text comes
from the server with its ids (OutputProcessor's text-only mode).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx

from paged_chat.engine.core.errors import PagedChatError

# What a local tokenizer must encode as the server does to count as the served model's.
PROBE_TEXT = "Paged chat, 2026: ¿qué tal?  Ünïcödé 東京 🙂\n\tdef f(x): return x**2"


class ServerTokenizerError(PagedChatError):
    """The server refused a tokenize or detokenize call, or could not be reached."""


class ServerTokenizer:
    """vLLM's tokenizer endpoints for `model` at `root_url` (the server's root URL)."""

    def __init__(self, root_url: str, model: str, headers: dict[str, str], timeout_s: float = 30.0) -> None:
        self.root_url = root_url.rstrip("/")
        self.model = model
        self._http = httpx.Client(headers=headers, timeout=timeout_s)
        self.max_model_len: int | None = None  # as /tokenize reports it

    @classmethod
    def probe(cls, root_url: str, model: str, headers: dict[str, str]) -> ServerTokenizer | None:
        """The server's tokenizer, or None where it has no /tokenize (llama.cpp's takes
        another body, paged-chat serve and most others have none)."""
        tokenizer = cls(root_url, model, headers)
        try:
            tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        except ServerTokenizerError:
            tokenizer.close()
            return None
        return tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenize({"prompt": text, "add_special_tokens": add_special_tokens})

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        assert not skip_special_tokens, "vLLM's /detokenize keeps special tokens"
        return str(self._post("/detokenize", {"model": self.model, "tokens": list(ids)})["prompt"])

    def apply_chat_template(self, messages: list[dict[str, str]], chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            **_: Any) -> str | list[int]:
        """The server's own template over `messages` (`chat_template` is the local one's
        name for it: the server keeps its own)."""
        ids = self._tokenize({"messages": messages, "add_generation_prompt": add_generation_prompt,
                              "add_special_tokens": False})
        return ids if tokenize else self.decode(ids)

    def close(self) -> None:
        self._http.close()

    def _tokenize(self, body: dict[str, Any]) -> list[int]:
        answer = self._post("/tokenize", {"model": self.model, **body})
        tokens = answer.get("tokens")
        if not isinstance(tokens, list):
            raise ServerTokenizerError(f"{self.root_url}/tokenize answered no tokens: {answer!r:.200}")
        self.max_model_len = answer.get("max_model_len", self.max_model_len)
        return [int(token) for token in tokens]

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.root_url + path
        try:
            response = self._http.post(url, json=body)
        except httpx.HTTPError as error:
            raise ServerTokenizerError(f"cannot reach {url} ({error})") from error
        if response.status_code != 200:
            raise ServerTokenizerError(f"{url} answered {response.status_code}: {response.text[:200]}")
        try:
            answer = response.json()
        except json.JSONDecodeError as error:
            raise ServerTokenizerError(f"{url} answered no JSON ({error})") from error
        if not isinstance(answer, dict):
            raise ServerTokenizerError(f"{url} answered {answer!r:.200}")
        return answer
