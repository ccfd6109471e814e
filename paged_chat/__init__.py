"""paged-chat: many terminal chat tabs on one paged-KV-cache LLM engine."""

__version__ = "0.1.0"
