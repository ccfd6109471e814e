"""Where a model's tokenizer comes from, loaded on first use, and a GGUF's saved copy of it.

Loading a tokenizer costs `import transformers` and the load itself, on the way to the
engine's first step. An engine child needs its
tokenizer only for a text prompt or a grammar: the clients send token ids, templated and
tokenized by the app's own copy. So where a GGUF's converted tokenizer is saved (a warm
start), the child names the saved folder and the app loads it from there, while the child
imports torch and loads the weights; the child loads its own only if a request needs it.

This module imports neither torch nor transformers (the app process imports it before it
may fork its engine child); transformers comes in on the first load.
"""

from __future__ import annotations

import hashlib
import json
import threading
import warnings
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Used when a tokenizer has none: the plain ChatML most small chat models were tuned on.
PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TokenizerSource:
    """A model's tokenizer and chat template, loaded once, on first use (thread-safe: the
    engine's thread and a client's may ask at once).

    `saved_folder`: a saved tokenizer another process can load itself (`load_saved_tokenizer`)
    and get the same tokenizer; None where the tokenizer is made some other way.
    """

    def __init__(self, model_name: str, load: Callable[[], PreTrainedTokenizerBase],
                 saved_folder: Path | None = None) -> None:
        self.model_name = model_name
        self.saved_folder = saved_folder
        self._load: Callable[[], PreTrainedTokenizerBase] | None = load
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._chat_template = ""
        self._lock = threading.Lock()

    @classmethod
    def loaded(cls, model_name: str, tokenizer: PreTrainedTokenizerBase) -> TokenizerSource:
        """A source whose tokenizer is already here (its template is read, and a missing one
        warned of, now)."""
        source = cls(model_name, lambda: tokenizer)
        source._ensure_loaded()
        return source

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        self._ensure_loaded()
        assert self._tokenizer is not None
        return self._tokenizer

    @property
    def chat_template(self) -> str:
        self._ensure_loaded()
        return self._chat_template

    def _ensure_loaded(self) -> None:
        with self._lock:
            if self._load is not None:
                tokenizer = self._load()
                self._chat_template = chat_template_of(tokenizer, self.model_name)
                self._tokenizer, self._load = tokenizer, None


def saved_tokenizer_folder(cache_dir: Path, header_digest: str) -> Path:
    """Where a GGUF's converted tokenizer is saved: keyed by the whole header (a template
    edited in place is never served stale) and by the transformers version that converted
    it (read from its metadata: importing transformers to ask would cost a second)."""
    key = hashlib.sha256(f"{version('transformers')}:{header_digest}".encode()).hexdigest()
    return cache_dir / "tokenizers" / key[:32]


def load_saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved with `save_pretrained`, as the class it was saved as. The generic
    tokenizers-backed class (what a GGUF converts to) is loaded directly: AutoTokenizer
    would pick the same class, after importing every model's tokenizer and config
    mappings."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    try:
        saved_class = json.loads((folder / "tokenizer_config.json").read_bytes()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):  # a damaged copy: AutoTokenizer says what is wrong
        saved_class = None
    if saved_class == TokenizersBackend.__name__:
        return TokenizersBackend.from_pretrained(folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def chat_template_of(tokenizer: PreTrainedTokenizerBase, model_name: str) -> str:
    """The tokenizer's template, or plain ChatML (set on the tokenizer too) with a warning."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one is for chat
        template = template.get("default")
    if not template:
        warnings.warn(
            f"{model_name}: the tokenizer has no chat template; using a plain ChatML template",
            stacklevel=5)
        template = PLAIN_CHATML_TEMPLATE
        tokenizer.chat_template = template
    return template
